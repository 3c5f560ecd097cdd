"""Progress bars for long work (uploading weights), on stderr, silent when stderr is not a terminal."""

from __future__ import annotations

from collections.abc import Callable

from tqdm import tqdm


def load_progress() -> Callable[[str, int], Callable[[int], None]]:
    """A factory `(device, total_bytes) -> tick(n_bytes)` drawing one bar per device upload."""

    def start(device: str, total: int) -> Callable[[int], None]:
        bar = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc=f"loading {device}",
            leave=False,
            disable=None,
        )

        def tick(n: int) -> None:
            bar.update(n)
            if bar.n >= total:
                bar.close()

        return tick

    return start

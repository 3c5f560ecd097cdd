"""Progress bars for long work (uploading weights, warming up), on stderr; silent when stderr is not
a terminal."""

from __future__ import annotations

from collections.abc import Callable

from tqdm import tqdm


def load_progress() -> Callable[..., Callable[[int], None]]:
    """A factory `(what, total, unit="B") -> tick(n)` drawing one bar per piece of loading work: each
    device's upload (bytes), then the warm-up (steps)."""

    def start(what: str, total: int, unit: str = "B") -> Callable[[int], None]:
        in_bytes = unit == "B"
        bar = tqdm(
            total=total,
            unit=unit,
            unit_scale=in_bytes,
            unit_divisor=1024 if in_bytes else 1000,
            desc=what,
            leave=False,
            disable=None,
        )

        def tick(n: int) -> None:
            bar.update(n)
            if bar.n >= total:
                bar.close()

        return tick

    return start

"""Progress bars for long work (uploading weights), on stderr, silent when stderr is not a terminal."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from tqdm import tqdm

from llmx.gguf import TensorInfo


def load_progress() -> Callable[[Iterable[TensorInfo], int], Callable[[int], None]]:
    """A factory `(tensors, total_bytes) -> tick(n_bytes)` drawing one bar per device upload."""

    def start(infos: Iterable[TensorInfo], total: int) -> Callable[[int], None]:
        bar = tqdm(
            total=total,
            unit="B",
            unit_scale=True,
            unit_divisor=1024,
            desc="loading",
            leave=False,
            disable=None,
        )

        def tick(n: int) -> None:
            bar.update(n)
            if bar.n >= total:
                bar.close()

        return tick

    return start

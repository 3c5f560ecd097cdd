"""Reading a step's results one step late: a device tensor's copy to the host, queued behind the work
that makes it, so the host can issue the next step before it waits for this one's values."""

from __future__ import annotations

import torch


class HostCopy:
    """The values of `x` (ints) on their way to the host: queued at once into pinned memory (a copy
    from pageable memory would wait for the device), read by `values`."""

    def __init__(self, x: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if not x.is_cuda:  # a CPU step is over when its call returns
            self._host = x
            return
        self._host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
        self._host.copy_(x, non_blocking=True)
        self._event = torch.cuda.Event()
        self._event.record(torch.cuda.current_stream(x.device))

    def values(self) -> list[int]:
        """The values, once the copy is over (waiting for it, and for nothing queued after it)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()

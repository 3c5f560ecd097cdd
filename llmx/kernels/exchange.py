"""Adding a partial sum across GPUs (`-sm row`) in one kernel a GPU, fast enough for decode.

A split layer meets its other GPUs twice (after the attention output and after the FFN down matrix).
Torch's peer copies with stream waits cost ~30 us a meeting inside a CUDA graph on two NVLinked
H200s; this costs ~3 us (`bench/exchange.py`). Each GPU's kernel writes its partial straight into
every other GPU's inbox over NVLink (peer access), raises a flag there (release, system scope),
waits for the others' flags (acquire), and adds the partials in GPU order, so every GPU gets the
same bits. No graph edge joins the GPUs: a captured step holds one such kernel per meeting on each.

Every meeting launches the same EXCHANGE_FLAGS programs (program p moves the chunks p, p + P, ...
whatever the size; some move none), and each counts its meetings: the count is the flag value it
raises and waits for, so a replayed graph needs no reset. Inboxes alternate between two slots: a GPU
can be at most one meeting ahead of another (it cannot finish meeting n without every GPU's flags
of it, raised only once that GPU has finished meeting n - 1), so the slot it writes is never one
still being read.

Every GPU must run the same sequence of meetings with the same sizes: a GPU whose partner never
arrives waits for ever, which is why, outside a capture, the executor issues every GPU's part of a
split segment from its own thread and lets no thread past a meeting before every GPU's kernel for it
is issued (`runtime.tensor_parallel`). A part that fails after its partners entered a meeting leaves
them waiting (the error is raised; the process cannot use those GPUs again).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmx.errors import LlmxError
from llmx.plan.memory import EXCHANGE_FLAGS

BLOCK = 1024  # floats a program moves at a time


@triton.jit
def _all_reduce_kernel(
    partial,  # this GPU's partial sum, n elements
    out,  # the total, n elements
    inbox,  # this GPU's inbox: [2 slots, G sources, capacity] float32
    inboxes,  # int64 [G]: every GPU's inbox address
    flags,  # this GPU's flags: [2 slots, G sources, PROGRAMS] int32
    all_flags,  # int64 [G]: every GPU's flags address
    counters,  # int32 [PROGRAMS]: meetings each program has held here
    n,
    capacity,
    RANK: tl.constexpr,
    G: tl.constexpr,
    PROGRAMS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    p = tl.program_id(0)
    stride = PROGRAMS * BLOCK
    offs = tl.arange(0, BLOCK)
    meeting = tl.load(counters + p) + 1
    tl.store(counters + p, meeting)
    slot = meeting % 2
    for start in range(p * BLOCK, n, stride):
        m = start + offs < n
        v = tl.load(partial + start + offs, mask=m).to(tl.float32)
        for k in tl.static_range(G):
            if k != RANK:
                theirs = tl.load(inboxes + k).to(tl.pointer_type(tl.float32))
                tl.store(theirs + (slot * G + RANK) * capacity + start + offs, v, mask=m)
    tl.debug_barrier()  # every thread's stores are issued before the flag goes up
    for k in tl.static_range(G):
        if k != RANK:
            their_flags = tl.load(all_flags + k).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(
                their_flags + (slot * G + RANK) * PROGRAMS + p, meeting, sem="release", scope="sys"
            )
    for k in tl.static_range(G):
        if k != RANK:
            while (
                tl.atomic_add(flags + (slot * G + k) * PROGRAMS + p, 0, sem="acquire", scope="sys") < meeting
            ):
                pass
    for start in range(p * BLOCK, n, stride):
        m = start + offs < n
        total = tl.zeros([BLOCK], tl.float32)
        for k in tl.static_range(G):
            if k == RANK:
                total += tl.load(partial + start + offs, mask=m).to(tl.float32)
            else:
                total += tl.load(inbox + (slot * G + k) * capacity + start + offs, mask=m, volatile=True)
        tl.store(out + start + offs, total.to(out.dtype.element_ty), mask=m)


class Exchange:
    """The inboxes, flags and counters of GPUs that add partial sums of up to `capacity` elements."""

    def __init__(self, devices: list[torch.device], capacity: int) -> None:
        for a in devices:
            for b in devices:
                if a != b and not torch.cuda.can_device_access_peer(a, b):
                    raise LlmxError(
                        f"-sm row needs {a} to reach {b}'s memory directly (NVLink or PCIe peer access), "
                        "which this machine does not allow; use -sm layer"
                    )
        g = len(devices)
        self.devices, self.capacity = devices, capacity
        self.inbox = [torch.zeros(2, g, capacity, dtype=torch.float32, device=d) for d in devices]
        self.flags = [torch.zeros(2, g, EXCHANGE_FLAGS, dtype=torch.int32, device=d) for d in devices]
        self.counters = [torch.zeros(EXCHANGE_FLAGS, dtype=torch.int32, device=d) for d in devices]
        inboxes = [t.data_ptr() for t in self.inbox]
        flags = [t.data_ptr() for t in self.flags]
        self.tables = [
            (
                torch.tensor(inboxes, dtype=torch.int64, device=d),
                torch.tensor(flags, dtype=torch.int64, device=d),
            )
            for d in devices
        ]
        for a in devices:  # peer access is turned on by a first copy between each pair
            for b in devices:
                if a != b:
                    torch.zeros(1, device=a).copy_(torch.zeros(1, device=b))

    def all_reduce(self, partial: torch.Tensor, rank: int) -> torch.Tensor:
        """The sum over every GPU of their `partial`s, on GPU `rank` (same shape and dtype)."""
        n = partial.numel()
        if n > self.capacity:
            raise LlmxError(
                f"a partial sum of {n} values exceeds the {self.capacity} the -sm row buffers hold; lower -ub"
            )
        partial = partial.contiguous()
        out = torch.empty_like(partial)
        inboxes, all_flags = self.tables[rank]
        _all_reduce_kernel[(EXCHANGE_FLAGS,)](
            partial, out, self.inbox[rank], inboxes, self.flags[rank], all_flags, self.counters[rank],
            n, self.capacity, RANK=rank, G=len(self.devices), PROGRAMS=EXCHANGE_FLAGS, BLOCK=BLOCK,
            num_warps=4,
        )  # fmt: skip
        return out

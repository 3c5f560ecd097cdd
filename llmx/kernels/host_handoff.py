"""A captured GPU step's trips to the CPU: a layer's inputs handed to host memory, the result taken back.

A decode step on a GPU whose layers keep their routed experts in RAM (`--cpu-moe`, `-ncmoe`) meets the
CPU once a layer. Each meeting is two kernels inside the step's one CUDA graph: `hand_over` writes the
layer's operands (normed hidden state, routing weights, expert ids) into pinned host memory and raises
the trip's `ready` flag there; `take_back` waits until the host has raised `done` to the same count,
then copies the host's result to the GPU. The host serves the trips in order while the graph runs
(`runtime.host_trips`), so no CUDA call, copy or synchronisation is issued between the layers: a trip
costs a flag's way over PCIe each way.

Flags count instead of being reset: a trip's `hand_over` raises `ready` to that trip's count of
meetings (a device counter it keeps), `take_back` waits for `done` to equal it, and the host echoes the
value it read. A step the host gave up on (`abandon` raised) or left waiting past MAX_SPINS polls
(`late` raised) lets every `take_back` through at once, so a failing host never hangs the GPU.

Host memory is reached over PCIe with loads and stores that bypass the GPU's caches (volatile loads,
write-through stores) ordered by system-scope fences: atomics on host memory are not atomic against
the CPU there. A trip's addresses are one row of ADDRESS_FIELDS int64 values in device memory (its host
buffers and flags), which the kernels read as pointers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmx.quant.triton.launch import interpreting

# A trip's row of addresses: host buffers x (float32), weights (float32), ids (int64), y (float32),
# then its flags ready and done, and the host's abandon and late flags (int32 each)
ADDRESS_FIELDS = 8
X, WEIGHTS, IDS, Y, READY, DONE, ABANDON, LATE = (tl.constexpr(i) for i in range(ADDRESS_FIELDS))
BLOCK = 2048  # values a kernel moves at a time (a whole hidden state of most models in one pass)
# take_back's polls of host memory (~1 us each) before it stops waiting: minutes, as a layer's experts
# read from a slow disk (an mmapped file's first tokens) may take seconds; a host that fails raises
# `abandon` instead, so this bounds only a host that hangs
MAX_SPINS = 300_000_000


@triton.jit
def _system_fence(v, FENCE: tl.constexpr):
    """v, after a system-scope fence: this thread's memory operations before it are seen by the host
    before those after it (compiled only: the interpreter runs on the host itself)."""
    if FENCE:
        v = tl.inline_asm_elementwise(
            "fence.sc.sys; mov.b32 $0, $1;", "=r,r", [v], dtype=tl.int32, is_pure=False, pack=1
        )
    return v


@triton.jit
def _hand_over_kernel(
    x, weights, ids, row, counter, n_x, n_k, BLOCK: tl.constexpr, K_BLOCK: tl.constexpr, FENCE: tl.constexpr
):
    x_host = tl.load(row + X).to(tl.pointer_type(tl.float32))
    weights_host = tl.load(row + WEIGHTS).to(tl.pointer_type(tl.float32))
    ids_host = tl.load(row + IDS).to(tl.pointer_type(tl.int64))
    ready = tl.load(row + READY).to(tl.pointer_type(tl.int32))
    count = tl.load(counter + tl.zeros([1], tl.int32)) + 1
    offs = tl.arange(0, BLOCK)
    for start in range(0, n_x, BLOCK):
        m = start + offs < n_x
        x_m = tl.load(x + start + offs, mask=m).to(tl.float32)
        tl.store(x_host + start + offs, x_m, mask=m, cache_modifier=".wt")
    k = tl.arange(0, K_BLOCK)
    m = k < n_k
    tl.store(weights_host + k, tl.load(weights + k, mask=m).to(tl.float32), mask=m, cache_modifier=".wt")
    tl.store(ids_host + k, tl.load(ids + k, mask=m).to(tl.int64), mask=m, cache_modifier=".wt")
    tl.debug_barrier()  # every thread has read the count, and issued its stores, before the flag goes up
    one = tl.zeros([1], tl.int32)
    tl.store(counter + one, count)
    tl.store(ready + one, _system_fence(count, FENCE), cache_modifier=".wt")


@triton.jit
def _take_back_kernel(
    y, row, counter, n_y, MAX_SPINS: tl.constexpr, BLOCK: tl.constexpr, FENCE: tl.constexpr
):
    y_host = tl.load(row + Y).to(tl.pointer_type(tl.float32))
    done = tl.load(row + DONE).to(tl.pointer_type(tl.int32))
    abandon = tl.load(row + ABANDON).to(tl.pointer_type(tl.int32))
    late = tl.load(row + LATE).to(tl.pointer_type(tl.int32))
    want = tl.load(counter)
    seen = tl.load(done, volatile=True)
    gone = tl.load(abandon, volatile=True) | tl.load(late, volatile=True)
    spins = 0
    while (seen != want) & (gone == 0) & (spins < MAX_SPINS):
        seen = tl.load(done, volatile=True)
        gone = tl.load(abandon, volatile=True) | tl.load(late, volatile=True)
        spins += 1
    if (seen != want) & (gone == 0):
        tl.store(late, 1, cache_modifier=".wt")
    _system_fence(tl.zeros([1], tl.int32) + seen, FENCE)  # the result is read after the flag
    offs = tl.arange(0, BLOCK)
    for start in range(0, n_y, BLOCK):
        m = start + offs < n_y
        tl.store(y + start + offs, tl.load(y_host + start + offs, mask=m, volatile=True), mask=m)


def hand_over(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, row: torch.Tensor, counter: torch.Tensor
) -> None:
    """Write x [T, E], weights [T, k] and ids [T, k] (contiguous, on the GPU) into the host buffers of
    the trip whose addresses are `row` [ADDRESS_FIELDS] int64, then raise its ready flag to its count,
    `counter` [1] int32 plus one (kept in `counter`)."""
    n_k = ids.numel()
    _hand_over_kernel[(1,)](
        x, weights, ids, row, counter, x.numel(), n_k,
        BLOCK=BLOCK, K_BLOCK=triton.next_power_of_2(n_k), FENCE=not interpreting(), num_warps=4,
    )  # fmt: skip


def take_back(y: torch.Tensor, row: torch.Tensor, counter: torch.Tensor) -> None:
    """Wait until the host has raised the trip's done flag to its count (or given up), then copy its
    result, the trip's host y, into y [T, E] float32 (contiguous, on the GPU)."""
    _take_back_kernel[(1,)](
        y, row, counter, y.numel(), MAX_SPINS=MAX_SPINS, BLOCK=BLOCK, FENCE=not interpreting(), num_warps=4
    )

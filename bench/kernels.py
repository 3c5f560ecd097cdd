"""Triton kernel speed per GGML type against the GPU's measured ceilings.

For each type and weight shape N x K (default: Llama-3-8B's FFN, 14336x4096 and 4096x14336) and each
batch M, the median time of each kernel `matmul.linear` can run there (M <= 8: GEMV and GEMM; larger
M: GEMM and dequantize + torch matmul; any M: the integer-dot GEMV of its rows, and from 2 rows the
integer tensor-core GEMM "mmq", for the types they read), on `prepare`d weights; with GB/s of weight
bytes over the measured device-to-device copy bandwidth (what bounds M <= 8) and TFLOP/s over the
measured bf16 matmul rate (what bounds large M). At M = 512 a dense bf16 torch matmul of the same
shape is timed too, and at M = 1 the GEMV on raw (not prepared) rows and a plain read of the same
bytes ("read": what any kernel reading them at this size can reach). The integer-dot GEMVs ("dot8"
at M = 1, "dot8_rows" above) and "mmq" take x already quantized, as decode's norm and gate kernels
write it up to 15 rows (from 16, a step quantizes x in a launch of its own, once for the weights
that share it: not in these times). A batched decode step's matrices, "mmq" against "dequant" and
"gemm":

    python bench/kernels.py --types Q4_K,Q6_K,Q8_0 --m 8,16,32,64 --kernels mmq,dequant,gemm,dot8_rows

The ceilings are measured in the same run: a copy of a 4 GB buffer (bytes read + written) and an
8192^3 bf16 matmul.
At M <= 8 calls are timed on the GPU alone, replayed from CUDA graphs (as decode runs them) as what
one call adds to a stream of them (`graph_ms`), over copies of the weight that together exceed the
L2; larger M use triton.testing.do_bench, which clears the L2 before every call. Either way each
call reads its weight from HBM.

    python bench/kernels.py [--types Q4_K,Q8_0] [--m 1,2,4,8,16,512] [--kernels dequant,dense]
                            [--sweep Q4_K [--shapes 2/2048/1,4/2048/2/late] [--sweep-m 8]]
                            [--dequant-sweep Q4_0] [--sustain SECONDS] [--rows-bm 4,8,16] [--json PATH]
                            [--tile-sweep 64/128/256/8/3,32/64/256/4/3 --m 16,64]

`--sweep` also times a grid of GEMV launch shapes at M = 1 (how the integer-dot shapes of
`llmx/quant/triton/launch_shapes.json` were chosen), or at `--sweep-m` rows ("dot8_rows"),
`--dequant-sweep` one of the dequantize kernel's (its `dequantize` shape). `--sustain S` times the rows
at M <= 8 after S seconds of back-to-back calls and notes the SM clock and power they left: a
GEMV that keeps the SMs busy issuing can hold an H200 at its power cap, at lower clocks.
`--rows-bm 4,8,16` times "dot8_rows" at each of these rows of x a program (`matmul.ROWS8_BM`).
`--tile-sweep` times the half-precision tensor-core GEMM "mmh" (or with `--tile-kernel mmq` the integer
one) at each of these tiles (their `launch_shapes.json` entries) for each type and `--m`.
Prints markdown tables; JSON goes to --json, else to $OUT/kernels.json when $OUT is set.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial
from types import SimpleNamespace

import torch
import triton
import triton.language as tl
import triton.testing
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from llmx.bench.blocks import chunk_rng, random_data
from llmx.bench.results import tool_output
from llmx.quant import BLOCK_TYPES, choice, qtype
from llmx.quant.triton import activation, launch
from llmx.quant.triton import matmul as tops
from llmx.quant.triton.layout import prepare
from llmx.quant.triton.tuning import GemmConfig, LaunchShape

SHAPES = [(14336, 4096), (4096, 14336)]


def bench_ms(fn) -> float:
    """Median milliseconds of fn() with a cleared L2 before each call."""
    return float(triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median"))


SPIN_CYCLES = 600_000  # ~0.3 ms at an H200's clock: longer than the CPU takes to queue a replay


def replay_ms(graph: torch.cuda.CUDAGraph, times: int = 10) -> float:
    """Median GPU milliseconds of a replay of `graph`. Each waits behind a spin kernel, so that the
    CPU has queued it before the GPU reaches the start event: otherwise the time of the CPU's
    submission, during which the GPU idles, is counted too."""
    out = []
    for _ in range(times):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SPIN_CYCLES)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return statistics.median(out)


@dataclasses.dataclass
class StreamGraphs:
    """CUDA graphs of `rounds` and of 4 x `rounds` passes over a list of calls (`stream_graphs`)."""

    short: torch.cuda.CUDAGraph
    long: torch.cuda.CUDAGraph
    calls_between: int  # the calls the long graph makes beyond the short one's
    calls: list[Callable[[], object]]  # held: the graphs read their tensors, which a graph does not keep

    def call_ms(self) -> float:
        """GPU milliseconds one call adds to a stream of them: the difference of the two graphs'
        median replays over the calls between them (see `graph_ms`)."""
        return (replay_ms(self.long) - replay_ms(self.short)) / self.calls_between


def stream_graphs(calls: list[Callable[[], object]], rounds: int = 4) -> StreamGraphs:
    """The calls run once outside any capture (compiling and tuning them), then captured as
    `StreamGraphs` and each graph replayed once."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and tune outside the capture
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graphs = []
    for passes in (rounds, 4 * rounds):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(passes):
                for call in calls:
                    call()
        graph.replay()
        graphs.append(graph)
    return StreamGraphs(*graphs, calls_between=3 * rounds * len(calls), calls=calls)


def graph_ms(calls: list[Callable[[], object]], rounds: int = 4, sustain_s: float = 0.0) -> float:
    """GPU milliseconds one of `calls` adds to a stream of them, from CUDA graphs of `rounds` and of
    4 x `rounds` passes over all of them: no launch or Python time, which at M <= 8 would otherwise
    exceed the kernel's. The difference of the two graphs' median replays, over the calls between
    them, leaves out what a replay costs once: the GPU starting it, its first call with no kernel
    before it to overlap (the GEMVs load their weights while their predecessor ends), its last
    call's drain. That was 3-9 µs a replay on an H200, which divided among 16 GEMVs read 2-6% slow
    (bench/RESULTS.md, session 23). With `sustain_s`, the long graph first replays back to back for
    that long: a GEMV that keeps the SMs issuing can draw the GPU to its power cap, which lowers its
    clocks after a fraction of a second (session 16), so a short burst and a sustained stream differ.

    A process's GEMV graphs replay 1-2% faster until it has run a few bursts of eager work on
    streams other than the one replaying them, as `stream_graphs` does (its calls' first run on a
    side stream, and torch's two small kernels on its capture stream before each capture; sessions
    24-25, `bench/graph_state.py`), so a process's first timing reads high: compare timings from
    the second on."""
    graphs = stream_graphs(calls, rounds)
    start = time.perf_counter()
    while time.perf_counter() - start < sustain_s:
        graphs.long.replay()
        torch.cuda.synchronize()
    return graphs.call_ms()


def copies(w: SimpleNamespace) -> list[SimpleNamespace]:
    """`w` and enough copies of it to fill more than twice the L2 (50 MB on an H200), so that
    calls taking them in turn each read their weight from HBM."""
    n = max(1, -(-(128 << 20) // (w.raw.numel() * w.raw.element_size())))
    return [w] + [SimpleNamespace(**(vars(w) | {"raw": w.raw.clone()})) for _ in range(n - 1)]


def gpu_state() -> dict[str, float]:
    """The GPU's SM clock (MHz) and power draw (W) now, from nvidia-smi; empty where it cannot say."""
    query = ["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits", "-i", "0"]
    out = tool_output(query)
    try:
        mhz, watts = (float(v) for v in (out or "").splitlines()[0].split(","))
    except (ValueError, IndexError):
        return {}
    return {"sm_mhz": mhz, "watts": watts}


def ceilings() -> dict[str, float]:
    """Device-to-device copy GB/s (read + write) and bf16 matmul TFLOP/s, measured now."""
    src = torch.empty(1 << 30, dtype=torch.float32, device="cuda").uniform_()
    copy_gbs = 2 * src.numel() * 4 / bench_ms(partial(torch.Tensor.copy_, torch.empty_like(src), src)) / 1e6
    a, b = (torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    mm_tflops = 2 * 8192**3 / bench_ms(partial(torch.matmul, a, b)) / 1e9
    return {"copy_gbs": copy_gbs, "bf16_tflops": mm_tflops}


@triton.jit
def _read_kernel(p, out, n_words, BLOCK: tl.constexpr, STEPS: tl.constexpr, PDL: tl.constexpr):
    """Sum STEPS * BLOCK int32 words from program_id * STEPS * BLOCK: a read of the bytes, nothing
    else. PDL: as the GEMVs do (`dot8.gemv8_kernel`), let the next launch start at once and issue
    every load before waiting for the previous one, so that back-to-back reads overlap like them."""
    if PDL:
        gdc_launch_dependents()
    base = tl.program_id(0).to(tl.int64) * BLOCK * STEPS
    acc = tl.zeros([BLOCK], tl.int32)
    for s in tl.static_range(STEPS):
        off = base + s * BLOCK + tl.arange(0, BLOCK)
        acc += tl.load(p + off, mask=off < n_words, other=0)
    if PDL:
        gdc_wait()
    tl.store(out + tl.program_id(0), tl.sum(acc))


def read_row(w: SimpleNamespace, ceil: dict[str, float], sustain_s: float = 0.0) -> dict:
    """GB/s of the fastest plain read of w's bytes (a few launch shapes) timed like the GEMVs, and
    overlapping its neighbours as they do (PDL, where the GPU has it): the ceiling at this size for
    a kernel that reads and barely computes. Without PDL a read of the 33-62 MB FFN matrices
    reached 79-91% of the copy, with it 100-104% (bench/RESULTS.md, session 16)."""
    n, k = w.shape
    words = [c.raw.view(-1).view(torch.int32) for c in copies(w)]
    pdl = launch.programmatic_launch(w.raw.device)
    best = float("inf")
    for block, steps, warps in ((1024, 4, 4), (2048, 4, 8), (4096, 2, 8), (2048, 8, 4)):
        grid = (-(-words[0].numel() // (block * steps)),)
        out = torch.empty(grid[0], dtype=torch.int32, device="cuda")

        def read(v: torch.Tensor, out=out, grid=grid, block=block, steps=steps, warps=warps) -> None:
            _read_kernel[grid](
                v, out, v.numel(), BLOCK=block, STEPS=steps, PDL=pdl, num_warps=warps, launch_pdl=pdl
            )

        best = min(best, graph_ms([partial(read, v) for v in words], sustain_s=sustain_s))
    gbs = w.raw.numel() * w.raw.element_size() / best / 1e6
    row = {"type": w.qtype.name, "n": n, "k": k, "m": 1, "kernel": "read", "ms": best, "gbs": gbs}
    row |= {"tflops": 0.0, "frac": gbs / ceil["copy_gbs"], "layout": "prepared"}
    return row | sustained(sustain_s)


def sustained(sustain_s: float) -> dict:
    """What a row measured after `sustain_s` seconds of back-to-back calls adds: those seconds and
    the clock and power they left the GPU at."""
    return {"sustain_s": sustain_s} | gpu_state() if sustain_s else {}


def make_weight(name: str, n: int, k: int) -> SimpleNamespace:
    """A random valid [n, k] weight of type `name` on the GPU, shaped like llmx.quant.weight.QWeight."""
    qt = qtype(name)
    data = random_data(qt, n * k, 0.02, chunk_rng(0, qt.ggml_id, n))
    raw = torch.from_numpy(data).view(n, qt.row_bytes(k)).cuda()
    return SimpleNamespace(raw=raw, qtype=qt, shape=(n, k), name=f"{name} {n}x{k}", packed=None)


def measure(
    w: SimpleNamespace, m: int, kernel: str, ceil: dict[str, float], sustain_s: float = 0.0, **extra: object
) -> dict:
    """One timed row: kernel `kernel` on weight `w` with M = m bf16 inputs (at M <= 8 after
    `sustain_s` seconds of them, see `graph_ms`)."""
    n, k = w.shape
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    # x quantized (or scaled into f16) beforehand, once for the weights that share it in a step
    qx = activation.quantize_x(x) if kernel in tops.INT8_KERNELS else None
    half = activation.half_rows(x) if kernel == "mmh" else None
    if m <= choice.GEMV_MAX_M:
        calls = [partial(tops.linear, x, c, kernel=kernel, qx=qx, half=half) for c in copies(w)]
        t = graph_ms(calls, sustain_s=sustain_s)
        extra |= sustained(sustain_s)
    else:
        t = bench_ms(partial(tops.linear, x, w, kernel=kernel, qx=qx, half=half))
    gbs, tflops = w.raw.numel() * w.raw.element_size() / t / 1e6, 2 * m * n * k / t / 1e9
    frac = gbs / ceil["copy_gbs"] if m <= choice.GEMV_MAX_M else tflops / ceil["bf16_tflops"]
    row = {"type": w.qtype.name, "n": n, "k": k, "m": m, "kernel": kernel, "ms": t, "gbs": gbs}
    return row | {"tflops": tflops, "frac": frac} | extra


def run(
    types: list[str],
    ms: list[int],
    ceil: dict[str, float],
    only: set[str] | None = None,
    sustain_s: float = 0.0,
    rows_bms: tuple[int, ...] = (),
) -> Iterator[dict]:
    """Timed rows, yielded as they are measured (a long run that is cut short still reports);
    `only` keeps the kernels named in it (of KERNELS, "read" and "dense"); rows at M <= 8 are timed
    after `sustain_s` seconds of back-to-back calls; "dot8_rows" once for each of `rows_bms` as its
    rows of x a program (`matmul.ROWS8_BM`; none: the default)."""
    wanted = (lambda kernel: True) if only is None else only.__contains__
    for name, (n, k) in itertools.product(types, SHAPES):
        raw = make_weight(name, n, k)
        w = prepare(raw)
        layout = "prepared" if w is not raw else "raw"
        if 1 in ms and wanted("read"):
            yield read_row(w, ceil, sustain_s)
        if 1 in ms and w is not raw and wanted("gemv"):
            yield measure(raw, 1, "gemv", ceil, sustain_s, layout="raw")
        for m in ms:
            # GEMM at M <= 8 only at 2 and 8: each M bucket costs an autotuning pass.
            kernels = (
                ("gemm", "dequant")
                if m > choice.GEMV_MAX_M
                else ("gemv", "gemm")
                if m in (2, 8)
                else ("gemv",)
            )
            int8 = "dot8" if m == 1 else "dot8_rows"  # x quantized beforehand (`measure`)
            if tops.kernel_for(w, m, int8) == int8:
                kernels = (int8, *kernels)
            for tiled in ("mmq", "mmh"):
                if m > 1 and tops.kernel_for(w, m, tiled) == tiled:
                    kernels = (tiled, *kernels)
            for kern in filter(wanted, kernels):
                if kern != "dot8_rows" or not rows_bms:
                    yield measure(w, m, kern, ceil, sustain_s, layout=layout)
                    continue
                default_bm = tops.ROWS8_BM
                for bm in rows_bms:
                    tops.ROWS8_BM = bm
                    yield measure(w, m, kern, ceil, sustain_s, layout=layout, rows_bm=bm)
                tops.ROWS8_BM = default_bm
            if m >= 512 and wanted("dense"):
                dense = SimpleNamespace(raw=torch.randn(n, k, dtype=torch.bfloat16, device="cuda"))
                dense.qtype, dense.shape, dense.name, dense.packed = qtype("BF16"), (n, k), "dense", None
                yield measure(dense, m, "dense", ceil, layout="bf16") | {"type": name}
        del raw, w


def dequant_sweep(types: list[str], ceil: dict[str, float]) -> list[dict]:
    """GB/s (weight bytes read + bf16 rows written) of the dequantize kernel alone for a grid of
    launch shapes (rows x weights a program, warps), on prepared weights: how the tuning's
    `dequantize` shape was chosen."""
    grid = [
        LaunchShape(bn, bk, warps)
        for bn, bk in ((4, 512), (8, 512), (16, 512), (2, 1024), (4, 1024), (8, 1024), (2, 2048), (4, 2048))
        for warps in (4, 8)
    ]
    rows = []
    for name, (n, k) in itertools.product(types, SHAPES):
        w = prepare(make_weight(name, n, k))
        moved = w.raw.numel() + 2 * n * k
        for cfg in grid:
            t = bench_ms(partial(tops.dequantize_rows, w, 0, n, torch.bfloat16, cfg))
            row = {"type": name, "n": n, "k": k, "m": 0, "kernel": "dequant", "ms": t, "gbs": moved / t / 1e6}
            rows.append(row | cfg.__dict__ | {"frac": row["gbs"] / ceil["copy_gbs"]})
            print(f"dequant {name} {n}x{k} {cfg}: {row['gbs']:.0f} GB/s", flush=True)
    return rows


def sweep(types: list[str], given: list[LaunchShape], m: int = 1) -> list[dict]:
    """Time at M = m of the integer-dot GEMV ("dot8", or "dot8_rows" for several rows; the float one
    for types they cannot read) for the `given` launch shapes, else a grid of them, on prepared
    weights."""
    rows = []
    for name, (n, k) in itertools.product(types, SHAPES):
        w = prepare(make_weight(name, n, k))
        kernel = tops.kernel_for(w, m, "dot8" if m == 1 else "dot8_rows")
        if kernel in tops.INT8_KERNELS:
            # One warp and few rows a program were among the best shapes on an H200 (bench/RESULTS.md);
            # Q4_K's headers can be loaded late (LaunchShape.late_headers), which changes the best.
            steps = (512, 1024, 2048) if name == "Q8_0" else (1024, 2048, 4096)
            late = (False, True) if name == "Q4_K" else (False,)
            shapes = list(itertools.product((1, 2, 4, 8), steps, (1, 2, 4), late))
        else:
            shapes = list(itertools.product((2, 4, 8), (256, 512, 1024), (2, 4)))
        grid = given or [LaunchShape(*c) for c in shapes]
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        qx = activation.quantize_x(x) if kernel in tops.INT8_KERNELS else None
        ws = copies(w)
        for cfg in grid:
            t = graph_ms([partial(tops.linear, x, c, kernel=kernel, gemv=cfg, qx=qx) for c in ws])
            row = {
                "type": name,
                "n": n,
                "k": k,
                "m": m,
                "kernel": kernel,
                "ms": t,
                "gbs": w.raw.numel() / t / 1e6,
            }
            rows.append(row | cfg.__dict__)
            print(f"sweep {name} {n}x{k} M={m} {cfg}: {row['gbs']:.0f} GB/s", flush=True)
    return rows


def tile_sweep(kernel: str, types: list[str], tiles: list[GemmConfig], ms: list[int]) -> list[dict]:
    """Time of the tensor-core GEMM `kernel` ("mmh" or "mmq") at each of `tiles` (BM/BN/BK/warps/stages)
    for each type, weight shape and M in `ms`, x scaled into f16 (mmh) or quantized (mmq) beforehand;
    L2 cleared before each call."""
    rows = []
    for name, (n, k), m in itertools.product(types, SHAPES, ms):
        w = prepare(make_weight(name, n, k))
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        out = torch.empty((m, n), dtype=torch.bfloat16, device="cuda")
        launch, x_form = (
            (tops._mmh, activation.half_rows(x)) if kernel == "mmh" else (tops._mmq, activation.quantize_x(x))
        )
        for cfg in tiles:
            t = bench_ms(partial(launch, x_form, [w], [out], None, cfg))
            row = {"type": name, "n": n, "k": k, "m": m, "kernel": kernel, "tile": str(cfg), "ms": t}
            rows.append(row | {"gbs": w.raw.numel() / t / 1e6})
            label = f"tile sweep {kernel} {name} {n}x{k} M={m} {cfg}"
            print(f"{label}: {t * 1e3:.1f} us, {rows[-1]['gbs']:.0f} GB/s", flush=True)
    return rows


TABLE_HEAD = (
    "| type | N x K | M | kernel | layout | time µs | GB/s (weights) | TFLOP/s | fraction of ceiling |\n"
    "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
)


def table_row(r: dict) -> str:
    ceiling = "copy" if r["m"] <= choice.GEMV_MAX_M else "bf16"
    state = ""
    if "sustain_s" in r:  # the clock and power the sustained calls left
        state = f" ({r['sustain_s']:g} s on: {r.get('sm_mhz', '?')} MHz, {r.get('watts', '?')} W)"
    if "rows_bm" in r:
        state += f" BM {r['rows_bm']}"
    return (
        f"| {r['type']} | {r['n']}x{r['k']} | {r['m']} | {r['kernel']}{state} | {r['layout']} | "
        f"{r['ms'] * 1e3:.1f} | {r['gbs']:.0f} | {r['tflops']:.1f} | {r['frac']:.0%} of {ceiling} |"
    )


def parse_shapes(text: str) -> list[LaunchShape]:
    """Launch shapes from "BN/BK/warps[/late][/rN][/sN],..." (as `str(LaunchShape)` spells them):
    "/late" for `late_headers`, "/r128" for `max_registers` 128, "/s4" for `stagger` 4."""
    return [LaunchShape.parse(item) for item in filter(None, text.split(","))]


def sweep_table(rows: list[dict]) -> str:
    """The best and the median launch shape per (type, shape, M)."""
    out = [
        "| type | N x K | M | kernel | best BN/BK/warps[/late][/rN] | best GB/s | median GB/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for key, group in itertools.groupby(rows, lambda r: (r["type"], r["n"], r["k"], r["m"], r["kernel"])):
        group = list(group)
        best = max(group, key=lambda r: r["gbs"])
        med = statistics.median(r["gbs"] for r in group)
        cfg = LaunchShape(**{f.name: best[f.name] for f in dataclasses.fields(LaunchShape)})
        out.append(
            f"| {key[0]} | {key[1]}x{key[2]} | {key[3]} | {key[4]} | {cfg} | {best['gbs']:.0f} | {med:.0f} |"
        )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(BLOCK_TYPES))
    ap.add_argument("--m", default="1,2,4,8,16,512")
    ap.add_argument("--sweep", default="", help="types whose GEMV launch shapes to sweep, e.g. Q4_K,Q8_0")
    ap.add_argument(
        "--shapes", default="", help="the sweep's launch shapes BN/BK/warps[/late][/rN], else a grid"
    )
    ap.add_argument(
        "--kernels",
        default="",
        help="time only these, e.g. dequant,dense (of dot8, dot8_rows, mmq, gemv, gemm, dequant, read, "
        "dense; none: a sweep alone)",
    )
    ap.add_argument("--dequant-sweep", default="", help="types whose dequantize launch shapes to sweep")
    ap.add_argument(
        "--sustain",
        type=float,
        default=0.0,
        help="seconds of back-to-back calls before timing each M <= 8 row (default 0: a short burst)",
    )
    ap.add_argument("--sweep-m", type=int, default=1, help="rows of x the sweep times (dot8_rows from 2)")
    ap.add_argument(
        "--rows-bm", default="", help="time dot8_rows at each of these rows of x a program, e.g. 4,8,16"
    )
    ap.add_argument(
        "--tile-sweep",
        default="",
        help="time --tile-kernel at each of these tiles BM/BN/BK/warps/stages (at --m rows)",
    )
    ap.add_argument(
        "--tile-kernel", default="mmh", choices=("mmh", "mmq"), help="the kernel --tile-sweep times"
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    path = args.json or (os.path.join(os.environ["OUT"], "kernels.json") if os.environ.get("OUT") else None)
    gpu = torch.cuda.get_device_name()
    ceil = ceilings()
    result: dict = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "ceilings": ceil}
    print(f"{gpu}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"ceilings: copy {ceil['copy_gbs']:.0f} GB/s (read+write), ", end="")
    print(f"bf16 matmul {ceil['bf16_tflops']:.0f} TFLOP/s\n")
    if args.sweep:
        result["sweep"] = sweep(args.sweep.split(","), parse_shapes(args.shapes), args.sweep_m)
        print(sweep_table(result["sweep"]) + "\n", flush=True)
    if args.tile_sweep:
        tiles = [GemmConfig.parse(t) for t in args.tile_sweep.split(",")]
        ms = [int(m) for m in args.m.split(",")]
        result["tile_sweep"] = tile_sweep(args.tile_kernel, args.types.split(","), tiles, ms)
    if args.dequant_sweep:
        result["dequant_sweep"] = dequant_sweep(args.dequant_sweep.split(","), ceil)
        print(sweep_table(result["dequant_sweep"]) + "\n", flush=True)
    print(TABLE_HEAD, flush=True)
    result["rows"] = []
    only = set(args.kernels.split(",")) if args.kernels else None
    bms = tuple(int(bm) for bm in filter(None, args.rows_bm.split(",")))
    for row in run(args.types.split(","), [int(m) for m in args.m.split(",")], ceil, only, args.sustain, bms):
        result["rows"].append(row)
        print(table_row(row), flush=True)
        if path:  # rewritten after every row, so a run that is cut short keeps what it measured
            with open(path, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

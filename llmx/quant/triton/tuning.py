"""Launch shapes of the Triton kernels, as data keyed by the kind of GPU (`launch_shapes.json`).

Each GPU kind ("sm_90": compute capability 9.0, H100 and H200) has one entry; a GPU without one
takes "default", shapes that run well anywhere rather than ones fitted to one chip. The entry is
chosen once per device (`for_device`). Under Triton's interpreter the tests run the tuned GPU's
shapes (TUNED), so they cover what that GPU runs.

An entry holds, per kernel:
- `dequantize`: the dequantize kernel's rows and weights a program;
- `gemv` / `gemv_m1`: the float GEMV's shape for one input row and for more, and per type for one;
- `dot8`, `dot8_one_step`, `dot8_long_rows`, `long_row`: the integer-dot GEMV's shape per type (`any`
  for the rest), for rows of exactly one step's weights, and for rows of `long_row` weights or more;
- `dot8_rows`: its several-row form's (`dot8_rows.py`), per type (`any` for the rest): for now the
  M = 1 shapes without their register caps and staggered waits (a program holds several rows' x,
  ~150-250 registers a thread on sm_90 at 8 rows), to be swept (`bench/kernels.py --sweep-m`);
- `mmq`: the integer tensor-core GEMM's tile per type (`mmq.py`), as BM/BN/BK/warps/stages: BM the
  most rows of x a program takes (fewer where M is smaller), BN weight rows, BK weights a loop step;
  the largest BM that compiles for sm_90 without spills on Triton 3.6 and 3.9 (`bench/ptx_gemv.py
  --mmq`; Q4_K and Q8_0 at 64 spill on 3.6), a launch's BM being M rounded up from 16 to it;
- `mmh`: the half-precision tensor-core GEMM's tiles per type (`mmh.py`), in `mmq`'s form (BK is
  fixed: a step is 256 weights), by BM: a launch takes the first tile whose BM holds its rows of x
  (M rounded up from 16 to a power of two), else the last (an H100's `bench/kernels.py --tile-sweep`:
  Q4_K at 16 rows 39.6-45.2 us on 64 weight rows and 4 warps against 46.0-50.7 on 128 and 8, at 64
  rows 57.9-60.7 on 128 and 8 against 63.0-69.9);
- `gemm`: the GEMM autotuner's candidates (`autotune.py`);
- `moe_gemm`: the grouped expert GEMM's tile (`moe.py`), whose BM is also the block its pairs are
  sorted into (`bench/moe_kernels.py --sweep` times candidates and prints the line to put here).
- `moe_dot8`, `moe_dot8_sum`: the grouped expert GEMV on integer dot products (`moe.py`), per type
  (`any` for the rest), for one (token, slot) pair a program (gate and up) and for a token's pairs
  summed in one (the down projection; /h2: in two, each adding half the slots into the output):
  BN rows a program, BK weights a step (at most the row's, rounded up to a power of two). Gate and
  up take the dense shapes (`bench/ptx_moe.py` read what Triton compiles for sm_90), Q4_K's timed
  on an H100. The down projection's are an H100's fastest of `bench/moe_kernels.py --dot8-sweep`
  (experts from HBM, s50): every type's /h2 shape, 8.5 / 7.1 / 7.7 us a launch for Q6_K / Q4_K /
  Q8_0 against 11.7 / 10.8 / 9.4 for the best shape of one program a token (raw
  bench/results/h100-20261208-s50-dot8-sweep-*.txt).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from llmx.quant.triton.launch import capability

TABLE = Path(__file__).with_name("launch_shapes.json")
TUNED = "sm_90"  # the kind the interpreter borrows
FALLBACK = "default"


@dataclass(frozen=True)
class LaunchShape:
    """Launch shape of a kernel over weight rows: BN rows a program, BK weights a loop step (the
    GEMVs) or a program (dequantize), and its warps. `late_headers` (the integer-dot GEMV, Q4_K):
    a step's block headers are loaded as it is computed, from the L1 lines its codes brought in,
    not a step ahead with the codes: half the registers a thread, so twice the warps an SM.
    `max_registers` caps a thread's registers (ptxas' maxnreg; None: its own choice). `stagger`
    (the integer-dot GEMV, launched as a programmatic dependent): one program in `stagger` waits for
    the kernel before it and only then loads its weights, where the others load theirs first; when
    the wait ends, those programs' loads keep the memory busy while the rest compute what they
    loaded ahead (1: none waits first). `halves` (the grouped expert GEMV that sums a token's slots,
    2 or 1): a token's pairs taken by two programs of half of them each, which add their sums into
    the zeroed output, where one program goes through all of them in turn."""

    bn: int
    bk: int
    num_warps: int
    late_headers: bool = False
    max_registers: int | None = None
    stagger: int = 1
    halves: int = 1

    def __str__(self) -> str:
        """BN/BK/warps, then /late, /rN, /sN and /h2 where set: the name `parse` reads back (the
        table and the benchmarks' --shapes use it)."""
        late = "/late" if self.late_headers else ""
        regs = f"/r{self.max_registers}" if self.max_registers else ""
        stagger = f"/s{self.stagger}" if self.stagger > 1 else ""
        halves = f"/h{self.halves}" if self.halves > 1 else ""
        return f"{self.bn}/{self.bk}/{self.num_warps}{late}{regs}{stagger}{halves}"

    @staticmethod
    def parse(text: str) -> LaunchShape:
        """ "BN/BK/warps[/late][/rN][/sN][/h2]" (as `str` spells it) -> LaunchShape."""
        bn, bk, warps, *extra = text.split("/")
        regs = next((int(e[1:]) for e in extra if e.startswith("r")), None)
        stagger = next((int(e[1:]) for e in extra if e.startswith("s")), 1)
        halves = next((int(e[1:]) for e in extra if e.startswith("h")), 1)
        if halves not in (1, 2):
            raise ValueError(f"{text}: /h takes 2 (two programs a token's slots) or 1")
        return LaunchShape(int(bn), int(bk), int(warps), "late" in extra, regs, stagger, halves)


@dataclass(frozen=True)
class GemmConfig:
    """One candidate of the GEMM autotuner: a BM x BN output tile, BK a step, warps and stages."""

    bm: int
    bn: int
    bk: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return f"{self.bm}/{self.bn}/{self.bk}/{self.num_warps}/{self.num_stages}"

    @staticmethod
    def parse(text: str) -> GemmConfig:
        return GemmConfig(*(int(v) for v in text.split("/")))


@dataclass(frozen=True)
class Tuning:
    """One GPU kind's launch shapes (an entry of `launch_shapes.json`)."""

    kind: str
    dequantize: LaunchShape
    gemv_one_row: LaunchShape
    gemv_rows: LaunchShape
    gemv_m1: dict[str, LaunchShape]
    dot8_any: LaunchShape
    dot8_by_type: dict[str, LaunchShape]
    dot8_one_step: dict[str, LaunchShape]
    dot8_long_rows: dict[str, LaunchShape]
    dot8_rows_shapes: dict[str, LaunchShape]
    long_row: int
    mmq_shapes: dict[str, GemmConfig]
    mmh_shapes: dict[str, tuple[GemmConfig, ...]]
    gemm: tuple[GemmConfig, ...]
    moe_gemm: GemmConfig
    moe_dot8_shapes: dict[str, LaunchShape]
    moe_dot8_sum_shapes: dict[str, LaunchShape]

    def gemv(self, name: str, bm: int) -> LaunchShape:
        """The float GEMV's shape for type `name` and BM input rows (a power of two)."""
        if bm == 1:
            return self.gemv_m1.get(name, self.gemv_one_row)
        return self.gemv_rows

    def dot8(self, name: str, k: int) -> LaunchShape:
        """The integer-dot GEMV's shape (M = 1) for rows of k weights of type `name`: the long-row
        shape from `long_row` weights on, the one-step shape for rows of exactly its BK weights,
        else the type's."""
        if k >= self.long_row and name in self.dot8_long_rows:
            return self.dot8_long_rows[name]
        one_step = self.dot8_one_step.get(name)
        if one_step is not None and k == one_step.bk:
            return one_step
        return self.dot8_by_type.get(name, self.dot8_any)

    def dot8_rows(self, name: str) -> LaunchShape:
        """The several-row integer-dot GEMV's shape for rows of type `name`."""
        return self.dot8_rows_shapes.get(name, self.dot8_rows_shapes["any"])

    def moe_dot8(self, name: str, summed: bool) -> LaunchShape:
        """The grouped expert GEMV's shape (integer dot products) for expert rows of type `name`, for a
        launch of one pair a program, or of a token's pairs `summed` in one."""
        shapes = self.moe_dot8_sum_shapes if summed else self.moe_dot8_shapes
        return shapes.get(name, shapes["any"])

    def mmq(self, name: str) -> GemmConfig:
        """The integer tensor-core GEMM's tile for rows of type `name`."""
        return self.mmq_shapes[name]

    def mmh(self, name: str, bm: int) -> GemmConfig:
        """The half-precision tensor-core GEMM's tile for rows of type `name` and launches of `bm`
        rows of x a program (at most)."""
        tiles = self.mmh_shapes[name]
        return next((t for t in tiles if t.bm >= bm), tiles[-1])


def _shapes(entry: dict[str, str]) -> dict[str, LaunchShape]:
    return {name: LaunchShape.parse(text) for name, text in entry.items()}


@cache
def table() -> dict[str, Tuning]:
    """Every GPU kind's tuning, read from TABLE once."""
    devices = json.loads(TABLE.read_text())["devices"]
    out = {}
    for kind, e in devices.items():
        dot8 = _shapes(e["dot8"])
        out[kind] = Tuning(
            kind=kind,
            dequantize=LaunchShape.parse(e["dequantize"]),
            gemv_one_row=LaunchShape.parse(e["gemv"]["m1"]),
            gemv_rows=LaunchShape.parse(e["gemv"]["more"]),
            gemv_m1=_shapes(e["gemv_m1"]),
            dot8_any=dot8.pop("any"),
            dot8_by_type=dot8,
            dot8_one_step=_shapes(e["dot8_one_step"]),
            dot8_long_rows=_shapes(e["dot8_long_rows"]),
            dot8_rows_shapes=_shapes(e["dot8_rows"]),
            long_row=int(e["long_row"]),
            mmq_shapes={name: GemmConfig.parse(text) for name, text in e["mmq"].items()},
            mmh_shapes={name: tuple(map(GemmConfig.parse, tiles)) for name, tiles in e["mmh"].items()},
            gemm=tuple(GemmConfig.parse(c) for c in e["gemm"]),
            moe_gemm=GemmConfig.parse(e["moe_gemm"]),
            moe_dot8_shapes=_shapes(e["moe_dot8"]),
            moe_dot8_sum_shapes=_shapes(e["moe_dot8_sum"]),
        )
    return out


def kind_of(device: torch.device) -> str:
    """The table's key for `device`: "sm_<major><minor>" for a GPU, TUNED under the interpreter."""
    if device.type != "cuda":
        return TUNED
    major, minor = capability(device)
    return f"sm_{major}{minor}"


@cache
def for_device(device: torch.device) -> Tuning:
    """`device`'s tuning: its kind's entry, else the fallback."""
    tunings = table()
    return tunings.get(kind_of(device), tunings[FALLBACK])

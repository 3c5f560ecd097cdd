"""What the integer-dot GEMV's main loop compiles to on Hopper, without a GPU.

Triton compiles `dot8.gemv8_kernel` for sm_90 here (PTX needs no device); for each launch shape this
counts, inside the loop over K, the global loads a thread issues, the warp shuffles and the barriers
(`shfl.sync`, `bar.sync`: layout conversions between threads, through the L1's data path like the
loads), and the registers a thread uses (from the cubin: they bound the warps an SM holds, e.g. 80
allow 24 of 64); then, as "end", the shuffles/barriers outside the loop (the partial sums'
reduction, which runs after the last load has waited). Device time is scarce; this shows before a
run whether a change removed loads or added shuffles (bench/RESULTS.md, sessions 6, 9 and 26).
Triton versions lay the same kernel out differently: to see another version's code, put its wheel's
package first on PYTHONPATH (e.g. the device's 3.6, `pip install --target DIR triton==3.6.0`; no GPU
needed).

    python bench/ptx_gemv.py [--types Q4_K,Q6_K,Q8_0] [--bn 2,4,8,16] [--bk 1024,2048,4096] [--warps 1,2,4]
        [--late 0,1] [--maxnreg 0,128] [--rows 8]

`--rows BM` compiles the several-row form (`dot8_rows.gemv8_rows_kernel`) at BM rows of x a program
instead: its loop holds BM rows' x and reduces each row's sums every step (its shuffles and barriers).

    python bench/ptx_gemv.py --mmq 16,32,64 [--types ...] [--tile BM/BN/BK/warps/stages]
    python bench/ptx_gemv.py --mmh 16,32,64 [--types ...] [--tile BM/BN/BK/warps/stages]

`--mmq` compiles the integer tensor-core GEMM (`mmq.mmq_kernel`) instead, at each of these BM rows of
x a program (at most the tile's BM), at the type's tile for sm_90 (`launch_shapes.json`) or `--tile`:
its registers, the local-memory instructions of spilled ones, the tensor-core instructions (wgmma or
mma) and the machine instructions of its loop over K; `--mmh` the same for the half-precision one
(`mmh.mmh_kernel`).
"""

from __future__ import annotations

import argparse
import itertools
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from llmx.quant import choice, qtype
from llmx.quant.triton import dot8, dot8_rows, mmh, mmq, tuning
from llmx.quant.triton import matmul as tops
from llmx.quant.triton.tuning import GemmConfig, LaunchShape

POINTERS = {"xq_ptr": "*i8", "dx_ptr": "*fp32", "xs_ptr": "*fp32"}
HALF_POINTERS = {"xh_ptr": "*fp16", "xs_ptr": "*fp32"}  # mmh's x
WEIGHT = {"w": "*u8", "o": "*bf16", "n": "i32"}
CONSTANTS = ("QT", "UNIT", "QUADS", "BN", "BU", "NW", "ASM", "EVEN", "ROW_WORDS", "PDL", "RES", "LATE")
CONSTANTS += ("STAGGER", "SCATTER4")
ROWS_CONSTANTS = ("QT", "UNIT", "BN", "BU", "BM", "BMP", "NW", "ASM", "EVEN", "ROW_WORDS", "PDL", "RES")
ROWS_CONSTANTS += ("LATE",)
MMQ_CONSTANTS = ("QT", "BM", "BN", "SU", "NW", "RES")
MMH_CONSTANTS = ("QT", "BM", "BN", "NW", "RES", "ASM")


def compiled(name: str, cfg: LaunchShape, rows: int = 0) -> dict[str, str | bytes]:
    """The PTX and cubin of one launch shape (with `rows`: of the several-row kernel at BM = rows):
    one weight a launch, rows whole 16-byte units, every pointer and integer but the row length (and
    the several-row kernel's M and chunks) a multiple of 16 (as Triton specializes them for
    Llama-shaped matrices)."""
    unit = qtype(name).block_elems
    signature = weights_signature()
    bu = max(1, cfg.bk // unit)
    if rows:
        fn, names = dot8_rows.gemv8_rows_kernel, ROWS_CONSTANTS
        signature |= {"M": "i32", "K": "i32", "row_units": "i32", "chunks": "i32"}
        values = (name, unit, cfg.bn, bu, rows, 1 << (rows - 1).bit_length(), 1, True, True, 4, False, False)
        values += (cfg.late_headers,)
    else:
        fn, names = dot8.gemv8_kernel, CONSTANTS
        signature |= {"K": "i32", "row_units": "i32"}
        values = (name, unit, tops.DOT8_QUADS[name], cfg.bn, bu, 1, True, True, 4, False, False)
        # compiled without PDL: stagger changes nothing
        values += (cfg.late_headers, cfg.stagger, tops.scatter_end(name, cfg))
    # a row's count of 16-byte units need not be a multiple of 16 (Q6_K's 4096-weight rows: 210)
    options = {"num_warps": cfg.num_warps, "maxnreg": cfg.max_registers}
    return compile_for_hopper(
        fn, signature, dict(zip(names, values, strict=True)), ("row_units", "M", "chunks"), options
    )


def compiled_tiles(kernel: str, name: str, cfg: GemmConfig, bm: int) -> dict[str, str | bytes]:
    """The PTX and cubin of a tensor-core GEMM ("mmq" or "mmh") at tile `cfg` and BM = bm rows of x,
    one weight a launch, aligned as `compiled`'s (a Q6_K row of 4096 weights is 3360 bytes)."""
    signature = weights_signature(HALF_POINTERS if kernel == "mmh" else POINTERS)
    signature |= {"part_ptr": "*fp32", "count_ptr": "*i32"}
    signature |= {"M": "i32", "K": "i32", "row_bytes": "i32", "m_tiles": "i32"}
    signature |= {"splits": "i32", "split_steps": "i32"}
    if kernel == "mmh":
        values = (name, bm, cfg.bn, 1, False, True)
        fn, constexprs = mmh.mmh_kernel, dict(zip(MMH_CONSTANTS, values, strict=True))
    else:
        values = (name, bm, cfg.bn, max(1, cfg.bk // qtype(name).block_elems), 1, False)
        fn, constexprs = mmq.mmq_kernel, dict(zip(MMQ_CONSTANTS, values, strict=True))
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    unaligned = ("M", "m_tiles", "splits", "split_steps")
    return compile_for_hopper(fn, signature, constexprs, unaligned, options)


def weights_signature(x_pointers: dict[str, str] = POINTERS) -> dict[str, str]:
    """The integer-dot kernels' leading arguments: x (quantized, unless other `x_pointers`),
    DOT8_MAX_WEIGHTS weight slots, the residual."""
    signature = dict(x_pointers)
    for j in range(tops.DOT8_MAX_WEIGHTS):
        signature |= {f"{k}{j}": v for k, v in WEIGHT.items()}
    return signature | {"r_ptr": "*bf16"}


def compile_for_hopper(
    fn: object, signature: dict[str, str], constexprs: dict[str, object], free: tuple[str, ...], options: dict
) -> dict[str, str | bytes]:
    """`fn` compiled for sm_90 with `constexprs`, every other argument but those in `free` a multiple
    of 16."""
    signature |= dict.fromkeys(constexprs, "constexpr")
    aligned = [i for i, (k, v) in enumerate(signature.items()) if v != "constexpr" and k not in free]
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs=constexprs,
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm


def cuobjdump(cubin: bytes, option: str) -> str:
    """What the cuobjdump shipped with Triton prints for the cubin with `option`."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), option, f.name], capture_output=True, text=True, check=True).stdout


def registers(cubin: bytes) -> int:
    """Registers a thread of the compiled kernel uses (they bound how many warps an SM holds)."""
    return int(re.search(r"REG:(\d+)", cuobjdump(cubin, "-res-usage")).group(1))


def spills(cubin: bytes) -> int:
    """Local-memory loads and stores in the machine code: registers spilled (0 where all fit)."""
    return len(re.findall(r"\b(?:LDL|STL)\b", cuobjdump(cubin, "-sass")))


def tensor_core_ops(ptx: str) -> int:
    """Tensor-core instructions in the PTX (Hopper's wgmma, or the mma of older GPUs' path)."""
    return len(re.findall(r"\b(?:wgmma\.mma_async|mma\.sync)\b", ptx))


def sass_loop(cubin: bytes) -> int:
    """Machine instructions in the loop over K: from the target of the last backward branch to it.
    The kernel is memory-bound only while the SMs can issue these fast enough (an H200 issues about
    4 warp instructions a cycle an SM), so fewer a step is headroom."""
    addresses = []
    for line in cuobjdump(cubin, "-sass").splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            addresses.append((int(m.group(1), 16), m.group(2)))
    branches = [(a, int(t, 16)) for a, ins in addresses for t in re.findall(r"BRA\s+0x([0-9a-f]+)", ins)]
    end, start = max((a, t) for a, t in branches if t < a)
    return sum(start <= a <= end for a, _ in addresses)


def loop_body(code: str) -> list[str]:
    """The lines of the innermost loop (LLVM marks its header), up to its backward branch (conditional,
    or `bra.uni` where LLVM rotated the loop)."""
    lines = code.splitlines()
    head = next(i for i, line in enumerate(lines) if "Inner Loop Header" in line)
    labels = (re.match(r"(\$L__BB\d+_\d+):", line) for line in lines[head - 1 : head + 1])
    label = next(m.group(1) for m in labels if m)
    end = max(i for i, line in enumerate(lines) if re.search(rf"bra(\.uni)?\s+{re.escape(label)};", line))
    return lines[head - 1 : end + 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(choice.DOT8_TYPES))
    ap.add_argument("--bn", default="2,4,8,16")
    ap.add_argument("--bk", default="1024,2048,4096")
    ap.add_argument("--warps", default="1,2,4")
    ap.add_argument(
        "--late", default="0", help="Q4_K's headers loaded late (1), a step ahead (0), or both (0,1)"
    )
    ap.add_argument("--maxnreg", default="0", help="caps on a thread's registers (0: none), e.g. 0,128")
    ap.add_argument("--rows", type=int, default=0, help="BM: compile dot8_rows at BM rows of x a program")
    ap.add_argument(
        "--mmq", default="", help="compile mmq at each of these BM rows of x a program, e.g. 16,64"
    )
    ap.add_argument("--mmh", default="", help="compile mmh at each of these BM rows of x a program")
    ap.add_argument(
        "--tile", default="", help="mmq's or mmh's tile BM/BN/BK/warps/stages (default: the type's for sm_90)"
    )
    args = ap.parse_args()
    if args.mmq or args.mmh:
        kernel = "mmh" if args.mmh else "mmq"
        bms = [int(bm) for bm in (args.mmh or args.mmq).split(",")]
        print_tiles(kernel, args.types.split(","), bms, args.tile)
        return
    ints = [[int(v) for v in a.split(",")] for a in (args.bn, args.bk, args.warps, args.late, args.maxnreg)]
    print(f"Triton {triton.__version__}")
    columns = "loads a step (16-byte) | shuffles | barriers | registers | SASS a step | end"
    print(f"| type | BN/BK/warps | {columns} |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, bn, bk, warps, late, maxnreg in itertools.product(args.types.split(","), *ints):
        cfg = LaunchShape(bn, bk, warps, bool(late), maxnreg or None)
        asm = compiled(name, cfg, args.rows)
        body = loop_body(asm["ptx"])
        loads = sum("ld.global" in line for line in body)
        vectors = sum("ld.global" in line and ".v4." in line for line in body)
        shuffles = sum("shfl.sync" in line for line in body)
        barriers = sum("bar.sync" in line for line in body)
        regs, sass = registers(asm["cubin"]), sass_loop(asm["cubin"])
        end = f"{asm['ptx'].count('shfl.sync') - shuffles}/{asm['ptx'].count('bar.sync') - barriers}"
        cells = (cfg, f"{loads} ({vectors})", shuffles, barriers, regs, sass, end)
        print(f"| {name} | " + " | ".join(map(str, cells)) + " |", flush=True)


def print_tiles(kernel: str, types: list[str], bms: list[int], tile: str) -> None:
    """One table row for each type and BM: `compiled_tiles`' registers, spills, tensor-core
    instructions and loop instructions."""
    print(f"Triton {triton.__version__}")
    print("| type | BM/BN/BK/warps/stages | registers | spills | tensor-core ops | SASS a step |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, bm in itertools.product(types, bms):
        tuned = tuning.table()[tuning.TUNED]
        cfg = (
            GemmConfig.parse(tile) if tile else (tuned.mmh(name, bm) if kernel == "mmh" else tuned.mmq(name))
        )
        cfg = GemmConfig(min(bm, cfg.bm), cfg.bn, cfg.bk, cfg.num_warps, cfg.num_stages)
        asm = compiled_tiles(kernel, name, cfg, cfg.bm)
        cells = (cfg, registers(asm["cubin"]), spills(asm["cubin"]), tensor_core_ops(asm["ptx"]))
        print(f"| {name} | " + " | ".join(map(str, (*cells, sass_loop(asm["cubin"])))) + " |", flush=True)


if __name__ == "__main__":
    main()

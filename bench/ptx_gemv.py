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
from llmx.quant.triton import dot8, dot8_rows
from llmx.quant.triton import matmul as tops
from llmx.quant.triton.tuning import LaunchShape

POINTERS = {"xq_ptr": "*i8", "dx_ptr": "*fp32", "xs_ptr": "*fp32"}
WEIGHT = {"w": "*u8", "o": "*bf16", "n": "i32"}
CONSTANTS = ("QT", "UNIT", "QUADS", "BN", "BU", "NW", "ASM", "EVEN", "ROW_WORDS", "PDL", "RES", "LATE")
CONSTANTS += ("STAGGER", "SCATTER4")
ROWS_CONSTANTS = ("QT", "UNIT", "BN", "BU", "BM", "BMP", "NW", "ASM", "EVEN", "ROW_WORDS", "PDL", "RES")
ROWS_CONSTANTS += ("LATE",)


def compiled(name: str, cfg: LaunchShape, rows: int = 0) -> dict[str, str | bytes]:
    """The PTX and cubin of one launch shape (with `rows`: of the several-row kernel at BM = rows):
    one weight a launch, rows whole 16-byte units, every pointer and integer but the row length (and
    the several-row kernel's M and chunks) a multiple of 16 (as Triton specializes them for
    Llama-shaped matrices)."""
    unit = qtype(name).block_elems
    signature = dict(POINTERS)
    for j in range(tops.DOT8_MAX_WEIGHTS):
        signature |= {f"{k}{j}": v for k, v in WEIGHT.items()}
    signature["r_ptr"] = "*bf16"
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
    signature |= dict.fromkeys(names, "constexpr")
    # a row's count of 16-byte units need not be a multiple of 16 (Q6_K's 4096-weight rows: 210)
    free = ("row_units", "M", "chunks")
    aligned = [i for i, (k, v) in enumerate(signature.items()) if v != "constexpr" and k not in free]
    src = ASTSource(
        fn=fn,
        signature=signature,
        constexprs=dict(zip(names, values, strict=True)),
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    options = {"num_warps": cfg.num_warps, "maxnreg": cfg.max_registers}
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
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()

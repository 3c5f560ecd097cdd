"""What the integer-dot grouped expert GEMV compiles to on Hopper, without a GPU.

Triton compiles `moe_kernels.moe_gemv8_kernel` for sm_90 here (PTX needs no device), as
`bench/ptx_gemv.py` does the dense one, at Qwen3-30B-A3B's decode launches: the fused gate and up
(2048-weight rows, one pair a program) and the down projection summed over a token's 8 slots
(768-weight rows), rows whole 16-byte units. For each launch shape: the global loads (16-byte
vectors), warp shuffles and barriers in the innermost loop (the pairs, for rows of one step) and
in the whole kernel, and a thread's registers. The launch shapes of `launch_shapes.json`'s
`moe_dot8` and `moe_dot8_sum` were picked from this table: no shuffles or barriers in the loop.

    python bench/ptx_moe.py [--types Q4_K,Q6_K,Q8_0] [--launch gated,sum] [--k 2048,768] [--bn 1,2,4,8]
        [--bk 1024,2048] [--warps 1,2,4] [--halves 1,2]
"""

from __future__ import annotations

import argparse
import itertools

import triton
from ptx_gemv import loop_body, registers
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from llmx.quant import choice, qtype
from llmx.quant.triton import moe, moe_kernels
from llmx.quant.triton.tuning import LaunchShape

POINTERS = {"xq_ptr": "*i8", "dx_ptr": "*fp32", "xs_ptr": "*fp32", "w_ptr": "*u8", "w2_ptr": "*u8"}
POINTERS |= {"ids_ptr": "*i32", "topw_ptr": "*fp32", "res_ptr": "*fp32", "out_ptr": "*fp32"}
UNALIGNED = ("N", "E", "x_div", "row_units", "row_units2")  # integers not taken as multiples of 16
SLOTS = 8


def compiled(name: str, k: int, cfg: LaunchShape, summed: bool) -> dict[str, str | bytes]:
    """The PTX and cubin of one launch: gate and up of type `name` (or a summed down projection)."""
    names = list(moe_kernels.moe_gemv8_kernel.arg_names)
    consts: dict[str, object] = {"BN": cfg.bn, "LATE": cfg.late_headers, "SLOTS": SLOTS, "ASM": True}
    consts |= {"GATED": not summed, "SUM": summed, "RES": summed, "PDL": True}  # as decode launches them
    consts["HALVES"] = cfg.halves if summed else 1
    consts |= moe.gemv8_constants([(qtype(name), 4)] * 2, k, moe.step_weights(cfg.bk, k))
    signature = {n: "constexpr" if n in consts else POINTERS.get(n, "i32") for n in names}
    aligned = [i for i, n in enumerate(names) if n not in consts and n not in UNALIGNED]
    src = ASTSource(
        fn=moe_kernels.moe_gemv8_kernel,
        signature=signature,
        constexprs=consts,
        attrs={(i,): [["tt.divisibility", 16]] for i in aligned},
    )
    options = {"num_warps": cfg.num_warps, "maxnreg": cfg.max_registers}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm


def counts(lines: list[str]) -> str:
    loads = sum("ld.global" in line for line in lines)
    vectors = sum("ld.global" in line and ".v4." in line for line in lines)
    shuffles = sum("shfl.sync" in line for line in lines)
    barriers = sum("bar.sync" in line for line in lines)
    return f"{loads} ({vectors}) | {shuffles} | {barriers}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default=",".join(choice.DOT8_TYPES))
    ap.add_argument("--launch", default="gated,sum", help="gated (gate and up, 2048), sum (down, 768)")
    ap.add_argument("--bn", default="1,2,4,8")
    ap.add_argument("--bk", default="1024,2048")
    ap.add_argument("--warps", default="1,2,4")
    ap.add_argument("--late", default="1", help="Q4_K's headers loaded late (1), a step ahead (0), or both")
    ap.add_argument("--halves", default="1", help="programs a token's sum (1, 2, or both: 1,2)")
    args = ap.parse_args()
    ints = [[int(v) for v in a.split(",")] for a in (args.bn, args.bk, args.warps, args.late, args.halves)]
    print(f"Triton {triton.__version__}")
    loop = "loop loads (16-byte) | loop shuffles | loop barriers"
    print(f"| launch | type | BN/BK/warps | {loop} | loads (16-byte) | shuffles | barriers | registers |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    launches, types = args.launch.split(","), args.types.split(",")
    for launch, name, bn, bk, warps, late, halves in itertools.product(launches, types, *ints):
        if late and name != "Q4_K":
            late = 0
        if halves > 1 and launch != "sum":
            continue
        cfg = LaunchShape(bn, bk, warps, bool(late), halves=halves)
        k = 768 if launch == "sum" else 2048
        asm = compiled(name, k, cfg, launch == "sum")
        try:
            loop = counts(loop_body(asm["ptx"]))
        except (StopIteration, ValueError):  # no loop: straight-line code
            loop = "- | - | -"
        whole = counts(asm["ptx"].splitlines())
        print(f"| {launch} | {name} | {cfg} | {loop} | {whole} | {registers(asm['cubin'])} |", flush=True)


if __name__ == "__main__":
    main()

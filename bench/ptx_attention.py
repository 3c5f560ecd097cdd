"""What the attention kernels' cache reads compile to on Hopper, without a GPU.

Triton compiles `decode_attention.attention_kernel` (split over the keys), its `combine_kernel` (the
merge, its output quantized) and `prefill_attention.prefill_kernel` (over a contiguous cache, and
"paged" over a paged one) for sm_90 here (PTX needs no device) at Llama-3-8B's shape (32 heads, 8 KV
heads, D = 128) for each cache type, and counts what a thread issues: global loads (`ld.global`: waited
on in registers), asynchronous copies (`cp.async`: the loads the compiler pipelines through shared
memory, only those of 4 bytes or more), shared-memory stores, loads and barriers (layout conversions),
conversions (`cvt`) and all instructions; and the shared memory a program takes (it bounds the programs
an SM holds). The integer arguments are specialized as a launch specializes them (divisible by 16 or
not), so a block cache's head stride (136 bytes of q8_0) is known only 8-aligned, as on the device.
Triton versions lay the same kernel out differently: to see the device's 3.6, put its wheel's package
first on PYTHONPATH (`pip install --target DIR triton==3.6.0`; no GPU needed).

    python bench/ptx_attention.py [--types f16,q8_0,q4_0] [--heads 32,8,128] [--rotation]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from llmx.kernels.cache_rows import BLOCKS
from llmx.kernels.decode_attention import BLOCK_N, MERGE_SPLITS, attention_kernel, combine_kernel
from llmx.kernels.prefill_attention import _tiles, prefill_kernel
from llmx.ops.hadamard import kv_rotation
from llmx.quant import qtype

COUNTED = ("ld.global", "cp.async", "st.shared", "ld.shared", "bar.sync", "cvt")


def counts(ptx: str) -> dict[str, int]:
    """Instructions of the PTX by the prefixes in COUNTED, and all of them."""
    ops = Counter()
    for line in ptx.splitlines():
        m = re.match(r"\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", line)
        if m and not line.lstrip().startswith((".", "//", "$")):
            ops[m.group(1)] += 1
    out = {k: sum(n for op, n in ops.items() if op.startswith(k)) for k in COUNTED}
    return out | {"total": sum(ops.values())}


def compile_sm90(fn, pointers: dict[str, str], ints: dict[str, int], consts: dict, warps: int, stages: int):
    """`fn` compiled for sm_90: pointer arguments of `pointers`' types (others *fp16, all 16-aligned),
    integers specialized by the values `ints` (others unknown)."""
    sig = {
        a: "constexpr" if a in consts else pointers.get(a, "*fp16") if a.endswith("_ptr") else "i32"
        for a in fn.arg_names
    }
    aligned = [a for a in fn.arg_names if sig[a].startswith("*") or ints.get(a, 1) % 16 == 0]
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    src = ASTSource(fn, sig, constexprs=consts, attrs=attrs)
    options = {"num_warps": warps, "num_stages": stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


NORMS = False  # Llama has no per-head q/k norms (Qwen3, Gemma 3 do)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="f16,q8_0,q4_0", help="cache types (f16, bf16, q8_0, q4_0, ...)")
    ap.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim")
    ap.add_argument(
        "--rotation", action="store_true", help="the decode kernel with block caches' Walsh-Hadamard rotation"
    )
    args = ap.parse_args()
    n_head, n_kv, d = (int(x) for x in args.heads.split(","))
    block_d = max(16, triton.next_power_of_2(d))
    for name in args.types.split(","):
        qt = qtype(name)
        code, block = BLOCKS.get(qt.name, (0, 0))
        head = d // 32 * block if code else d  # a cache row's head stride, in its elements
        rotation = kv_rotation((qt, qt), (d, d), torch.device("cuda")) if args.rotation else (0, 0)
        cache = "*u8" if code else {"F16": "*fp16", "BF16": "*bf16"}[qt.name]
        kinds = dict(
            KT=code, KB=block, VT=code, VB=block, DOT=tl.float16, D=d, BLOCK_D=block_d, G=n_head // n_kv
        )
        rows = {"k_ptr": cache, "v_ptr": cache, "kc_ptr": cache, "vc_ptr": cache, "levels_ptr": "*fp32",
                "pos_ptr": "*i64", "kpos_ptr": "*i64", "table_ptr": "*i32", "part_ptr": "*fp32",
                "stats_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32",
                "xq_ptr": "*i8", "dx_ptr": "*fp32", "xs_ptr": "*fp32", "qn_ptr": "*fp32",
                "kn_ptr": "*fp32", "starts_ptr": "*i32", "tables_ptr": "*i32"}  # fmt: skip
        strides = {"sq_b": n_head * d, "sq_t": n_head * d, "sq": d, "sq_h": d, "sk_b": n_kv * d, "sk": d,
                   "sv_b": n_kv * d, "sv": d, "skc_n": n_kv * head, "svc_n": n_kv * head, "sk_n": n_kv * head,
                   "sv_n": n_kv * head, "skc_h": head, "svc_h": head, "sk_h": head, "sv_h": head}  # fmt: skip
        decode = compile_sm90(
            attention_kernel, rows, strides,
            kinds | dict(N_DIMS=d, NEOX=False, WINDOW=False, SOFTCAP=False, PAGED=False, BR=1, WAIT=False,
                         BLOCK_G=max(16, triton.next_power_of_2(n_head // n_kv)), BLOCK_N=BLOCK_N,
                         SPLIT=True, QUANT=d % 32 == 0, TRIGGER=False, Q_NORM=NORMS, K_NORM=NORMS)
            | dict(ROT_K=rotation[0], ROT_V=rotation[1]),
            4, 3,  # as `decode_attention._launch` launches a float16 or block cache (float32: 1)
        )  # fmt: skip
        bm, bn, warps, stages = _tiles(d, True, False, code != 0)
        prefill_kinds = kinds | dict(WINDOW=False, SOFTCAP=False, RING=False, BLOCK_M=bm, BLOCK_N=bn)
        prefill, paged = (
            compile_sm90(prefill_kernel, rows, strides, prefill_kinds | dict(PAGED=p, BR=br), warps, stages)
            for p, br in ((False, 1), (True, 16))
        )
        # the split merge of a decode step at a long context (as many splits as it loads at once)
        combine = compile_sm90(
            combine_kernel, rows, strides,
            dict(D=d, QUANT=d % 32 == 0, TRIGGER=d % 32 == 0, ROT_V=rotation[1], MERGE_SPLITS=MERGE_SPLITS,
                 BLOCK_D=block_d),
            4, 1,
        )  # fmt: skip
        kernels = (("decode", decode), ("combine", combine), ("prefill", prefill), ("paged", paged))
        for kernel, compiled in kernels:
            shown = " ".join(f"{k} {n}" for k, n in counts(compiled.asm["ptx"]).items())
            print(f"{kernel:8} {name:7} {shown}  shared {compiled.metadata.shared}")


if __name__ == "__main__":
    main()

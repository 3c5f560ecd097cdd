"""CPU matmul options for a GGUF's matrices: time, bytes and error of each, and a per-token estimate.

For every distinct (type, N x K) of the model (default: the embedded SmolLM2 Q4_1) and each batch M,
the best-of-R time of each way to compute x @ W^T on the CPU:

- packed:    what `linear` runs: the native kernels on the GGUF blocks for their types, else the fused
             GEMV on repacked codes (M <= 8), else dequant chunks + mm
- repacked:  for the native kernels' types, the repacked codes' path they replaced
- dequant:   raw blocks dequantized a chunk at a time (torch_ops) + mm, no repacking
- emulated:  the whole matrix dequantized, then one mm
- int4pack:  torch's `_weight_int4pack_mm_for_cpu` (bf16 x, scales and y; 4-bit types only)
- int8pack:  torch's `_weight_int8pack_mm` on the weights re-quantized per row (Q8_0 only: lossy)
- f32 / bf16 dense: a dense copy of the dequantized matrix (what the memory budget forbids)

"err" is max |y - y_ref| / max |y_ref| against float64 dequantize + matmul. Then the whole forward's
matrices (every layer's, plus the output head) are timed in sequence at M = 1, a decode step's
matmul time (one call per matrix, then with each layer's q/k/v and gate/up joined by `linear_many`),
and the layers' at M = 512, a prompt's. Weights stream from RAM as in real decoding.

    python bench/cpu_matmul.py [--model PATH] [--threads 2] [--m 1,512] [--repeat 20] [--prompt 512]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from llmx.bench.tables import Column, markdown
from llmx.gguf import open_gguf
from llmx.measured import best_seconds
from llmx.models_on_disk import default_model_path
from llmx.quant import cpu_pack, reference, weight
from llmx.quant import torch_ops as T
from llmx.quant.weight import QWeight, dequantize, linear, linear_many, prepare_cpu, prepare_shared
from llmx.runtime.weights import host_view


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    return best_seconds(fn, repeat) * 1e3


def int4pack(w: QWeight) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """x -> x @ W^T through torch's int4pack kernel, for types whose codes fit 4 bits in groups of 32."""
    spec = T.CODES.get(w.qtype.ggml_id)
    if spec is None or spec.group != 32 or spec.hi - spec.lo > 15 or w.shape[0] % 16:
        return None
    c = T.codes(w.raw, w.qtype)
    offset = c.offset if c.offset is not None else torch.zeros_like(c.scale)
    u = (c.code - spec.lo).to(torch.int32)  # int4pack computes (u - 8) * scale + zero
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
    zero = offset + (8 + spec.lo) * c.scale
    sz = torch.stack((c.scale, zero), -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, 32, sz).float()


def int8pack(w: QWeight) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """x -> x @ W^T with W re-quantized to int8 with one scale per row (lossy; Q8_0 only)."""
    if w.qtype.name != "Q8_0":
        return None
    dense = dequantize(w)
    scale = dense.abs().amax(1).clamp_min(1e-30) / 127
    codes = (dense / scale[:, None]).round().to(torch.int8)
    return lambda x: torch._weight_int8pack_mm(x, codes, scale)


def methods(w: QWeight) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], int]]:
    """Name -> (x -> y, bytes of weight read per call)."""
    n, k = w.shape
    out = {
        "packed": (lambda x: linear(x, w), w.packed.nbytes if w.packed is not None else w.raw.nbytes),
        "dequant": (lambda x: linear(x, w, kernel="dequant"), w.raw.nbytes),
        "emulated": (lambda x: linear(x, w, kernel="emulated"), w.raw.nbytes),
    }
    if w.packed is None and cpu_pack.packable(w.qtype, w.shape):  # the native kernels take it
        pk = cpu_pack.pack(w.raw, w.qtype)
        out["repacked"] = (lambda x: weight._packed_matmul(x, pk), pk.nbytes)
    for name, fn in (("int4pack", int4pack(w)), ("int8pack", int8pack(w))):
        if fn is not None:
            out[name] = (fn, n * k // (2 if name == "int4pack" else 1) + n * k // 32 * 4)
    dense = dequantize(w)
    dense_bf16 = dense.bfloat16()
    out["f32 dense"] = (lambda x: x @ dense.t(), dense.nbytes)
    out["bf16 dense"] = (lambda x: (x.bfloat16() @ dense_bf16.t()).float(), dense_bf16.nbytes)
    return out


def matrix_rows(weights: list[QWeight], ms: list[int], repeat: int) -> list[dict]:
    rows, seen = [], set()
    for w in weights:
        if (w.qtype.name, w.shape) in seen:
            continue
        seen.add((w.qtype.name, w.shape))
        w64 = torch.from_numpy(reference.dequantize(w.raw.numpy(), w.qtype)).double()
        for m in ms:
            x = torch.randn(m, w.shape[1], generator=torch.Generator().manual_seed(m))
            ref = x.double() @ w64.t()
            for name, (fn, nbytes) in methods(w).items():
                if m > 64 and name == "int8pack":
                    continue  # its CPU kernel is a slow reference loop for large M
                err = ((fn(x).double() - ref).abs().max() / ref.abs().max()).item()
                ms_ = best_ms(lambda fn=fn, x=x: fn(x), repeat if m == 1 else max(3, repeat // 5))
                n, k = w.shape
                rate = dict(gbs=nbytes / ms_ / 1e6, gflops=2 * m * n * k / ms_ / 1e6)
                rows.append(
                    dict(type=w.qtype.name, shape=f"{n}x{k}", m=m, method=name, ms=ms_, err=err, **rate)
                )
    return rows


def forward_rows(weights: list[QWeight], head: QWeight, repeat: int, prompt: int) -> list[dict]:
    """Time all matrices of one forward in sequence: decode (M = 1, head included), the same with
    each layer's q/k/v and gate/up joined by `linear_many`, and a prompt."""
    calls = [[w] for w in [*weights, head]]
    joined = _joined_calls(weights) + [[head]]
    rows = []
    tests = [("decode step", 1, calls), ("decode step, q/k/v + gate/up joined", 1, joined)]
    for label, m, groups in tests + ([(f"prompt of {prompt}", prompt, calls[:-1])] if prompt else []):
        xs = {k: torch.randn(m, k) for k in {g[0].shape[1] for g in groups}}
        ms_ = best_ms(
            lambda g=groups, xs=xs: [linear_many(xs[ws[0].shape[1]], ws) for ws in g], repeat if m == 1 else 2
        )
        nbytes = sum(w.packed.nbytes if w.packed is not None else w.raw.nbytes for g in groups for w in g)
        rows.append(dict(what=label, mats=len(groups), ms=ms_, tps=m * 1e3 / ms_, gbs=nbytes / ms_ / 1e6))
    return rows


JOINS = (("attn_q", "attn_k", "attn_v"), ("ffn_gate", "ffn_up"))  # matrices of a layer that share x


def _joined_calls(weights: list[QWeight]) -> list[list[QWeight]]:
    """Each layer's matrices as calls: q/k/v together, gate/up together (each group prepared as one
    call, `prepare_shared`), the others alone."""
    by_name = {w.name: w for w in weights}
    calls, done = [], set()
    for w in weights:
        if w.name in done:
            continue
        layer, kind = w.name.removesuffix(".weight").rsplit(".", 1)
        group = next(
            (g for g in JOINS if kind in g and all(f"{layer}.{k}.weight" in by_name for k in g)), (kind,)
        )
        calls.append([by_name[f"{layer}.{k}.weight"] for k in group])
        done.update(x.name for x in calls[-1])
        prepare_shared(calls[-1])  # as the loader does: one call for the group where it can
    return calls


def load(path: str) -> tuple[list[QWeight], QWeight, int]:
    """The model's 2-D matrices except the output head, the head (output.weight or the tied embedding)."""
    mf = open_gguf(path)
    weights = {
        name: prepare_cpu(QWeight(host_view(info), info.qtype, info.shape, name))
        for name, info in mf.tensors.items()
        if len(info.shape) == 2 and info.qtype.ggml_id in reference.DEQUANT
    }
    head = weights.pop("output.weight", None) or weights["token_embd.weight"]
    layers = [w for name, w in weights.items() if name.startswith("blk.")]
    return layers, head, mf.nbytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--m", default="1,512", help="batches of the per-matrix table ('' skips it)")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=512, help="the forward table's prompt (0: none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    layers, head, file_bytes = load(args.model or str(default_model_path()))
    print(f"{torch.get_num_threads()} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    packed = sum(w.packed.nbytes for w in [*layers, head] if w.packed is not None)
    print(f"packed matrices: {packed / 2**20:.1f} MiB (file {file_bytes / 2**20:.1f} MiB)\n")
    with torch.inference_mode():
        if args.m:
            rows = matrix_rows([*layers, head], [int(m) for m in args.m.split(",")], args.repeat)
            print(markdown(rows, MATRIX_COLUMNS))
            print()
        print(markdown(forward_rows(layers, head, args.repeat, args.prompt), FORWARD_COLUMNS))


MATRIX_COLUMNS = [
    Column("type", lambda r: r["type"], right=False),
    Column("N x K", lambda r: r["shape"]),
    Column("M", lambda r: str(r["m"])),
    Column("method", lambda r: r["method"], right=False),
    Column("ms", lambda r: f"{r['ms']:.4f}"),
    Column("GB/s (M=1) or GFLOP/s", lambda r: f"{r['gbs']:.1f}" if r["m"] == 1 else f"{r['gflops']:.0f}"),
    Column("err", lambda r: f"{r['err']:.1e}"),
]
FORWARD_COLUMNS = [
    Column("matmuls of", lambda r: r["what"], right=False),
    Column("kernel calls", lambda r: str(r["mats"])),
    Column("ms", lambda r: f"{r['ms']:.2f}"),
    Column("tokens/s", lambda r: f"{r['tps']:.0f}"),
    Column("weight GB/s", lambda r: f"{r['gbs']:.1f}"),
]


if __name__ == "__main__":
    main()

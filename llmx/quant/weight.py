"""QWeight, the one weight object of the runtime, and `linear`, which runs the kernel it holds.

A QWeight keeps a tensor's GGUF bytes as they are (uint8 rows of blocks, or a float tensor for
F32/F16/BF16) on its device, with everything its kernels need made when it is made or prepared at
load: the kernel of each M bucket (`llmx.quant.choice`'s table, consulted there and nowhere else),
the native CPU call, and the group of weights it shares x with. A call only indexes that state:

- CUDA: the Triton kernels (`llmx.quant.triton.matmul`); "emulated" where Triton is missing;
- CPU, Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K matrices: kept as GGUF's blocks and multiplied by the native kernels
  (`cpu_native.py`): one pass over the weights for up to 15 rows of x (and one call for the matrices
  that share x), else chunks of rows dequantized into float32 for `torch.mm`; where no C compiler is
  at hand, the packed path below;
- CPU, other quantized matrices (repacked at load by `prepare_cpu`, see `cpu_pack.py`): up to GEMV_MAX_M
  rows of x, the compiled GEMV on the packed codes, row by row; more rows (prompts), the packed
  rows dequantized a chunk at a time into float32 and multiplied by MKL (`torch.mm`);
- CPU otherwise (float types, LLMX_KERNEL=dequant): the same chunks, dequantized from the raw blocks;
- "emulated": the whole weight dequantized, then one dense float32 matmul; the numerics reference,
  forced for every call with LLMX_KERNEL=emulated (or per call with `kernel="emulated"`).

Every CPU path computes in float32 from the exact weights, so they differ only in summation order.
"""

from __future__ import annotations

import contextlib
import operator
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from llmx import settings
from llmx.errors import LlmxError
from llmx.quant import QType
from llmx.quant import choice as C
from llmx.quant import cpu_native as N
from llmx.quant import cpu_pack as P
from llmx.quant import torch_ops as T
from llmx.quant.triton import layout as L
from llmx.quant.triton import matmul as G
from llmx.quant.triton.launch import has_triton

KERNELS = settings.CPU_KERNELS
KERNEL = settings.cpu_kernel()  # read once; `linear(..., kernel=)` overrides per call
GPU_KERNEL = settings.gpu_kernel()  # read once: a GPU kernel forced at every M (benchmarks)
GEMV_MAX_M = 8  # rows of x up to which the fused GEMV beats dequantize + dense matmul (bench/cpu_matmul.py)
DEQUANT_CHUNK_BYTES = 4 << 20  # float32 rows dequantized at a time: big enough for mm, small enough for L3
_ON_GPU = frozenset((*C.GPU_KERNELS, "float"))  # the kernels `G.run` takes
_BUCKET_OF, _BUCKETED, _LAST_BUCKET = C.BUCKET_OF, len(C.BUCKET_OF), C.LAST_BUCKET  # `C.bucket`, inlined


class _NativeRows(threading.local):
    limit = C.NATIVE_MAX_ROWS  # rows of x up to which the CPU's native GEMV runs, on this thread


_NATIVE_ROWS = _NativeRows()


@contextlib.contextmanager
def decode_tokens() -> Iterator[None]:
    """Within it, on this thread, x of up to `cpu_native.MAX_ROWS` rows takes the CPU's native GEMV
    (and the native gated FFN and router): the rows are decode tokens of a batch, each then computed
    as that token alone is (the several-row kernels give each row the one-row kernel's result), where
    a prompt's ubatch of more than NATIVE_MAX_ROWS rows multiplies float x in dequantized chunks. At 16
    rows a SmolLM2 decode step took 73 ms this way against 173-236 through the chunks (bench/RESULTS.md)."""
    before, _NATIVE_ROWS.limit = _NATIVE_ROWS.limit, N.MAX_ROWS
    try:
        yield
    finally:
        _NATIVE_ROWS.limit = before


@dataclass
class QWeight:
    """A weight as stored in the GGUF, on its device, with its kernels chosen.

    raw:     uint8 [rows, row_bytes] raw blocks, or a float tensor of `shape` for F32/F16/BF16
    qtype:   its GGML type
    shape:   logical row-major shape; (out_features, in_features) for a matrix, (n_expert,
             out_features, in_features) for a stack of expert matrices (`ffn_*_exps`)
    packed:  a device form built once at load, or None: cpu_pack.PackedCodes from `prepare_cpu`,
             triton.layout.SPLIT (raw rows rearranged) from `prepare_gpu`
    kernels: the kernel of each M bucket (`choice.kernels`, from the device and layout)
    native:  the native GEMV call of this weight alone, where the native kernels take it
    shared:  the weights it multiplies x with in one call, where `prepare_shared` joined them
    experts: a stack's matrices, expert by expert: QWeights whose raw (and packed form) are row views
             of the stack's, so each takes the kernels of a matrix its size; () for a matrix

    A stack is prepared as the tall matrix [n_expert * out, in] it is in the GGUF (repacked for the
    CPU, or rearranged for Triton, row by row), so its experts' views are prepared too.
    The derived fields follow raw and packed: replacing either (op offload pins a CPU weight's raw)
    derives them again at once, so they never describe bytes the weight no longer holds.
    """

    raw: torch.Tensor
    qtype: QType
    shape: tuple[int, ...]
    name: str = ""
    packed: object | None = None
    kernels: tuple[str, ...] = field(init=False, repr=False)
    native: N.Gemv | None = field(init=False, default=None, repr=False)
    shared: SharedInput | None = field(init=False, default=None, repr=False)
    experts: tuple[QWeight, ...] = field(init=False, default=(), repr=False)

    def __post_init__(self) -> None:
        self._derive()

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name in ("raw", "packed") and "kernels" in self.__dict__:
            self._derive()

    def _derive(self) -> None:
        """Choose the kernels for the current raw and packed, and build the native calls they need
        (a stack: its experts' views, each with its own)."""
        if len(self.shape) == 3:
            object.__setattr__(self, "kernels", ())
            object.__setattr__(self, "experts", _expert_views(self))
            return
        layout = _layout(self)
        device = self.raw.device.type
        if device == "cuda":
            device = "cuda" if has_triton() else "cuda-emulated"
            preference = "emulated" if KERNEL == "emulated" else GPU_KERNEL
        else:
            preference = KERNEL
        object.__setattr__(self, "kernels", C.kernels(self.qtype, device, layout, preference))
        native = N.Gemv([(self.raw, self.qtype)]) if layout == C.NATIVE else None
        object.__setattr__(self, "native", native)
        if self.shared is not None:
            self.shared.derive()

    def describe(self) -> str:
        """How this weight is computed on the CPU, for the load report: "Q4_1 -> 4-bit codes, ..."."""
        if self.experts:
            return self.experts[0].describe()
        if self.native is not None:
            return f"{self.qtype.name} (GGUF blocks, native kernel)"
        if not isinstance(self.packed, P.PackedCodes):
            return f"{self.qtype.name} (dequantized per chunk)"
        return f"{self.qtype.name} -> {self.packed.describe()}"


@dataclass(eq=False)
class SharedInput:
    """CPU weights that multiply the same x (q/k/v, gate/up), prepared at load to run as one:

    members: the QWeights, in order
    native:  one native GEMV call for all of them (all take the native kernels, same K), or None
    packed:  their packed forms concatenated along N (each member's `packed` is a row view of it),
             or None
    sizes:   their output features, to split the joined result
    bias:    their biases joined (absent ones zero), made at the first native call given them (a
             layer's biases never change), or None
    """

    members: tuple[QWeight, ...]
    native: N.Gemv | None = None
    packed: P.PackedCodes | None = None
    sizes: list[int] = field(default_factory=list)
    bias: torch.Tensor | None = None

    def derive(self) -> None:
        """The one native call for the members' current raws, where they all take it."""
        ws, k = self.members, self.members[0].shape[1]
        native = len(ws) <= N.MAX_WEIGHTS and all(w.native is not None and w.shape[1] == k for w in ws)
        self.native = N.Gemv([(w.raw, w.qtype) for w in ws]) if native else None

    def serves(self, ws: Sequence[QWeight]) -> bool:
        """Whether these are exactly the members, in order."""
        return len(self.members) == len(ws) and all(map(operator.is_, self.members, ws))

    def bias_rows(self, biases: Sequence[torch.Tensor | None] | None, m: int) -> torch.Tensor | None:
        """The members' `biases` joined as the native call's residual for m rows [m, sum of outputs],
        or None where none is given."""
        if biases is None or all(b is None for b in biases):
            return None
        if self.bias is None:
            parts = zip(self.members, biases, strict=True)
            self.bias = torch.cat(
                [torch.zeros(w.shape[0]) if b is None else b.float().cpu() for w, b in parts]
            )
        return self.bias.expand(m, -1)


def _expert_views(stack: QWeight) -> tuple[QWeight, ...]:
    """Expert e's matrix [out, in] of a stack [n_expert, out, in]: rows e*out .. (e+1)*out of the
    stack's raw blocks and of its packed form (Triton's SPLIT marker applies to every row)."""
    n_expert, n = stack.shape[:2]
    views = []
    for e in range(n_expert):
        raw = stack.raw[e] if stack.raw.is_floating_point() else stack.raw[e * n : (e + 1) * n]
        packed = stack.packed
        if isinstance(packed, P.PackedCodes):
            packed = packed.rows(e * n, (e + 1) * n)
        views.append(QWeight(raw, stack.qtype, stack.shape[1:], f"{stack.name}[{e}]", packed))
    return tuple(views)


def as_matrix(w: QWeight) -> QWeight:
    """A stack [n_expert, out, in] as the tall matrix [n_expert * out, in] of the same bytes (the
    GGUF's layout), which the preparations below take row by row; a matrix itself."""
    if len(w.shape) != 3:
        return w
    e, n, k = w.shape
    raw = w.raw.reshape(e * n, k) if w.raw.is_floating_point() else w.raw
    return QWeight(raw, w.qtype, (e * n, k), w.name, w.packed)


def _layout(w: QWeight) -> str:
    if w.raw.device.type == "cuda":
        return G.layout_of(w)
    if isinstance(w.packed, P.PackedCodes):
        return C.PACKED
    return C.NATIVE if w.packed is None and _native_blocks(w) else C.GGUF


def _native_blocks(w: QWeight) -> bool:
    """Whether `w.raw` holds GGUF blocks on the CPU that the native kernels read."""
    cpu_blocks = w.raw.device.type == "cpu" and w.raw.is_contiguous()
    return cpu_blocks and N.supports(w.qtype, w.shape) and N.available()


# --- preparing at load ----------------------------------------------------------------------------


def prepare_cpu(w: QWeight, repack: bool = True) -> QWeight:
    """Build the CPU packed form once at load when the type allows it and the native kernels do not
    take it (they read the raw blocks); the raw bytes stay for `embedding`.

    After repacking, the raw bytes' pages are handed back to the kernel (a tied embedding table reads
    its rows back on demand), so an mmap-backed weight does not count twice in the process's memory.
    """
    native = (w.experts[0] if w.experts else w).native is not None
    if not repack or w.raw.device.type != "cpu" or native or not P.packable(w.qtype, w.shape[-2:]):
        return w
    w.packed = P.pack(w.raw, w.qtype)
    P.release_pages(w.raw)
    P.compiled_kernels()  # load (or build once) the GEMV kernels now rather than at the first token
    return w


def prepare_gpu(w: QWeight) -> QWeight:
    """The Triton kernels' row layout (same bytes, same row width, `triton.layout.prepare`), written
    back into `w.raw` in place so the tensor keeps no allocation of its own; the repacked copy is
    temporary. Not where Triton is missing (the emulated path reads GGUF rows)."""
    if not has_triton():
        return w
    prepared = L.prepare(as_matrix(w))
    if prepared.packed is not w.packed:
        w.raw.copy_(prepared.raw)
        w.packed = prepared.packed
    return w


def prepare_shared(ws: Sequence[QWeight]) -> SharedInput | None:
    """Prepare CPU weights that multiply the same x to run as one call (`linear_many`, `swiglu`): one
    native call, or their packed forms joined along N (no extra memory: each weight's packed form
    becomes a row view of the concatenation, and keeps working alone). None where they cannot."""
    if len(ws) < 2 or any(w.raw.device.type != "cpu" for w in ws):
        return None
    group = SharedInput(tuple(ws))
    group.derive()
    if group.native is None and not _join(group):
        return None
    for w in ws:
        object.__setattr__(w, "shared", group)
    return group


def _join(group: SharedInput) -> bool:
    """Concatenate the members' packed forms along N; False when they are not all packed alike."""
    pks = [w.packed for w in group.members]
    if not all(isinstance(p, P.PackedCodes) for p in pks):
        return False
    first = pks[0]
    alike = all(
        p.codes.dtype == first.codes.dtype
        and p.codes.shape[1:] == first.codes.shape[1:]
        and (p.offset is None) == (first.offset is None)
        for p in pks
    )
    if not alike:
        return False
    offsets = None if first.offset is None else torch.cat([p.offset for p in pks])
    group.packed = P.PackedCodes(
        torch.cat([p.codes for p in pks]), torch.cat([p.scale for p in pks]), offsets
    )
    group.sizes = [p.codes.shape[0] for p in pks]
    r0 = 0
    for w, size in zip(group.members, group.sizes, strict=True):  # each weight keeps working alone
        w.packed = group.packed.rows(r0, r0 + size)
        r0 += size
    return True


# --- calls ----------------------------------------------------------------------------------------


def linear(
    x: torch.Tensor, w: QWeight, kernel: str | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., in] float32 @ W^T for W [out, in] -> [..., out] float32, computed on W's device;
    plus `residual` [..., out] where given (on a GPU inside the GEMV where it can be).

    `kernel` forces one of KERNELS for this call (tests, benchmarks); None runs the weight's own.
    """
    n, k = w.shape
    if x.shape[-1] != k:
        raise LlmxError(f"{w.name or 'weight'} {w.shape} cannot multiply x of shape {tuple(x.shape)}")
    flat = x.dim() == 2  # a decode step's x: no reshapes (each costs about a microsecond)
    m = x.shape[0] if flat else x.numel() // max(k, 1)
    if kernel is None:
        choice = w.kernels[_BUCKET_OF[m] if m < _BUCKETED else _LAST_BUCKET]
        if choice == "native_chunks" and m <= _NATIVE_ROWS.limit:
            choice = "native"
    else:
        choice = _forced(w, m, kernel)
    if choice in _ON_GPU:  # x keeps its shape; the integer-dot GEMV adds the residual as it stores
        return G.run(x, G.unit_rows(x), w, choice, residual=residual)
    x2 = x if flat else x.reshape(-1, k)
    if choice == "native" and flat:  # a decode step: the GEMV adds the residual as it stores
        return w.native(x2, residual)
    if choice == "native":
        y = w.native(x2)
    elif choice == "native_chunks":
        y = _native_matmul(x2, w)
    elif choice == "packed":
        if not isinstance(w.packed, P.PackedCodes):
            raise LlmxError(f"{w.name or 'weight'} ({w.qtype.name}) has no packed CPU form; see prepare_cpu")
        y = _packed_matmul(x2.contiguous(), w.packed)
    elif choice == "emulated":
        y = x2 @ dequantize(w).t()
    else:
        y = _dequant_matmul(x2, w)
    y = y if flat else y.reshape(*x.shape[:-1], n)
    return y if residual is None else y.add_(residual)


def _forced(w: QWeight, m: int, kernel: str) -> str:
    """The kernel for M = m under the per-call preference `kernel` (one of KERNELS; on a GPU only
    "emulated" changes anything)."""
    if kernel not in KERNELS:
        raise LlmxError(f"unknown kernel {kernel!r}; choose one of {', '.join(KERNELS)}")
    if w.raw.device.type == "cuda":
        return C.choose(w.qtype, "cuda", _layout(w), m, "emulated" if kernel == "emulated" else "auto")
    return C.choose(w.qtype, "cpu", _layout(w), m, kernel)


def linear_many(
    x: torch.Tensor,
    ws: Sequence[QWeight],
    kernel: str | None = None,
    biases: Sequence[torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """[linear(x, w) for w in ws] (e.g. q/k/v, or gate/up), in one kernel call where possible; plus
    biases[j] (a vector, or None) on output j where `biases` is given.

    On a GPU, x is quantized once for all the integer-dot GEMVs among them, and those of one type
    share launches. On the CPU, weights `prepare_shared` joined at load run as one call (which adds
    the biases too: a decode step with no torch op between its native calls, `runtime.cpu_replay`);
    the results are then views of one [..., sum(out)] tensor.
    """
    if kernel is None and ws[0].raw.is_cuda:
        x2 = G.unit_rows(x)
        m = x2.shape[0]
        b = _BUCKET_OF[m] if m < _BUCKETED else _LAST_BUCKET
        chosen = [w.kernels[b] for w in ws]
        if _ON_GPU.issuperset(chosen):
            return with_biases(G.run_many(x, x2, list(ws), chosen), biases)
    group = ws[0].shared
    if group is None or (kernel or KERNEL) not in ("auto", "packed") or not group.serves(ws):
        return with_biases([linear(x, w, kernel) for w in ws], biases)
    k = ws[0].shape[1]
    if x.shape[-1] != k:
        raise LlmxError(f"{ws[0].name or 'weight'} {ws[0].shape} cannot multiply x of shape {tuple(x.shape)}")
    rows = x.numel() // max(k, 1)
    if group.native is not None and rows <= _NATIVE_ROWS.limit:
        x2 = x if x.dim() == 2 else x.reshape(-1, k)
        outs = group.native(x2, group.bias_rows(biases, rows)).split_with_sizes(group.native.sizes, dim=1)
        return list(outs) if x.dim() == 2 else [y.reshape(*x.shape[:-1], -1) for y in outs]
    if group.packed is None:
        return with_biases([linear(x, w, kernel) for w in ws], biases)
    y = _packed_matmul(x.reshape(-1, k).contiguous(), group.packed)
    return with_biases(list(y.reshape(*x.shape[:-1], -1).split(group.sizes, dim=-1)), biases)


def with_biases(outs: list[torch.Tensor], biases: Sequence[torch.Tensor | None] | None) -> list[torch.Tensor]:
    """outs[j] + biases[j] (brought to its device) where a bias is given."""
    if biases is None:
        return outs
    return [y if b is None else y + b.to(y.device) for y, b in zip(outs, biases, strict=True)]


def gated_ffn(
    x: torch.Tensor,
    gate: QWeight,
    up: QWeight,
    down: QWeight,
    activation: str,
    residual: torch.Tensor | None = None,
    gate_inp: QWeight | None = None,
) -> torch.Tensor | None:
    """down(act(gate(x)) * up(x)) (`activation`: one of `cpu_native.ACTIVATIONS`), each token's row times
    sigmoid(gate_inp . x_t) where `gate_inp` [1, K] is given (a shared expert's gate: float32, as GGUFs
    keep it), plus `residual` where given, in one native call for a decode step's x [M, K] (M <=
    NATIVE_MAX_ROWS; `decode_tokens`' limit within it) when gate and up were prepared as one native
    call (`prepare_shared`) and down takes the native kernels too (`cpu_native.Gemv.gated_ffn`); None
    otherwise."""
    if KERNEL not in ("auto", "packed") or x.dim() != 2 or x.shape[0] > _NATIVE_ROWS.limit or not x.is_cpu:
        return None
    group, down_call = gate.shared, down.native
    if group is None or group.native is None or down_call is None or not group.serves((gate, up)):
        return None
    if gate.shape[0] != up.shape[0] or down.shape[1] != gate.shape[0]:
        return None
    scale = None
    if gate_inp is not None:
        scale = gate_inp.raw
        if not (scale.is_cpu and scale.dtype == torch.float32 and scale.is_contiguous()):
            return None
        if scale.numel() != x.shape[1] or x.shape[1] % N.ROUTE_LANES != 0:
            return None
        scale = scale.reshape(-1)
    return group.native.gated_ffn(x, down_call, activation, residual, scale)


def moe_swiglu(
    x: torch.Tensor,
    gate_exps: QWeight,
    up_exps: QWeight,
    down_exps: QWeight,
    weights: torch.Tensor,
    ids: torch.Tensor,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The routed experts' FFNs (`ops.moe_ffn`) of x [T, K] in native calls (`cpu_native.moe_swiglu`),
    plus `residual` where given, when the three stacks take the native kernels (written into `out`
    where given); None otherwise."""
    if KERNEL not in ("auto", "packed") or x.dim() != 2 or not x.is_cpu or x.dtype != torch.float32:
        return None
    stacks = (gate_exps, up_exps, down_exps)
    if not all(w.experts and w.experts[0].native is not None and w.raw.is_contiguous() for w in stacks):
        return None
    n_expert, f, e = gate_exps.shape
    if up_exps.shape != gate_exps.shape or down_exps.shape != (n_expert, e, f):
        return None
    return N.moe_swiglu(x, [(w.raw, w.qtype) for w in stacks], (n_expert, f, e), ids, weights, residual, out)


def moe_route(
    x: torch.Tensor, router: QWeight, k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A MoE layer's routing (`ops.moe.router`) of x [T, E] in one native call (`cpu_native.moe_route`)
    for a decode step's few tokens (T <= NATIVE_MAX_ROWS, `decode_tokens`' limit within it; a prompt's
    matmul is torch's) by a float32 router on the CPU, as GGUFs keep routers; None otherwise."""
    raw = router.raw
    if KERNEL not in ("auto", "packed") or not N.available():
        return None
    if x.dim() != 2 or x.shape[0] > _NATIVE_ROWS.limit:
        return None
    if not (x.is_cpu and raw.is_cpu and x.dtype == raw.dtype == torch.float32 and raw.is_contiguous()):
        return None
    if raw.shape != router.shape or raw.shape[1] % N.ROUTE_LANES != 0:
        return None
    return N.moe_route(x, raw, k, normalize)


def embedding(ids: torch.Tensor, w: QWeight, scale: float = 1.0) -> torch.Tensor:
    """Rows `ids` (integer, any shape) of the table W [rows, cols] times `scale` -> float32
    [*ids.shape, cols]."""
    cols = w.shape[-1]
    if w.raw.is_floating_point():
        rows = w.raw[ids.to(w.raw.device)].float()
    elif _triton_layout(w):
        rows = G.embedding(ids.to(w.raw.device), w)
    elif _native_blocks(w):  # a repacked tied table keeps its raw rows for lookups; scaled in the call
        flat = ids.reshape(-1).to(device="cpu", dtype=torch.long)
        return N.embedding_rows(w.raw, w.qtype, flat, cols, scale).reshape(*ids.shape, cols)
    else:
        rows = T.embedding_rows(w.raw, w.qtype, cols, ids).reshape(*ids.shape, cols)
    return rows if scale == 1.0 else rows * scale


def dequantize(w: QWeight) -> torch.Tensor:
    """The whole weight as float32 of `w.shape`, on its device (bit-exact with gguf-py)."""
    if _triton_layout(w):
        return G.dequantize(w)
    return T.dequantize(w.raw, w.qtype).reshape(w.shape)


def _triton_layout(w: QWeight) -> bool:
    """A CUDA weight whose rows `prepare_gpu` rearranged: only Triton's kernels read it."""
    return w.raw.device.type == "cuda" and w.packed is not None


# --- CPU matmuls ----------------------------------------------------------------------------------


def _native_matmul(x2: torch.Tensor, w: QWeight) -> torch.Tensor:
    """x2 [M, K] @ W^T on the GGUF blocks for more rows than a GEMV call takes: W dequantized in chunks
    of rows for `torch.mm` (fewer rows take `w.native`)."""
    n, k = w.shape
    buf = _scratch(min(n, _chunk_rows(k)) * k)
    return _chunked_matmul(
        x2, n, lambda r0, r1: N.dequantize_rows(w.raw, w.qtype, r0, r1, k, buf[: (r1 - r0) * k].view(-1, k))
    )


def _packed_matmul(x2: torch.Tensor, pk: P.PackedCodes) -> torch.Tensor:
    """x2 [M, K] @ W^T from the packed form: the compiled GEMV per row for few rows, else dense chunks."""
    m, k = x2.shape
    gemv = pk.gemv
    if gemv is not None and m == 1:
        return gemv(x2)
    if gemv is not None and m <= GEMV_MAX_M:
        return torch.cat([gemv(x2[i : i + 1]) for i in range(m)])
    buf = _scratch(min(pk.scale.shape[0], _chunk_rows(k)) * k)
    return _chunked_matmul(
        x2,
        pk.scale.shape[0],
        lambda r0, r1: P.dequantize_into(pk.rows(r0, r1), buf[: (r1 - r0) * k].view(-1, k)),
    )


def _dequant_matmul(x2: torch.Tensor, w: QWeight) -> torch.Tensor:
    """x2 [M, K] @ W^T with W dequantized from its raw blocks a chunk of rows at a time."""
    if w.qtype.name == "F32":
        return x2 @ w.raw.t()
    return _chunked_matmul(x2, w.shape[0], lambda r0, r1: T.dequantize(w.raw[r0:r1], w.qtype))


def _chunked_matmul(x2: torch.Tensor, n: int, rows_of_w: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
    """x2 [M, K] @ W^T -> [M, N], where rows_of_w(r0, r1) is W[r0:r1] in float32."""
    step = _chunk_rows(x2.shape[1])
    # each chunk of W's rows (one where they fit) writes its columns of y in place: BLAS takes the
    # slice's row stride as its leading dimension. (Chunks of y^T made contiguous at the end cost a
    # strided transpose of all of y: 12% of a Gemma 3 prompt on the 2-core Xeon, its 4 MB FFN outputs
    # at ~1.6 GB/s.)
    out = torch.empty(x2.shape[0], n, device=x2.device)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        torch.mm(x2, rows_of_w(r0, r1).t(), out=out[:, r0:r1])
    return out


def _chunk_rows(k: int) -> int:
    return max(16, DEQUANT_CHUNK_BYTES // (4 * k))


_SCRATCH = threading.local()  # a reused float32 buffer per thread: fresh large allocations page-fault


def _scratch(numel: int) -> torch.Tensor:
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < numel:
        # a normal tensor even when first needed under inference_mode: it is reused outside it too
        with torch.inference_mode(False):
            buf = _SCRATCH.buf = torch.empty(numel)
    return buf

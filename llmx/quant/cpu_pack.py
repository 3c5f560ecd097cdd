"""CPU repacking (llmx's `-rtr`) and the fused CPU GEMV that runs on the packed form.

At load, a matrix's GGUF blocks become `PackedCodes`: the `torch_ops.Codes` form
`w = scale * code + offset` per group, with the codes stored densely (4-bit codes two to a byte,
wider ones as int8) and float32 scales/offsets. Nothing is rounded: every scale and offset is the
float32 value the reference computes, so results are exact up to float32 summation order.

Kernels:
- `gemv` (one row of x, i.e. decode): `gemv_torch` below, compiled by Inductor into one vectorized
  OpenMP loop per code width (every shape shares it). LLMX_CPU_GEMV picks how; the default, auto,
  takes the first of these that works:
  - aot: AOTInductor packages, built once per machine and torch version in a subprocess (~1 min;
    cached under LLMX_CACHE_DIR, default ~/.cache/llmx), so the serving process never imports the
    compiler and pays ~5-10 us per call;
  - jit: where those cannot be built or loaded (some torch builds crash in the package loader),
    torch.compile in this process at load (~5 s, ~30 s the first time on a machine), the same loops
    at ~25 us per call;
  - eager: no compiled GEMV: every batch takes the dequantize path (slower, same results), as it does
    without a working C++ toolchain.
- `dequantize_into` (many rows of x, i.e. prompts): eager in-place unpacking of a chunk of rows
  into a reused float32 buffer, followed by a dense `torch.mm` in the caller.

4-bit layout (that of GGUF's legacy blocks): per group of g weights, byte j holds code j in its low
nibble and code j + g/2 in its high nibble. Stored codes are `code - lo`, so they are unsigned,
and `lo * scale` is folded into the offset.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import hashlib
import inspect
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmx.cpu_info import cpu_features
from llmx.errors import first_line
from llmx.quant import QType
from llmx.quant import torch_ops as T
from llmx.settings import cache_dir, cpu_gemv

PACK_ROWS = 1024  # rows unpacked at a time while packing: bounds the temporary memory


@dataclass
class PackedCodes:
    """W [N, K] as `scale * code + offset` per group of weights along K (G groups of g).

    codes:  uint8 [N, G, g/2], two 4-bit codes per byte; or int8 [N, G, g]
    scale:  float32 [N, G]
    offset: float32 [N, G]; None only for int8 codes of types without an offset
    """

    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None
    _kernel: list[Gemv | None] = field(default_factory=list, repr=False, compare=False)  # [] until bound

    @property
    def gemv(self) -> Gemv | None:
        """The compiled GEMV bound to this weight, x [1, K] float32 (contiguous) -> x @ W^T [1, N];
        None without one (no C++ toolchain, or a dimension of 1, which the packages are not built for)."""
        if not self._kernel:
            self._kernel.append(bind_gemv(self))
        return self._kernel[0]

    @property
    def bits(self) -> int:
        return 4 if self.codes.dtype == torch.uint8 else 8

    @property
    def group(self) -> int:
        return self.codes.shape[-1] * (2 if self.bits == 4 else 1)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.offset is None else self.offset.nbytes
        return self.codes.nbytes + self.scale.nbytes + extra

    def rows(self, r0: int, r1: int) -> PackedCodes:
        """Rows r0..r1 of W (views, no copy)."""
        off = None if self.offset is None else self.offset[r0:r1]
        return PackedCodes(self.codes[r0:r1], self.scale[r0:r1], off)

    def describe(self) -> str:
        codes = "4-bit codes" if self.bits == 4 else "int8 codes"
        offset = "" if self.offset is None else " + offset"
        return f"{codes}, f32 scale{offset} per {self.group} (exact)"


def packable(qt: QType, shape: tuple[int, ...]) -> bool:
    """Whether a weight of type `qt` and `shape` can be packed: a matrix of a type with affine codes."""
    return qt.ggml_id in T.CODES and len(shape) == 2


def pack(raw: torch.Tensor, qt: QType) -> PackedCodes:
    """Raw GGUF rows [N, row_bytes] (uint8, CPU) -> PackedCodes, unpacked PACK_ROWS rows at a time."""
    spec = T.CODES[qt.ggml_id]
    four_bit = spec.hi - spec.lo <= 15
    shift = spec.lo if four_bit else 0
    n_groups = raw.shape[1] // qt.block_bytes * qt.block_elems // spec.group
    codes = torch.empty(raw.shape[0], n_groups, spec.group // 2 if four_bit else spec.group,
                        dtype=torch.uint8 if four_bit else torch.int8)  # fmt: skip
    scale = torch.empty(raw.shape[0], n_groups)
    offset = torch.empty_like(scale) if four_bit or spec.has_offset else None
    for r0 in range(0, raw.shape[0], PACK_ROWS):
        c = T.codes(raw[r0 : r0 + PACK_ROWS].contiguous(), qt)
        r1 = r0 + c.code.shape[0]
        grouped = c.code.view(r1 - r0, n_groups, spec.group)
        if four_bit:
            u = (grouped - shift).to(torch.uint8).view(r1 - r0, n_groups, 2, spec.group // 2)
            torch.bitwise_or(u[:, :, 0], u[:, :, 1] << 4, out=codes[r0:r1])
        else:
            codes[r0:r1] = grouped
        scale[r0:r1] = c.scale
        if offset is not None:
            base = c.offset if c.offset is not None else torch.zeros_like(c.scale)
            offset[r0:r1] = base + shift * c.scale
    return PackedCodes(codes, scale, offset)


# --- kernels: the torch code is the spec; `gemv` is its compiled form ---------------------------------


def gemv_torch(
    x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None
) -> torch.Tensor:
    """x [1, G, g] float32 @ W^T -> [1, N]: per group, scale * (codes . x) (+ offset * sum(x))."""
    s = scale.unsqueeze(-1)
    if codes.dtype == torch.uint8:  # 4-bit: low nibbles meet the first half of each group of x
        half = codes.shape[-1]
        y = ((codes & 0x0F).float() * s * x[:, None, :, :half]).sum((-1, -2))
        y = y + ((codes >> 4).float() * s * x[:, None, :, half:]).sum((-1, -2))
    else:
        y = (codes.float() * s * x[:, None]).sum((-1, -2))
    if offset is not None:
        y = y + (offset * x.sum(-1)[:, None]).sum(-1)
    return y


def dequantize_into(pk: PackedCodes, out: torch.Tensor) -> torch.Tensor:
    """Packed rows -> `out` float32 [rows, K], in place (equal to the reference up to one rounding)."""
    n, g, width = pk.codes.shape
    if pk.bits == 4:
        halves = out.view(n, g, 2, width)
        halves[:, :, 0].copy_(pk.codes & 0x0F)
        halves[:, :, 1].copy_(pk.codes >> 4)
    else:
        out.view(n, g, width).copy_(pk.codes)
    w = out.view(n, g, -1).mul_(pk.scale.unsqueeze(-1))
    if pk.offset is not None:
        w.add_(pk.offset.unsqueeze(-1))
    return out


Runner = Callable[[list[torch.Tensor]], list[torch.Tensor]]
Gemv = Callable[[torch.Tensor], torch.Tensor]
_VARIANTS = ("u4_offset", "i8", "i8_offset")  # what pack() produces: 4-bit codes always have an offset
_RUNNERS: list[dict[str, Runner]] = []  # the compiled kernels by variant, once loaded ({}: none)


def bind_gemv(pk: PackedCodes) -> Gemv | None:
    """The compiled kernel for `pk`'s variant with its tensors bound, or None."""
    run = compiled_kernels().get(_variant(pk))
    if run is None or min(pk.codes.shape[:2]) < 2:
        return None
    g = pk.scale.shape[1]
    tensors = [pk.codes, pk.scale] + ([pk.offset] if pk.offset is not None else [])
    tensors = [_inference_alias(t) for t in tensors]  # whichever mode made them: one JIT kernel for all
    return lambda x: run([x.view(1, g, -1), *tensors])[0]


def _inference_alias(t: torch.Tensor) -> torch.Tensor:
    """`t` as an inference tensor: the same memory (no copy), made in inference mode."""
    if t.is_inference():
        return t
    with torch.inference_mode():
        alias = torch.empty(0, dtype=t.dtype)
        return alias.set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride())


def compiled_kernels() -> dict[str, Runner]:
    """The compiled GEMV kernels by variant, loaded (built first if needed) once per process."""
    if not _RUNNERS:
        _RUNNERS.append(_load_or_build())
    return _RUNNERS[0]


def _variant(pk: PackedCodes) -> str:
    return "u4_offset" if pk.bits == 4 else ("i8_offset" if pk.offset is not None else "i8")


def _load_or_build() -> dict[str, Runner]:
    """The kernels of the path LLMX_CPU_GEMV picks: AOTInductor's packages (built first if missing), else
    torch.compile's; {} (with a warning) when neither works, in which case every batch takes the
    dequantize path."""
    path = cpu_gemv()
    folder, problems = _cache_dir(), []
    for name, kernels in (("aot", _aot_kernels), ("jit", _jit_kernels)):
        if path in ("auto", name):
            runners, problem = kernels(folder, problems)
            if runners:
                return runners
            problems.append(f"{name}: {problem}")
    if problems:
        warnings.warn(
            f"llmx: no compiled CPU kernels ({'; '.join(problems)}); decoding will be slower", stacklevel=3
        )
    return {}


def _aot_kernels(folder: Path, _: list[str]) -> tuple[dict[str, Runner], str | None]:
    """The AOTInductor packages of every variant, built first if missing; or why there are none."""
    missing = [v for v in _VARIANTS if not (folder / f"{v}.pt2").exists()]
    problem = _build_all(folder, missing) if missing else None
    if problem is None:
        problem = _verified(folder, "aot")
    if problem is not None:
        return {}, problem
    return {v: _runner(folder, v) for v in _VARIANTS}, None


def _jit_kernels(folder: Path, problems: list[str]) -> tuple[dict[str, Runner], str | None]:
    """gemv_torch compiled in this process by torch.compile (Inductor's C++/OpenMP code), checked against
    the eager kernel and warmed up here so that the first token does not pay for it; or why there are
    none. ~5 s on 2 cores; ~30 s the first time on a machine (the check in a subprocess, a cold cache)."""
    problem = _verified(folder, "jit")  # a crash while compiling or running must not take this process down
    if problem is not None:
        return {}, problem
    after = f" ({problems[-1]})" if problems else ""
    print(f"llmx: compiling CPU kernels {', '.join(_VARIANTS)} with torch.compile{after}", file=sys.stderr)
    try:
        runners = _jit_runners()
        _check(runners)
    except Exception as e:  # any failure of the compiler means: no kernels
        return {}, first_line(e)
    return runners, None


class _Gemv(torch.nn.Module):
    """What AOTInductor exports: gemv_torch without offsets ..."""

    def forward(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return gemv_torch(x, codes, scale, None)


class _GemvOffset(torch.nn.Module):
    """... and with them."""

    def forward(
        self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor
    ) -> torch.Tensor:
        return gemv_torch(x, codes, scale, offset)


def _cache_dir() -> Path:
    """Where the compiled packages live: keyed by torch version, the CPU's features (they are built with
    -march=native) and the kernel source, so that any change means a fresh build."""
    cpu = torch.backends.cpu.get_cpu_capability()
    tag = hashlib.sha256(
        (inspect.getsource(gemv_torch) + inspect.getsource(_build) + cpu_features()).encode()
    ).hexdigest()
    root = cache_dir()
    return root / f"cpu-gemv-torch{torch.__version__}-{cpu}-{tag[:12]}"


def _build_all(folder: Path, variants: list[str]) -> str | None:
    """Build `variants` into `folder`, one subprocess each, in parallel (the compiler never enters
    this process); the reason it failed, or None."""
    print(
        f"llmx: building CPU kernels {', '.join(variants)} once (about a minute) in {folder}", file=sys.stderr
    )
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"cannot create {folder}: {e.strerror}; set LLMX_CACHE_DIR"
    build = [sys.executable, "-m", "llmx.quant.cpu_pack", str(folder)]
    procs = [
        subprocess.Popen([*build, v], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for v in variants
    ]
    errors = [p.communicate()[1] for p in procs if p.wait() != 0]
    if errors:
        return (errors[0].decode(errors="replace").strip().splitlines() or ["the build failed"])[-1]
    return None


def _runner(folder: Path, variant: str) -> Runner:
    load = torch._C._aoti.AOTIModelPackageLoader  # the C++ runner alone: no compiler in this process
    return load(str(folder / f"{variant}.pt2"), "model", False, 1, -1).run


def _verified(folder: Path, path: str) -> str | None:
    """None if the kernels of `path` run here ("aot": the packages in `folder`; "jit": torch.compile's),
    else why not: tried once in a subprocess (some torch builds crash in AOTInductor's package loader,
    which must not take the serving process down), the verdict kept in `folder` where it can be."""
    tag = "" if path == "aot" else "-jit-" + hashlib.sha256(_JIT_SOURCE.encode()).hexdigest()[:12]
    marker = folder / f"verified{tag}"
    if not marker.exists():
        check = subprocess.run(
            [sys.executable, "-m", "llmx.quant.cpu_pack", str(folder), f"--check-{path}"], capture_output=True
        )
        last = (check.stderr.decode(errors="replace").strip().splitlines() or [""])[-1]
        if check.returncode == 0:
            verdict = "ok"
        elif check.returncode < 0:
            verdict = f"they crash with this torch ({signal.Signals(-check.returncode).name})"
        else:
            verdict = f"they fail with this torch: {last}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            marker.write_text(verdict)
        except OSError:
            return None if verdict == "ok" else verdict  # checked again next time
    verdict = marker.read_text()
    return None if verdict == "ok" else verdict


def _check(runners: dict[str, Runner]) -> None:
    """Run every variant against the eager kernel: on a decode-sized matrix (the first call, which a JIT
    kernel is compiled for: its sizes pick the loops that OpenMP shares out), a tiny one and one with
    K > 8192 (the latter two must reuse that kernel)."""
    rng = torch.Generator().manual_seed(0)
    for variant in _VARIANTS:
        four_bit, with_offset = variant.startswith("u4"), variant.endswith("offset")
        for n, g, width in ((1536, 136, 16 if four_bit else 32), (8, 3, 16), (24, 520, 16)):
            codes = torch.randint(0, 255, (n, g, width), generator=rng, dtype=torch.uint8)
            codes = codes if four_bit else codes.view(torch.int8)
            scale, offset = (
                torch.rand(n, g, generator=rng),
                torch.rand(n, g, generator=rng) if with_offset else None,
            )
            x = torch.randn(1, g, 2 * width if four_bit else width, generator=rng)
            weights = [codes, scale] + ([offset] if offset is not None else [])
            args = [x] + [_inference_alias(t) for t in weights]  # as `bind_gemv` passes them
            got, want = runners[variant](args)[0], gemv_torch(x, codes, scale, offset)
            magnitude = codes if four_bit else codes.short().abs()  # scale, offset >= 0 here
            size = gemv_torch(x.abs(), magnitude, scale, offset)  # sum |x w|: bounds any rounding
            if not ((got - want).abs() <= 2e-5 * size).all():  # float32 sums in another order, no worse
                raise ValueError(f"the {variant} kernel is wrong for a {n}x{g}x{width} matrix")


def _build(folder: Path, variant: str) -> None:
    """Export gemv_torch for `variant` with dynamic N, G, g and compile it with AOTInductor (subprocess)."""
    import torch._inductor.config as inductor_config  # only the build subprocess loads the compiler

    inductor_config.aot_inductor.compile_wrapper_opt_level = "O0"  # the wrapper is glue; the kernel is -O3
    inductor_config.cpp.enable_floating_point_contract_flag = "fast"  # FMAs: ~5% faster, still float32 sums
    four_bit, with_offset = variant.startswith("u4"), variant.endswith("offset")
    n, g, width = 64, 4, 16
    codes = torch.zeros(n, g, width, dtype=torch.uint8 if four_bit else torch.int8)
    x = torch.zeros(1, g, 2 * width if four_bit else width)
    dn, dg, dw = (torch.export.Dim(name, min=2, max=1 << 24) for name in ("n", "g", "w"))
    args = (x, codes, torch.ones(n, g))
    shapes = [{1: dg, 2: 2 * dw if four_bit else dw}, {0: dn, 1: dg, 2: dw}, {0: dn, 1: dg}]
    if with_offset:
        args, shapes = (*args, torch.ones(n, g)), [*shapes, {0: dn, 1: dg}]
    module = _GemvOffset() if with_offset else _Gemv()
    program = torch.export.export(module, args, dynamic_shapes=tuple(shapes))
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        package = Path(tmp) / f"{variant}.pt2"
        torch._inductor.aoti_compile_and_package(program, package_path=str(package))
        os.replace(package, folder / f"{variant}.pt2")  # atomic: a concurrent loader sees all or nothing


# --- the same kernels compiled in-process, where AOTInductor's packages cannot be loaded --------------


_JIT_CONFIG = {"cpp.enable_floating_point_contract_flag": "fast"}  # as `_build`: FMAs, float32 sums


@functools.cache
def _jit_compile() -> Callable[..., torch.Tensor]:
    """gemv_torch through torch.compile (one per process: every variant and shape shares it).

    All sizes are symbolic (dynamic=True), so one kernel per variant serves every matrix; its loops are
    those of the AOT packages, with the same FP-contract flag. Inductor would sum float32 reductions
    longer than 4096 through a cascade helper, and guard on that length (a second kernel per variant,
    ~2x slower at K=14336): `_plain_float_sums` keeps the one vectorized accumulation, as in AOT.
    """
    from torch._inductor.compile_fx import compile_fx  # only loaded when this path is taken

    def inductor(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Callable:
        with _plain_float_sums():
            return compile_fx(gm, example_inputs, config_patches=_JIT_CONFIG)

    return torch.compile(gemv_torch, backend=inductor, dynamic=True, fullgraph=True)


@contextlib.contextmanager
def _plain_float_sums() -> Iterator[None]:
    """Inductor's C++ code generator without its cascade summation of long float32 reductions (a no-op
    on a torch whose code generator is laid out otherwise: there, K > 4096 costs a second kernel)."""
    from torch._inductor.codegen import cpp

    kernel = getattr(cpp, "CppKernel", None)
    original = getattr(kernel, "need_use_acc_helper", None)
    if original is None:
        yield
        return

    def need_use_acc_helper(self, reduction_type, dtype, use_scalar):
        return reduction_type != "sum" and original(self, reduction_type, dtype, use_scalar)

    kernel.need_use_acc_helper = need_use_acc_helper
    try:
        yield
    finally:
        kernel.need_use_acc_helper = original


def _jit_runners() -> dict[str, Runner]:
    """A Runner per variant over `_jit_compile()`, every call made in inference mode with inference
    tensors (the state the kernel was compiled for, which dynamo's guards check: anything else would
    compile it again; `bind_gemv` passes the weights so); outside inference mode (tests) the result is
    copied out as a normal tensor."""
    gemv = _jit_compile()

    def run(args: list[torch.Tensor]) -> list[torch.Tensor]:
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                y = run(args)[0]
            return [y.clone()]
        x, *weights = args
        return [gemv(x if x.is_inference() else x.clone(), *weights, *[None] * (3 - len(weights)))]

    return dict.fromkeys(_VARIANTS, run)


_JIT_SOURCE = "".join(inspect.getsource(f) for f in (_jit_compile, _plain_float_sums, _jit_runners, _check))


# --- giving back the pages of the file --------------------------------------------------------------

_MADV_PAGEOUT = 21  # Linux >= 5.4: reclaim these pages (clean file pages are dropped, never lost)
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def release_pages(t: torch.Tensor) -> None:
    """Ask the kernel to reclaim the whole pages under CPU tensor `t` (e.g. raw blocks already repacked).

    The data stays valid: a later read faults it back in from the page cache or the file. This keeps
    the bytes of a repacked, mmap-backed weight from counting twice in the process's memory.
    """
    start = t.data_ptr()
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (start + t.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if last > first:
        _libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_PAGEOUT)


if __name__ == "__main__":
    if sys.argv[2] == "--check-aot":
        _check({v: _runner(Path(sys.argv[1]), v) for v in _VARIANTS})
    elif sys.argv[2] == "--check-jit":
        _check(_jit_runners())
    else:
        _build(Path(sys.argv[1]), sys.argv[2])

"""Native CPU kernels on GGUF's own blocks (`cpu_blocks.c`), for the types most GGUFs are made of.

Matrices of the types in TYPES (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) stay on the CPU as the
file stores them (no repacking: Q4_K is 0.5625 bytes a weight here against 0.75 in `cpu_pack`'s
float32-scaled form), and a decode step reads each byte once: `gemv` multiplies up to MAX_ROWS rows of x
per pass over the weights, on torch's threads, and the matrices that share x (q/k/v, gate/up) in one
call; it reads x rounded to 16-bit codes per group of 32 (see cpu_blocks.c). Prompts dequantize chunks
of rows with `dequantize_rows` for a dense `torch.mm`. `decode_attention` is one token's attention over
a KV cache, `Attention` a layer's whole decode step over its cache (RoPE, store, attend), and
`paged_rope_store_attend` a batch's decode tokens over the paged one (see `llmx.kernels.cpu_attention`).

The C file is compiled once per machine (`cc -O3 -march=native -fopenmp`, about a second, linked to
torch's own OpenMP runtime) into the cache directory, keyed by its source, the compiler, the CPU's
features and that runtime, and loaded with ctypes.
Every call into it goes through `_issue`, so that a `Recording` can keep a step's calls in order (with
their arguments and the buffers behind their pointers) for `llmx.runtime.cpu_replay` to make again.
Without a C compiler, or with LLMX_CPU_GEMV=eager, `available` is False and these types take
`cpu_pack`'s path, with a warning saying why.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from llmx.cpu_info import cpu_features, read_or_empty
from llmx.errors import LlmxError, first_line
from llmx.measured import remember, remembered
from llmx.quant import QType, qtype
from llmx.settings import c_compiler, cache_dir, cpu_gemv, cpu_prefetch, pin_threads

SOURCE = Path(__file__).with_name("cpu_blocks.c")
TYPES = {
    "Q4_K": 0,
    "Q6_K": 1,
    "Q8_0": 2,
    "Q4_0": 3,
    "Q4_1": 4,
    "Q5_K": 5,
    "Q5_0": 6,
    "Q5_1": 7,
}  # the C file's type numbers
MAX_ROWS = 64  # rows of x a `gemv` call takes (cpu_blocks.c's MAX_ROWS)
MAX_WEIGHTS = 4  # matrices one `gemv` call takes (cpu_blocks.c's MAX_WEIGHTS)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}  # a gated FFN's activation: cpu_blocks.c's ACT_* numbers
# tokens a native MoE call takes: its scratch is tokens * k * (2 * F + E) floats, 29 MB at 256 for
# Qwen3-30B-A3B, and each call reads its chosen experts once (nearly all of them past ~64 tokens)
MOE_TOKENS = 256


class Prefetch(NamedTuple):
    """How a GEMV thread asks for its weights ahead (`cpu_blocks.c`'s prefetch_block): into the L1
    `ahead` bytes past the block it multiplies, and into the L2 `far` times as far (0: not)."""

    ahead: int
    far: int


PREFETCH_CHOICES = tuple(Prefetch(ahead, far) for far in (0, 4) for ahead in (1024, 2048, 4096, 8192))
PREFETCH_MATRIX = 128 << 20  # bytes of the matrix timed to choose: past any CPU's last-level cache
PREFETCH_FILE = "cpu-prefetch-2.json"  # the choices made, by CPU and thread count (cpu-prefetch.json:
# the distances alone that versions before the L2 prefetch keep)


def supports(qt: QType, shape: tuple[int, ...]) -> bool:
    """Whether a matrix of this type and shape takes these kernels (when they are `available`)."""
    return qt.name in TYPES and len(shape) == 2 and shape[1] % qt.block_elems == 0


@functools.cache
def _library() -> ctypes.CDLL | None:
    if cpu_gemv() == "eager":
        return None
    try:
        return bind(_built())
    except subprocess.CalledProcessError as e:
        errors = [ln for ln in e.stderr.decode(errors="replace").splitlines() if "error" in ln]
        return _unavailable((errors or ["the compiler failed"])[0])
    except OSError as e:  # no compiler, an unwritable cache, a library that does not load
        return _unavailable(first_line(e))


def bind(path: Path) -> ctypes.CDLL:
    """Load a build of `cpu_blocks.c` and declare its functions."""
    lib = ctypes.CDLL(str(path))
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.llmx_gemv_many.argtypes = [i32, ptr, ptr, ptr, ptr, i64, ptr, i64, ptr, ptr, i32]
    lib.llmx_gated_ffn.argtypes = [i32, ptr, ptr, ptr, ptr, i64, ptr, i64, i32, ptr, ptr, ptr, ptr]
    lib.llmx_gated_ffn.argtypes += [i32, ptr, ptr, ptr, i32]
    lib.llmx_moe_swiglu.argtypes = [i32, ptr, i64] * 3 + [i64, i64, i64, ptr, i64, i64, ptr, ptr, ptr, ptr]
    lib.llmx_moe_swiglu.argtypes += [i32]
    lib.llmx_moe_route.argtypes = [ptr, i64, i64, ptr, i64, i64, i32, ptr, ptr, i32]
    lib.llmx_dequantize_rows.argtypes = [i32, ptr, ptr, i64, i64, i64, i64, ctypes.c_float, ptr, i32]
    lib.llmx_decode_attention.argtypes = [ptr, ptr, ptr, i32, i32, i64, i64, i64, i64, ptr, i32]
    lib.llmx_rope_store_attend.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i32, ptr, ptr, i32, i32, i64, i64]
    lib.llmx_rope_store_attend.argtypes += [i64, i64, i64, i64, ctypes.c_float, i32, i32, ptr, i32]
    lib.llmx_rope_store_attend.restype = i32
    lib.llmx_paged_rope_store_attend.argtypes = [ptr, ptr, ptr, i64, i64, i64, ptr, ptr, i64, i32, ptr, ptr]
    lib.llmx_paged_rope_store_attend.argtypes += [i32, i32]
    lib.llmx_paged_rope_store_attend.argtypes += [ptr, i64, i64, ptr, i64, i64, i64, i64, i64, ctypes.c_float]
    lib.llmx_paged_rope_store_attend.argtypes += [i32, i32, ptr, i32]
    lib.llmx_paged_rope_store_attend.restype = i32
    lib.llmx_rms_norm.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, i32]
    lib.llmx_rms_norm.restype = None
    lib.llmx_hadamard_rows.argtypes = [ptr, i64, i64, i32, i32]
    lib.llmx_hadamard_rows.restype = None
    lib.llmx_top_k.argtypes = [ptr, i64, i64, ptr, ptr]
    lib.llmx_top_k.restype = None
    lib.llmx_pin_threads.argtypes = [ptr, i32]
    lib.llmx_set_prefetch.argtypes = [i64, i64]
    lib.llmx_set_prefetch.restype = None
    lib.llmx_gemv_many.restype = lib.llmx_dequantize_rows.restype = lib.llmx_decode_attention.restype = i32
    lib.llmx_gated_ffn.restype = lib.llmx_moe_swiglu.restype = lib.llmx_moe_route.restype = i32
    lib.llmx_pin_threads.restype = i32
    lib.llmx_slots_entry.argtypes = [ctypes.c_char_p, i32]
    lib.llmx_slots_entry.restype = i32
    lib.llmx_replay.argtypes = [i64, ptr, ptr, ptr, i32, i64, ptr, i64]
    lib.llmx_replay.restype = i32
    lib.llmx_serve_trips.argtypes = [i64, ptr, ptr, ptr, i32, ptr, ptr, i64]
    lib.llmx_serve_trips.restype = i32
    return lib


def _unavailable(reason: str) -> None:
    warnings.warn(
        f"llmx: the native CPU kernels could not be built ({reason}); using the packed path", stacklevel=3
    )


def available() -> bool:
    return _library() is not None


def _compiler() -> str:
    compiler = c_compiler()
    if compiler is None:
        raise OSError("no C compiler (cc or gcc) on the PATH")
    return compiler


def _torch_openmp() -> str | None:
    """The file of the OpenMP runtime torch loaded into this process, if any. The kernels link to
    it, so that they share torch's thread pool: a second runtime's threads would spin beside torch's
    (a wheel may bundle its libgomp under another name than the system's)."""
    for line in read_or_empty("/proc/self/maps").splitlines():
        path = line.split()[-1] if "/" in line else ""
        if re.search(r"/lib(gomp|iomp5)[^/]*\.so", path):
            return path
    return None


def compile_to(out: Path, *flags: str) -> None:
    """Build `cpu_blocks.c` into the shared library `out` (extra `flags` after the usual ones),
    linked to torch's OpenMP runtime where it has one."""
    cc, runtime = _compiler(), _torch_openmp()
    compile_flags = ["-O3", "-march=native", "-fopenmp", "-fPIC", *flags]
    if runtime is None:
        build = [cc, *compile_flags, "-shared", str(SOURCE), "-lm", "-o", str(out)]
        subprocess.run(build, capture_output=True, check=True)
        return
    obj = out.with_suffix(".o")
    subprocess.run([cc, *compile_flags, "-c", str(SOURCE), "-o", str(obj)], capture_output=True, check=True)
    link = [cc, "-shared", str(obj), runtime, f"-Wl,-rpath,{Path(runtime).parent}", "-lm", "-o", str(out)]
    subprocess.run(link, capture_output=True, check=True)
    obj.unlink()


def _built() -> Path:
    """The shared library for this source, compiler and CPU, compiled on first use."""
    version = subprocess.run([_compiler(), "--version"], capture_output=True, check=True).stdout
    source = SOURCE.read_bytes()
    machine = cpu_features() + str(_torch_openmp())
    tag = hashlib.sha256(source + version + machine.encode()).hexdigest()[:16]
    path = cache_dir() / f"cpu-blocks-{tag}.so"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    print(f"llmx: building the native CPU kernels once into {path}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:  # built aside, then renamed: no torn file
        out = Path(tmp) / path.name
        compile_to(out)
        out.replace(path)
    return path


_pinned_team = 0  # the thread count whose workers were last pinned


def _threads(lib: ctypes.CDLL) -> int:
    """torch's CPU thread count; the first time a count is used, its OpenMP workers are pinned to CPUs
    of their own (`llmx_pin_threads`: the calling thread stays free), unless LLMX_PIN_THREADS=0 or
    there are more threads than CPUs this process may use, and the GEMVs' prefetch distance is set
    for that many threads (`prefetch_distance`)."""
    global _pinned_team, recording
    n = torch.get_num_threads()
    if n != _pinned_team:
        _pinned_team = n
        held, recording = recording, None  # the setup below (a timed GEMV) is no part of a step
        try:
            _set_up_team(lib, n)
        finally:
            recording = held
    return n


def threads() -> int:
    """The thread count the native calls take now (`_threads`)."""
    lib = _library()
    assert lib is not None
    return _threads(lib)


def _set_up_team(lib: ctypes.CDLL, n: int) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if pin_threads() and 1 < n <= len(cpus):
        lib.llmx_pin_threads((ctypes.c_int * n)(*cpus[:n]), n)
    lib.llmx_set_prefetch(*prefetch_choice(lib, n))


class Recording:
    """A step's native calls as `_issue` made them while this was `recording`: each entry point with
    its argument tuple, in order, and the tensors behind its pointers kept alive (`kept`). Arguments
    that change from step to step are marked by the call that made them (`per_step`): an offset from
    the step's `position`, which a replay adds to its own position."""

    def __init__(self, position: int) -> None:
        self.position, self.thread = position, threading.get_ident()  # the thread whose calls it keeps
        self.calls: list[tuple[Callable[..., int | None], tuple, bool]] = []  # entry, args, threads last
        self.fields: list[tuple[int, int, int]] = []  # (call, argument, offset from the position)
        self.last_position = sys.maxsize  # the last position a replay of these calls may take
        self.kept: list[object] = []

    def per_step(self, arg: int, value: int, bound: int) -> None:
        """Argument `arg` of the last call is the step's position plus a fixed offset (its `value` now)
        and may be at most `bound`."""
        offset = value - self.position
        self.fields.append((len(self.calls) - 1, arg, offset))
        self.last_position = min(self.last_position, bound - offset)


class _Slot(ctypes.Union):
    """One argument of a recorded call as `llmx_replay` reads it (cpu_blocks.c's slot_t)."""

    _fields_ = (("i", ctypes.c_int64), ("f", ctypes.c_float))


def _slot(value: object, argtype: type) -> _Slot:
    """`value` as the entry point takes it under `argtype`: a float, or an integer or address (None,
    an int, a ctypes array the recording keeps alive)."""
    if argtype is ctypes.c_float:
        return _Slot(f=float(value))  # type: ignore[arg-type]
    if value is None or isinstance(value, int):
        return _Slot(i=value or 0)
    return _Slot(i=ctypes.addressof(value))  # type: ignore[arg-type]


def _slots_entry(lib: ctypes.CDLL, entry: Callable[..., int | None], args: tuple) -> int:
    return lib.llmx_slots_entry(entry.__name__.encode(), len(args))


def unreplayable(recorded: Recording) -> str | None:
    """The first entry point among `recorded`'s calls that a `Program` cannot make, or None."""
    lib = _library()
    assert lib is not None
    missing = (entry.__name__ for entry, args, _ in recorded.calls if _slots_entry(lib, entry, args) < 0)
    return next(missing, None)


class Program:
    """A recording's calls made again in one native call (`llmx_replay`): each call's arguments held
    as slots, its thread count and the recording's position fields set there before it runs. Made
    from Python, each of a step's ~180 calls cost ~1 us converting its arguments."""

    def __init__(self, recorded: Recording) -> None:
        lib = _library()
        assert lib is not None
        self._lib, self.recorded = lib, recorded  # the recording keeps what the slots point into
        calls = recorded.calls
        self._names = [entry.__name__ for entry, _, _ in calls]
        self._slots = [
            (_Slot * len(args))(*(_slot(a, t) for a, t in zip(args, entry.argtypes, strict=True)))
            for entry, args, _ in calls
        ]
        entries = [_slots_entry(lib, entry, args) for entry, args, _ in calls]
        assert min(entries, default=0) >= 0, "an entry point llmx_replay cannot make (see `unreplayable`)"
        n = len(calls)
        self._entries = (ctypes.c_int32 * n)(*entries)
        self._args = (ctypes.c_void_p * n)(*(ctypes.addressof(s) for s in self._slots))
        self._threads_at = (ctypes.c_int32 * n)(*(len(args) - 1 if last else -1 for _, args, last in calls))
        fields = [v for field in recorded.fields for v in field]
        self._fields = (ctypes.c_int64 * max(len(fields), 1))(*fields)

    def __call__(self, position: int) -> None:
        """The calls again, at `position` (the step's; its fields moved with it), on `threads()`."""
        failed = self._lib.llmx_replay(
            len(self._slots), self._entries, self._args, self._threads_at, _threads(self._lib),
            len(self.recorded.fields), self._fields, position,
        )  # fmt: skip
        if failed:
            raise RuntimeError(f"{self._names[failed - 1]} failed in a replayed step at position {position}")

    def serve_trips(self, ready: ctypes.Array, done: ctypes.Array, timeout: float) -> int:
        """The calls again, call c once the int32 flag at address ready[c] differs from the one at done[c]
        (a GPU's trip to the host, `runtime.host_trips`; both `addresses`, made once), which then takes
        ready[c]'s value: 0, or -(c + 1) where flag c did not move within `timeout` seconds."""
        n = len(self._slots)
        assert len(ready) == len(done) == n and not self.recorded.fields
        failed = self._lib.llmx_serve_trips(
            n, self._entries, self._args, self._threads_at, _threads(self._lib),
            ready, done, int(timeout * 1e9),
        )  # fmt: skip
        if failed > 0:
            raise RuntimeError(f"{self._names[failed - 1]} failed serving a trip from the GPU")
        return failed


def addresses(values: Sequence[int]) -> ctypes.Array:
    """Addresses as the C array of pointers an entry point takes (`Program.serve_trips`' flags)."""
    return (ctypes.c_void_p * len(values))(*values)


recording: Recording | None = None  # where `_issue` keeps the calls it makes, when set


@contextlib.contextmanager
def recording_calls(position: int) -> Iterator[Recording]:
    """The native calls this thread makes inside, kept in a `Recording` (positions as offsets from
    `position`)."""
    global recording
    recording = Recording(position)
    try:
        yield recording
    finally:
        recording = None


def _issue(
    entry: Callable[..., int | None], args: tuple, kept: tuple[object, ...], threads: bool = True
) -> int | None:
    """entry(*args), kept in the `recording` if one is on (`kept`: what args points into; `threads`:
    the last argument is the thread count, which a replay reads again)."""
    if recording is not None and recording.thread == threading.get_ident():
        recording.calls.append((entry, args, threads))
        recording.kept.extend(kept)
    return entry(*args)


def prefetch_choice(lib: ctypes.CDLL, threads: int) -> Prefetch:
    """How a GEMV thread asks for its weights ahead: LLMX_CPU_PREFETCH's, else the choice a decode
    GEMV ran fastest under on this machine with this many threads, measured once (~0.2 s) and kept in
    the cache directory. The best is the machine's (bench/RESULTS.md: 2 KiB on the H200 host, 4-8 KiB
    on a Zen 4; the L2 prefetch far ahead +17-22% on a 2-core Xeon's MoE decode)."""
    forced = cpu_prefetch()
    if forced is not None:
        return Prefetch(*forced)
    key = f"{hashlib.sha256(cpu_features().encode()).hexdigest()[:16]}|{threads} threads"
    kept = remembered(PREFETCH_FILE).get(key)
    if isinstance(kept, list) and len(kept) == 2 and all(isinstance(v, int) for v in kept):
        return Prefetch(*kept)
    choice = _fastest_prefetch(lib)  # none kept, or not a choice
    remember(PREFETCH_FILE, key, list(choice))
    return choice


def _fastest_prefetch(lib: ctypes.CDLL) -> Prefetch:
    """The PREFETCH_CHOICES choice under which a Q4_K GEMV over PREFETCH_MATRIX bytes (more than the
    caches hold: it streams from RAM) runs fastest, each timed thrice, round by round."""
    qt, k = qtype("Q4_K"), 4096
    block = np.full(qt.block_bytes, 0x11, dtype=np.uint8)  # every code 1 ...
    block[:4] = np.array([1.0, 1.0], dtype=np.float16).view(np.uint8)  # ... d and dmin 1: no denormals
    rows = PREFETCH_MATRIX // qt.row_bytes(k)
    raw = torch.from_numpy(np.tile(block, rows * (k // qt.block_elems))).view(rows, qt.row_bytes(k))
    matrix, x = Gemv([(raw, qt)]), torch.randn(1, k)
    best = dict.fromkeys(PREFETCH_CHOICES, float("inf"))
    for _ in range(3):
        for choice in PREFETCH_CHOICES:
            lib.llmx_set_prefetch(*choice)
            t0 = time.perf_counter()
            matrix(x)
            best[choice] = min(best[choice], time.perf_counter() - t0)
    return min(best, key=lambda c: best[c])


class Gemv:
    """Up to MAX_WEIGHTS matrices that share x (q/k/v, gate/up), each W [N, K] given as its GGUF rows
    `raw` [N, row_bytes] and type, made ready once for `llmx_gemv_many`: called with x2 [M, K] float32
    (M <= MAX_ROWS), [M, N1 + N2 + ...]. A decode step makes some hundred of these calls, so their
    arguments are built here once rather than at every call (~15 us each)."""

    def __init__(self, weights: Sequence[tuple[torch.Tensor, QType]]) -> None:
        count, lib = len(weights), _library()
        assert lib is not None and 0 < count <= MAX_WEIGHTS and all(raw.is_contiguous() for raw, _ in weights)
        self._lib = lib
        self.raws = tuple(raw for raw, _ in weights)  # kept alive with the pointers below
        self.sizes = [raw.shape[0] for raw in self.raws]
        self.n = sum(self.sizes)
        self._weights = (
            count,
            (ctypes.c_int * count)(*(TYPES[qt.name] for _, qt in weights)),
            (ctypes.c_void_p * count)(*(raw.data_ptr() for raw in self.raws)),
            (ctypes.c_int64 * count)(*self.sizes),
            (ctypes.c_int64 * count)(*(raw.shape[1] for raw in self.raws)),
        )

    def __call__(self, x2: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x2 [M, K] times the matrices, plus `residual` [M, N] where given (added in the same call)."""
        return self._run(x2, self.n, residual, self._lib.llmx_gemv_many)

    def gated_ffn(
        self,
        x2: torch.Tensor,
        down: Gemv,
        activation: str,
        residual: torch.Tensor | None = None,
        scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """down(act(gate(x2)) * up(x2)) in one native call (act: one of ACTIVATIONS), this call being
        the joined gate and up matrices (equal heights F) and `down` one matrix of F columns: [M, down.n],
        each row t times sigmoid(scale . x2[t]) where `scale` [K] float32 is given (a shared expert's
        gate), plus `residual` [M, down.n] where given (a block's residual stream, added in the same call)."""
        kept = () if scale is None else (scale,)
        if scale is not None:
            assert scale.dtype == torch.float32 and scale.is_contiguous() and scale.numel() == x2.shape[1]
        gated = (*down._weights, ACTIVATIONS[activation], None if scale is None else scale.data_ptr())
        return self._run(x2, down.n, residual, self._lib.llmx_gated_ffn, gated, kept)

    def _run(
        self,
        x2: torch.Tensor,
        n: int,
        residual: torch.Tensor | None,
        entry: Callable[..., int],
        weights_after_x: tuple[object, ...] = (),
        kept: tuple[torch.Tensor, ...] = (),
    ) -> torch.Tensor:
        """`entry`(this call's weights, K, x2, M, `weights_after_x`, residual, y, threads) into y [M, n]
        (`kept`: tensors that `weights_after_x` points into)."""
        assert x2.dtype == torch.float32 and x2.shape[0] <= MAX_ROWS
        x2 = x2.contiguous()
        m, k = x2.shape
        y = torch.empty((m, n), dtype=torch.float32)
        res = _residual(residual, y)
        res_ptr = None if res is None else res.data_ptr()
        threads = _threads(self._lib)
        args = (*self._weights, k, x2.data_ptr(), m, *weights_after_x, res_ptr, y.data_ptr(), threads)
        err = _issue(entry, args, (x2, res, y, *kept))
        assert err == 0, (self.sizes, m)
        return y


def gemv(x2: torch.Tensor, weights: Sequence[tuple[torch.Tensor, QType]]) -> torch.Tensor:
    """`Gemv(weights)(x2)`, for a call made once."""
    return Gemv(weights)(x2)


def moe_swiglu(
    x2: torch.Tensor,
    stacks: Sequence[tuple[torch.Tensor, QType]],
    shape: tuple[int, int, int],
    ids: torch.Tensor,
    weights: torch.Tensor,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The routed experts' FFNs of a MoE layer in one native call a MOE_TOKENS tokens: x2 [T, E]
    float32, the gate, up and down stacks as their GGUF rows `raw` [X * rows, row_bytes] and type, of
    `shape` (X, F, E) for gate and up (down: (X, E, F)), each token's expert ids [T, k] (in 0..X-1)
    and routing weights [T, k] -> [T, E] float32: sum over j of weights[t, j] * down_e(silu(gate_e
    x_t) * up_e x_t), e = ids[t, j]. A call reads each chosen expert's blocks once, for all the
    tokens that chose it; x and the activations are read as 16-bit codes, as `gemv` reads x. Plus
    `residual` [T, E] float32 where given (the block's residual stream, added in the same call); written
    into `out` (contiguous [T, E] float32) where given."""
    lib = _library()
    n_expert, n_ff, n_embd = shape
    assert lib is not None and x2.dtype == torch.float32 and x2.shape[1] == n_embd and len(stacks) == 3
    assert all(raw.is_contiguous() for raw, _ in stacks)
    x2 = x2.contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    m, k_used = ids.shape
    y = torch.empty((m, n_embd), dtype=torch.float32) if out is None else out
    assert y.shape == (m, n_embd) and y.dtype == torch.float32 and y.is_contiguous()
    res = _residual(residual, y)
    args = [a for raw, qt in stacks for a in (TYPES[qt.name], raw.data_ptr(), raw.shape[1])]
    threads = _threads(lib)
    for t0 in range(0, m, MOE_TOKENS):
        n = min(MOE_TOKENS, m - t0)
        err = _issue(lib.llmx_moe_swiglu, (
            *args, n_expert, n_ff, n_embd, x2[t0].data_ptr(), n, k_used, ids[t0].data_ptr(),
            weights[t0].data_ptr(), None if res is None else res[t0].data_ptr(), y[t0].data_ptr(), threads,
        ), (x2, ids, weights, res, y))  # fmt: skip
        assert err == 0, (shape, n, k_used)
    return y


def _residual(residual: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor | None:
    """A call's `residual` operand for its output y: float32 of y's shape, contiguous (kept alive with
    the call: a replay reads it again), or None."""
    if residual is None:
        return None
    assert residual.dtype == torch.float32 and residual.shape == y.shape
    return residual.contiguous()


ROUTE_LANES = 16  # cpu_blocks.c's ROUTE_LANES: a router's width must be a multiple of it


def moe_route(
    x2: torch.Tensor, router: torch.Tensor, k: int, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """A MoE layer's routing in one native call: x2 [T, E] float32 and the router's rows [X, E] float32
    (E a multiple of ROUTE_LANES, 1 <= k <= X) -> (weights [T, k] float32, expert ids [T, k] int64), best
    first: the k largest of softmax(router x_t), of equal ones the lower id first, rescaled to sum to 1
    where `normalize` (`ops.moe.route` of the router's logits)."""
    lib = _library()
    n_expert, n_embd = router.shape
    assert lib is not None and x2.dtype == router.dtype == torch.float32 and x2.shape[1] == n_embd
    assert router.is_contiguous() and n_embd % ROUTE_LANES == 0 and 1 <= k <= n_expert
    x2 = x2.contiguous()
    m = x2.shape[0]
    weights, ids = torch.empty((m, k), dtype=torch.float32), torch.empty((m, k), dtype=torch.int64)
    err = _issue(lib.llmx_moe_route, (
        x2.data_ptr(), m, n_embd, router.data_ptr(), n_expert, k, int(normalize), weights.data_ptr(),
        ids.data_ptr(), _threads(lib),
    ), (x2, router, weights, ids))  # fmt: skip
    assert err == 0, (m, n_expert, n_embd, k)
    return weights, ids


def dequantize_rows(
    raw: torch.Tensor, qt: QType, r0: int, r1: int, k: int, out: torch.Tensor
) -> torch.Tensor:
    """W[r0:r1] in float32 into `out` [r1 - r0, K] (contiguous), from the GGUF rows `raw`."""
    return _dequantize(raw, qt, None, r0, r1 - r0, k, out)


def embedding_rows(
    raw: torch.Tensor, qt: QType, ids: torch.Tensor, k: int, scale: float = 1.0
) -> torch.Tensor:
    """Rows `ids` (int64, 1-D, each checked to be a row of `raw`) of W in float32 times `scale`,
    [len(ids), K], equal to gguf-py's values (times `scale` in float32): one call where the torch
    decoding took ~30 small ops (~80 µs a decode step's token, which a GPU decode waits for)."""
    ids = ids.contiguous()
    bad = [i for i in ids.tolist() if not 0 <= i < raw.shape[0]]
    if bad:
        raise LlmxError(f"token id {bad[0]} is outside the embedding table's {raw.shape[0]} rows")
    out = torch.empty((ids.numel(), k), dtype=torch.float32)
    return _dequantize(raw, qt, ids, 0, ids.numel(), k, out, scale)


def _dequantize(
    raw: torch.Tensor,
    qt: QType,
    ids: torch.Tensor | None,
    r0: int,
    n: int,
    k: int,
    out: torch.Tensor,
    scale: float = 1.0,
) -> torch.Tensor:
    lib = _library()
    assert lib is not None and raw.is_contiguous() and out.is_contiguous() and out.shape == (n, k)
    id_ptr = None if ids is None else ids.data_ptr()
    args = (
        TYPES[qt.name],
        raw.data_ptr(),
        id_ptr,
        r0,
        n,
        raw.shape[1],
        k,
        scale,
        out.data_ptr(),
        _threads(lib),
    )
    err = _issue(lib.llmx_dequantize_rows, args, (raw, ids, out))
    assert err == 0, qt.name
    return out


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest values of float32 x [n] (contiguous, on the CPU, no NaN; 1 <= k <= n) and their
    indices, largest first, of equal values the lower index first: `torch.topk` in one pass on one
    thread (a sampler's top-k of a 128k vocabulary took torch 0.87 ms on the 16-core H200 host)."""
    lib = _library()
    assert lib is not None and x.dtype == torch.float32 and x.dim() == 1 and x.is_contiguous()
    assert 1 <= k <= x.numel()
    values, ids = torch.empty(k, dtype=torch.float32), torch.empty(k, dtype=torch.int64)
    _issue(
        lib.llmx_top_k,
        (x.data_ptr(), x.numel(), k, values.data_ptr(), ids.data_ptr()),
        (x, values, ids),
        False,
    )
    return values, ids


# cpu_blocks.c's cache types: GGML type names (a float cache's from its dtype, `kv_type`)
KV_TYPES = {"F32": 0, "F16": 1, "BF16": 2, "Q8_0": 3, "Q4_0": 4, "Q4_1": 5, "Q5_0": 6, "Q5_1": 7, "IQ4_NL": 8}
FLOAT_KV = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}
MAX_HEAD_DIM = 512  # cpu_blocks.c's MAX_HEAD_DIM


def decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, types: tuple[str, str], scale: float
) -> torch.Tensor:
    """One token's attention: q [1, H, D] float32 over k, v [N, Hk, row] (contiguous cache prefixes of
    the KV_TYPES `types`, every key visible) -> [1, H * D] float32. Each key and value is read once,
    in the cache's own type."""
    lib = _library()
    _, n_head, d = q.shape
    n, n_kv = k.shape[0], k.shape[1]
    assert lib is not None and k.is_contiguous() and v.is_contiguous()
    qs = (q.reshape(n_head, d) * scale).contiguous()
    out = torch.empty(1, n_head * d, dtype=torch.float32)
    err = _issue(lib.llmx_decode_attention, (
        qs.data_ptr(), k.data_ptr(), v.data_ptr(), KV_TYPES[types[0]], KV_TYPES[types[1]], n, n_head, n_kv,
        d, out.data_ptr(), _threads(lib),
    ), (qs, k, v, out))  # fmt: skip
    assert err == 0, (n_head, n_kv, d)
    return out


ATTENTION_POSITION = 11  # `llmx_rope_store_attend`'s argument position


class Attention:
    """One layer's cache on the CPU, kc and vc [rows, Hk, row] (contiguous, of the KV_TYPES `types`, equal
    head widths D; position p in row p mod rows), made ready once for `llmx_rope_store_attend`: a decode
    step makes one call a layer, so the cache's pointers and types are bound here rather than looked up
    at every call. `rotation`: the cache's Walsh-Hadamard blocks of keys and values (`ops.hadamard`)."""

    def __init__(
        self, kc: torch.Tensor, vc: torch.Tensor, types: tuple[str, str], d: int, rotation: tuple[int, int]
    ) -> None:  # fmt: skip
        lib = _library()
        assert lib is not None and kc.is_contiguous() and vc.is_contiguous()
        self._lib, self.caches = lib, (kc, vc)  # the caches kept alive with their pointers
        self.rows, self.n_kv, self.d, self.rotation = kc.shape[0], kc.shape[1], d, rotation
        self._cache = (kc.data_ptr(), vc.data_ptr(), KV_TYPES[types[0]], KV_TYPES[types[1]])

    def takes(self, position: int, window: int | None) -> bool:
        """Whether the rows hold every key a token at `position` sees (the last `window`, for a
        sliding window)."""
        return position >= 0 and min(position + 1, window or position + 1) <= self.rows

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
        neox: bool, position: int, window: int | None, scale: float,
    ) -> torch.Tensor:  # fmt: skip
        """One token's attention step in one call (where `takes`): q [1, H, D] and k [1, Hk, D] float32
        rotated by RoPE (cos, sin [1, n_dims / 2] float32), k and v [1, Hk, D] stored (quantized, for a
        block type) in the caches' row of `position`, then attention over positions 0..position (the
        last `window` of them, for a sliding window) -> [1, H * D] float32; all of it in the cache's
        `rotation`, the output rotated back."""
        n_head = q.shape[1]
        qs, ks, vs = q.contiguous(), k.contiguous(), v.contiguous()  # read, not written: the C side copies
        cos, sin = cos.contiguous(), sin.contiguous()
        out = torch.empty(1, n_head * self.d, dtype=torch.float32)
        err = _issue(self._lib.llmx_rope_store_attend, (
            qs.data_ptr(), ks.data_ptr(), vs.data_ptr(), cos.data_ptr(), sin.data_ptr(), 2 * cos.shape[-1],
            int(neox), *self._cache, position, self.rows, window or 0, n_head, self.n_kv, self.d, scale,
            *self.rotation, out.data_ptr(), _threads(self._lib),
        ), (qs, ks, vs, cos, sin, out, self))  # fmt: skip
        assert err == 0, (n_head, self.n_kv, self.d, position, window)
        if recording is not None and recording.thread == threading.get_ident():
            # a replay writes and reads at its own position: any, in a ring that holds the window
            ring = window is not None and window <= self.rows
            recording.per_step(ATTENTION_POSITION, position, sys.maxsize if ring else self.rows - 1)
        return out


def paged_rope_store_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    neox: bool,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    types: tuple[str, str],
    tables: torch.Tensor,
    block_rows: int,
    positions: torch.Tensor,
    window: int | None,
    scale: float,
    rotation: tuple[int, int],
) -> torch.Tensor:
    """The decode step of B sequences over a paged cache in one call: sequence b's q [H, D] and k
    [Hk, D] (rows b of q [B, H, D], k and v [B, Hk, D], float32; the rows may lie apart, each one's
    heads contiguous) rotated by RoPE (rows b of cos, sin [B, n_dims / 2] float32), its k and v stored
    (quantized, for a block type) at its position positions[b] (int64 [B]) in the pools [rows, Hk, row]
    (contiguous, of the KV_TYPES `types`), whose blocks of `block_rows` rows it holds in order in
    tables[b] (int32 [B, max blocks]), then its attention over its positions up to its own (the last
    `window` of them, for a sliding window) -> [B, H * D] float32; in the pools' Walsh-Hadamard
    `rotation` (`Attention`'s)."""
    lib = _library()
    n_seq, n_head, d = q.shape
    n_kv = k.shape[1]
    assert lib is not None and k_pool.is_contiguous() and v_pool.is_contiguous()
    assert tables.dtype == torch.int32 and positions.dtype == torch.int64 and tables.shape[0] == n_seq
    # read, not written (the C side copies), where they lie: the rows of one joined projection's
    # columns need no copy (a torch op, which a replayed step would not make again: `runtime.cpu_replay`)
    qs, ks, vs = (t if t.stride(2) == 1 and t.stride(1) == t.shape[2] else t.contiguous() for t in (q, k, v))
    cos, sin = cos.contiguous(), sin.contiguous()
    tables, positions = tables.contiguous(), positions.contiguous()
    out = torch.empty(n_seq, n_head * d, dtype=torch.float32)
    err = _issue(lib.llmx_paged_rope_store_attend, (
        qs.data_ptr(), ks.data_ptr(), vs.data_ptr(), qs.stride(0), ks.stride(0), vs.stride(0), cos.data_ptr(),
        sin.data_ptr(), 2 * cos.shape[-1],
        int(neox), k_pool.data_ptr(), v_pool.data_ptr(), KV_TYPES[types[0]], KV_TYPES[types[1]],
        tables.data_ptr(), tables.shape[1], block_rows, positions.data_ptr(), window or 0, n_seq, n_head,
        n_kv, d, scale, *rotation, out.data_ptr(), _threads(lib),
    ), (qs, ks, vs, cos, sin, k_pool, v_pool, tables, positions, out))  # fmt: skip
    assert err == 0, (n_head, n_kv, d, tables.shape, positions.tolist())
    return out


def hadamard_rows(x: torch.Tensor, block: int) -> None:
    """x [..., D] float32 (contiguous, on the CPU) with each run of `block` values of its last dimension
    rotated in place by the orthonormal Walsh-Hadamard matrix (`ops.hadamard.rotate`'s bits)."""
    lib = _library()
    assert lib is not None and x.dtype == torch.float32 and x.is_contiguous() and not x.is_cuda
    d = x.shape[-1]
    _issue(lib.llmx_hadamard_rows, (x.data_ptr(), x.numel() // d, d, block, _threads(lib)), (x,))


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    delta: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, RMSNorm(h) * weight) for x [..., E] float32 (contiguous) and weight [E] float32, where
    h = x, or x + delta (same shape) when given; plus `residual` (same shape) where given."""
    lib = _library()
    assert lib is not None and x.dtype == weight.dtype == torch.float32 and x.is_contiguous()
    n = x.shape[-1]
    out = torch.empty_like(x)
    h = x if delta is None else torch.empty_like(x)
    # the operands as the call reads them, kept with a recording (a copy made here must outlive it)
    add = None if delta is None else delta.contiguous()
    res = None if residual is None else residual.contiguous()
    w = weight.contiguous()
    add_ptr, res_ptr = (None if t is None else t.data_ptr() for t in (add, res))
    rows = x.numel() // n
    args = (
        x.data_ptr(),
        add_ptr,
        w.data_ptr(),
        res_ptr,
        h.data_ptr(),
        out.data_ptr(),
        rows,
        n,
        eps,
        _threads(lib),
    )
    _issue(lib.llmx_rms_norm, args, (x, add, w, res, h, out))
    return h, out

"""Placement and runtime options, named and meaning what they mean in llama.cpp.

Parsed once and shared by `run`, `chat`, `serve`, `bench`, `plan` and the Python API:

    add_options(parser)              # the llama.cpp flags on an argparse parser
    options_from_args(args)          # -> Options
    Options(n_gpu_layers="all", override_tensor=["exps=CPU"])   # llmx.load(path, **options)

`Options.__post_init__` is the one place that checks and normalizes a value, whether it came from
the command line (strings) or from Python (ints, lists, dicts), so both paths give equal Options.
A bad value is a `LlmxError` with one line naming the option. Whether a BUFT such as `CUDA3` exists
depends on the machine, so the planner checks that, not this module. Stdlib only (no torch).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from llmx.errors import LlmxError

# `-ngl all` (and llama.cpp's habit `-ngl 999`): more than any model's layer count.
ALL_LAYERS = 999
SPLIT_MODES = ("none", "layer", "row")
# llama.cpp's `-ctk`/`-ctv` choices (common/arg.cpp kv_cache_types).
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
FLASH_ATTN = ("on", "off", "auto")


@dataclass(frozen=True)
class Options:
    """Everything that decides where tensors live and how big the runtime buffers are.

    `None` means "not given", so auto-fit can tell the user's choices from defaults.
    """

    n_gpu_layers: int | None = None  # -ngl: the last N repeating layers (N > n_layer: also output)
    split_mode: str = "layer"  # -sm none|layer|row ("tensor" is accepted as row)
    tensor_split: tuple[float, ...] | None = None  # -ts: proportions per GPU; None = free memory
    main_gpu: int = 0  # -mg: the GPU of -sm none; small/shared tensors and KV in row mode
    override_tensor: tuple[tuple[str, str], ...] = ()  # -ot: ordered (regex, BUFT); first match wins
    cpu_moe: bool = False  # --cpu-moe: every layer's expert tensors stay on the CPU
    n_cpu_moe: int = 0  # -ncmoe N: the first N layers' expert tensors stay on the CPU
    no_kv_offload: bool = False  # KV cache on the CPU even for GPU layers
    no_op_offload: bool = False  # never stream CPU weights (layers, used experts) to a GPU for prompt batches
    no_fused_moe: bool = False  # routed experts' gate and up as two GPU launches, not one (-no-fmoe)
    # -c: llama.cpp defaults to the model's training context, which for current models is 128K
    # and would size a huge KV cache by surprise; llmx defaults to 4096. 0 = the model's own.
    ctx_size: int = 4096
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    batch_size: int = 2048  # -b: logical batch (tokens per prompt-processing call)
    ubatch_size: int = 512  # -ub: physical batch; sizes the compute buffers
    attn_max_batch: int = 0  # -amb MiB: cap on attention scratch (0 = no cap)
    flash_attn: str = "auto"
    no_mmap: bool = False
    mlock: bool = False
    fit: bool | None = None  # None: on when -ngl is not given and the machine has a GPU
    fit_margin_mib: int = 1024  # memory every device keeps free under --fit
    gpu_fit_margin: tuple[tuple[int, int], ...] = ()  # per-GPU (index, MiB) overriding fit_margin
    devices: str | None = None  # a described inventory, e.g. "cuda0=16GiB,cuda1=8GiB,cpu=64GiB"
    threads: int | None = None  # -t; None: one per physical core (see `n_threads`)
    # Names the caller set explicitly (CLI flags given / kwargs passed); fit leaves them alone.
    given: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        for name, value in _normalized(self).items():
            object.__setattr__(self, name, value)

    # --- derived values the planner and the runtime share ---

    @property
    def n_ubatch(self) -> int:
        """The physical batch actually used: llama.cpp clamps -ub to -b."""
        return min(self.ubatch_size, self.batch_size)

    @property
    def n_threads(self) -> int:
        """-t, or one thread per physical core (hyper-threads only contend for the same FPU)."""
        if self.threads is not None:
            return self.threads
        try:
            import psutil

            return psutil.cpu_count(logical=False) or os.cpu_count() or 1
        except ImportError:
            return os.cpu_count() or 1

    def fit_enabled(self, has_gpu: bool) -> bool:
        """--fit as given, else llama.cpp's default: fit when no -ngl was given and there is a GPU."""
        if self.fit is not None:
            return self.fit
        return has_gpu and self.n_gpu_layers is None

    def margin_mib(self, gpu: int | None) -> int:
        """The free memory --fit keeps on GPU `gpu` (None: the CPU)."""
        if gpu is None:
            return self.fit_margin_mib
        return dict(self.gpu_fit_margin).get(gpu, self.fit_margin_mib)

    def replace(self, **changes: Any) -> Options:
        """A copy with `changes` applied (the way fit() returns options a user could have typed)."""
        return dataclasses.replace(self, **changes)

    def to_args(self) -> list[str]:
        """The placement flags that reproduce these options, as a user would type them."""
        out: list[str] = []
        if self.n_gpu_layers is not None:
            out += ["-ngl", "all" if self.n_gpu_layers >= ALL_LAYERS else str(self.n_gpu_layers)]
        if self.split_mode != "layer":
            out += ["-sm", self.split_mode]
        if self.tensor_split is not None:
            out += ["-ts", ",".join(f"{p:g}" for p in self.tensor_split)]
        if self.main_gpu:
            out += ["-mg", str(self.main_gpu)]
        for regex, buft in self.override_tensor:
            out += ["-ot", f"{regex}={buft}"]
        if self.cpu_moe:
            out.append("--cpu-moe")
        if self.n_cpu_moe:
            out += ["-ncmoe", str(self.n_cpu_moe)]
        if self.no_kv_offload:
            out.append("--no-kv-offload")
        if self.no_op_offload:
            out.append("--no-op-offload")
        return out


# --- normalization: one function per kind of value, shared by argparse strings and Python values ---


def _normalized(o: Options) -> dict[str, Any]:
    ngl = _ngl(o.n_gpu_layers)
    ubatch = _positive("ubatch_size", o.ubatch_size)
    return {
        "n_gpu_layers": ngl,
        "split_mode": _split_mode(o.split_mode),
        "tensor_split": _tensor_split(o.tensor_split),
        "main_gpu": _count("main_gpu", o.main_gpu),
        "override_tensor": _overrides(o.override_tensor),
        "cpu_moe": bool(o.cpu_moe),
        "n_cpu_moe": _count("n_cpu_moe", o.n_cpu_moe),
        "no_kv_offload": bool(o.no_kv_offload),
        "no_op_offload": bool(o.no_op_offload),
        "no_fused_moe": bool(o.no_fused_moe),
        "ctx_size": _count("ctx_size", o.ctx_size),
        "cache_type_k": _choice("cache_type_k", o.cache_type_k, CACHE_TYPES),
        "cache_type_v": _choice("cache_type_v", o.cache_type_v, CACHE_TYPES),
        "batch_size": _positive("batch_size", o.batch_size),
        "ubatch_size": ubatch,
        "attn_max_batch": _count("attn_max_batch", o.attn_max_batch),
        "flash_attn": _flash_attn(o.flash_attn),
        "no_mmap": bool(o.no_mmap),
        "mlock": bool(o.mlock),
        "fit": _on_off("fit", o.fit),
        "fit_margin_mib": _count("fit_margin_mib", o.fit_margin_mib),
        "gpu_fit_margin": _gpu_margins(o.gpu_fit_margin),
        "devices": None if o.devices in (None, "") else str(o.devices),
        "threads": None if o.threads is None else _positive("threads", o.threads),
        "given": frozenset(o.given),
    }


def _int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise LlmxError(f"{name} must be a whole number, got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise LlmxError(f"{name} must be a whole number, got {value!r}") from None


def _count(name: str, value: Any) -> int:
    n = _int(name, value)
    if n < 0:
        raise LlmxError(f"{name} must be 0 or more, got {n}")
    return n


def _positive(name: str, value: Any) -> int:
    n = _int(name, value)
    if n < 1:
        raise LlmxError(f"{name} must be at least 1, got {n}")
    return n


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    v = str(value).lower()
    if v not in choices:
        raise LlmxError(f"{name} must be one of {', '.join(choices)}; got {value!r}")
    return v


def _ngl(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in ("all", "max"):
        return ALL_LAYERS
    n = _int("n_gpu_layers (-ngl)", value)
    # llama.cpp's -1 means "as many as possible", i.e. all.
    return ALL_LAYERS if n < 0 else min(n, ALL_LAYERS)


def _split_mode(value: Any) -> str:
    v = str(value).lower()
    # Current llama.cpp renamed row split to "tensor"; both spell the same thing here.
    return "row" if v == "tensor" else _choice("split_mode (-sm)", v, SPLIT_MODES)


def _tensor_split(value: Any) -> tuple[float, ...] | None:
    if value is None or value == "":
        return None
    parts = re.split(r"[,/]", value) if isinstance(value, str) else list(value)
    try:
        props = tuple(float(p) for p in parts)
    except (TypeError, ValueError):
        raise LlmxError(f"tensor_split (-ts) must be numbers like 3,1; got {value!r}") from None
    if any(p < 0 for p in props) or sum(props) <= 0:
        raise LlmxError(f"tensor_split (-ts) needs proportions >= 0 with a positive sum; got {value!r}")
    return props


def _overrides(value: Any) -> tuple[tuple[str, str], ...]:
    """-ot rules in order. Accepts "RE=BUFT,RE=BUFT" strings, (regex, buft) pairs, or a list of either."""
    items = [value] if isinstance(value, str) else list(value or ())
    rules: list[tuple[str, str]] = []
    for item in items:
        if isinstance(item, str):
            for clause in filter(None, item.split(",")):
                regex, sep, buft = clause.rpartition("=")
                if not sep or not regex or not buft:
                    raise LlmxError(f"override_tensor (-ot) wants REGEX=BUFT, e.g. exps=CPU; got {clause!r}")
                rules.append((regex, buft))
        else:
            regex, buft = item
            rules.append((str(regex), str(buft)))
    for regex, _ in rules:
        try:
            re.compile(regex)
        except re.error as e:
            raise LlmxError(f"override_tensor (-ot): bad regular expression '{regex}': {e}") from None
    return tuple(rules)


def _flash_attn(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return _choice("flash_attn (-fa)", value, FLASH_ATTN)


def _on_off(name: str, value: Any) -> bool | None:
    if value is None or isinstance(value, bool):
        return value
    v = str(value).lower()
    if v in ("on", "1", "true", "yes"):
        return True
    if v in ("off", "0", "false", "no"):
        return False
    raise LlmxError(f"{name} must be on or off, got {value!r}")


def _gpu_margins(value: Any) -> tuple[tuple[int, int], ...]:
    """--gpu-fit-margin "0=1024,1=512" (GPU index = MiB), a {index: MiB} dict, or pairs."""
    if isinstance(value, str):
        pairs = []
        for clause in filter(None, value.split(",")):
            index, sep, mib = clause.partition("=")
            if not sep:
                raise LlmxError(f"gpu_fit_margin wants GPU=MiB pairs like 0=1024,1=512; got {clause!r}")
            pairs.append((index, mib))
    elif isinstance(value, dict):
        pairs = list(value.items())
    else:
        pairs = list(value or ())
    return tuple(sorted((_count("gpu_fit_margin GPU", i), _count("gpu_fit_margin MiB", m)) for i, m in pairs))


# --- argparse and keyword front ends ---

_FIELDS = {f.name for f in dataclasses.fields(Options)} - {"given"}
_FLAG = {"action": "store_true", "default": None}  # default None so an absent flag is "not given"
_ON = {"nargs": "?", "const": "on"}  # bare `-fa` / `--fit` mean on
_APPEND = {"action": "append"}  # -ot is repeatable; its order is the rules' order
# (flags, dest, metavar, help, extra argparse keywords): llama.cpp's spelling of each option.
_ARGUMENTS: list[tuple[tuple[str, ...], str, str | None, str, dict[str, Any]]] = [
    (("-ngl", "--n-gpu-layers"), "n_gpu_layers", "N", "last N layers on GPUs ('all': and output)", {}),
    (("-sm", "--split-mode"), "split_mode", "none|layer|row", "one GPU / whole layers / matrix rows", {}),
    (("-ts", "--tensor-split"), "tensor_split", "P0,P1", "GPU shares, e.g. 3,1 (default: free memory)", {}),
    (("-mg", "--main-gpu"), "main_gpu", "I", "GPU for -sm none and for shared tensors in row mode", {}),
    (("-ot", "--override-tensor"), "override_tensor", "RE=BUFT", "BUFT CPU|CUDAi; first wins", _APPEND),
    (("-cmoe", "--cpu-moe"), "cpu_moe", None, "keep all MoE expert tensors on the CPU", _FLAG),
    (("-ncmoe", "--n-cpu-moe"), "n_cpu_moe", "N", "keep the first N layers' MoE experts on the CPU", {}),
    (("-nkvo", "--no-kv-offload"), "no_kv_offload", None, "keep the KV cache on the CPU", _FLAG),
    (("-nopo", "--no-op-offload"), "no_op_offload", None, "prompts: CPU weights stay on the CPU", _FLAG),
    (("-no-fmoe", "--no-fused-moe"), "no_fused_moe", None, "MoE gate and up in two launches, not one", _FLAG),
    (("-c", "--ctx-size"), "ctx_size", "N", "context length (default 4096; 0: the model's own)", {}),
    (
        ("-ctk", "--cache-type-k"),
        "cache_type_k",
        "TYPE",
        f"K cache type: {', '.join(CACHE_TYPES)}",
        {},
    ),
    (("-ctv", "--cache-type-v"), "cache_type_v", "TYPE", "V cache type (default f16)", {}),
    (("-b", "--batch-size"), "batch_size", "N", "logical batch size (default 2048)", {}),
    (("-ub", "--ubatch-size"), "ubatch_size", "N", "physical batch size (default 512)", {}),
    (
        ("-amb", "--attention-max-batch"),
        "attn_max_batch",
        "MiB",
        "with -fa off, attend a chunk of heads at a time whose scores fit in MiB (default: all at once)",
        {},
    ),
    (
        ("-fa", "--flash-attn"),
        "flash_attn",
        "on|off|auto",
        "flash attention (off: attention materializes the scores)",
        _ON,
    ),
    (("--no-mmap",), "no_mmap", None, "read the model file instead of mapping it", _FLAG),
    (("--mlock",), "mlock", None, "lock the model's pages in RAM (not supported yet: run refuses it)", _FLAG),
    (("-fit", "--fit"), "fit", "on|off", "auto-choose -ngl/-ncmoe/-ts (default: on without -ngl)", _ON),
    (("--fit-margin",), "fit_margin_mib", "MiB", "free memory --fit keeps on every device (1024)", {}),
    (("-gfm", "--gpu-fit-margin"), "gpu_fit_margin", "I=MiB,...", "per-GPU --fit margin: 0=1024,1=512", {}),
    (("--devices",), "devices", "DESC", "plan for described devices: cuda0=16GiB,cuda1=8GiB,cpu=64GiB", {}),
    (("-t", "--threads"), "threads", "N", "CPU threads (default: physical cores)", {}),
]


def add_options(parser: argparse.ArgumentParser) -> None:
    """Add llama.cpp's placement/runtime flags. Every default is None, so `given` records what was typed."""
    group = parser.add_argument_group("placement and runtime (llama.cpp names)")
    for flags, dest, metavar, help_text, extra in _ARGUMENTS:
        kwargs = {"metavar": metavar} if metavar else {}
        group.add_argument(*flags, dest=dest, help=help_text, **kwargs, **extra)


def options_from_args(args: argparse.Namespace) -> Options:
    """Options from a namespace filled by `add_options`; flags left out keep the Options defaults."""
    given = {k: v for k, v in vars(args).items() if k in _FIELDS and v is not None}
    return options_from_kwargs(**given)


def options_from_kwargs(**kwargs: Any) -> Options:
    """Options from Python keywords (`llmx.load(path, n_gpu_layers=20, ...)`); unknown names are an error."""
    unknown = sorted(set(kwargs) - _FIELDS)
    if unknown:
        raise LlmxError(f"unknown option {', '.join(unknown)}; known options: {', '.join(sorted(_FIELDS))}")
    return Options(**kwargs, given=frozenset(kwargs))

"""The Python API: `llmx.load(path, **options)` returns a ready model that turns text into text.

    model = llmx.load("model.gguf", n_gpu_layers=20, ctx_size=2048)
    print(model.generate("The capital of France is", max_tokens=16, temperature=0))
    for piece in model.stream("Once upon a time", max_tokens=64):
        print(piece, end="", flush=True)

Options are llama.cpp's (see `llmx.plan.options.Options`); sampling keywords are `SamplingParams`'.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from llmx import settings
from llmx.engine import WARM_UP_PROMPTS, Engine
from llmx.errors import LlmxError
from llmx.gguf import ModelFile, open_gguf
from llmx.model_config import ModelConfig
from llmx.models import model_class
from llmx.models.common import Model
from llmx.models.layout import check_tensors
from llmx.models_on_disk import default_model_path
from llmx.ops.cached_attention import AttentionKernels
from llmx.plan.fit import plan as make_plan
from llmx.plan.model import ModelSpec
from llmx.plan.options import Options, options_from_kwargs
from llmx.plan.placement import Plan
from llmx.runtime import host_heap
from llmx.runtime.cache import KVCache, LayerShape
from llmx.runtime.devices import probe
from llmx.runtime.executor import Executor
from llmx.runtime.tensor_parallel import Rendezvous, TensorParallel, deal, exchange_reducers
from llmx.runtime.weights import LoadReport, load_weights
from llmx.text.chat import chat_ids
from llmx.text.sampler import SamplingParams
from llmx.text.tokenizer import StreamDecoder, Tokenizer


@dataclass
class LoadedModel:
    """A model on its devices with its tokenizer: `generate`, `stream` and `chat` over text."""

    file: ModelFile
    config: ModelConfig
    engine: Engine
    tokenizer: Tokenizer
    options: Options
    plan: Plan
    report: LoadReport
    load_seconds: float  # everything `load` did, the warm-up included
    warm_up: WarmUp | None = None  # GPU placements only

    # --- text in, text out -----------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special=True, parse_special=True)

    def stream_ids(
        self, prompt: str | Sequence[int], max_tokens: int = 128, keep_context: bool = False, **sampling: Any
    ) -> Iterator[int]:
        """Token ids generated after `prompt`; the context restarts unless `keep_context`."""
        ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not keep_context:
            self.engine.reset()
        yield from self.engine.generate(ids, max_tokens, SamplingParams(**sampling), self.tokenizer.stop_ids)

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 128, **kw: Any) -> Iterator[str]:
        """Text pieces as they are generated; never half a UTF-8 character."""
        decoder = StreamDecoder(self.tokenizer)
        for token in self.stream_ids(prompt, max_tokens, **kw):
            piece = decoder.push(token)
            if piece:
                yield piece
        tail = decoder.flush()
        if tail:
            yield tail

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, **kw: Any) -> str:
        return "".join(self.stream(prompt, max_tokens, **kw))

    def chat_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The ids of `messages` rendered with the model's chat template, ready for the reply; `tools`:
        OpenAI function tools, handed to the template as Hugging Face's `apply_chat_template` does."""
        return chat_ids(self.tokenizer, messages, add_generation_prompt=True, tools=tools)


def kv_shapes(cls: type[Model], config: ModelConfig, plan: Plan, shard: int) -> list[LayerShape]:
    """What each layer caches on GPU `shard` of a `-sm row` split (0: the main GPU, which also holds
    every layer outside the split; another GPU holds nothing for those)."""
    out = []
    for i in range(config.n_layer):
        n_kv, dk, dv = cls.kv_shape(config, i)
        device, rows = plan.kv_device(i), plan.kv_rows[i]
        if i in plan.split_layers:
            h0, h1 = plan.split[shard].kv_heads
            n_kv, device = h1 - h0, device if device == "cpu" else plan.split[shard].device
        elif shard:
            n_kv, device = 0, "cpu"
        out.append(LayerShape(n_kv, dk, dv, device, rows))
    return out


def load(path: str | os.PathLike | None = None, **options: Any) -> LoadedModel:
    """Open a GGUF (default: the embedded SmolLM2), place and load its weights, build the engine."""
    opts = options.pop("options", None) or options_from_kwargs(**options)
    return load_with_options(path, opts)


def open_checked(path: str | os.PathLike, mmap: bool) -> tuple[ModelFile, ModelSpec, type[Model], Tokenizer]:
    """Open a GGUF and check all that can be checked before its weights load: the architecture, the
    config, every tensor's shape and type, and the vocabulary. Each failure is one line naming the file."""
    mf = open_gguf(path, mmap=mmap)
    try:
        cls = model_class(mf.architecture)
    except LlmxError as e:
        raise LlmxError(f"{mf.path.name}: {e}") from None
    spec = ModelSpec.from_gguf(mf)
    cls.check_config(spec.config, mf.path.name)
    tensors = ((t.name, t.qtype, t.shape) for t in mf.tensors.values())
    check_tensors(mf.path.name, spec.config, tensors, cls.layer_tensors(spec.config))
    return mf, spec, cls, Tokenizer.from_gguf(mf)


def check_runnable(opts: Options) -> None:
    """Refuse the options llama.cpp has and this runtime cannot honour yet, before anything loads
    (`llmx plan` still plans with them: it loads nothing)."""
    if opts.mlock:
        raise LlmxError("--mlock is not supported yet: llmx does not lock the model's pages in RAM")
    if opts.devices:
        raise LlmxError(
            "--devices describes a machine for `llmx plan`; loading uses this machine's devices "
            "(choose GPUs with CUDA_VISIBLE_DEVICES)"
        )


def load_with_options(path: str | os.PathLike | None, opts: Options, progress=None) -> LoadedModel:
    """Open, plan, load: the plan (from `llmx.plan`) decides every tensor's and KV layer's device."""
    check_runnable(opts)
    t0 = time.perf_counter()
    torch.set_num_threads(opts.n_threads)
    host_heap.keep_freed_blocks()
    mf, spec, cls, tokenizer = open_checked(path or default_model_path(), mmap=not opts.no_mmap)
    config = spec.config
    plan = make_plan(spec, probe(), opts)
    plan.check(suggestion="lower -ngl or -c, or use --fit")
    top, layers, report = load_weights(mf, plan, progress=progress)
    devices = [torch.device(s.device) for s in plan.split]
    rendezvous = Rendezvous(len(devices))
    reducers = exchange_reducers(devices, opts.n_ubatch * config.n_embd, rendezvous) if devices else []
    models = deal(cls, config, top, layers, reducers, fused_moe=not opts.no_fused_moe)
    attention = AttentionKernels.choose(opts.flash_attn, settings.fused_attention(), opts.attn_max_batch)
    caches = [
        KVCache(plan.ctx, kv_shapes(cls, config, plan, j), opts.cache_type_k, opts.cache_type_v, attention)
        for j in range(len(models))
    ]
    model, cache = models[0], caches[0]
    split = None
    if devices:
        split = TensorParallel(devices, models, caches, frozenset(plan.split_layers), rendezvous)
    layer_devices = [torch.device(d) for d in plan.layer_device]
    executor = Executor(
        model,
        cache,
        layer_devices,
        torch.device(plan.device_of("token_embd.weight")),
        torch.device(plan.device_of("output_norm.weight")),
        op_offload=torch.device(plan.op_offload) if plan.op_offload else None,
        stage_experts=not opts.no_op_offload,
        split=split,
    )
    engine = Engine(executor, ubatch=opts.n_ubatch)
    warm_up = None
    if any(d.startswith("cuda") for d in plan.tensor_device.values()):
        tick = progress("warming up", len(WARM_UP_PROMPTS) + 1, "steps") if progress else (lambda n: None)
        gpus = sorted({d for d in plan.tensor_device.values() if d.startswith("cuda")})
        before, held = _compiled_kernels(), _allocated(gpus)
        seconds = engine.warm_up(tick)
        retained = {d: n - held[d] for d, n in _allocated(gpus).items()}
        warm_up = WarmUp(seconds, len(_compiled_kernels() - before), _kernel_cache_folder(), retained)
    return LoadedModel(mf, config, engine, tokenizer, opts, plan, report, time.perf_counter() - t0, warm_up)


@dataclass(frozen=True)
class WarmUp:
    """What `Engine.warm_up` did at load: its seconds, the kernels it compiled into Triton's cache
    folder (none once an earlier run on this machine compiled them), and the bytes it left allocated
    on each GPU (captured graphs' pools and their buffers: compute memory, not weights or KV)."""

    seconds: float
    compiled: int
    cache_folder: str
    retained: dict[str, int]


def _allocated(gpus: list[str]) -> dict[str, int]:
    """Bytes torch has allocated on each of `gpus`, their queued work done."""
    for d in gpus:
        torch.cuda.synchronize(d)
    return {d: torch.cuda.memory_allocated(d) for d in gpus}


def _kernel_cache_folder() -> str:
    try:
        from triton import knobs
    except ImportError:  # no Triton: nothing is compiled
        return ""
    return str(knobs.cache.dir)


def _compiled_kernels() -> set[str]:
    """The entries of Triton's on-disk kernel cache (a folder per compiled kernel or launcher)."""
    folder = _kernel_cache_folder()
    return set(os.listdir(folder)) if folder and os.path.isdir(folder) else set()

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

from llmx.engine import Engine
from llmx.errors import LlmxError
from llmx.gguf import ModelFile, open_gguf
from llmx.models import model_class
from llmx.models.common import Config
from llmx.models_on_disk import default_model_path
from llmx.plan.options import Options, options_from_kwargs
from llmx.runtime.cache import KVCache, LayerShape
from llmx.runtime.executor import Executor
from llmx.runtime.weights import LoadReport, load_weights
from llmx.text.chat import chat_ids
from llmx.text.sampler import Sampler, SamplingParams
from llmx.text.tokenizer import StreamDecoder, Tokenizer


@dataclass
class LoadedModel:
    """A model on its devices with its tokenizer: `generate`, `stream` and `chat` over text."""

    file: ModelFile
    config: Config
    engine: Engine
    tokenizer: Tokenizer
    options: Options
    report: LoadReport
    load_seconds: float

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
        sampler = Sampler(SamplingParams(**sampling))
        yield from self.engine.generate(ids, max_tokens, sampler, self.tokenizer.stop_ids)

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

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The ids of `messages` rendered with the model's chat template, ready for the reply."""
        return chat_ids(self.tokenizer, messages, add_generation_prompt=True)


def _threads(options: Options) -> None:
    torch.set_num_threads(options.n_threads)


def load(path: str | os.PathLike | None = None, **options: Any) -> LoadedModel:
    """Open a GGUF (default: the embedded SmolLM2), place and load its weights, build the engine."""
    opts = options.pop("options", None) or options_from_kwargs(**options)
    return load_with_options(path, opts)


def load_with_options(path: str | os.PathLike | None, opts: Options, progress=None) -> LoadedModel:
    t0 = time.perf_counter()
    _threads(opts)
    mf = open_gguf(path or default_model_path(), mmap=not opts.no_mmap)
    cls = model_class(mf.architecture)
    config = cls.config_from_gguf(mf.metadata)
    tokenizer = Tokenizer.from_metadata(mf.metadata)
    n_ctx = opts.ctx_size or config.n_ctx_train
    device_of = _placement(mf, opts)
    top, layers, report = load_weights(mf, device_of, progress=progress)
    model = cls(config, top, layers)
    layer_devices = [torch.device(_layer_device(mf, i, device_of)) for i in range(config.n_layer)]
    kv_devices = ["cpu" if opts.no_kv_offload else str(d) for d in layer_devices]
    cache = KVCache(
        n_ctx,
        [LayerShape(*cls.kv_shape(config, i), kv_devices[i]) for i in range(config.n_layer)],
        opts.cache_type_k,
        opts.cache_type_v,
    )
    executor = Executor(
        model,
        cache,
        layer_devices,
        torch.device(device_of("token_embd.weight")),
        torch.device(device_of("output_norm.weight")),
    )
    engine = Engine(executor, ubatch=opts.n_ubatch)
    return LoadedModel(mf, config, engine, tokenizer, opts, report, time.perf_counter() - t0)


def _layer_device(mf: ModelFile, i: int, device_of) -> str:
    """Where block i runs and keeps its KV: the device of its attention (`-ot` may move single
    tensors elsewhere; those ops then run where their weight lives)."""
    name = f"blk.{i}.attn_q.weight"
    if name not in mf.tensors:
        name = next(n for n in mf.tensors if n.startswith(f"blk.{i}."))
    return device_of(name)


def _placement(mf: ModelFile, opts: Options):
    """tensor name -> device string. CPU-only until the planner drives placement."""
    if opts.n_gpu_layers and not torch.cuda.is_available():
        raise LlmxError(
            f"-ngl {opts.n_gpu_layers} asks for GPU layers but torch sees no CUDA device; "
            "drop -ngl to run on the CPU"
        )
    return lambda name: "cpu"

"""Generation over token ids: chunked prefill, the decode loop, stop ids, timings.

The engine knows nothing about text: the tokenizer and chat templates stay in `llmx.text` and the
API/CLI. It walks the model's blocks and moves the hidden state (a few KB per token) to the device
of each block; weights never move.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field, fields

import torch

from llmx.errors import LlmxError
from llmx.quant.choice import BUCKET_TOPS
from llmx.runtime.executor import Executor, ids_on
from llmx.runtime.host_copy import HostCopy
from llmx.text.device_sampler import DeviceSampler
from llmx.text.sampler import SamplingParams

# Prompt lengths that between them run every kernel a GPU compiles for prompts: the float GEMV of 2
# rows and of 3-4 (its loop over rows is compiled for a power of two), then the first M of each
# larger bucket of `llmx.quant.choice` (the fused GEMM's two, dequantize + matmul's); `warm_up` ends
# with a decode step (the integer-dot GEMV, the fused decode attention, the decode graph).
WARM_UP_PROMPTS = (2, 3, *(top + 1 for top in BUCKET_TOPS[1:]))


@dataclass
class Timings:
    """llama.cpp-style counters: prompt (prefill) and generation (decode) tokens and seconds, plus
    where a decode step's time goes and what op offload streamed.

    `gen_host_seconds` is the time the host spends issuing decode steps: from the start of a step
    to the point where it waits for the logits, less any wait for a GPU at a GPU -> CPU boundary.
    On a GPU it is Python and launch overhead (a CUDA-graph replay is one launch per segment); CPU
    ops run on the host, so it also holds the CPU segments' time (`gen_cpu_seconds`), and on a
    CPU-only run it is the whole step. `gen_cpu_bytes` are the weight and KV bytes those CPU
    segments read (weights counted as stored in the GGUF), so bytes / seconds is their bandwidth.
    """

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    gen_tokens: int = 0
    gen_seconds: float = 0.0
    prompt_bytes_streamed: int = 0  # CPU weight bytes copied to a GPU for prompts (op offload)
    gen_host_seconds: float = 0.0
    gen_cpu_seconds: float = 0.0
    gen_cpu_bytes: int = 0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def gen_tps(self) -> float:
        return self.gen_tokens / self.gen_seconds if self.gen_seconds else 0.0

    def since(self, earlier: Timings) -> Timings:
        """The counts added after `earlier` (a copy of these timings taken before)."""
        return Timings(**{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)})

    @property
    def host_ms_per_token(self) -> float:
        return 1000 * self.gen_host_seconds / self.gen_tokens if self.gen_tokens else 0.0

    @property
    def cpu_ms_per_token(self) -> float:
        return 1000 * self.gen_cpu_seconds / self.gen_tokens if self.gen_tokens else 0.0

    @property
    def cpu_gbs(self) -> float:
        """Bandwidth of the CPU segments during decode, decimal GB/s."""
        return self.gen_cpu_bytes / self.gen_cpu_seconds / 1e9 if self.gen_cpu_seconds else 0.0


@dataclass
class Engine:
    """Runs a model through its `Executor` over one sequence; `n_past` tokens are in the KV cache."""

    executor: Executor
    ubatch: int = 512
    n_past: int = 0
    timings: Timings = field(default_factory=Timings)

    @property
    def n_ctx(self) -> int:
        return self.executor.cache.n_ctx

    def reset(self) -> None:
        """Forget the context (the cache buffers are reused; positions restart at 0)."""
        self.n_past = 0
        self.timings = Timings()

    def warm_up(self, tick: Callable[[int], None] = lambda n: None) -> float:
        """Run each kind of step once on a throwaway context, so that a user's first tokens pay for no
        kernel compilation (or loading from Triton's cache), autotuning, lazy import or decode-graph
        capture; `tick(1)` after each step. Returns the seconds it took; the context is empty after."""
        t0 = time.perf_counter()
        for n in WARM_UP_PROMPTS:
            if n < self.n_ctx:  # leaves room for the decode step
                self.reset()
                self.prefill([0] * n)
            tick(1)
        self.decode(0)
        tick(1)
        self.synchronize()
        self.reset()
        return time.perf_counter() - t0

    def synchronize(self) -> None:
        for dev in {d for d in self.executor.layer_devices if d.type == "cuda"}:
            torch.cuda.synchronize(dev)

    @torch.inference_mode()
    def forward(
        self, ids: Sequence[int] | torch.Tensor, all_logits: bool = False, on_device: bool = False
    ) -> torch.Tensor:
        """Run one micro-batch at position n_past; returns logits [T or 1, vocab] (float32, on the CPU,
        or left on the head's device if `on_device`). `ids` may be a tensor of ids sampled on a device."""
        if self.n_past + len(ids) > self.n_ctx:
            raise LlmxError(
                f"the context is full: {self.n_past} + {len(ids)} tokens exceed -c {self.n_ctx}; "
                "raise -c or shorten the prompt"
            )
        try:
            ids = ids if isinstance(ids, torch.Tensor) else list(ids)
            logits = self.executor.forward(ids, self.n_past, all_logits, on_device)
        except torch.OutOfMemoryError as e:  # the context stays as it was: n_past does not move
            gpu = re.search(r"GPU (\d+)", str(e))
            need = re.search(r"Tried to allocate ([\d.]+ [KMGT]iB)", str(e))
            where = f"cuda:{gpu.group(1)}" if gpu else "a GPU"
            more = f" ({need.group(1)} more were needed)" if need else ""
            raise LlmxError(
                f"out of memory on {where} running {len(ids)} tokens{more}; "
                "lower -ub, -c or -ngl, or use --fit"
            ) from None
        except RuntimeError as e:
            if "can't allocate memory" not in str(e):  # the CPU allocator's words for it
                raise
            raise LlmxError(
                f"out of RAM running {len(ids)} tokens; lower -ub or -c, or close other programs"
            ) from None
        self.n_past += len(ids)
        return logits

    def prefill(self, ids: Sequence[int], all_logits: bool = False, on_device: bool = False) -> torch.Tensor:
        """Process a prompt in `ubatch`-sized chunks; logits of the last token [vocab] (or all [T, vocab]),
        on the CPU or, if `on_device`, left where the model made them (then the step may still run)."""
        if not ids:
            raise LlmxError("the prompt is empty")
        streamed = self.executor.bytes_streamed
        t0 = time.perf_counter()
        ub = self.ubatch
        outs = [self.forward(ids[s : s + ub], all_logits, on_device) for s in range(0, len(ids), ub)]
        self.timings.prompt_tokens += len(ids)
        self.timings.prompt_seconds += time.perf_counter() - t0
        self.timings.prompt_bytes_streamed += self.executor.bytes_streamed - streamed
        return torch.cat(outs) if all_logits else outs[-1][-1]

    def token_ids(self, ids: Sequence[int]) -> torch.Tensor:
        """`ids` as a tensor on the device that embeds them, where a sampler on it leaves its tokens."""
        return ids_on(ids, self.executor.embed_device)

    def decode(self, token: int | torch.Tensor, on_device: bool = False) -> torch.Tensor:
        """One generation step: logits [vocab] for the token after `token` (an id, or an id [1] on a
        device); as `forward`'s, on the CPU or left on the device."""
        t0 = time.perf_counter()
        logits = self.forward([token] if isinstance(token, int) else token, on_device=on_device)[-1]
        t = self.timings
        t.gen_tokens += 1
        t.gen_seconds += time.perf_counter() - t0
        step = self.executor.last
        t.gen_host_seconds += step.issued_at - t0 - step.waited
        t.gen_cpu_seconds += step.cpu_seconds
        t.gen_cpu_bytes += step.cpu_bytes
        return logits

    def generate(
        self,
        prompt: Sequence[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop_ids: Collection[int] = frozenset(),
    ) -> Iterator[int]:
        """Yield up to `max_tokens` new ids after `prompt` (appended to the current context), sampled
        with `sampling` (`continue_from`); generation ends at a stop id (not yielded) or when the
        context is full."""
        if self.n_past + len(prompt) >= self.n_ctx:
            raise LlmxError(
                f"the prompt has {len(prompt)} tokens but the context holds {self.n_ctx} "
                f"({self.n_past} already used); raise -c or shorten the prompt"
            )
        logits = self.prefill(prompt, on_device=True)
        yield from self.continue_from(logits, prompt, max_tokens, sampling, stop_ids)

    def continue_from(
        self,
        logits: torch.Tensor,
        history: Sequence[int],
        max_tokens: int,
        sampling: SamplingParams,
        stop_ids: Collection[int] = frozenset(),
    ) -> Iterator[int]:
        """The decode loop after a context `history` whose last logits [vocab] are `logits` (on the
        model's device): as `generate`'s. Each token is sampled on that device (`text.device_sampler`)
        and fed to the next step there; the host reads it one step late, while that next step runs.
        So a token that ends the reply (a stop id, or the caller closing this iterator after it) has
        had one more step issued after it: that step's position is taken back (`n_past`), so the
        context holds exactly what was yielded but the last id, as if each step had waited."""
        if max_tokens <= 0:
            return
        sampler = DeviceSampler(1, logits.shape[-1], logits.device)
        sampler.start(0, sampling, history)
        token = sampler(logits[None], [0])
        ahead, issued = HostCopy(token), False
        try:
            for n in range(1, max_tokens + 1):
                copy = ahead
                issued = n < max_tokens and self.n_past < self.n_ctx
                if issued:
                    token = sampler(self.decode(token, on_device=True)[None], [0])
                    ahead = HostCopy(token)
                t0 = time.perf_counter()
                (value,) = copy.values()
                waited = time.perf_counter() - t0  # the device's time the host did not cover
                if n == 1:
                    self.timings.prompt_seconds += waited
                else:
                    self.timings.gen_seconds += waited
                if value in stop_ids:
                    return
                yield value
                if not issued:
                    return
        finally:
            if issued:  # a step after the last token, run for nothing
                self.n_past -= 1
                self.timings.gen_tokens -= 1

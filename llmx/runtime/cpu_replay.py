"""A CPU decode step made again from its native calls, as a GPU replays a CUDA graph (`runtime.graphs`).

On the CPU a one-token step of SmolLM2 is some 180 calls into `cpu_blocks.c` (`quant.cpu_native`:
GEMVs, the gated FFNs, norms, one attention call a layer) and ~3 ms of Python around them: the
model's functions, the ops' choices, views and allocations, where the calls themselves take 7-11 ms.
Between two steps only a few values change: the token, the attention calls' position (the cache row
written and the rows read, in a sliding-window layer's ring and window too) and the RoPE angles. So
the first such step of an executor is recorded (`cpu_native.Recording`: each call with its arguments,
the tensors behind its pointers kept alive) and each later one is replayed: the token written into
the recorded ids, the angles copied into the recorded tables, then the calls made in order, in one
native call (`cpu_native.Program`), with the attention calls' position fields moved to the step's.
The calls are deterministic at a given thread count, so a replayed step's logits are the eager
step's, bit for bit; the thread count is read again at each replay.

A recording holds only if nothing but the native calls computed anything: a torch op between two calls
(the sigmoid gate of a Qwen2-MoE shared expert kept in float16, which the native call does not take)
would leave its recorded output for the next call to read again. (Gemma 3's step is native throughout:
its scaled embedding, its GELU-gated FFN and its norm after the FFN with the residual add each have
their call; Qwen2's q/k/v biases are added in the joined GEMV call; a MoE layer's router call writes the
ids and weights that its experts' call reads, and that call adds the residual; Qwen2-MoE's shared expert
is one gated FFN call that computes its float32 gate and adds the layer's output.) So the next step
after the recording is run both ways, eagerly and replayed over it, and the replay is kept only if its
logits equal the eager step's bit for bit (a stale value, which differs from token to token and position
to position, shows); otherwise the step is run eagerly once more (rewriting the cache row the replay
wrote) and the executor stops trying. (Watching the recorded step's ops with a TorchDispatchMode instead
imports ~900 modules, ~140 MB, at its first use.) A replay is made only where the recorded calls hold: a
one-token step at a position the attention calls' caches hold (any, in a sliding-window layer's ring
that holds its window).

The logits a replay returns are its last call's output buffer, written again by the next replay.
"""

from __future__ import annotations

import ctypes
import sys
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

import torch

from llmx.models.common import Step
from llmx.ops.rope import Rope
from llmx.quant import cpu_native

# What a CPU-only executor's batch recordings may hold of their own (each keeps its step's buffers:
# ~0.9 MiB a row of SmolLM2, ~7 MiB of Llama-3-8B's widths): past it the least recently used batch
# size is dropped, and recorded and checked again if it comes back (two eager steps).
RECORDINGS_BYTES = 256 << 20


class CpuReplay:
    """The one-token decode steps of a CPU-only executor: recorded at the first, replayed after.
    `ropes`: the model's RoPEs (their tables are the step's inputs), `vocab`: the embedding's rows."""

    def __init__(self, ropes: Sequence[Rope], vocab: int) -> None:
        self.ropes, self.vocab = tuple(ropes), vocab
        self.last_position = sys.maxsize  # the last position a replay may take: the recording's
        self.refused: str | None = None  # why this executor's step cannot be replayed
        self._replay: _Replay | None = None
        self._checked = False  # whether a replay has given an eager step's logits

    def decode(
        self,
        ids: Sequence[int] | torch.Tensor,
        n_past: int,
        run: Callable[[torch.Tensor, Step], torch.Tensor],
    ) -> torch.Tensor | None:
        """Logits [1, vocab] of the token ids[0] at position n_past: replayed, or computed by
        `run(ids, step)` while recorded (the first time) or checked against a replay (the second);
        None where none of them may be done (the caller runs the step eagerly)."""
        token = int(ids[0])
        if not 0 <= token < self.vocab or n_past > self.last_position or self.refused is not None:
            return None
        if self._replay is not None and self._checked:
            return self._replay(token, n_past)
        ids_t = torch.tensor([token], dtype=torch.long)
        step = Step(torch.arange(n_past, n_past + 1), masked=False, n_read=n_past + 1)
        if self._replay is None:
            return self._record(ids_t, step, run)
        eager = run(ids_t, step).clone()
        if torch.equal(self._replay(token, n_past), eager):
            self._checked = True
            return eager
        self.refused, self._replay = (
            "a replayed step differs from the eager one: it computes between its native calls",
            None,
        )
        return run(ids_t, step)  # the cache row the replay wrote, written again

    def _record(
        self, ids: torch.Tensor, step: Step, run: Callable[[torch.Tensor, Step], torch.Tensor]
    ) -> torch.Tensor:
        recording, tables, logits, self.refused = _recorded(
            self.ropes, int(step.positions[0]), ids, step, lambda: run(ids, step)
        )
        if self.refused is None:
            self._replay = _Replay(recording, ids, tables, logits)
            self.last_position = recording.last_position
        return logits.clone()  # the recorded buffer: the check's replay writes it again


def _recorded(
    ropes: Sequence[Rope], position: int, ids: torch.Tensor, step: Step, run: Callable[[], torch.Tensor]
) -> tuple[cpu_native.Recording, list[tuple[Rope, torch.Tensor, torch.Tensor]], torch.Tensor, str | None]:
    """A step `run` while its native calls are recorded (positions as offsets from `position`): the
    recording, the RoPE angles it reads (made first: the step's inputs), its logits, and why it
    cannot be replayed (None: it can)."""
    angles = [(rope, *step.rope(rope)) for rope in ropes]
    with cpu_native.recording_calls(position) as recording:
        logits = run()
    return recording, angles, logits, _unusable(recording, ids, logits)


def _unusable(recording: cpu_native.Recording, ids: torch.Tensor, logits: torch.Tensor) -> str | None:
    """Why a recording that ran only allowed ops still cannot be replayed, or None."""
    pointers = {a for _, args, _ in recording.calls for a in args if isinstance(a, int)}
    if not recording.calls or ids.data_ptr() not in pointers:
        return "the step's embedding is no native call"
    if logits.data_ptr() not in pointers or not logits.is_contiguous():
        return "the step's logits are no native call's output"
    missing = cpu_native.unreplayable(recording)
    return None if missing is None else f"the replay cannot make {missing} calls"


class _Replay:
    def __init__(
        self,
        recording: cpu_native.Recording,
        ids: torch.Tensor,
        tables: list[tuple[Rope, torch.Tensor, torch.Tensor]],
        logits: torch.Tensor,
    ) -> None:
        self.ids, self.tables, self.logits = ids, tables, logits  # ids: the token's slot, below
        self._token = ctypes.c_int64.from_address(ids.data_ptr())
        self._program = cpu_native.Program(recording)

    def __call__(self, token: int, position: int) -> torch.Tensor:
        self._token.value = token
        positions = torch.tensor([position])
        for rope, cos, sin in self.tables:
            new_cos, new_sin = rope.tables(positions, position + 1)
            cos.copy_(new_cos)
            sin.copy_(new_sin)
        self._program(position)
        return self.logits


class CpuBatchReplay:
    """The decode-only steps of a batch over one paged cache (`runtime.batch.cpu_decode`) of a CPU-only
    executor, as `CpuReplay` makes a single sequence's: per batch size B, the first step is recorded,
    the second run both ways and checked (logits bit-equal, else that B is refused), the later ones
    replayed. Between two steps of one B only the inputs change, and the calls read them from memory:
    the B tokens, their positions, their block tables (int32 [B, W], W fixed: every block a sequence
    may hold, so a table that grows needs no other call) and the RoPE angles; a replay writes them
    into the recorded tensors and makes the calls again. Sequences that join or leave change B: that
    B's recording serves, or one is made; the recordings' own buffers stay within RECORDINGS_BYTES,
    the least recently used dropped first. Its calls hold `cache`'s pools: another cache needs another
    `CpuBatchReplay`."""

    def __init__(self, cache: object, ropes: Sequence[Rope], vocab: int) -> None:
        self.cache, self.ropes, self.vocab = cache, tuple(ropes), vocab
        self.refused: dict[int, str] = {}  # by B: why its steps cannot be replayed
        self._replays: OrderedDict[int, _BatchReplay] = OrderedDict()  # least recently used first
        self._checked: set[int] = set()  # the B whose replay has given an eager step's logits

    def decode(
        self,
        ids: torch.Tensor,
        step: Step,
        tables: torch.Tensor,
        run: Callable[[torch.Tensor, Step, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor | None:
        """Logits [B, vocab] of tokens `ids` (int64 [B]) at `step.positions` in their blocks `tables`:
        replayed, or computed by `run(ids, step, tables)` while recorded (the first time for this B)
        or checked against a replay (the second); None where none of them may be done (the caller
        runs the step eagerly). The inputs are the recording's after the first time: the caller
        makes new ones for each step."""
        b = ids.shape[0]
        if b in self.refused or not bool(((ids >= 0) & (ids < self.vocab)).all()):
            return None
        replay = self._replays.get(b)
        if replay is None:
            return self._record(ids, step, tables, run)
        self._replays.move_to_end(b)
        if b in self._checked:
            return replay(ids, step, tables)
        eager = run(ids, step, tables).clone()
        if torch.equal(replay(ids, step, tables), eager):
            self._checked.add(b)
            return eager
        self.refused[b] = "a replayed step differs from the eager one: it computes between its native calls"
        del self._replays[b]
        return run(ids, step, tables)  # the cache rows the replay wrote, written again

    def _record(
        self,
        ids: torch.Tensor,
        step: Step,
        tables: torch.Tensor,
        run: Callable[[torch.Tensor, Step, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        b = ids.shape[0]
        recording, angles, logits, refused = _recorded(
            self.ropes, 0, ids, step, lambda: run(ids, step, tables)
        )
        if refused is None:
            self._replays[b] = _BatchReplay(recording, (ids, step.positions, tables), angles, logits)
            while len(self._replays) > 1 and self.held_bytes() > RECORDINGS_BYTES:
                dropped, _ = self._replays.popitem(last=False)
                self._checked.discard(dropped)
        else:
            self.refused[b] = refused
        return logits.clone()  # the recorded buffer: the check's replay writes it again

    def held_bytes(self) -> int:
        """The bytes only one recording holds (its step's buffers), summed over the recordings: what
        dropping them would free. The weights and the cache's pools, which every recording holds, do
        not count (nor anything with a single recording, which has nothing to be set against)."""
        if len(self._replays) < 2:
            return 0
        holders = Counter(ptr for r in self._replays.values() for ptr in r.storages)
        return sum(n for r in self._replays.values() for ptr, n in r.storages.items() if holders[ptr] == 1)


class _BatchReplay:
    def __init__(
        self,
        recording: cpu_native.Recording,
        inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        angles: list[tuple[Rope, torch.Tensor, torch.Tensor]],
        logits: torch.Tensor,
    ) -> None:
        self.inputs, self.angles, self.logits = inputs, angles, logits
        self._program = cpu_native.Program(recording)
        self.storages = {  # the memory its calls point into, by address: bytes
            t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in recording.kept
            if isinstance(t, torch.Tensor)
        }

    def __call__(self, ids: torch.Tensor, step: Step, tables: torch.Tensor) -> torch.Tensor:
        for recorded, given in zip(self.inputs, (ids, step.positions, tables), strict=True):
            recorded.copy_(given)
        for rope, cos, sin in self.angles:
            new_cos, new_sin = step.rope(rope)
            cos.copy_(new_cos)
            sin.copy_(new_sin)
        self._program(0)  # its calls' positions are in the recorded tensors, written above
        return self.logits

"""A CPU-only model's decode steps replayed from their recorded native calls (`runtime.cpu_replay`):
logits bit for bit the eager steps', a step with another torch op refused at its check and run eagerly;
the same for a batch's decode steps over a paged cache, per batch size."""

from __future__ import annotations

import threading

import pytest
import torch
from references import GREEDY
from tiny_models import random_prompt, write_tiny

import llmx
from llmx.quant import cpu_native, qtype
from llmx.runtime import cpu_replay
from llmx.runtime.batch import Chunk, forward_batch
from llmx.runtime.blocks import BlockTable
from llmx.runtime.cpu_replay import CpuBatchReplay
from llmx.runtime.paged import PagedKVCache

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="the native CPU kernels did not build")

STEPS = 24


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the native calls sum in one order at a given thread count
    yield
    torch.set_num_threads(threads)


def decode_run(model, replay: bool, prompt: list[int]) -> torch.Tensor:
    """Logits of STEPS greedy decode steps after `prompt` [STEPS, vocab], replayed or eager, on a
    context reset and filled again (the recording is kept across resets)."""
    engine = model.engine
    engine.executor.use_graphs = replay
    engine.reset()
    logits, out = engine.prefill(prompt), []
    for _ in range(STEPS):
        logits = engine.decode(int(logits.argmax()))
        out.append(logits)  # a CPU caller's logits stay its own: the next replay does not write them
    return torch.stack(out)


def generated(model, replay: bool, prompt: list[int]) -> list[int]:
    """Greedy ids from `Engine.generate`, which samples each step's logits on their device and reads
    the id one step late."""
    model.engine.executor.use_graphs = replay
    model.engine.reset()
    return list(model.engine.generate(prompt, STEPS, GREEDY))


def check_replays(model, prompt: list[int]) -> None:
    eager = decode_run(model, False, prompt)
    replay = model.engine.executor._cpu_replay
    assert replay is not None and replay._replay is None
    replayed = decode_run(model, True, prompt)
    assert replay.refused is None and replay._replay is not None and replay._checked
    assert torch.equal(replayed, eager)
    # again after a reset, from another prompt length (other positions), and rewound mid-way
    longer = prompt + random_prompt(5, 7)
    assert torch.equal(decode_run(model, True, longer), decode_run(model, False, longer))
    engine = model.engine
    engine.n_past -= 4
    rewound_replay = [engine.decode(3).clone() for _ in range(2)]
    engine.executor.use_graphs = False
    engine.n_past -= 2
    assert torch.equal(torch.stack(rewound_replay), torch.stack([engine.decode(3) for _ in range(2)]))
    assert generated(model, True, prompt) == generated(model, False, prompt)


def test_smollm2_decode_replays_bit_for_bit(smollm2_path) -> None:
    check_replays(llmx.load(smollm2_path, ctx_size=128), [1, 2, 3])


@pytest.mark.parametrize(
    ("arch", "type_name"),
    [
        ("llama", "Q8_0"), ("qwen2", "Q8_0"), ("qwen3", "Q4_K_M"), ("gemma3", "Q8_0"), ("gemma3", "Q4_K_M"),
        ("qwen3moe", "Q8_0"), ("qwen3moe", "Q4_K_M"), ("mixtral", "Q8_0"), ("qwen2moe", "Q8_0"),
        ("qwen2moe", "Q4_K_M"),
    ],
)  # fmt: skip
def test_tiny_decode_replays_bit_for_bit(arch, type_name, tmp_path) -> None:
    """Qwen2's q/k/v biases are added in its joined GEMV call; Gemma 3's steps cross its sliding window
    (SLIDING_WINDOW = 8 tokens) and, with -ub 8, wrap its local layers' rings (window + -ub = 16 rows)
    over and over. A MoE layer's router and routed experts are a native call each, the experts' call
    reading the ids and weights the router's wrote; Qwen2-MoE's shared expert is one call that
    computes its sigmoid gate and adds its FFN to the routed experts' output."""
    model = llmx.load(write_tiny(arch, type_name, tmp_path), ctx_size=64, ubatch_size=8)
    check_replays(model, random_prompt(6, 1))


def test_a_step_with_a_torch_op_runs_eagerly(tmp_path) -> None:
    """A Qwen2-MoE file whose shared expert's gate is float16 (the native call takes a float32 one, as
    GGUFs keep it) leaves that gate's product and sigmoid to torch between native calls: the replay
    checked against the step after the recording differs, is dropped, and every step (that one
    included, its cache row written again) gives the eager logits, as with replays off."""
    path = write_tiny("qwen2moe", "Q8_0", tmp_path, retyped={"ffn_gate_inp_shexp": "F16"})
    model = llmx.load(path, ctx_size=64)
    prompt = random_prompt(4, 2)
    replayed = decode_run(model, True, prompt)
    replay = model.engine.executor._cpu_replay
    assert replay._replay is None and "differs from the eager one" in replay.refused
    assert torch.equal(replayed, decode_run(model, False, prompt))


def test_a_recording_keeps_only_its_own_thread_s_calls() -> None:
    """A native call another thread makes meanwhile (a server's sampler) is no part of the step."""
    x, w = torch.ones(1, 64), torch.ones(64)
    with cpu_native.recording_calls(0) as recording:
        other = threading.Thread(target=lambda: cpu_native.rms_norm(x, w, 1e-6))
        other.start()
        other.join()
        assert recording.calls == []
        cpu_native.rms_norm(x, w, 1e-6)
        assert [entry.__name__ for entry, _, _ in recording.calls] == ["llmx_rms_norm"]
    assert cpu_native.recording is None


def _recorded(run) -> cpu_native.Recording:
    """The native calls `run()` makes, recorded."""
    with cpu_native.recording_calls(0) as recording:
        run()
    return recording


def test_a_program_makes_the_recorded_calls_again_and_names_one_that_fails() -> None:
    """`cpu_native.Program` makes a recording's calls again in one native call (a norm reads its
    weight's memory anew); a call that fails is named with the step's position; a recording with an
    entry point it cannot make (the sampler's top-k) is told apart before any Program is made."""
    x, w = torch.ones(1, 64), torch.ones(64)
    recording = _recorded(lambda: cpu_native.rms_norm(x, w, 1e-6))
    out = recording.kept[-1]  # the norm's output buffer
    w.fill_(2.0)
    cpu_native.Program(recording)(0)
    assert torch.equal(out, cpu_native.rms_norm(x, w, 1e-6)[1])

    gemv = cpu_native.Gemv([(torch.zeros(16, 34, dtype=torch.uint8), qtype("Q8_0"))])
    broken = _recorded(lambda: gemv(torch.ones(1, 32)))
    entry, args, threads = broken.calls[0]
    broken.calls[0] = (entry, (*args[:7], 0, *args[8:]), threads)  # no rows of x: the call refuses
    assert cpu_native.unreplayable(broken) is None
    with pytest.raises(RuntimeError, match="llmx_gemv_many failed in a replayed step at position 5"):
        cpu_native.Program(broken)(5)

    sampler = _recorded(lambda: cpu_native.top_k(torch.randn(100), 4))
    assert cpu_native.unreplayable(sampler) == "llmx_top_k"


# --- batched decode steps over a paged cache ---------------------------------------------------------

# the sequences in each step, as they join and leave: batches of 3, 4, 2 and 3, each B met again later
SCHEDULE = [(0, 1, 2)] * 3 + [(0, 1, 2, 3)] * 3 + [(1, 3)] * 3 + [(1, 3, 4)] * 2 + [(0, 1, 2)] * 2


def batched_run(model, replay: bool, sampled: bool = False) -> list[torch.Tensor]:
    """Logits of the SCHEDULE's batched steps (`forward_batch`), replayed or eager: a sequence's prompt
    is read in a step of its own when it first comes, then each step feeds it its greedy token (with
    `sampled`, as the server's sampler leaves it: a tensor, which the caller commits once read)."""
    executor = model.engine.executor
    executor.use_graphs = replay
    paged = PagedKVCache.over(executor.cache, 4, caching=False)
    tables = [BlockTable() for _ in range(5)]
    last: dict[int, int] = {}
    out = []
    for seqs in SCHEDULE:
        for j in seqs:
            if j not in last:
                last[j] = int(
                    forward_batch(executor, paged, [Chunk(tables[j], random_prompt(3 + 2 * j, j))])[
                        0
                    ].argmax()
                )
        ids = {j: torch.tensor([last[j]]) if sampled else [last[j]] for j in seqs}
        logits = forward_batch(executor, paged, [Chunk(tables[j], ids[j]) for j in seqs])
        if sampled:
            for j in seqs:
                paged.blocks.commit(tables[j], [last[j]])
        last |= {j: int(row.argmax()) for j, row in zip(seqs, logits, strict=True)}
        out.append(logits)
    return out


def check_batch_replays(model) -> CpuBatchReplay:
    eager = batched_run(model, False)
    replayed = batched_run(model, True)
    assert all(torch.equal(a, b) for a, b in zip(replayed, eager, strict=True))
    replays = model.engine.executor._cpu_batch
    assert replays is not None
    return replays


def test_smollm2_batched_decode_replays_bit_for_bit_as_sequences_join_and_leave(smollm2_path) -> None:
    """Each batch size is recorded at its first step, checked at its second, replayed after, also when
    it comes back with other sequences (other positions and block tables)."""
    replays = check_batch_replays(llmx.load(smollm2_path, ctx_size=128))
    assert replays.refused == {} and replays._checked == {2, 3, 4}
    # each recording's own buffers: its rows' activations (~0.9 MiB a row), not the weights every one holds
    assert 5 << 20 < replays.held_bytes() < 20 << 20


def test_batch_recordings_past_their_budget_drop_the_least_recently_used(smollm2_path, monkeypatch) -> None:
    """With room for one recording, each new batch size drops the last one's, which is recorded and
    checked again when it comes back; the logits stay the eager steps'."""
    monkeypatch.setattr(cpu_replay, "RECORDINGS_BYTES", 1)
    replays = check_batch_replays(llmx.load(smollm2_path, ctx_size=128))
    assert replays.refused == {} and list(replays._replays) == [3] and replays._checked == {3}


def test_sampled_ids_replay_as_host_ids_and_their_caller_commits_them(smollm2_path) -> None:
    """A server's steps feed the ids its sampler left as tensors, which the step must not commit to
    the tables (the caller does, once it has read them): replayed so, the logits are the eager steps'
    on host ids."""
    model = llmx.load(smollm2_path, ctx_size=128)
    eager = batched_run(model, False)
    replayed = batched_run(model, True, sampled=True)
    assert all(torch.equal(a, b) for a, b in zip(replayed, eager, strict=True))
    assert model.engine.executor._cpu_batch._checked == {2, 3, 4}


@pytest.mark.parametrize(("arch", "type_name"), [("llama", "Q8_0"), ("gemma3", "Q8_0")])
def test_tiny_batched_decode_replays_or_runs_eagerly(arch, type_name, tmp_path) -> None:
    """Gemma 3's torch ops between its native calls show at the check: its batches run eagerly."""
    replays = check_batch_replays(llmx.load(write_tiny(arch, type_name, tmp_path), ctx_size=128))
    if arch == "gemma3":
        assert set(replays.refused) == {2, 3, 4} and not replays._checked
    else:
        assert replays.refused == {} and replays._checked == {2, 3, 4}

"""The GPU paths give the CPU's tokens and, within LOGITS_TOL, its logits: all-GPU, hybrid (-ngl), single
tensors overridden to the CPU, KV on the CPU, two GPUs; eager vs CUDA-graph decode; and the loaded bytes
match the plan. Skipped without CUDA."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from references import DECISIVE_MARGIN, decisive, greedy_agrees_until_a_near_tie

import llmx
from llmx.errors import LlmxError
from llmx.models_on_disk import default_model_path
from llmx.runtime.offload import NEVER, offload_threshold
from llmx.runtime.segments import Segment, segments

# A random model of SmolLM2's shape (a GPU machine without the package) meets near-ties early on some
# prompts, which would leave the greedy checks little to compare: the tests take the prompt whose CPU
# path stays decisive longest.
PROMPTS = ("The three primary colours are", "The capital of France is", "def add(a, b):")
N = 32
CPU_ONLY = {"n_gpu_layers": 0, "no_op_offload": True}  # the reference: no prompt streamed to a GPU


def greedy_ids(model, prompt: str) -> list[int]:
    return list(model.stream_ids(prompt, N, temperature=0))


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """The embedded SmolLM2, or (on a GPU machine without the package) a synthetic file of its shape."""
    try:
        return default_model_path()
    except LlmxError:
        from llmx.bench.synth import synthesize

        path = tmp_path_factory.mktemp("synth") / "smollm2-135m-Q4_1.gguf"
        synthesize("smollm2-135m", "Q4_1", path, progress=False)
        return path


def forced_logits(model, prompt: str, tokens: list[int]) -> torch.Tensor:
    """Float64 logits after the prompt and after each of `tokens` fed in turn (the same path for
    every placement, whatever each would pick): [len(tokens) + 1, vocab]."""
    model.engine.reset()
    out = [model.engine.prefill(model.encode(prompt))]
    out += [model.engine.decode(t) for t in tokens]
    return torch.stack([o.reshape(-1).double().cpu() for o in out])


def decisive_steps(logits: torch.Tensor) -> int:
    """Greedy steps before the first near-tie of the reference's `logits`."""
    steps = decisive(logits[:N], DECISIVE_MARGIN)
    return N if bool(steps.all()) else int((~steps).nonzero()[0, 0])


@pytest.fixture(scope="module")
def reference(model_path) -> tuple[str, list[int], torch.Tensor]:
    """The prompt of PROMPTS whose CPU path stays decisive longest, the CPU's greedy tokens after it
    and its logits along them."""
    model = llmx.load(model_path, ctx_size=512, **CPU_ONLY)
    runs = []
    for prompt in PROMPTS:
        tokens = greedy_ids(model, prompt)
        runs.append((prompt, tokens, forced_logits(model, prompt, tokens)))
    return max(runs, key=lambda run: decisive_steps(run[2]))


@pytest.fixture(scope="module")
def prompt(reference) -> str:
    return reference[0]


@pytest.fixture(scope="module")
def cpu_tokens(reference) -> list[int]:
    return reference[1]


@pytest.fixture(scope="module")
def cpu_logits(reference) -> torch.Tensor:
    return reference[2]


# ||GPU - CPU|| / ||CPU|| over every position's logits. The CPU computes in float32 on exact weights;
# a GPU multiplies prompts on fp16 tensor cores (x scaled per row: ~2**-11 relative per value) and
# decodes Q4_K/Q6_K/Q8_0 weights on int8-quantized x (at most 1/254 of each 32 values' largest |x|).
LOGITS_TOL = 1e-2


def test_segments_group_consecutive_devices():
    cpu, gpu = torch.device("cpu"), torch.device("cuda:0")
    two = segments([cpu, cpu, gpu, gpu], gpu)
    assert two == [Segment(cpu, range(0, 2), False), Segment(gpu, range(2, 4), True)]
    assert segments([gpu, cpu], cpu) == [Segment(gpu, range(0, 1), False), Segment(cpu, range(1, 2), True)]
    assert segments([cpu], gpu) == [Segment(cpu, range(0, 1), False), Segment(gpu, range(0), True)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "options",
    [
        {"n_gpu_layers": "all"},
        {"n_gpu_layers": 15},
        {"n_gpu_layers": "all", "override_tensor": ["ffn=CPU"]},
        {"n_gpu_layers": "all", "no_kv_offload": True},
        {"n_gpu_layers": 15, "override_tensor": [r"attn_output\.weight=CUDA0"]},
        {"n_gpu_layers": "all", "flash_attn": "off"},
    ],
    ids=["all-gpu", "ngl-15", "ffn-on-cpu", "no-kv-offload", "cpu-layers-attn-output-on-gpu", "fa-off"],
)
def test_gpu_greedy_matches_cpu(model_path, prompt, cpu_tokens, cpu_logits, options):
    model = llmx.load(model_path, ctx_size=512, **options)
    assert model.warm_up is not None  # a GPU placement warms up at load, and changes no token
    greedy_agrees_until_a_near_tie(greedy_ids(model, prompt), cpu_tokens, cpu_logits)
    logits = forced_logits(model, prompt, cpu_tokens)
    err = ((logits - cpu_logits).norm() / cpu_logits.norm()).item()
    print(f"{options}: logits relative error {err:.2e}")
    assert err < LOGITS_TOL


@pytest.mark.gpu
def test_offload_threshold_measures_cpu_resident_matrices_only(model_path, tmp_path, monkeypatch):
    """CPU layers whose matrices an -ot rule put on the GPU: the op-offload threshold is measured on
    the first layer that still holds CPU matrices, and on them only (a GPU matrix there was once
    multiplied with the CPU's x); with none left, nothing streams."""
    monkeypatch.setenv("LLMX_CACHE_DIR", str(tmp_path))  # measured, not read from this machine's cache
    rules = [r"blk\.0\.=CUDA0", r"blk\.1\.attn_output=CUDA0"]
    model = llmx.load(model_path, ctx_size=512, n_gpu_layers=15, override_tensor=rules)
    layers, gpu = model.engine.executor.model.layers, torch.device("cuda:0")
    assert offload_threshold([layers[0]], gpu) == NEVER
    assert 2 <= offload_threshold([layers[0], layers[1]], gpu) < NEVER


@pytest.mark.gpu
def test_graph_decode_matches_eager(model_path, prompt):
    model = llmx.load(model_path, ctx_size=512, n_gpu_layers="all")
    graphed = greedy_ids(model, prompt)
    model.engine.executor.use_graphs = False
    assert greedy_ids(model, prompt) == graphed


@pytest.mark.gpu
def test_graphs_match_eager_after_the_context_grows(model_path, prompt, cpu_tokens):
    """Prompt graphs (a prompt's shape seen a second time) and decode graphs give the eager logits,
    also after a longer context replaced the RoPE tables the first graphs were captured with, and
    the freed memory was written over."""
    model = llmx.load(model_path, ctx_size=1024, n_gpu_layers="all")
    executor, tokens = model.engine.executor, cpu_tokens[:8]
    executor.use_graphs = False
    eager = forced_logits(model, prompt, tokens)
    executor.use_graphs = True
    forced_logits(model, prompt, tokens)  # the prompt runs eagerly once more; decode graphs are captured
    model.engine.n_past = 1000
    model.engine.decode(tokens[0])  # a graph of the last bucket: every RoPE table grows
    torch.full((1 << 26,), float("nan"), device="cuda")  # scribble over what was freed
    assert len(executor.graphs.prompt) == 0
    graphed = forced_logits(model, prompt, tokens)  # the prompt's second sighting: captured and replayed
    assert len(executor.graphs.prompt) == sum(s.device.type == "cuda" for s in executor.segments)
    again = forced_logits(model, prompt, tokens)  # replayed from the kept graph
    for logits in (graphed, again):
        assert torch.isfinite(logits).all()
        assert ((logits - eager).norm() / eager.norm()).item() < 1e-4


@pytest.mark.gpu
def test_prompts_run_eagerly_when_a_graph_does_not_fit(model_path, prompt, cpu_tokens, monkeypatch):
    """Out of memory while capturing a prompt graph: a warning, the eager result, no more captures."""
    model = llmx.load(model_path, ctx_size=512, n_gpu_layers="all")
    executor, tokens = model.engine.executor, cpu_tokens[:4]
    eager = forced_logits(model, prompt, tokens)

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(executor.graphs, "capture", no_memory)  # decode graphs are captured already
    with pytest.warns(UserWarning, match="no GPU memory left to capture prompt graphs"):
        again = forced_logits(model, prompt, tokens)
    assert torch.equal(again, eager) and executor.graphs.prompt_off
    assert torch.equal(forced_logits(model, prompt, tokens), eager)


@pytest.mark.gpu
def test_prompt_graphs_of_many_shapes_cost_no_workspace_each(model_path):
    """torch keeps a cuBLAS workspace (32 MiB) for every stream that ran a matmul: captures of many
    prompt shapes must share one stream, not grow the memory by a workspace each."""
    model = llmx.load(model_path, ctx_size=512, n_gpu_layers="all", split_mode="none")
    engine = model.engine

    def twice(n: int) -> None:  # a shape's second sighting is captured
        for _ in range(2):
            engine.reset()
            engine.prefill(list(range(1, n + 1)))  # >= 16 tokens: cuBLAS multiplies them

    for n in (17, 18):
        twice(n)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(0)
    for n in range(19, 27):
        twice(n)
    torch.cuda.synchronize()
    assert len(engine.executor.graphs.prompt) == 10
    assert torch.cuda.memory_allocated(0) - before < 32 * 2**20


@pytest.mark.gpu
def test_allocated_bytes_match_the_plan(model_path):
    gc.collect()  # earlier tests' models, held only by reference cycles, are freed now, not mid-load
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(0)
    model = llmx.load(model_path, ctx_size=2048, n_gpu_layers="all", split_mode="none")  # all on GPU 0
    measured = torch.cuda.memory_allocated(0) - before - model.warm_up.retained["cuda:0"]
    use = model.plan.device_use("cuda:0")
    planned = use.weights + use.kv
    assert abs(measured - planned) <= 0.05 * planned, (measured, planned)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_row_split_decode_replays_one_graph_across_both_gpus(model_path, prompt, cpu_tokens, cpu_logits):
    """A row-split model's decode step is one CUDA graph holding both GPUs' kernels and exchanges (the
    executor falls back to eager steps with a warning where that fails: here it must not)."""
    model = llmx.load(model_path, ctx_size=512, n_gpu_layers="all", split_mode="row", tensor_split="1,1")
    executor = model.engine.executor
    assert any(executor._peers) and executor.split is not None
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*could not be captured")
        greedy_agrees_until_a_near_tie(greedy_ids(model, prompt), cpu_tokens, cpu_logits)
    assert executor.graphs.decode


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize(
    "options",
    [
        {"n_gpu_layers": "all", "split_mode": "layer", "tensor_split": "1,1"},
        {"n_gpu_layers": "all", "split_mode": "row", "tensor_split": "1,1"},
        {"n_gpu_layers": 20, "split_mode": "layer", "tensor_split": "3,1"},
        {"n_gpu_layers": 20, "split_mode": "row", "tensor_split": "3,1"},
    ],
    ids=["layer-split", "row-split", "layer-split-hybrid", "row-split-hybrid"],
)
def test_two_gpus_greedy_matches_cpu(model_path, prompt, cpu_tokens, cpu_logits, options):
    model = llmx.load(model_path, ctx_size=512, **options)
    devices = {str(d) for d in model.engine.executor.layer_devices}
    assert {"cuda:0", "cuda:1"} <= devices or options["split_mode"] == "row"
    greedy_agrees_until_a_near_tie(greedy_ids(model, prompt), cpu_tokens, cpu_logits)
    logits = forced_logits(model, prompt, cpu_tokens)
    assert ((logits - cpu_logits).norm() / cpu_logits.norm()).item() < LOGITS_TOL


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_exchange_adds_partials_to_the_same_bits_on_both_gpus():
    """`kernels.exchange`: meetings of every size (a decode token, a prompt batch, an odd length), many
    in a row (the inboxes alternate), eagerly and replayed from one graph holding both GPUs' kernels,
    give torch's sum in GPU order, identical on both GPUs."""
    from llmx.kernels.exchange import Exchange

    devices = [torch.device("cuda", 0), torch.device("cuda", 1)]
    exchange = Exchange(devices, 512 * 4096)
    for n in (4096, 1000, 512 * 4096, 1, 4096, 4096):
        partials = [torch.randn(n, device=d) for d in devices]
        sums = [exchange.all_reduce(p, rank) for rank, p in enumerate(partials)]
        want = partials[0] + partials[1].to(devices[0])
        assert torch.equal(sums[0], want) and torch.equal(sums[1].to(devices[0]), want)
    x = [torch.randn(4096, device=d) for d in devices]
    y = [torch.empty_like(t) for t in x]
    streams = [torch.cuda.Stream(d) for d in devices]
    graph = torch.cuda.CUDAGraph()
    streams[0].wait_stream(torch.cuda.current_stream(devices[0]))
    with torch.cuda.graph(graph, stream=streams[0]):
        streams[1].wait_stream(streams[0])
        with torch.cuda.stream(streams[1]), torch.cuda.device(devices[0]):
            for rank, d in enumerate(devices):
                with torch.cuda.device(d):
                    for _ in range(8):  # eight meetings a replay, each adding to the last total
                        y[rank].copy_(exchange.all_reduce(x[rank], rank))
                        x[rank].copy_(y[rank] * 0.5)
        streams[0].wait_stream(streams[1])
    for _ in range(3):
        start = [t.clone() for t in x]
        graph.replay()
        for d in devices:
            torch.cuda.synchronize(d)
        total = start[0] + start[1].to(devices[0])
        for _ in range(7):
            total = (total * 0.5) + (total * 0.5)
        assert torch.equal(y[0], total) and torch.equal(y[1].to(devices[0]), total)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_row_split_allocates_what_the_plan_says_on_each_gpu(model_path):
    """Each GPU of a split holds its parts of the weights, its KV heads and the exchange's inboxes:
    within 5% of the plan."""
    from llmx.plan.memory import exchange_bytes
    from llmx.plan.model import ModelSpec

    torch.cuda.empty_cache()
    before = [torch.cuda.memory_allocated(i) for i in range(2)]
    model = llmx.load(model_path, ctx_size=2048, n_gpu_layers="all", split_mode="row", tensor_split="1,1")
    assert len(model.plan.split) == 2
    inboxes = exchange_bytes(ModelSpec.from_gguf(model.file), model.plan.options, 2)
    for i in range(2):
        measured = torch.cuda.memory_allocated(i) - before[i]
        use = model.plan.device_use(f"cuda:{i}")
        planned = use.weights + use.kv + inboxes
        assert abs(measured - planned) <= 0.05 * planned, (i, measured, planned)

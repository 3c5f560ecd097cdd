"""`-sm row` as tensor parallelism: the planner's cuts, the loader's column pieces, and the split layers'
arithmetic, all on the CPU (two-GPU runs: tests/test_gpu.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from llmx.gguf import open_gguf
from llmx.models import model_class
from llmx.models.common import Model, Step, TensorGroup
from llmx.models.naming import group_key
from llmx.plan import ModelSpec, Options, get_shape, parse_devices, place
from llmx.plan.memory import kv_layer_bytes
from llmx.plan.tensor_parallel import Shard, shards
from llmx.runtime.cache import KVCache, LayerShape
from llmx.runtime.tensor_parallel import Rendezvous, TensorParallel, deal, meeting
from llmx.runtime.weights import load_weights, pieces, shape_raw, sharded

TWO_GPUS = "cuda0=24GiB,cuda1=24GiB,cpu=64GiB"


def llama3(recipe: str = "Q4_K_M") -> ModelSpec:
    return ModelSpec.from_shape(get_shape("llama3-8b"), recipe)


def test_each_gpu_holds_its_heads_and_ffn_columns_and_a_copy_of_the_norms():
    m = llama3()
    p = place(m, parse_devices(TWO_GPUS), Options(n_gpu_layers=999, split_mode="row", tensor_split=(1, 1)))
    assert p.split == (Shard("cuda:0", (0, 4), (0, 7168)), Shard("cuda:1", (4, 8), (7168, 14336)))
    assert p.split_layers == tuple(range(32)) and p.warnings == ()
    halves = (("cuda:0", 0, 2048), ("cuda:1", 2048, 4096))
    assert p.row_split("blk.7.attn_q.weight") == halves  # 4 KV heads x 4 query heads x 128
    assert p.row_split("blk.7.attn_v.weight") == (("cuda:0", 0, 512), ("cuda:1", 512, 1024))
    assert p.column_split("blk.7.attn_output.weight") == halves
    assert p.row_split("blk.7.ffn_up.weight") == (("cuda:0", 0, 7168), ("cuda:1", 7168, 14336))
    assert p.column_split("blk.7.ffn_down.weight") == (("cuda:0", 0, 7168), ("cuda:1", 7168, 14336))
    assert (
        p.replicas["blk.7.attn_norm.weight"] == ("cuda:1",)
        and p.device_of("blk.7.attn_norm.weight") == "cuda:0"
    )
    use = {u.device: u for u in p.usage}
    kv = sum(kv_layer_bytes(m, p.options, i) for i in range(32))
    assert use["cuda:0"].kv == use["cuda:1"].kv == kv // 2
    copies = sum(t.nbytes * len(p.replicas.get(t.name, ())) for t in m.tensors)
    assert sum(u.weights for u in p.usage) == m.nbytes + copies
    assert p.layers[3].devices["ffn"] == "cuda:0+cuda:1" and p.layers[3].kv_device == "cuda:0+cuda:1"
    assert p.notes[-1] == (
        "-sm row divides 32 layers: cuda:0 KV heads 0-3, FFN columns 0-7167; cuda:1 KV heads 4-7, "
        "FFN columns 7168-14335; partial sums are added across the GPUs twice a layer"
    )


def test_the_main_gpu_comes_first_and_shares_follow_tensor_split():
    p = place(
        llama3(),
        parse_devices(TWO_GPUS),
        Options(n_gpu_layers=999, split_mode="row", tensor_split=(3, 1), main_gpu=1),
    )
    assert p.split == (Shard("cuda:1", (0, 2), (0, 3584)), Shard("cuda:0", (2, 8), (3584, 14336)))
    assert p.column_split("blk.0.attn_output.weight") == (("cuda:1", 0, 1024), ("cuda:0", 1024, 4096))


def test_layers_that_cannot_be_split_stay_whole_and_say_why():
    inv = parse_devices(TWO_GPUS)
    row = Options(n_gpu_layers=999, split_mode="row")
    pinned = place(
        llama3(), inv, Options(n_gpu_layers=999, split_mode="row", override_tensor=[r"blk\.3\.ffn_down=CPU"])
    )
    assert 3 not in pinned.split_layers and 4 in pinned.split_layers  # -ot keeps its layer whole
    assert (
        pinned.row_split("blk.3.attn_q.weight") is None and pinned.device_of("blk.3.ffn_down.weight") == "cpu"
    )
    hybrid = place(llama3(), inv, Options(n_gpu_layers=8, split_mode="row"))
    assert hybrid.split_layers == tuple(range(24, 32))  # CPU layers are not split
    p = place(ModelSpec.from_shape(get_shape("deepseek-v3"), "Q4_K_M"), inv, row)
    why = "1 KV head(s) and an FFN of 18432 cannot be divided between GPUs"
    assert p.split == () and p.warnings == (f"-sm row: {why}; the layers run whole on cuda:0",)
    wide = llama3()
    narrow = dataclasses.replace(
        wide, config=dataclasses.replace(wide.config, head_dim=8, head_dim_v=8)
    )  # 4 heads of 8: half a Q4_K block
    assert (
        shards(narrow, ["cuda:0", "cuda:1"], [1, 1])
        == "its attention heads do not end on Q4_K block boundaries"
    )
    assert place(llama3(), inv, Options(n_gpu_layers=999, split_mode="row", tensor_split=(1, 0))).split == ()


@pytest.mark.parametrize("name", ["blk.0.attn_output.weight", "blk.0.ffn_down.weight"])
def test_a_column_piece_holds_exactly_its_columns(smollm2_path, name):
    """The loader's column cut of a quantized matrix, dequantized by gguf-py, is the whole matrix's
    columns."""
    mf = open_gguf(smollm2_path)
    p = place(ModelSpec.from_gguf(mf), parse_devices(TWO_GPUS), Options(n_gpu_layers=999, split_mode="row"))
    info = mf.tensors[name]
    qt = GGMLQuantizationType[info.qtype.name]
    whole = dequantize(info.data.reshape(info.shape[0], -1), qt)
    cuts = [c for c in pieces(mf, p) if c.info.name == name]
    assert [c.columns for c in cuts] == [(lo, hi) for _, lo, hi in p.column_split(name)]
    for c in cuts:
        got = dequantize(c.data.reshape(c.shape[0], -1), qt)
        np.testing.assert_array_equal(got, whole[:, c.columns[0] : c.columns[1]])
        assert c.nbytes == c.data.nbytes


@dataclasses.dataclass
class CpuSplit:
    """SmolLM2 cut as for two GPUs (2 and 1 KV heads: unequal parts) with both parts on the CPU, run
    by `TensorParallel` (a thread a part), its partial sums added through the threads' rendezvous;
    and the whole model beside it."""

    split: TensorParallel
    whole: Model
    whole_cache: KVCache

    @classmethod
    def load(cls, path) -> CpuSplit:
        mf = open_gguf(path)
        spec = ModelSpec.from_gguf(mf)
        plan = place(spec, parse_devices(TWO_GPUS), Options(n_gpu_layers=999, split_mode="row"))
        arch = model_class(mf.architecture)
        config = spec.config
        top, whole_layers, _ = load_weights(
            mf, place(spec, parse_devices("cpu=64GiB"), Options()), repack=False
        )
        cut = pieces(mf, plan)
        shapes = {c.key: c.shape for c in cut}
        raws = {c.key: shape_raw(torch.from_numpy(c.data.copy()), c.info.qtype, c.shape) for c in cut}
        dealt: dict[int, dict] = {}
        for info in mf.tensors.values():
            layer, key = group_key(info.name)
            if layer is not None:
                dealt.setdefault(layer, {})[key] = sharded(info, plan, shapes, raws, False)
        n = len(plan.split)
        rendezvous, parts = Rendezvous(n), [torch.empty(0)] * n

        def add(j: int):  # what kernels.exchange does on GPUs, with the threads' rendezvous
            def reduce(partial: torch.Tensor) -> torch.Tensor:
                parts[j] = partial
                rendezvous.met()
                total = parts[0] + parts[1]
                rendezvous.met()
                return total

            return reduce

        layers = [TensorGroup(f"blk.{i}.", dealt[i]) for i in range(config.n_layer)]
        models = deal(arch, config, top, layers, [meeting(add(j), rendezvous) for j in range(n)])

        def cache(n_kv: int) -> KVCache:
            shape = LayerShape(n_kv, config.head_dim, config.head_dim, "cpu")
            return KVCache(64, [shape] * config.n_layer, "f32", "f32")

        caches = [cache(s.kv_heads[1] - s.kv_heads[0]) for s in plan.split]
        split = TensorParallel(
            [torch.device("cpu")] * n, models, caches, frozenset(plan.split_layers), rendezvous
        )
        return cls(split, arch(config, top, whole_layers), cache(config.n_head_kv))

    def run_whole(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        for i in range(self.whole.config.n_layer):
            writer = self.whole_cache.writer(i, step.positions, step.n_read)
            x = self.whole.block(i, self.whole.layers[i], x, step, writer)
        return x


def test_split_layers_in_two_threads_give_the_whole_models_hidden_states(smollm2_path):
    """The hidden states of a prompt and of the next token, each part of the split run in its own
    thread, match the unsplit model's, and both parts keep the same residual stream."""
    cpu = CpuSplit.load(smollm2_path)
    layers = list(range(cpu.whole.config.n_layer))
    for positions in (torch.arange(6), torch.tensor([6])):
        x = cpu.whole.embed(torch.tensor([1, 504, 3303, 28, 253, 1234, 42])[positions])
        step = Step(positions, masked=True, n_read=int(positions[-1]) + 1)
        got = cpu.split.run(layers, x.clone(), step)
        want = cpu.run_whole(x, Step(positions, masked=True, n_read=step.n_read))
        # float32 sums in another order, over 30 layers of a stream reaching ~4e3: 3.5e-5 measured
        assert ((got - want).norm() / want.norm()).item() < 2e-4


def test_a_part_that_fails_frees_the_others_and_raises_its_error(smollm2_path):
    """One part raising in layer 5 must not leave the other thread waiting at its next exchange for
    ever: the run raises that error (not the partner's broken rendezvous), and runs again after."""
    cpu = CpuSplit.load(smollm2_path)
    second = cpu.split.models[1]
    block = second.block

    def failing(i, *args):
        if i == 5:
            raise RuntimeError("out of memory on the second part")
        return block(i, *args)

    second.block = failing
    x = cpu.whole.embed(torch.tensor([1, 504, 3303]))
    layers = list(range(cpu.whole.config.n_layer))
    with pytest.raises(RuntimeError, match="out of memory on the second part"):
        cpu.split.run(layers, x, Step(torch.arange(3), masked=True, n_read=3))
    second.block = block
    got = cpu.split.run(layers, x, Step(torch.arange(3), masked=True, n_read=3))
    want = cpu.run_whole(x, Step(torch.arange(3), masked=True, n_read=3))
    assert ((got - want).norm() / want.norm()).item() < 2e-4


@pytest.mark.skipif(torch.cuda.is_available(), reason="compiled there: test_gpu.py runs it on two GPUs")
def test_the_exchange_kernel_adds_partials_in_gpu_order_under_the_interpreter():
    """`kernels.exchange` under TRITON_INTERPRET=1 with both ranks on the CPU, one after the other
    (the interpreter runs one kernel at a time): rank 1's part of each meeting is put in rank 0's inbox
    and flags as rank 1's kernel would, then rank 0's kernel runs (storing its part into rank 1's inbox
    and raising rank 1's flags), then rank 1's, which finds them. Meetings of several sizes in a row
    (the inboxes alternate) give partial 0 + partial 1 bit for bit on both ranks; a sum larger than
    the inboxes is a clear error."""
    from llmx.errors import LlmxError
    from llmx.kernels.exchange import Exchange

    cpu = torch.device("cpu")
    exchange = Exchange([cpu, cpu], 3000)
    for count, n in enumerate((1000, 2500, 7, 2500, 1000), start=1):
        partials = [torch.randn(n), torch.randn(n)]
        slot = count % 2
        exchange.inbox[0][slot, 1, :n] = partials[1]  # what rank 1 sends rank 0
        exchange.flags[0][slot, 1] = count
        sums = [exchange.all_reduce(partials[r], r) for r in range(2)]
        want = partials[0] + partials[1]
        assert torch.equal(sums[0], want) and torch.equal(sums[1], want), n
        assert (exchange.flags[1][slot, 0] == count).all()  # rank 0 raised rank 1's flags
    with pytest.raises(LlmxError, match="a partial sum of 3001 values exceeds the 3000"):
        exchange.all_reduce(torch.randn(3001), 0)

"""The GGUF reader against gguf-py's reader, and its zero-copy promise."""

from __future__ import annotations

import os

import gguf
import numpy as np
import psutil
import pytest

from llmx.errors import LlmxError
from llmx.gguf import open_gguf
from tests.conftest import craft_gguf


def test_matches_gguf_py_on_smollm2(smollm2_path):
    ours, theirs = open_gguf(smollm2_path), gguf.GGUFReader(smollm2_path)
    assert len(ours.tensors) == len(theirs.tensors) == 272
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert mine.qtype.ggml_id == int(t.tensor_type)
        assert mine.shape == tuple(int(d) for d in reversed(t.shape))
        assert mine.offset == t.data_offset
        assert np.array_equal(mine.data, np.asarray(t.data).reshape(-1).view(np.uint8))
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        assert (
            ours.metadata[key] == pytest.approx(value)
            if isinstance(value, float)
            else ours.metadata[key] == value
        )


def test_tensors_are_views_of_one_mmap(smollm2_path):
    proc = psutil.Process(os.getpid())
    rss_before = proc.memory_info().rss
    mf = open_gguf(smollm2_path)
    rss_added = proc.memory_info().rss - rss_before
    assert mf.mapped
    for info in mf.tensors.values():
        assert np.shares_memory(info.data, mf.buffer)
        assert not info.data.flags.writeable
    # Opening reads the header, not the 98 MB of weights.
    assert rss_added < 0.1 * mf.nbytes, f"opening added {rss_added / 2**20:.1f} MiB of resident memory"


def test_no_mmap_reads_the_same_bytes(smollm2_path):
    mapped, read = open_gguf(smollm2_path), open_gguf(smollm2_path, mmap=False)
    assert not read.mapped
    name = "blk.3.ffn_down.weight"
    assert np.array_equal(mapped.tensors[name].data, read.tensors[name].data)


@pytest.mark.parametrize("alignment", [32, 64])
def test_metadata_types_and_alignment(tmp_path, alignment):
    meta = {
        "general.architecture": "llama",
        "a.int": -7,
        "a.float": 0.5,
        "a.bool": True,
        "a.str": "héllo",
        "a.strs": ["x", "yz"],
        "a.floats": [1.0, 2.5],
    }
    arrays = {"t0": np.arange(6, dtype=np.float32).reshape(2, 3), "t1": np.ones(5, np.float32)}
    mf = open_gguf(craft_gguf(tmp_path / "m.gguf", meta, arrays, alignment=alignment))
    for key, value in meta.items():
        assert mf.metadata[key] == value
    assert mf.alignment == alignment and mf.data_offset % alignment == 0
    for name, arr in arrays.items():
        info = mf.tensors[name]
        assert info.shape == arr.shape and info.offset % alignment == 0
        assert np.array_equal(info.data.view(np.float32).reshape(arr.shape), arr)


def test_a_cut_inside_a_string_array_is_a_clear_error(tmp_path):
    key, words = "tokenizer.ggml.tokens", ["a", "bc", "déf"]
    whole = craft_gguf(tmp_path / "m.gguf", {"general.architecture": "llama", key: words}, {}).read_bytes()
    start = whole.index(key.encode()) + len(key) + 4 + 4 + 8  # value type, element type, count
    end = start + sum(8 + len(w.encode()) for w in words)
    for cut in range(start, end):  # inside every length and every string
        path = tmp_path / "cut.gguf"
        path.write_bytes(whole[:cut])
        with pytest.raises(LlmxError, match="truncated GGUF header"):
            open_gguf(path)

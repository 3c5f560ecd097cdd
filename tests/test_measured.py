"""Answers measured once and kept for later processes (`llmx.measured`)."""

from __future__ import annotations

import json

from llmx.measured import best_seconds, remember, remembered


def test_answers_are_kept_beside_other_processes_answers(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMX_CACHE_DIR", str(tmp_path / "cache"))
    assert remembered("memo.json") == {}  # no folder yet
    remember("memo.json", "a", 1)
    (tmp_path / "cache" / "memo.json").write_text(json.dumps({"a": 1, "b": 2}))  # another process's
    remember("memo.json", "c", 3)
    assert remembered("memo.json") == {"a": 1, "b": 2, "c": 3}
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["memo.json"]


def test_a_damaged_memo_only_costs_measuring_again(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMX_CACHE_DIR", str(tmp_path))
    for damaged in ('{"a": 1', "[1, 2]"):
        (tmp_path / "memo.json").write_text(damaged)
        assert remembered("memo.json") == {}
    remember("memo.json", "a", 1)
    assert remembered("memo.json") == {"a": 1}


def test_the_quickest_of_the_timed_calls_after_an_untimed_one():
    calls, syncs = [], []
    best = best_seconds(lambda: calls.append(1), 3, lambda: syncs.append(1))
    assert len(calls) == len(syncs) == 4 and 0 <= best < 1

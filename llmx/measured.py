"""Measuring on this machine and keeping the answer for later processes: the quickest of a few timed
runs, and small JSON files of answers by key in the cache folder (`settings.cache_dir()`).

A kept file is only a memo: an absent or damaged one costs measuring again, never an error.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from llmx.cpu_info import read_or_empty
from llmx.settings import cache_dir


def best_seconds(fn: Callable[[], object], reps: int, sync: Callable[[], None] = lambda: None) -> float:
    """The quickest of `reps` timed calls of `fn`, each followed by `sync`, after one untimed call: a
    first call pays for cold caches, lazy loading and first-touch page faults, and any one call for
    whatever else the machine does meanwhile."""
    fn()
    sync()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def remembered(name: str) -> dict[str, Any]:
    """The answers kept in the cache folder's file `name`; {} where there is none or it is damaged."""
    try:
        found = json.loads(read_or_empty(str(cache_dir() / name)) or "{}")
    except json.JSONDecodeError:
        return {}
    return found if isinstance(found, dict) else {}


def remember(name: str, key: str, value: Any) -> None:
    """Keep `key: value` in the cache folder's file `name`, beside the answers other processes kept
    there; the file is replaced whole (written under this process's own name first), so a reader
    never meets half of it."""
    path = cache_dir() / name
    path.parent.mkdir(parents=True, exist_ok=True)
    answers = remembered(name) | {key: value}
    written = path.with_name(f"{path.name}.{os.getpid()}")
    written.write_text(json.dumps(answers, indent=1, sort_keys=True))
    written.replace(path)

"""The C heap's settings for CPU prompt steps (`runtime.host_heap`), checked through glibc's own counters
in a fresh process (a long-lived one's heap may hold free blocks of any size)."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest

from llmx.runtime import host_heap

PROBE = """
import ctypes, ctypes.util, json, sys
from llmx.runtime import host_heap

class Mallinfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
if not hasattr(libc, "mallinfo2"):
    print(json.dumps(None)); sys.exit()
libc.mallinfo2.restype = Mallinfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
kept = host_heap.keep_freed_blocks() if sys.argv[1] == "kept" else None
mapped = {}
for size in (8 << 20, host_heap.TRIM_THRESHOLD + host_heap.TOP_PAD + host_heap.MMAP_THRESHOLD):
    before = libc.mallinfo2().hblkhd
    block = libc.malloc(size)
    mapped[size] = libc.mallinfo2().hblkhd - before >= size
    libc.free(block)
print(json.dumps({"kept": kept, "mapped": list(mapped.values())}))
"""


def probe(how: str) -> dict | None:
    out = subprocess.run([sys.executable, "-c", PROBE, how], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_prompt_sized_blocks_come_from_the_heap_and_larger_ones_get_mappings() -> None:
    default, kept = probe("default"), probe("kept")
    if kept is None:
        pytest.skip("not glibc 2.33 or later")
    assert default["mapped"] == [True, True]  # glibc's own: 8 MB gets a mapping of its own
    # past what the heap's top may hold free (TRIM_THRESHOLD, TOP_PAD), a block still needs a mapping
    assert kept == {"kept": True, "mapped": [False, True]}


def test_without_glibcs_mallopt_the_heap_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoMallopt:  # a C library without the symbol (musl, macOS)
        def __init__(self, name: str | None) -> None: ...

    monkeypatch.setattr(ctypes, "CDLL", NoMallopt)
    assert not host_heap.keep_freed_blocks()

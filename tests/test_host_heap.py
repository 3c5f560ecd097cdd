"""The C heap's settings for CPU prompt steps (`runtime.host_heap`), checked through glibc's own counters."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest

from llmx.runtime import host_heap


class Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks")
        + ("fordblks", "keepcost")
    ]


def mapped_bytes(libc: ctypes.CDLL) -> int:
    """Bytes malloc holds in mappings of their own (mallinfo2's hblkhd)."""
    libc.mallinfo2.restype = Mallinfo2
    return libc.mallinfo2().hblkhd


def test_prompt_sized_blocks_come_from_the_heap_and_larger_ones_get_mappings() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("not glibc 2.33 or later")
    assert host_heap.keep_freed_blocks()
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    # past what the heap's top may hold free (TRIM_THRESHOLD, TOP_PAD), a block needs a mapping of its own
    larger = host_heap.TRIM_THRESHOLD + host_heap.TOP_PAD + host_heap.MMAP_THRESHOLD
    for size, mapped in ((8 << 20, False), (larger, True)):
        before = mapped_bytes(libc)
        block = libc.malloc(size)
        assert block and (mapped_bytes(libc) - before >= size) == mapped
        libc.free(block)


def test_without_glibcs_mallopt_the_heap_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    class NoMallopt:  # a C library without the symbol (musl, macOS)
        def __init__(self, name: str | None) -> None: ...

    monkeypatch.setattr(ctypes, "CDLL", NoMallopt)
    assert not host_heap.keep_freed_blocks()

"""How the process's C heap treats the megabyte-sized blocks that CPU prompt steps allocate and free.

A prompt step on the CPU makes and drops activations of megabytes op after op (a 512-token chunk's FFN
rows: 4 MB a tensor for Gemma 3 270M, 29 MB for Llama-3-8B). By default glibc's malloc gives blocks that
large mappings of their own, unmapped when freed, or trims the heap's top back to the kernel, so each step
faults fresh pages in and has the kernel zero them again. Kept in the heap instead (blocks up to
MMAP_THRESHOLD from it, the top trimmed only past TRIM_THRESHOLD, grown TOP_PAD at a time), the 2-core
Xeon's pp512 (`llmx bench -p 512 -n 0 -r 5 -t 2`, three alternating rounds): Gemma 3 270M 657-715 -> 722-740
t/s, SmolLM2 798-848 -> 852-928; peak RSS level (717 / 707 MB) and decode unchanged. Larger blocks (a CPU
KV cache) still get mappings of their own, returned to the system when freed.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# glibc's mallopt parameters (malloc.h) and the values set
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 256 << 20
TOP_PAD = 64 << 20


def keep_freed_blocks() -> bool:
    """Set the process's malloc to keep prompt-sized blocks in its heap (the module docstring). Returns
    whether it took every setting: False with a C library that has no glibc `mallopt` (it is then left
    as it was). Process-wide, and the same every call."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    settings = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD), (M_TRIM_THRESHOLD, TRIM_THRESHOLD), (M_TOP_PAD, TOP_PAD))
    return all([mallopt(param, value) == 1 for param, value in settings])

"""Giving freed host memory back to the operating system after each optimizer step (CPU runs).

glibc's malloc keeps the heap pages of freed tensors for reuse. A micro-batch's activations are freed at the
end of its backward, but the next micro-batch's (slightly differently shaped) tensors often do not fit the
holes exactly, so the heap grows and peak RSS creeps above what the tensors need. `malloc_trim(0)` returns
the free pages at once. The RL loop calls it once per optimizer step: after every micro-batch it lowers the
peak more but the pages then fault back in, ~11 % of the update (docs/benchmarks.md). It is called only when the model lives on the CPU, and is a no-op where the C library
has no malloc_trim (musl, macOS, Windows).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc.malloc_trim if libc is not None and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def release_freed_memory(device) -> bool:
    """malloc_trim(0) when `device` is the CPU and the C library has it; True when it ran."""
    trim = _malloc_trim()
    if trim is None or getattr(device, "type", str(device)) != "cpu":
        return False
    trim(0)
    return True

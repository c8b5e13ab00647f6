"""Giving freed host memory back to the operating system after each optimizer step (CPU runs).

glibc's malloc keeps the heap pages of freed tensors for reuse. A micro-batch's activations are freed at the
end of its backward, but the next micro-batch's (slightly differently shaped) tensors often do not fit the
holes exactly, so the heap grows and peak RSS creeps above what the tensors need. `malloc_trim(0)` returns
the free pages at once. The RL loop calls it once per optimizer step: after every micro-batch it lowers the
peak more but the pages then fault back in, ~11 % of the update (docs/benchmarks.md).

A trim is not free either: it walks the heap (docs/benchmarks.md), and the returned pages fault back in on the
next step. So it runs only when the heap holds at least `MIN_FREE_BYTES` free (glibc's `mallinfo2`, cheap to ask),
where it pays off in peak memory;
without `mallinfo2` (glibc < 2.33) it always runs. It runs only when the model lives on the CPU, and is a
no-op where the C library has no malloc_trim (musl, macOS, Windows).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Callable, Optional

MIN_FREE_BYTES = 256 * 2**20


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2 (malloc.h), every field a size_t
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


@functools.lru_cache(maxsize=1)
def _libc():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    libc = _libc()
    return libc.malloc_trim if libc is not None and hasattr(libc, "malloc_trim") else None


@functools.lru_cache(maxsize=1)
def _mallinfo2() -> Optional[Callable[[], _MallInfo2]]:
    libc = _libc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    fn = libc.mallinfo2
    fn.restype = _MallInfo2
    return fn


def free_heap_bytes() -> Optional[int]:
    """Bytes malloc holds free in its heap (mallinfo2's fordblks), or None where glibc cannot tell."""
    info = _mallinfo2()
    return None if info is None else int(info().fordblks)


def release_freed_memory(device, min_free_bytes: int = MIN_FREE_BYTES) -> bool:
    """malloc_trim(0) when `device` is the CPU, the C library has it, and its heap holds at least
    `min_free_bytes` free (or it cannot tell); True when it ran."""
    trim = _malloc_trim()
    if trim is None or getattr(device, "type", str(device)) != "cpu":
        return False
    free = free_heap_bytes()
    if free is not None and free < min_free_bytes:
        return False
    trim(0)
    return True

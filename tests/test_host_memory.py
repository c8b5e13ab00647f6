"""malloc_trim after an optimizer step: runs on CPU with glibc, never for other devices, only when the heap
holds enough free memory to be worth it, and gives pages back."""

from __future__ import annotations

import pytest
import torch

from tidyrl.models.host_memory import _malloc_trim, free_heap_bytes, release_freed_memory


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.skipif(_malloc_trim() is None, reason="this C library has no malloc_trim")
def test_trim_runs_on_cpu_only_and_returns_freed_heap_pages():
    assert release_freed_memory(torch.device("meta")) is False
    assert release_freed_memory("cuda") is False
    # Many small tensors live on the heap (below the mmap threshold); freeing all but every 64th leaves the heap
    # pages pinned by the survivors' neighbours until a trim returns the free ones.
    blocks = [torch.ones(4096) for _ in range(20000)]  # 16 KiB each, ~320 MiB
    keep = blocks[::64]
    del blocks
    before = rss_kib()
    assert release_freed_memory(torch.device("cpu"), min_free_bytes=0) is True
    after = rss_kib()
    assert before - after > 100 * 1024, (before, after)  # more than 100 MiB given back
    del keep


@pytest.mark.skipif(free_heap_bytes() is None, reason="this C library has no mallinfo2")
def test_trim_is_skipped_while_too_little_is_free():
    blocks = [torch.ones(4096) for _ in range(20000)]
    keep = blocks[::64]
    del blocks
    free = free_heap_bytes()
    assert free > 250 * 2**20  # ~310 MiB of freed blocks held by malloc
    before = rss_kib()
    assert release_freed_memory("cpu", min_free_bytes=free + 2**30) is False  # not worth it: not run
    assert rss_kib() > before - 10 * 1024  # nothing given back
    assert release_freed_memory("cpu", min_free_bytes=free // 2) is True
    assert rss_kib() < before - 100 * 1024
    del keep

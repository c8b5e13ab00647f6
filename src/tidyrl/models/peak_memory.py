"""How much memory a piece of work reached, and whether an error is the allocator's out-of-memory error: what the
worst-case probe (`loops.rl.probe`) measures and an out-of-memory error's message (`loops.run.out_of_memory`)
reports.

- On a CUDA device: the caching allocator's peak of allocated bytes (`torch.cuda.max_memory_allocated`), reset at
  the start of the measured work: the figure the memory plan predicts (tensors on the device, the process's own).
- On the host (Linux): the process's peak resident set (VmHWM of /proc/self/status), reset at the start through
  /proc/self/clear_refs after malloc_trim gave the heap's free pages back; beside it the resident set at the start,
  so that the work's own share (the peak above it) can be set against the plan's parts beyond the resident ones
  (as benchmarks/bench_memory_plan.py does). Tensors of a few MiB are lost in the runtime's own pages (a kernel's
  first call, the allocator's arenas): the host's figures mean something for real models, not tiny ones.
  Elsewhere nothing is measured (None).

An out-of-memory error is `torch.OutOfMemoryError` (CUDA's caching allocator, and torch's CPU allocator where it
raises that type), or the RuntimeError that torch's default CPU allocator raises when the C library refuses an
allocation ("DefaultCPUAllocator: can't allocate memory": under a memory limit such as `ulimit -v`, a cgroup
without swap refusing it, or a size beyond the machine). A host whose kernel kills the process instead (Linux's OOM
killer) leaves nothing to catch: the fault watch names the process that died (`loops.run.faults`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch

CPU_REFUSAL = "DefaultCPUAllocator: can't allocate memory"
"""The words of torch's CPU allocator when the C library refuses an allocation (c10/core/impl/alloc_cpu.cpp)."""


def is_out_of_memory(err: BaseException) -> bool:
    """Whether `err` is an allocator's out-of-memory error (see the module's docstring)."""
    if isinstance(err, torch.OutOfMemoryError):
        return True
    return type(err) is RuntimeError and CPU_REFUSAL in str(err)


@dataclass
class Peak:
    """What a piece of work reached: `peak` bytes at most, `start` bytes at its start, on `device` ("cuda", "cpu");
    `what`: how the figures are read, in words."""

    peak: int
    start: int
    device: str
    what: str

    @property
    def above_start(self) -> int:
        return max(self.peak - self.start, 0)


def _status(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
    except (OSError, StopIteration):
        return None


def _reset_host_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM starts again from the current resident set
        return True
    except OSError:
        return False


def reset(device: torch.device) -> Optional[int]:
    """Start measuring a peak on `device`: returns the bytes held now (None where nothing is measured)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    from tidyrl.models.host_memory import release_freed_memory

    release_freed_memory(device, 0)  # the heap's free pages back first: the work's own pages then count
    return _status("VmRSS:") if _reset_host_peak() else None


def read(device: torch.device, start: Optional[int]) -> Optional[Peak]:
    """The peak since `reset` (which returned `start`), or None where nothing is measured."""
    if start is None:
        return None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return Peak(torch.cuda.max_memory_allocated(device), start, "cuda", "CUDA memory allocated by torch")
    peak = _status("VmHWM:")
    return None if peak is None else Peak(peak, start, "cpu", "the process's resident memory (VmHWM)")


@contextlib.contextmanager
def measured(device: torch.device) -> Iterator[list]:
    """`with measured(device) as got:` ... then `got[0]` is the block's `Peak` (or None where nothing is
    measured), also when the block raised."""
    got: list = []
    start = reset(device)
    try:
        yield got
    finally:
        got.append(read(device, start))


def held_now(device: torch.device) -> Optional[Peak]:
    """The peak so far and the bytes held now, without a reset: an out-of-memory error's figures (on CUDA the peak
    since the process started or the last `reset`; on the host the process's peak resident set)."""
    if device.type == "cuda":
        return Peak(torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device), "cuda",
                    "CUDA memory allocated by torch")
    peak, now = _status("VmHWM:"), _status("VmRSS:")
    return None if peak is None or now is None else Peak(peak, now, "cpu", "the process's resident memory")

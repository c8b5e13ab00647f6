"""Host tensors onto the accelerator without waiting for it.

A blocking host-to-device copy (`tensor.to("cuda")`) synchronises: the host waits until the GPU has run all the
work queued before it, and the GPU then waits for the host to launch the next kernels. In a loop over
micro-batches or scoring chunks that is one stall per copy (several per micro-batch). From page-locked (pinned)
memory the copy is queued like a kernel (`non_blocking=True`) and the host keeps running ahead; torch's caching
host allocator keeps the pinned buffer alive until the copy has run. The way back (`.cpu()`, `.item()`) always
waits: the loops do it once per phase, never per micro-batch (tests/test_cuda.py runs them with
`torch.cuda.set_sync_debug_mode("error")`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch  # imported where used: the memory plan reads WIDTH_MULTIPLE without torch


def to_device(tensor: Optional[torch.Tensor], device: torch.device | str) -> Optional[torch.Tensor]:
    """`tensor` on `device`: from host memory to a CUDA device through pinned memory without a synchronisation,
    otherwise as `tensor.to(device)` (a no-op where it already is). None stays None."""
    import torch

    if tensor is None:
        return None
    device = torch.device(device)
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def phase_done(device: torch.device | str) -> None:
    """Before a phase's clock stops: on a CUDA device, wait for the kernels the phase queued (the optimizer step's,
    say), so that a phase's time is its own and not billed to the next one. One wait per phase, never inside a
    loop; nothing to wait for elsewhere."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Devices where the rows [prompt, completion] of a forward are left-padded up to a multiple of this many columns.
# On CUDA a shape seen for the first time costs far more than the same shape again (cuDNN's attention plans,
# cuBLAS's heuristics, new allocator blocks; docs/benchmarking.md measures it), and a rollout's chunks have as many
# widths as their longest prompts and completions. Padding the width to a multiple of 16 makes shapes recur, for at most
# 15 masked columns a row (the positions and every real column's maths unchanged). Elsewhere rows keep their width.
# (Generation's fixed-shape cache is rounded up the same way: SDPA's memory-efficient kernel wants its bias aligned.)
WIDTH_MULTIPLE: dict[str, int] = {"cuda": 16}


def width_padding(width: int, device) -> int:
    """The columns that pad `width` up to WIDTH_MULTIPLE's multiple on `device` (0 where it has none)."""
    import torch

    return -width % WIDTH_MULTIPLE.get(torch.device(device).type, 1)


def cuda_in_use() -> bool:
    """Whether this run's processes will take CUDA devices: a GPU is there and accelerate is not told to use the
    CPU (ACCELERATE_USE_CPU). Known before the accelerator exists, for checks that must come first."""
    import os

    import torch

    return torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true", "yes")

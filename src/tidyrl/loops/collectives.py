"""The small collectives of the training loops: a per-process number or small tensor reduced over processes, and
nothing at all on one process. A module of its own so that every loop part (loops/training.py, loops/exact_sums.py,
which training imports) takes them from one place."""

from __future__ import annotations


def reduce_sum(accelerator, tensor):
    """Sum a small per-process tensor over processes (on one process: the tensor itself)."""
    if accelerator.num_processes == 1:
        return tensor
    return accelerator.reduce(tensor.to(accelerator.device), reduction="sum").cpu()


def reduce_max(accelerator, value: float) -> float:
    """The largest of a per-process number over processes (metrics, and the exact sums' gradient bound)."""
    if accelerator.num_processes == 1:
        return value
    import torch

    return float(accelerator.reduce(torch.tensor([value], device=accelerator.device), reduction="max").cpu())


def agree(accelerator, flag: bool) -> bool:
    """True in every process if it is true in any (so that all stop at the same step)."""
    if accelerator.num_processes == 1:
        return flag
    import torch

    return bool(reduce_sum(accelerator, torch.tensor([float(flag)])).item() > 0)

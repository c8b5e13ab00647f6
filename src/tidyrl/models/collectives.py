"""The small collectives of a run: a per-process number or small tensor reduced or gathered over processes (and
nothing at all on one process), and a step's metric sums reduced in one all-reduce. Below the learners and the
rollouts, which both use them: each is handed the accelerator, never a learner."""

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


def reduce_min(accelerator, value: int) -> int:
    """The smallest of a per-process integer over processes, exactly (int64; e.g. the memory each process has)."""
    if accelerator.num_processes == 1:
        return value
    import torch

    negated = torch.tensor([-value], dtype=torch.int64, device=accelerator.device)
    return -int(accelerator.reduce(negated, reduction="max").cpu().item())


def agree(accelerator, flag: bool) -> bool:
    """True in every process if it is true in any (so that all stop at the same step)."""
    if accelerator.num_processes == 1:
        return flag
    import torch

    return bool(reduce_sum(accelerator, torch.tensor([float(flag)])).item() > 0)


def gather_cat(accelerator, tensor):
    """A per-process tensor concatenated over processes, in rank order (the global episode order), on the host
    (on one process: the tensor itself)."""
    if accelerator.num_processes == 1:
        return tensor
    return accelerator.gather(tensor.to(accelerator.device)).cpu()


class Sums:
    """A step's metric sums by name: `add(loss=..., correct=...)` per micro-batch, `reduced(accelerator)` once
    per step (one all-reduce of every name). The names are fixed up front, so every process reduces the same
    vector even when it saw no example of some kind."""

    def __init__(self, *names: str):
        import torch

        self.names = tuple(names)
        self._index = {name: i for i, name in enumerate(self.names)}
        self._values = torch.zeros(len(self.names), dtype=torch.float64)

    def add(self, **values) -> None:
        """Tensors on an accelerator are added where they are (no host synchronisation per micro-batch, only in
        `reduced`); the sums move there with the first such tensor and stay. Numbers and host tensors are read
        as numbers: copying a host value to the device, or the sums back, would wait for the device each time.
        Sums are float64 either way. The one move of the sums to the device goes through pinned memory
        (`tidyrl.models.devices.to_device`): queued like a kernel, never a wait for the device."""
        for name, value in values.items():
            if hasattr(value, "device") and value.device.type != "cpu":
                if self._values.device != value.device:
                    from tidyrl.models.devices import to_device

                    self._values = to_device(self._values, value.device)
                self._values[self._index[name]] += value.detach().to(self._values.dtype)
            else:
                self._values[self._index[name]] += float(value)

    def reduced(self, accelerator) -> dict[str, float]:
        """The sums over every process, by name (the one host synchronisation of a step's metrics)."""
        total = reduce_sum(accelerator, self._values).cpu().tolist()
        return dict(zip(self.names, total))

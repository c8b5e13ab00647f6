"""Gradient sums that do not depend on how the work is split (`train.exact_gradients: true`).

Floating-point addition is not associative: one process adds its micro-batches' gradients one after the other,
W processes each add their share and then all-reduce, so the same micro-batch gradients sum to different last
bits, the weights drift apart and, once a sampled token flips, the runs part. Here each micro-batch's gradient is
rounded onto a fixed-point grid and the grid points are summed as 64-bit integers, which is exact and
associative: the sum is the same in any order, on any number of processes (an integer all-reduce). The grid is
absolute, 2^-40 (~9.1e-13), the same for every micro-batch whatever its values or the split, so the same
micro-batch gradient always rounds to the same integers; a gradient element must stay below 2^11 = 2048 per
micro-batch, so that a sum of up to 2^12 micro-batches fits int64 (2^11 * 2^40 * 2^12 = 2^63; a gradient that
large means a diverged run: it is refused). The cost: one int64 copy of the trained parameters (2x their float32
size; under FSDP2 of each shard) and a rounding per micro-batch. What else makes the per-micro-batch gradients the same on any split is the learner's:
the micro-batches are formed from the whole mini-batch first and then shared out (`global_micro_batches`), so each
is computed from the same episodes in the same order, and every forward of the policy, the KL reference and a
teacher, and the built-in engine's decode, is the model's own on any number of processes (`models.forward.
exact_forward`: the fast paths of `models.forward` take other code paths inside DDP and are not taken under FSDP2,
and they round differently). Under FSDP2 the integer sum happens inside FSDP2's reduce-scatter
(`ShardedExactGradients`), and clipping reads a norm summed exactly from any split (`exact_grad_norm`). The no-grad scoring holds the same episodes per chunk on any split where
rollout.forward_batch_size divides each process's share of the rollout. The offline loop (loops/offline/loop.py: sft,
reward, dpo, kto) uses the same two parts: its micro-batches cut from the whole batch (`micro_batches`), and
each micro-batch's loss reading only global quantities that every process computes alike (the global batch's
normalisers, reference log-probs cached in chunks cut by index, KTO's z0 summed in one order). On a CPU, a kernel may split its sums by
thread: the same threads per process make the same kernels (measured: 2 threads against 1 moved the last bits).

Among the known ways (Demmel & Nguyen's pre-rounded reproducible summation, ReproBLAS; a canonical summation
tree over micro-batch indices) the fixed-point sum is the simplest that is exact rather than reproducible only,
and the one an all-reduce of integers does without a custom reduction.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from tidyrl.models.collectives import reduce_max

GRID_EXPONENT = 40
"""Each micro-batch gradient is rounded to a multiple of 2^-GRID_EXPONENT."""
LIMIT = 2.0 ** 11
"""The largest |gradient| per element of one micro-batch the grid takes."""
MAX_MICRO_BATCHES = 2 ** 12
"""The most micro-batches (over all processes) one sum may take: LIMIT * 2^GRID_EXPONENT * this = 2^63."""


def global_micro_batches(episodes: Sequence[int], micro_batch_size: int, rank: int, world: int) -> list[list[int]]:
    """This process's micro-batches of a global mini-batch: `episodes` (in the order the learner runs them) cut into
    micro-batches of `micro_batch_size` first, then shared out contiguously, len/W each. So a micro-batch holds the
    same episodes on any number of processes."""
    parts = [list(episodes[i: i + micro_batch_size]) for i in range(0, len(episodes), micro_batch_size)]
    per = len(parts) // world
    return parts[rank * per: (rank + 1) * per]


def to_grid(gradient: torch.Tensor) -> torch.Tensor:
    """A gradient rounded onto the grid, as int64 multiples of 2^-GRID_EXPONENT (round half to even)."""
    g = gradient.detach().double()
    return torch.round(torch.ldexp(g, torch.tensor(GRID_EXPONENT, device=g.device))).to(torch.int64)


def from_grid(total: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The float gradient an integer sum of grid points stands for."""
    return torch.ldexp(total.double(), torch.tensor(-GRID_EXPONENT, device=total.device)).to(dtype)


class _Peak:
    """The largest |gradient element| seen, kept where the gradients are (no host read per micro-batch)."""

    def __init__(self):
        self.peak = None

    def add(self, gradient: torch.Tensor) -> None:
        if gradient.numel():
            top = gradient.detach().abs().max().double()
            self.peak = top if self.peak is None else torch.maximum(self.peak, top)

    def value(self) -> float:
        return 0.0 if self.peak is None else float(self.peak)


def _check_peak(peak: float, accelerator) -> None:
    """Refuse, on every process alike, a micro-batch gradient past LIMIT (a NaN included): the largest over
    processes decides, so no process stops alone and leaves the others waiting in a collective."""
    peak = reduce_max(accelerator, peak)
    if not peak < LIMIT:
        raise FloatingPointError(
            f"train.exact_gradients: a micro-batch gradient reached {peak:.3g} (the exact sum takes |g| < "
            f"{LIMIT:g}): the run diverged; lower train.learning_rate or check the rewards")


def exact_accumulator(models: Sequence[torch.nn.Module]):
    """The exact sum for the trained `models` (a policy, and PPO's critic): `ShardedExactGradients` where they
    are FSDP2-sharded, else `ExactGradients`. Either is used the same way: for each micro-batch, backward under
    `micro_batch_sync(last)` (the synchronisation it needs), then `add()`; after the last, `reduce(accelerator)`
    leaves the exact sums as the parameters' gradients."""
    from tidyrl.models.sharding import is_root_sharded

    if any(is_root_sharded(m) for m in models):
        return ShardedExactGradients(models)
    return ExactGradients(p for m in models for p in m.parameters())


class ExactGradients:
    """Accumulates micro-batch gradients exactly (see the module docstring): `add()` after each micro-batch's
    backward (run without synchronisation) takes the parameters' gradients onto the grid and clears them;
    `reduce(accelerator)` sums over the processes and writes the total back as the parameters' gradients."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter]):
        self.parameters = [p for p in parameters if p.requires_grad]
        self.sums = [torch.zeros(p.shape, dtype=torch.int64, device=p.device) for p in self.parameters]
        self.peak = _Peak()

    def micro_batch_sync(self, last: bool) -> bool:
        """Whether the next backward synchronises over processes: never, the integer all-reduce does it."""
        return False

    def add(self) -> None:
        for p, total in zip(self.parameters, self.sums):
            if p.grad is None or not p.grad.numel():
                continue
            g = p.grad.detach()
            self.peak.add(g)
            total += to_grid(g)
            p.grad = None

    def reduce(self, accelerator) -> None:
        _check_peak(self.peak.value(), accelerator)  # (one host read per step)
        if accelerator.num_processes > 1:
            import torch.distributed as dist

            for total in self.sums:
                dist.all_reduce(total, op=dist.ReduceOp.SUM)
        for p, total in zip(self.parameters, self.sums):
            p.grad = from_grid(total, p.dtype)


class ShardedExactGradients:
    """The exact sum under FSDP2, whose backward reduce-scatters each layer's gradient as soon as it is computed:
    that reduce-scatter is replaced (FSDP2's `set_custom_reduce_scatter`) by one that takes this process's
    micro-batch gradient onto the grid, reduce-scatters the integers (each process receives the exact sum over
    processes of its shard) and adds them to an int64 sum of the shard kept here; FSDP2 receives zeros, and on
    the last micro-batch the whole sum, which it adds to the zeros it holds (exact) and lays out as the sharded
    gradients. Every micro-batch therefore synchronises (as sync_each_microbatch does), and the extra memory is
    an int64 copy of this process's shard, 2x the shard's float32 size. The same micro-batch gradients rounded
    onto the same grid and summed as integers: the gradients of one process, bit for bit."""

    def __init__(self, models: Sequence[torch.nn.Module]):
        from torch.distributed.fsdp import FSDPModule

        self.comms = []
        for model in models:
            for module in model.modules():
                if isinstance(module, FSDPModule):
                    comm = _exact_reduce_scatter()
                    module.set_custom_reduce_scatter(comm)
                    module.set_gradient_divide_factor(1.0)  # a sum (rl_update: the loss is this process's share)
                    module.set_force_sum_reduction_for_comms(True)
                    self.comms.append(comm)

    def micro_batch_sync(self, last: bool) -> bool:
        for comm in self.comms:
            comm.emit = last
        return True

    def add(self) -> None:
        """(the reduce-scatter of the backward took the micro-batch's gradient onto the grid)"""

    def reduce(self, accelerator) -> None:
        _check_peak(max((c.peak.value() for c in self.comms), default=0.0), accelerator)


def _exact_reduce_scatter():
    """FSDP2's reduce-scatter of one shard group, on the grid (`ShardedExactGradients`). (The class is made on
    first use: its bases are FSDP2's, imported only under FSDP2.)"""
    global _ExactReduceScatter
    if _ExactReduceScatter is None:
        import torch.distributed as dist
        from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

        # (torch 2.13 renamed reduce_scatter_tensor, which it deprecates)
        reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllocMixin

        class ExactReduceScatter(DefaultAllocMixin, ReduceScatter):
            def __init__(self):
                self.total = None
                self.emit = False
                self.peak = _Peak()

            def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
                self.peak.add(input_tensor)
                shard = torch.empty(output_tensor.shape, dtype=torch.int64, device=output_tensor.device)
                reduce_scatter(shard, to_grid(input_tensor), op=dist.ReduceOp.SUM, group=group)
                self.total = shard if self.total is None else self.total.add_(shard)
                if self.emit:  # the whole sum, added by FSDP2 to the zeros the earlier micro-batches left
                    output_tensor.copy_(from_grid(self.total, output_tensor.dtype))
                    self.total = None
                else:
                    output_tensor.zero_()
                return None

        _ExactReduceScatter = ExactReduceScatter
    return _ExactReduceScatter()


_ExactReduceScatter = None


NORM_BITS = 52
"""Each squared gradient element is rounded to an integer below 2^NORM_BITS (`exact_grad_norm`)."""
_SPLIT = 26


def exact_grad_norm(grads: Sequence[torch.Tensor], sharded: bool = False) -> float:
    """The 2-norm of `grads`, the same bit for bit however the elements are split over tensors, shards and
    processes (`sharded`: each process holds shards, the sums are all-reduced). Each square g^2 (exact in float64
    for a float32 g) is scaled by 2^(NORM_BITS - 2e), where 2^e bounds the largest |g| over every process, and
    rounded to an integer r < 2^NORM_BITS; the r are summed as integers in two halves (r >> 26 and the low 26
    bits, so up to 2^37 elements sum without overflow): exact and associative. Error: at most half a unit per
    element, a relative error of n * 2^-(NORM_BITS+1) of the squared norm for n elements at worst; torch's
    float32 norm is typically within the same."""
    import math

    grads = [g for g in grads if g.numel()]  # (a shard may hold no rows of a small parameter)
    # (one host read for the peak, one for the sums: the reductions stay on the gradients' device until then)
    peak = float(torch.stack([g.detach().abs().max().double() for g in grads]).max()) if grads else 0.0
    if sharded:
        import torch.distributed as dist

        top = torch.tensor([peak], dtype=torch.float64, device=_comm_device(grads))
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        peak = float(top)
    if peak == 0.0 or not math.isfinite(peak):
        return peak
    _, e = math.frexp(peak)  # peak < 2^e
    scale = NORM_BITS - 2 * e
    halves = []
    for g in grads:
        r = torch.round(torch.ldexp(g.detach().double().square(), torch.tensor(scale, device=g.device))).long()
        halves.append(torch.stack([(r >> _SPLIT).sum(), (r & ((1 << _SPLIT) - 1)).sum()]))
    parts = torch.stack(halves).sum(0) if halves else torch.zeros(2, dtype=torch.int64, device=_comm_device(grads))
    if sharded:
        dist.all_reduce(parts, op=dist.ReduceOp.SUM)
    high, low = (int(x) for x in parts)
    return math.sqrt(math.ldexp(float((high << _SPLIT) + low), -scale))


def _comm_device(grads) -> torch.device:
    """Where the norm's collectives run: the gradients' device (NCCL reduces device tensors), the host if none."""
    return grads[0].device if grads else torch.device("cpu")


def clip_exactly(grads: Sequence[torch.Tensor], max_norm: float, sharded: bool = False) -> float:
    """`exact_grad_norm`, and the gradients scaled by max_norm / (norm + 1e-6) where that is below 1, as
    torch.nn.utils.clip_grad_norm_ scales them. Returns the norm before clipping."""
    norm = exact_grad_norm(grads, sharded)
    coefficient = max_norm / (norm + 1e-6)
    if coefficient < 1.0:
        for g in grads:
            g.mul_(torch.tensor(coefficient, dtype=g.dtype, device=g.device))
    return norm

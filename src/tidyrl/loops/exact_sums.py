"""Gradient sums that do not depend on how the work is split (`train.exact_gradients: true`).

Floating-point addition is not associative: one process adds its micro-batches' gradients one after the other,
W processes each add their share and then all-reduce, so the same micro-batch gradients sum to different last
bits, the weights drift apart and, once a sampled token flips, the runs part. Here each micro-batch's gradient is
rounded onto a fixed-point grid and the grid points are summed as 64-bit integers, which is exact and
associative: the sum is the same in any order, on any number of processes (an integer all-reduce). The grid is
absolute, 2^-40 (~9.1e-13), the same for every micro-batch whatever its values or the split, so the same
micro-batch gradient always rounds to the same integers; a gradient element must stay below 2^11 = 2048 per
micro-batch, so that a sum of up to 2^12 micro-batches fits int64 (2^11 * 2^40 * 2^12 = 2^63; a gradient that
large means a diverged run: it is refused). The cost: one int64 copy of the trained parameters (2x their float32 size) and a
rounding per micro-batch. What else makes the per-micro-batch gradients the same on any split is the learner's:
the micro-batches are formed from the whole mini-batch first and then shared out (`global_micro_batches`), so each
is computed from the same episodes in the same order, and the update's forward is the model's own on any number of
processes (the fast paths of `models.forward` take another code path for a model inside DDP than for one alone,
which rounds differently). The no-grad scoring holds the same episodes per chunk on any split where
rollout.forward_batch_size divides each process's share of the rollout. The offline loop (loops/offline.py: sft,
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


class ExactGradients:
    """Accumulates micro-batch gradients exactly (see the module docstring): `add()` after each micro-batch's
    backward takes the parameters' gradients onto the grid and clears them; `reduce(accelerator)` sums over the
    processes and writes the total back as the parameters' gradients."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter]):
        self.parameters = [p for p in parameters if p.requires_grad]
        self.sums = [torch.zeros(p.shape, dtype=torch.int64, device=p.device) for p in self.parameters]

    def add(self) -> None:
        peaks = []
        for p, total in zip(self.parameters, self.sums):
            if p.grad is None:
                continue
            g = p.grad.detach().double()
            peaks.append(g.abs().max())
            total += torch.round(torch.ldexp(g, torch.tensor(GRID_EXPONENT, device=g.device))).to(torch.int64)
            p.grad = None
        peak = float(torch.stack(peaks).max()) if peaks else 0.0  # (one host read per micro-batch)
        if not peak < LIMIT:
            raise FloatingPointError(
                f"train.exact_gradients: a micro-batch gradient reached {peak:.3g} (the exact sum takes |g| < "
                f"{LIMIT:g}): the run diverged; lower train.learning_rate or check the rewards")

    def reduce(self, accelerator) -> None:
        if accelerator.num_processes > 1:
            import torch.distributed as dist

            for total in self.sums:
                dist.all_reduce(total, op=dist.ReduceOp.SUM)
        for p, total in zip(self.parameters, self.sums):
            p.grad = torch.ldexp(total.double(), torch.tensor(-GRID_EXPONENT, device=total.device)).to(p.dtype)

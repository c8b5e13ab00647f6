"""What the worst-case probes of the RL learner (`loops.rl.probe`) and the offline stages (`loops.offline.loop`)
share: the update's company (what a later micro-batch of a step has beside it), leaving no trace (the gradients set
back to none, torch's random streams restored), each phase's figures against the memory plan's, and the run's
words on them (train.memory_probe; docs/memory.md, "the worst case first")."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, Sequence

import torch

from tidyrl import liveness
from tidyrl.memory.plan import gib
from tidyrl.models import peak_memory


class RandomStreams:
    """torch's random streams (the host's and each CUDA device's), saved and put back."""

    def __init__(self):
        self.host = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else None

    def restore(self) -> None:
        torch.set_rng_state(self.host)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


@contextlib.contextmanager
def no_trace(models: Sequence) -> Iterator[None]:
    """Around a probe: afterwards (however it ends) the gradients of `models` are none again, as before a run's first
    step, and torch's random streams are where they were."""
    streams = RandomStreams()
    try:
        yield
    finally:
        for model in models:
            if model is not None:
                model.zero_grad(set_to_none=True)
        streams.restore()
        liveness.mark("ran the worst-case probe")


@contextlib.contextmanager
def later_micro_batch(trained: Sequence[tuple], accumulates: bool, sharded: bool) -> Iterator[None]:
    """Around a probe's update micro-batch: stand-ins for what a later micro-batch of a step has beside it, for each
    (model, optimizer) of `trained` — AdamW's two moments where no step has made them yet (zeros like each trained
    parameter: a shard of it under FSDP2), and where a step accumulates (`accumulates`) and the gradients are local
    (not `sharded`: under FSDP2 the probe runs a first micro-batch instead), the earlier micro-batches' gradients."""
    held = []
    for model, optimizer in trained:
        if not optimizer.state:
            held += [torch.zeros_like(p) for p in model.parameters() if p.requires_grad for _ in range(2)]
        if accumulates and not sharded:
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
    try:
        yield
    finally:
        del held


def figures(shapes: str, peak: Optional[peak_memory.Peak], phase, moments_made_here: bool) -> dict:
    """A phase's record: its shapes, what was measured and the plan's figure it compares with (on CUDA the
    phase's total; on a host its parts beyond those resident at the phase's start: the weights, and AdamW's
    moments unless the probe made stand-ins for them)."""
    out: dict = {"shapes": shapes}
    if peak is None:
        return out
    if peak.device == "cuda":
        out.update(measured_bytes=peak.peak, measured="peak CUDA memory allocated by torch")
        if phase is not None:
            out["planned_bytes"] = phase.total
    else:
        out.update(measured_bytes=peak.above_start, measured="peak resident memory above the phase's start")
        if phase is not None:
            resident = [k for k in phase.parts if k.endswith("_weights")
                        or (k.endswith("optimizer_state") and not moments_made_here)]
            out["planned_bytes"] = phase.total - sum(phase.parts[k] for k in resident)
    return out


def probe_line(probe: dict, before: str = "the first rollout") -> str:
    """The run's words on its probe."""
    parts = []
    for name, p in probe["phases"].items():
        if "measured_bytes" in p:
            planned = f", planned {gib(p['planned_bytes'])}" if "planned_bytes" in p else ""
            parts.append(f"{name} ({p['shapes']}) {gib(p['measured_bytes'])}{planned}")
        else:
            parts.append(f"{name} ({p['shapes']}) ran")
    return (f"memory probe: the worst case of each phase ran in {probe['seconds']:.1f} s before {before}: "
            + "; ".join(parts) + " (train.memory_probe: false skips it)")

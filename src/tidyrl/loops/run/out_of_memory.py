"""An out-of-memory error that stops a run, in words a user acts on: the phase of the memory plan it struck in and
its shapes (`liveness.working`, on whichever thread it struck), the plan's figure for that phase beside what was
measured (`models.peak_memory`), the knob that lowers that phase's peak, and where the run can resume from. The
checkpoints already written are complete (they are written whole, then renamed: `checkpoint`), so
`resume_from=latest` continues from the last of them, with the knob changed (every batch-size knob may change on a
resume: it changes no number of the plan)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from tidyrl import liveness
from tidyrl.memory.plan import gib

KNOBS = {"generation": ("rollout.generation_batch_size",), "scoring": ("rollout.forward_batch_size",),
         "update": ("train.micro_batch_size", "train.gradient_checkpointing")}
"""The phase of the memory plan -> the config keys that lower its peak, the first the batch size it runs at."""


class OutOfMemory(RuntimeError):
    """A phase of the run needed more memory than the device (or the host) had; the message says where, the
    planned and the measured peak, and what to change."""


def out_of_memory(err: BaseException, cfg, plan_phases: Optional[dict], device, out: Path, rank: int,
                  probing: bool = False, share: Optional[int] = None) -> OutOfMemory:
    """The `OutOfMemory` that stops the run for `err` (an allocator's out-of-memory error,
    `models.peak_memory.is_out_of_memory`): `plan_phases` the memory plan's phase -> predicted bytes (None where
    the model's shape gave no plan); `probing`: it struck in the worst-case probe, before the first rollout;
    `share`: each process's episodes a rollout (RL), which bounds the generation's and scoring's batches."""
    from tidyrl.checkpoint import last_good_checkpoint
    from tidyrl.models.peak_memory import held_now

    where = liveness.struck_in(err)
    phase, shapes = where if where is not None else (None, None)
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = [f"out of memory on process {rank}"
            + (f" in the {phase} phase ({shapes})" if phase else f" (after: {liveness.last()[1]})")
            + (" of the worst-case probe, before the first rollout" if probing else "") + f": {first}."]
    figures = []
    if phase and plan_phases and phase in plan_phases:
        figures.append(f"the memory plan predicted {gib(plan_phases[phase])} for it")
    held = held_now(device)
    if held is not None:
        figures.append(f"measured: {gib(held.peak)} at most, {gib(held.start)} held as it struck ({held.what})")
    if figures:
        text.append(_sentence("; ".join(figures)))
    knobs = KNOBS.get(phase)
    if knobs:
        size = _value(cfg, knobs[0])
        runs = min(size, share) if share and phase != "update" and isinstance(size, int) else size
        now = f"now {size}" + (f", {runs} at once: each process's episodes" if runs != size else "")
        others = "".join(f", or set {k}: true" for k in knobs[1:] if _value(cfg, k) is False)
        if runs == 1:  # one sequence does not fit: shorter ones, or more memory
            text.append(f"{knobs[0]} is 1 already: one sequence of that length does not fit{others and ' (' + others[5:] + ')'}; "
                        "lower data.max_prompt_length or rollout.max_new_tokens, or give each process more memory.")
        else:
            auto = " or set it to auto" if _may_be_auto(cfg, knobs[0]) else ""
            text.append(f"Lower {knobs[0]} ({now}){auto}{others}; `tidyrl plan CONFIG --memory SIZE` names the "
                        "smallest change for the memory a process has.")
    if not probing:
        text.append(_sentence(last_good_checkpoint(out)))
    return OutOfMemory(" ".join(text))


def _sentence(words: str) -> str:
    return words[:1].upper() + words[1:] + "."


def _may_be_auto(cfg, knob: str) -> bool:
    """Whether `knob` may be `auto` in this run (RL stages; the micro-batch not under train.exact_gradients)."""
    from tidyrl.config import OFFLINE_ALGORITHMS

    if cfg.algorithm in OFFLINE_ALGORITHMS:
        return False
    return knob != "train.micro_batch_size" or not cfg.train.exact_gradients


def _value(cfg, name: str):
    section, key = name.split(".")
    return getattr(getattr(cfg, section, None), key, None)

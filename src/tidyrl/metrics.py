"""What a run writes while it trains: metrics.jsonl, samples.jsonl, the trackers, the progress bar and the
end-of-run summary.

Metric names are part of the API (DESIGN §5); `STEP_METRICS` lists the fields every
metrics.jsonl row carries, and tests check them. Trackers (`log.report_to`, tidyrl.trackers)
receive the same rows under the same names.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional, Sequence

STEP_METRICS = (
    "step",  # 1-based optimizer step
    "rollout",  # 1-based rollout the step belongs to
    "episodes",  # cumulative completions generated
    "epoch",  # fractional passes over the prompt set
    "lr",  # learning rate the optimizer used for this step
    "loss",
    "reward_mean",
    "reward_std",
    "kl",  # mean per-token KL to the reference; null when no reference model is loaded
    "entropy",
    "clip_fraction",
    "grad_norm",  # global norm before clipping
    "completion_length_mean",
    "truncated_fraction",
    "time_s",  # wall-clock seconds since training started
)


def _plain(value: Any) -> Any:
    """JSON-safe scalars: tensors to floats, NaN/inf to null."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class JsonlWriter:
    """Appends one JSON object per line and flushes, so a crash loses at most the line being written."""

    def __init__(self, path: Path, enabled: bool = True):
        self.path = Path(path)
        self._file = open(self.path, "a", encoding="utf-8") if enabled else None

    def write(self, row: dict) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps({k: _plain(v) for k, v in row.items()}, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class ProgressBar:
    """A tqdm bar whose total is the plan's total optimizer steps; it advances once per optimizer step."""

    def __init__(self, total: int, enabled: bool = True, initial: int = 0):
        self._bar = None
        if enabled:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, unit="step", desc="tidyrl", dynamic_ncols=True)

    def step(self, reward: Optional[float], episodes: int) -> None:
        """RL: one optimizer step, showing the episodes so far and the rollout's mean reward."""
        postfix = {"episodes": episodes}
        if reward is not None:
            postfix["reward"] = f"{reward:.3f}"
        self.advance(postfix)

    def advance(self, postfix: dict) -> None:
        """One optimizer step, showing `postfix` (e.g. the offline stages' loss and accuracy)."""
        if self._bar is None:
            return
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.update(1)

    @property
    def n(self) -> int:
        return self._bar.n if self._bar is not None else 0

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


TIME_METRICS = {"generate": "time/generate_s", "reward": "time/reward_s", "score": "time/score_s",
                "update": "time/update_s"}
"""Parts of the wall time in the summary -> the metric that measures them. The first three are per rollout
(repeated on each row of a rollout), update is per optimizer step."""


class _SampleLog:
    """samples.jsonl, whose rows also wait in the RunLogger for the trackers' next sample table."""

    def __init__(self, path: Path, enabled: bool, pending: list):
        self._jsonl = JsonlWriter(path, enabled)
        self._pending = pending
        self._enabled = enabled

    def write(self, row: dict) -> None:
        self._jsonl.write(row)
        if self._enabled:
            self._pending.append(row)

    def close(self) -> None:
        self._jsonl.close()


class RunLogger:
    """metrics.jsonl and samples.jsonl, forwarded to the trackers of `log.report_to`.

    The loop calls `observe(row)` on every optimizer step (totals for the summary), `write(row)` on the
    rows it logs (metrics.jsonl + trackers, at global step = row["step"]), `samples.write(row)` for
    samples.jsonl, and `close()`. Samples reach the trackers as one table with the next logged row, so
    a tracker's steps only ever grow. Only the main process (`enabled`) writes or opens trackers.
    `first_step` is the optimizer step a resumed run continues after (0 for a new run).
    """

    def __init__(self, output_dir: Path, cfg, plan, enabled: bool = True, first_step: int = 0):
        from tidyrl.config import config_to_dict
        from tidyrl.trackers import open_trackers

        self.output_dir = Path(output_dir)
        self.metrics = JsonlWriter(self.output_dir / "metrics.jsonl", enabled)
        self._pending: list[dict] = []
        self.samples = _SampleLog(self.output_dir / "samples.jsonl", enabled, self._pending)
        self.timings = {part: 0.0 for part in TIME_METRICS} | {"steps": 0}
        """Seconds spent per part over the steps this process ran, and how many steps that is."""
        self._rollouts_timed: set = set()
        self.trackers = []
        if enabled:
            run_config = config_to_dict(cfg) | {"plan": plan.to_dict()}
            self.trackers = open_trackers(cfg.log.report_to, self.output_dir, run_config, first_step)
        self.tracker_locations = {t.name: str(t.location) for t in self.trackers}
        """Tracker name -> where it wrote (a folder or a URL), for the summary."""

    def observe(self, row: dict) -> None:
        """Add an optimizer step's times to `timings` (every step, logged or not)."""
        self.timings["steps"] += 1
        self.timings["update"] += row.get(TIME_METRICS["update"]) or 0.0
        if row.get("rollout") not in self._rollouts_timed:  # per-rollout times: count each rollout once
            self._rollouts_timed.add(row.get("rollout"))
            for part in ("generate", "reward", "score"):
                self.timings[part] += row.get(TIME_METRICS[part]) or 0.0
            if "time/wait_rollout_s" in row:  # rollout.lag: made beside training; the learner's share is its wait
                self.timings["wait"] = self.timings.get("wait", 0.0) + row["time/wait_rollout_s"]

    def write(self, row: dict) -> None:
        """A logged row: to metrics.jsonl, then to every tracker with the samples written since the last one."""
        self.metrics.write(row)
        clean = {k: _plain(v) for k, v in row.items()}
        for tracker in self.trackers:
            tracker.log(clean, step=row["step"], samples=list(self._pending))
        self._pending.clear()

    def close(self) -> None:
        self.metrics.close()
        self.samples.close()
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close()


def sample_episodes(prompts: int, samples_per_prompt: int, n: int) -> list[int]:
    """The global episodes samples.jsonl shows for a rollout of `prompts` x `samples_per_prompt` episodes
    (prompt-major: episode e is sample e % k of prompt e // k): the first sample of each prompt, then the
    second of each, ..., the first `n` of that order. Different prompts first, and the same choice on any
    number of processes (global indices)."""
    order = [p * samples_per_prompt + s for s in range(samples_per_prompt) for p in range(prompts)]
    return order[:n]


def _clock(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, sec = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{sec:02d} ({seconds:.0f} s)"


def _where_lines(best: Optional[dict], show, output_dir: Path, files: str, final_dir: Path,
                 tracker_locations: Optional[dict]) -> list[str]:
    """The summaries' closing lines: the best model (log.best_metric), the files, the model, the trackers."""
    lines = []
    if best:
        lines.append(f"  best {best['metric']}: {show(best['value'])} at step {best['step']} -> {best['dir']}")
    lines.append(f"  written to {output_dir}/: {files}")
    lines.append(f"  model: {final_dir}")
    lines += [f"  {name}: {where}" for name, where in (tracker_locations or {}).items()]
    return lines


def format_offline_summary(algorithm: str, plan, timings: dict, wall_s: float, first: dict, last: dict,
                           output_dir: Path, final_dir: Path, tracker_locations: Optional[dict] = None,
                           best: Optional[dict] = None, distribution: Optional[str] = None,
                           overrides: Sequence[str] = ()) -> str:
    """The end-of-run summary of sft, reward and dpo: totals, wall time (and how the model was distributed:
    `distribution`, e.g. 'fsdp2, 2 shards'), the developer overrides of the kernels in effect (`overrides`, a line
    each: `loops.run.setup.kernel_override_lines`), each headline metric at the first step and the last (`first` holds
    the first step's, kept in checkpoints so a resumed run still reports it), the last eval metrics, where things
    are."""
    def value(v):
        return "n/a" if v is None else f"{v:.4f}"

    epochs = "" if plan.dataset_epochs is None else f", {plan.dataset_epochs:g} dataset epochs"
    lines = [f"tidyrl: finished {algorithm}: {plan.total_optimizer_steps} optimizer steps ({plan.total_examples} "
             f"examples{epochs}) in {_clock(wall_s)}" + (f", {distribution}" if distribution else "")]
    lines += [f"  {line}" for line in overrides]
    steps = timings.get("steps", 0)
    if steps and steps != plan.total_optimizer_steps:
        lines.append(f"  (the last {steps} steps ran after resuming)")
    for name in first:
        lines.append(f"  {name}: {value(first[name])} (step 1) -> {value(last.get(name))} (last step)")
    for name in sorted(k for k in last if k.startswith("eval/")):
        lines.append(f"  {name}: {value(last[name])} (after the last step)")
    lines += _where_lines(best, value, output_dir, "config.yaml, plan.json, metrics.jsonl", final_dir,
                          tracker_locations)
    lines.append(f"  next: tidyrl plot {output_dir}")
    return "\n".join(lines)


def format_summary(plan, timings: dict, wall_s: float, first_reward: Optional[float],
                   last_reward: Optional[float], output_dir: Path, final_dir: Path,
                   tracker_locations: Optional[dict] = None, evals: Optional[dict] = None,
                   best: Optional[dict] = None, groups: Optional[dict] = None, engine: Optional[str] = None,
                   distribution: Optional[str] = None, overrides: Sequence[str] = ()) -> str:
    """The end-of-run summary: totals, wall time and its split, reward at start and end, where things are; how
    the model was distributed (`distribution`, e.g. 'fsdp2, 2 shards'), the engine that generated, and the
    developer overrides of the kernels in effect (`overrides`, a line each: `loops.run.setup.kernel_override_lines`).

    `timings` holds seconds per part of TIME_METRICS and `steps`, the number of optimizer steps they
    cover (fewer than the plan's after a resume: then the split covers only the steps run since).
    """
    def reward(value):
        return "n/a" if value is None else f"{value:.4f}"

    lines = [f"tidyrl: finished {plan.total_optimizer_steps} optimizer steps ({plan.rollouts} rollouts, "
             f"{plan.total_episodes} episodes) in {_clock(wall_s)}" + (f", {distribution}" if distribution else "")
             + (f", generated by the {engine} engine" if engine else "")]
    lines += [f"  {line}" for line in overrides]
    steps = timings.get("steps", 0)
    if steps:
        timed = {part: timings.get(part, 0.0) for part in TIME_METRICS}
        beside = None
        if "wait" in timings:  # rollout.lag: generation and rewards ran beside training; the learner only waited
            beside = f"generate {timed.pop('generate'):.1f} s, reward {timed.pop('reward'):.1f} s"
            timed = {"waiting for rollouts": timings["wait"], **timed}
        session = wall_s if steps == plan.total_optimizer_steps else sum(timed.values())
        timed["other"] = max(session - sum(timed.values()), 0.0)
        total = max(sum(timed.values()), 1e-9)
        split = ", ".join(f"{part} {sec:.1f} s ({100 * sec / total:.0f}%)" for part, sec in timed.items())
        scope = "" if steps == plan.total_optimizer_steps else f" (the {steps} steps run since resuming)"
        lines.append(f"  time{scope}: {split}")
        if beside:
            lines.append(f"  made ahead, beside training (rollout.lag): {beside}")
    lines.append(f"  reward_mean: {reward(first_reward)} (first rollout) -> {reward(last_reward)} (last rollout)")
    if groups:  # rollout.dynamic_sampling
        lines.append(f"  groups (dynamic sampling): {groups.get('groups/generated', 0)} generated, "
                     f"{groups.get('groups/kept', 0)} kept, {groups.get('groups/filled', 0)} filled, "
                     f"{groups.get('groups/dropped', 0)} dropped")
    for name, value in (evals or {}).items():
        lines.append(f"  {name}: {reward(value)} (held-out prompts, after the last step)")
    lines += _where_lines(best, reward, output_dir, "config.yaml, plan.json, metrics.jsonl, samples.jsonl",
                          final_dir, tracker_locations)
    lines.append(f"  next: tidyrl plot {output_dir}   |   "
                 f"tidyrl eval {Path(output_dir) / 'config.yaml'} --model {final_dir}")
    return "\n".join(lines)

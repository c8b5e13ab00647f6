"""A run's optimizer steps, RL and offline alike: the skeleton every loop steps through (`Steps`: the metrics log,
the progress bar, the checkpoint cadence) and its parts:

    no_sync         gradient accumulation without synchronisation until the last micro-batch
    apply_update    clip -> stop on NaN/inf -> optimizer step -> one LR-scheduler step -> zero the gradients
    StopSignals     Ctrl-C / SIGTERM: stop after the current optimizer step, with a checkpoint
    check_resume    the checkpoint `resume_from` names, read and compared with the current config

The small collectives (Sums, reduce_sum, reduce_max, agree) are in models/collectives.py, below the loops and the
rollouts alike.

The loops themselves stay explicit in their modules (loops/rl/learner.py, loops/offline/loop.py).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Iterable, Optional, Sequence

from tidyrl import liveness
from tidyrl.console import say
from tidyrl.models.collectives import agree


class TrainingInterrupted(RuntimeError):
    """Ctrl-C or SIGTERM: the run stopped cleanly after an optimizer step and saved a checkpoint."""


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN or infinite; the update was not applied."""


def no_sync(accelerator, models: Iterable, sync: bool):
    """A context in which backward() accumulates gradients locally (`sync` False: not the last micro-batch of a
    step) or synchronises them over processes (`sync` True), for every model in `models` (DESIGN §2)."""
    from tidyrl.models.sharding import gradient_sync, is_root_sharded

    stack = contextlib.ExitStack()
    if not sync:
        for model in models:  # FSDP2 has no no_sync: its own switch (accelerate's would sync every micro-batch)
            stack.enter_context(gradient_sync(model, False) if is_root_sharded(model) else accelerator.no_sync(model))
    return stack


def apply_update(accelerator, parts: Sequence[tuple], max_grad_norm: float, step: int, loss: float,
                 output_dir: Path, advice: str, exact: bool = False) -> list[tuple[float, float]]:
    """Clip every (model, optimizer, scheduler) of `parts` to `max_grad_norm` (<= 0: no clipping), then, if the
    loss and every gradient norm are finite, step each optimizer and its LR schedule exactly once and zero the
    gradients. Returns (the learning rate this step used, the gradient norm before clipping) per part. `exact`
    (train.exact_gradients): the norm summed exactly, the same on any split (loops.run.exact_sums.exact_grad_norm).

    A NaN or infinite loss or norm stops the run before any update (a NaN step would poison every later one):
    NonFiniteLossError names the 1-based `step`, where the run can resume from, and `advice`."""
    from tidyrl.checkpoint import last_good_checkpoint
    from tidyrl.models.host_memory import release_freed_memory

    from tidyrl.loops.run.exact_sums import clip_exactly
    from tidyrl.models.sharding import clip_grad_norm, is_root_sharded, local_grads

    max_norm = max_grad_norm if max_grad_norm > 0 else math.inf
    # A sharded model's norm is over every shard of every process (models.sharding.clip_grad_norm)
    if exact:
        norms = [clip_exactly(local_grads(model), max_norm, sharded=is_root_sharded(model)) for model, _, _ in parts]
    else:
        norms = [clip_grad_norm(model, max_norm) if is_root_sharded(model)
                 else float(accelerator.clip_grad_norm_(model.parameters(), max_norm)) for model, _, _ in parts]
    if not all(math.isfinite(x) for x in (loss, *norms)):
        for _, optimizer, _ in parts:
            optimizer.zero_grad(set_to_none=True)
        raise NonFiniteLossError(
            f"optimizer step {step}: the loss is {loss} and the gradient norm {norms[0]}; the update was not "
            f"applied and training stopped; {last_good_checkpoint(output_dir)}. {advice}"
        )
    done = []
    for (_, optimizer, scheduler), norm in zip(parts, norms):
        done.append((optimizer.param_groups[0]["lr"], norm))  # the rate this step uses
        optimizer.step()
        scheduler.step()  # exactly once per optimizer step, in every process
        optimizer.zero_grad(set_to_none=True)
    release_freed_memory(accelerator.device)  # this step's activations and gradients (host_memory.py)
    return done


def check_resume(cfg, output_dir: Path, accelerator) -> tuple[Optional[Path], Optional[dict]]:
    """(the checkpoint `cfg.resume_from` names, its trainer state), or (None, None) for a new run. Holds the
    output folder first (before reading a checkpoint another run could delete) and refuses a config that
    changes anything beyond the memory knobs and the saving cadence (checkpoint.RESUMABLE_CHANGES)."""
    if not cfg.resume_from:
        return None, None
    from tidyrl.checkpoint import EXTENDABLE, CheckpointError, find_checkpoint, load_trainer_state, refused_changes
    from tidyrl.config import config_to_dict
    from tidyrl.run_lock import hold_output_dir

    hold_output_dir(output_dir, accelerator)
    path = find_checkpoint(output_dir, cfg.resume_from)
    loaded = load_trainer_state(path)
    changes = refused_changes(with_defaults(loaded["state"]["config"]), config_to_dict(cfg),
                              allowed=EXTENDABLE if cfg.extend else frozenset())
    if changes:
        longer = [c for c in changes if c.split(":")[0] in EXTENDABLE]
        raise CheckpointError(
            f"cannot resume from {path}: these changes alter the plan or the maths:\n  " + "\n  ".join(changes)
            + "\nRevert them to resume, or start a new run in another output_dir. Only memory knobs (micro/"
            "generation/forward batch sizes, gradient checkpointing) and the saving cadence may change on resume."
            + ("\nTo train longer from this checkpoint, add extend=true (the LR schedule is then rebuilt over the "
               "new length: the result is not the run that length would have made from the start)." if longer else "")
        )
    return path, loaded


def continue_longer(cfg, loaded: dict, plan, out: Path, accelerator, schedulers) -> Optional[str]:
    """`extend: true`: the resumed run goes on to the new plan's length. Refuses a length that is not longer than
    the steps done; rebuilds each LR schedule over the new total (the optimizers' rates set from it at the resumed
    step: the next step uses the new schedule's rate); records the extension in plan.json (`extended`: step,
    from and to totals); returns the line that says so, or None when the length did not change."""
    import json

    from tidyrl.checkpoint import CheckpointError

    if not cfg.extend:
        return None
    step, before = loaded["state"]["step"], loaded["state"]["plan"]["total_optimizer_steps"]
    after = plan.total_optimizer_steps
    if after == before:
        return None
    if after <= step:
        raise CheckpointError(f"extend=true only makes a run longer: the checkpoint is at optimizer step {step}, and "
                              f"the new length is {after} steps. Raise train.rollouts, train.dataset_epochs or "
                              "train.max_steps.")
    for scheduler in schedulers:
        scheduler = getattr(scheduler, "scheduler", scheduler)  # accelerate's wrapper holds the LambdaLR
        for group, base, rate in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base * rate(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
    if accelerator.is_main_process:
        path = out / "plan.json"
        previous = json.loads(path.read_text()) if path.exists() else {}
        record = {"step": step, "from_total_optimizer_steps": before, "to_total_optimizer_steps": after}
        header = {k: v for k, v in previous.items() if k not in plan.to_dict() and k != "extended"}
        extended = previous.get("extended", []) + [record]
        path.write_text(json.dumps({**plan.to_dict(), **header, "extended": extended}, indent=2) + "\n")
    return (f"warning: extend=true: this run continues from optimizer step {step} of {before} to {after}, its LR "
            f"schedule rebuilt over {after} steps; the result is not the run that {after} steps from the start would "
            "have made (plan.json 'extended' records it)")


def keep_if_best(accelerator, cfg, output_dir: Path, best: Optional[dict], row: dict, model, tokenizer
                 ) -> Optional[dict]:
    """log.best_metric: when this evaluation (`row`, just scored) beats every earlier one (`best`), the model goes
    to best/ (atomically, replacing the previous best) and best.json records the metric, value and step. A name
    ending in `loss` is better lower, any other higher; the first evaluation is the best so far. Returns the
    best after this evaluation (kept in checkpoints, so a resumed run compares with the runs' real best)."""
    import json

    from tidyrl.loops.run.setup import save_pretrained_atomic

    name = cfg.log.best_metric
    if name is None:
        return best
    if row.get(name) is None:
        raise KeyError(f"log.best_metric = {name!r} is not among this stage's eval metrics "
                       f"({', '.join(k for k in row if k.startswith('eval/'))}); choose one of them")
    value = float(row[name])
    better = (lambda a, b: a < b) if name.endswith("loss") else (lambda a, b: a > b)
    if best is not None and not better(value, best["value"]):
        return best
    # With LoRA, the adapter only: merging would fold it into the weights still being trained.
    best_dir = save_pretrained_atomic(accelerator, model, tokenizer, Path(output_dir) / "best")
    best = {"metric": name, "value": value, "step": row["step"], "dir": str(best_dir)}
    if accelerator.is_main_process:
        (Path(output_dir) / "best.json").write_text(json.dumps(best, indent=2) + "\n")
    return best


def with_defaults(saved: dict) -> dict:
    """A checkpoint's saved config with the keys it predates filled in at their defaults, so that resuming a
    checkpoint of an earlier tidyrl is not refused for keys that did not exist then (a key whose default is
    what the run had anyway). A saved config this version cannot read is compared as it is."""
    from tidyrl.config import ConfigError, config_from_dict, config_to_dict

    try:
        return config_to_dict(config_from_dict(saved))
    except (ConfigError, TypeError, ValueError):
        return saved


class StopSignals:
    """Ctrl-C / SIGTERM ask the loop to stop after the current optimizer step (which then saves a
    checkpoint); a second signal abandons the step at once. Installed in the main thread only."""

    def __init__(self):
        self.requested, self.name, self._previous = False, "", {}

    def _handle(self, signum, frame):
        import signal

        if self.requested:
            raise KeyboardInterrupt
        self.requested, self.name = True, signal.Signals(signum).name
        print(flush=True)  # off the progress bar's line
        say(f"{self.name} received; stopping after this optimizer step (again to abandon it)")

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False


class Steps:
    """The skeleton every loop shares (the RL loop and the offline stages'): the metrics log (metrics.jsonl and the
    trackers of log.report_to) and the progress bar from the run's first step to the plan's last, Ctrl-C/SIGTERM
    turned into a checkpoint and a stop, the checkpoint cadence of log.save_every, and the check that the run took
    exactly the plan's steps. The loop itself stays in its own module:

        with Steps(cfg, plan, out, accelerator, first_step=step) as steps:
            for each optimizer step:
                ... -> row
                steps.record(row)                      # written every log.log_every steps and at the last
                steps.bar.step(...) / steps.bar.advance(...)
                steps.checkpoint_when_due(step, save)  # save() every log.save_every steps; on a signal, then stop
        steps.finished(step)
    """

    def __init__(self, cfg, plan, out: Path, accelerator, first_step: int):
        from tidyrl.metrics import ProgressBar, RunLogger

        is_main = accelerator.is_main_process
        self.cfg, self.total, self.out, self.accelerator = cfg, plan.total_optimizer_steps, out, accelerator
        self.log = RunLogger(out, cfg, plan, enabled=is_main, first_step=first_step)
        self.bar = ProgressBar(self.total, enabled=is_main and cfg.log.progress_bar, initial=first_step)
        self.stop = StopSignals()

    def __enter__(self) -> "Steps":
        from tidyrl.loops.run.faults import arm_watchdog

        self.stop.__enter__()
        arm_watchdog()  # from here on, a process that finishes no work for train.watchdog_s hangs
        return self

    def __exit__(self, *exc) -> bool:
        """Whatever happens, the signals are the process's again, the bar is closed and every row written so far
        is on disk."""
        self.stop.__exit__(*exc)
        self.bar.close()
        self.log.close()
        return False

    def record(self, row: dict) -> None:
        """Step `row["step"]`'s metrics: written every log.log_every steps and at the last; observed every step
        (the totals of the end-of-run summary)."""
        step = row["step"]
        if step % self.cfg.log.log_every == 0 or step == self.total:
            self.log.write(row)
        self.log.observe(row)

    def checkpoint_when_due(self, step: int, save) -> None:
        """`save()` (checkpoint-<step>) every log.save_every steps before the last, and after a stop signal, on
        which the run then ends with how to resume."""
        liveness.mark(f"optimizer step {step}")
        if agree(self.accelerator, self.stop.requested):
            self._save(step, save)
            raise TrainingInterrupted(
                f"stopped by {self.stop.name} after optimizer step {step} of {self.total}; checkpoint saved to "
                f"{self.out}/checkpoint-{step}. Resume with: tidyrl train CONFIG.yaml resume_from=latest")
        every = self.cfg.log.save_every
        if every and step % every == 0 and step < self.total:
            self._save(step, save)

    @staticmethod
    def _save(step: int, save) -> None:
        liveness.mark(f"optimizer step {step}; saving checkpoint-{step}")
        save()
        liveness.mark(f"saved checkpoint-{step}")

    def finished(self, step: int) -> None:
        """The run took exactly the plan's optimizer steps, and the bar says so."""
        if self.bar.n not in (0, self.total) or step != self.total:
            raise AssertionError(f"ran {step} optimizer steps, plan says {self.total}")

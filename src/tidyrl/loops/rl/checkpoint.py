"""The RL learner's checkpoints: what a run carries from rollout to rollout besides its weights and optimizers
(`RunState`), written into checkpoint-<step>/ with the unfinished rollout when a save falls inside one, and read
back so that a resumed run finishes as the uninterrupted one would (DESIGN §5)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from tidyrl.models.sharding import is_root_sharded
from tidyrl.rollouts.record import Rollout, share


@dataclass
class RunState:
    """The learner's running state: each normalised reward's moments, the KL coefficient's controller (None
    where the KL is a term of the loss), the best evaluation so far, dynamic sampling's group counts."""

    reward_moments: dict
    kl_control: Any = None
    best: Optional[dict] = None
    group_totals: dict = field(default_factory=dict)


def save_run(step: int, *, accelerator, out, trainee, tokenizer, state: RunState, plan, cfg, rollout, stats: dict,
             elapsed: float, first_reward, ahead: Optional[dict] = None) -> None:
    """checkpoint-<step> (written by the main process; under FSDP2 each process also writes its shards), with the
    unfinished `rollout` (None at a rollout's end) and its stats,
    and the rollouts made ahead (rollout.lag: rollout index -> this process's making, as plain values)."""
    from tidyrl.checkpoint import save_checkpoint
    from tidyrl.config import config_to_dict
    from tidyrl.loops.run.setup import distribution_of
    from tidyrl.models.generation import SAMPLER

    t = trainee
    sharded = is_root_sharded(t.model)  # then every process writes its shards (checkpoint.save_checkpoint)
    accelerator.wait_for_everyone()
    if sharded or accelerator.is_main_process:
        saved = {"step": step, "rollouts_started": -(-step // plan.optimizer_steps_per_rollout),
                 "elapsed_s": elapsed, "first_reward_mean": first_reward,
                 "reward_moments": {name: m.state_dict() for name, m in state.reward_moments.items()},
                 "kl_control": state.kl_control.state_dict() if state.kl_control else None,
                 "best": state.best, "group_totals": state.group_totals,
                 "world_size": accelerator.num_processes, "distribution": distribution_of(accelerator),
                 "plan": plan.to_dict(), "config": config_to_dict(cfg), "sampler": SAMPLER}
        unfinished = None
        if rollout is not None:
            unfinished = {"rollout": rollout.to_dict(), "stats": stats}
        save_checkpoint(out, step, model=accelerator.unwrap_model(t.model), tokenizer=tokenizer,
                        optimizer=t.optimizer, scheduler=t.scheduler, state=saved, rollout=unfinished, ahead=ahead,
                        keep_last=cfg.log.keep_last,
                        critic=None if t.critic is None else (accelerator.unwrap_model(t.critic), t.critic_optimizer,
                                                              t.critic_scheduler))
    accelerator.wait_for_everyone()


def restore_run(loaded: dict, *, accelerator, out, trainee, state: RunState, plan
                ) -> tuple[int, float, Optional[float], Optional[tuple], dict]:
    """Load a checkpoint's trainer state (`loaded`, from `training.check_resume`) into the trainee and `state`;
    drop the metrics and samples rows that the remaining steps will write again. Returns (step, elapsed seconds,
    first reward, the unfinished rollout and its stats or None, the rollouts made ahead: `saved_made_ahead`'s
    form, empty without rollout.lag)."""
    from tidyrl.checkpoint import restore_optimizer, set_rng_state, truncate_jsonl

    t = trainee
    restore_optimizer(loaded, "optimizer", t.model, t.optimizer)
    t.scheduler.load_state_dict(loaded["scheduler"])
    set_rng_state(loaded["rng"])
    saved = loaded["state"]
    for name, moments in state.reward_moments.items():
        moments.load_state_dict(saved["reward_moments"][name])
    if t.critic is not None:
        restore_optimizer(loaded, "critic_optimizer", t.critic, t.critic_optimizer)
        t.critic_scheduler.load_state_dict(loaded["critic_scheduler"])
    if state.kl_control is not None and saved.get("kl_control") is not None:
        state.kl_control.load_state_dict(saved["kl_control"])
    step = saved["step"]
    state.best = saved.get("best")
    state.group_totals = saved.get("group_totals") or {}
    started = -(-step // plan.optimizer_steps_per_rollout)  # rollouts begun: ceil(step / (E*M))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        truncate_jsonl(out / "metrics.jsonl", lambda row: row["step"] <= step)
        truncate_jsonl(out / "samples.jsonl", lambda row: row["rollout"] <= started)
    accelerator.wait_for_everyone()
    unfinished = None
    if loaded["rollout"] is not None:
        unfinished = (Rollout(**loaded["rollout"]["rollout"]), loaded["rollout"]["stats"])
    # rollout.lag: the rollouts made ahead, each process's share (int keys: torch.load keeps them)
    return step, saved["elapsed_s"], saved.get("first_reward_mean"), unfinished, loaded.get("ahead") or {}


def saved_made_ahead(pending: dict, world_size: int) -> dict:
    """rollout.lag: the rollouts made ahead (`RolloutsAhead.pending()`) as a checkpoint holds them: rollout index
    -> every process's share in rank order, as plain values (a collective with several processes: all call it)."""
    mine = {r: {"value": p.to_dict()} for r, p in pending.items()}
    if not mine:
        return {}
    if world_size == 1:
        return {r: [m] for r, m in mine.items()}
    from accelerate.utils import gather_object

    shares = gather_object([mine])
    return {r: [share[r] for share in shares] for r in mine}


def rollouts_made_ahead(saved: dict, rank: int, world_size: int, pad_id: int) -> dict:
    """`saved_made_ahead` read back for process `rank` of `world_size`: its share of each rollout; saved by another
    number of processes, the shares are joined and cut again (`record.share`)."""
    return {r: share([Rollout(**m["value"]) for m in shares], rank, world_size, pad_id) for r, shares in saved.items()}

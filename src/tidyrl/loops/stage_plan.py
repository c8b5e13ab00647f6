"""`tidyrl plan` for any stage: the checks `train` makes before it loads weights (the same functions), then the
plan.json a run would write and the notes it would print. Reads tokenizers, data and model configs; loads no weights."""

from __future__ import annotations

from typing import Optional

from tidyrl.config import OFFLINE_ALGORITHMS, Config, packs_rows


def stage_plan(cfg: Config, base_dir: Optional[str], num_processes: int, memory: Optional[str] = None,
               fsdp: Optional[bool] = None) -> tuple[dict, list[str]]:
    """(plan.json's content as the run would write it, the notes the run would print) for `num_processes`
    processes; `memory`, `fsdp`: as `tidyrl plan --memory/--fsdp` (None: as the launch asks). Raises the run's own
    errors (ConfigError, DataError, ...) where it would refuse."""
    if cfg.algorithm in OFFLINE_ALGORITHMS:
        return _offline_plan(cfg, num_processes, memory, fsdp)
    from tidyrl.loops.rl.inputs import check_rl_inputs, plan_extras

    inputs = check_rl_inputs(cfg, base_dir, num_processes, memory=memory, fsdp=fsdp)
    extras = plan_extras(cfg, inputs.plan, inputs.critic, inputs.eval_prompt_ids, inputs.memory, inputs.paths,
                         inputs.auto)
    return {**inputs.plan.to_dict(), **extras}, inputs.report.splitlines()


def _offline_plan(cfg: Config, num_processes: int, memory: Optional[str], fsdp: Optional[bool]) -> tuple[dict, list[str]]:
    """An offline stage's: its items tokenised as the loop does (the count of examples, pairs or packed rows and the
    longest sequence), the plan, the reference's cost (dpo, kto) and the memory plan."""
    from tidyrl.data.offline import load_stage_items
    from tidyrl.loops.offline import dpo, kto
    from tidyrl.memory.offline import check_offline_memory
    from tidyrl.models.loading import load_model_config, load_tokenizer
    from tidyrl.plan import plan_from_config

    reference_costs = {"dpo": dpo.reference_cost, "kto": kto.reference_cost}  # the stages with a frozen reference
    model_config = load_model_config(cfg.model)  # the policy exists (at once, offline too)
    items, held_out = load_stage_items(cfg, load_tokenizer(cfg.tokenizer or cfg.model), packing=packs_rows(cfg))
    plan = plan_from_config(cfg, len(items), num_processes)
    extra = {"eval_examples": len(held_out)} if held_out else {}
    if cfg.algorithm in reference_costs:
        extra.update(reference_costs[cfg.algorithm](cfg, plan, len(held_out)))
    planned, line = check_offline_memory(cfg, model_config, items, held_out, plan, memory, fsdp)
    if planned is not None:
        extra["memory"] = planned.to_dict()
    return {**plan.to_dict(), **extra}, [line]

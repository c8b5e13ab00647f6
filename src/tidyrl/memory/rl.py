"""An RL run's memory plan from its config, before any weights load (`check_memory`, run by `check_rl_inputs` for
`tidyrl train` and `tidyrl plan`): the shapes from the models' configs, the sizes from the batch plan, the memory a
process has (`tidyrl plan --memory`, else the CUDA device's own where the run uses one), and the phases that would
not fit with what to change. The formulas are `tidyrl.memory.plan`'s (pure, no torch)."""

from __future__ import annotations

import os
import sys
from typing import Callable, Optional

from tidyrl.algorithms.table import ALGORITHMS
from tidyrl.config import Config, ConfigError, is_auto
from tidyrl.engines import engine_module
from tidyrl.memory.plan import (DTYPE_BYTES, MemoryInputs, MemoryPlan, Scorer, Shape, fit_problems, gib,
                                      memory_plan, parse_size)
from tidyrl.models.families import on_fast_path
from tidyrl.models.kernels import Kernels, with_overrides
from tidyrl.models.loading import load_model_config


def memory_inputs(cfg: Config, model_config, prompt_ids: list, plan, critic: Optional[dict], *, cuda: bool,
                  fsdp: bool, device_bytes: Optional[int] = None) -> MemoryInputs:
    """The memory plan's numbers for this config: the policy's shape from `model_config`, the longest of
    `prompt_ids`, the plan's per-process sizes; the frozen models' shapes read from their configs (no weights)."""
    from tidyrl.config import algorithm_section

    b = DTYPE_BYTES[cfg.model_dtype]
    policy = Shape.of(model_config)

    def lean(config) -> bool:  # the lean pass scores on a CPU (models.forward.LAYOUTS; on CUDA the model's forward)
        return (not cuda and cfg.model_fast_paths and not cfg.train.exact_gradients
                and on_fast_path(config))

    scorers = []
    if algorithm_section(cfg).kl_coef > 0 and not cfg.lora.enabled:  # with LoRA the reference is the policy itself
        scorers.append(Scorer("reference", policy, b, True, lean=lean(model_config)))
    if ALGORITHMS[cfg.algorithm].teacher and cfg.teacher.model:
        # (sharded under FSDP2 like the reference, but one of another tokenizer: whole on every process)
        teacher = load_model_config(cfg.teacher.model, "teacher.model")
        scorers.append(Scorer("teacher", Shape.of(teacher), b, True, sharded=not cfg.teacher.cross_tokenizer,
                              lean=lean(teacher)))
    for n, reward in enumerate(cfg.rewards):
        if reward.model:
            shape = Shape.of(load_model_config(reward.model, f"rewards.{n}.model"), classifier=True)
            scorers.append(Scorer(f"reward_model_{n}", shape, b, False))
    critic_shape = None
    if critic:
        critic_shape = Shape.of(load_model_config(critic["critic_model"], "critic.model"), classifier=True)
    per_minibatch = plan.episodes_per_minibatch_per_process
    reserve = 0
    engine = engine_module(cfg.rollout.engine)
    if cuda and device_bytes and hasattr(engine, "device_reservation"):  # e.g. in-process vLLM's share
        reserve = engine.device_reservation(cfg, device_bytes)
    return MemoryInputs(
        policy=policy, dtype_bytes=b, prompt_tokens=max((len(p) for p in prompt_ids), default=0),
        new_tokens=cfg.rollout.max_new_tokens, generation_batch_size=cfg.rollout.generation_batch_size,
        forward_batch_size=cfg.rollout.forward_batch_size, micro_batch_size=cfg.train.micro_batch_size,
        episodes_per_process=plan.episodes_per_rollout_per_process, world_size=plan.world_size, fsdp=fsdp,
        lora_r=cfg.lora.r if cfg.lora.enabled else 0,
        lora_targets=tuple(cfg.lora.target_modules) if cfg.lora.enabled and cfg.lora.target_modules else None,
        gradient_checkpointing=cfg.train.gradient_checkpointing,
        sync_each_microbatch=cfg.train.sync_each_microbatch,
        accumulation_steps=per_minibatch // cfg.train.micro_batch_size,
        chunked_head=cuda and b < 4 and on_fast_path(model_config)
        and with_overrides(Kernels.of(cfg.kernels)).chunked_head,
        # (lean_forward.can_run: DDP and FSDP2 wrap the policy, LoRA and gradient checkpointing wrap its modules)
        lean_prefill=cfg.model_fast_paths and not cfg.train.exact_gradients and on_fast_path(model_config)
        and getattr(getattr(engine, "CAPABILITIES", None), "samples_trained_weights", False),
        lean_update=lean(model_config) and plan.world_size == 1 and not cfg.lora.enabled
        and not cfg.train.gradient_checkpointing,
        scorers=tuple(scorers), critic=critic_shape, engine_reserve=reserve, temperature=cfg.rollout.temperature)


def _cuda_bytes() -> Optional[int]:
    """The CUDA device's total memory, where this run uses one and torch is already imported (`tidyrl train`);
    None elsewhere (`tidyrl plan` imports no torch: give it --memory)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    from tidyrl.models.devices import cuda_in_use

    if not cuda_in_use():
        return None
    device = int(os.environ.get("LOCAL_RANK", "0")) % max(torch.cuda.device_count(), 1)
    return torch.cuda.mem_get_info(device)[1]


def available_host_bytes() -> Optional[int]:
    """MemAvailable of /proc/meminfo (Linux): the memory a new process may take without swapping; None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None


def plans_fsdp2(plan, fsdp: Optional[bool]) -> bool:
    """Whether the memory plan shards the policy with FSDP2 over the plan's processes: `fsdp` where given
    (`tidyrl plan --fsdp`), else as the launch asks."""
    from tidyrl.models.sharding import launch_sharding

    return plan.world_size > 1 and (launch_sharding() == "fsdp2" if fsdp is None else fsdp)


def budget_of(cfg: Config, memory: Optional[str]) -> tuple[Optional[int], str]:
    """`memory_budget` of `tidyrl plan --memory` where given, else of train.memory_budget."""
    return memory_budget(memory) if memory else memory_budget(cfg.train.memory_budget, key="train.memory_budget")


def memory_budget(memory: Optional[str], key: str = "--memory") -> tuple[Optional[int], str]:
    """(bytes a process has, where that figure comes from) for `memory`: a size ('24GiB'), 'available' (the host's
    available memory), or None: the CUDA device's total where the run uses one, else no budget (a CPU run is not
    refused on a prediction)."""
    if memory == "available":
        return available_host_bytes(), "the host's available memory (MemAvailable)"
    if memory is not None:
        try:
            return parse_size(memory), f"{key} {memory}"
        except ValueError as err:
            raise ConfigError([f"{key}: {err}"]) from None
    cuda = _cuda_bytes()
    return (cuda, "the CUDA device's memory") if cuda else (None, "")


AUTO_KNOBS = {"rollout.generation_batch_size": "generation", "rollout.forward_batch_size": "scoring",
              "train.micro_batch_size": "update"}
"""The knobs that may be `auto` -> the phase of the memory plan whose peak each one sets."""
AUTO_MARGIN = 0.10
"""`auto` batch sizes fit the budget less this fraction: room for what the plan does not count (the allocator's
fragmentation, a kernel's scratch buffers; docs/memory.md has the measured ratios)."""


def knob(cfg: Config, name: str):
    section, key = name.split(".")
    return getattr(getattr(cfg, section), key)


def set_knob(cfg: Config, name: str, value: int) -> None:
    section, key = name.split(".")
    setattr(getattr(cfg, section), key, value)


def auto_knobs(cfg: Config) -> list[str]:
    """The batch-size knobs `cfg` sets to `auto`."""
    return [name for name in AUTO_KNOBS if is_auto(knob(cfg, name))]


def auto_budget(cfg: Config, memory: Optional[str]) -> tuple[Optional[int], str]:
    """(bytes a process has, where that figure comes from) for `auto`: as `budget_of`, and on a machine whose
    budget is otherwise unknown (a CPU run without one), the host's available memory shared among the processes on
    it."""
    budget, source = budget_of(cfg, memory)
    if budget is None:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        available = available_host_bytes()
        if available:
            budget = available // local
            source = "the host's available memory (MemAvailable)" + (f" / {local} processes" if local > 1 else "")
    return budget, source


def candidates(name: str, share: int, must_divide: bool) -> list[int]:
    """The values `auto` may take for knob `name`, largest first: for the update's micro-batch the divisors of
    `share` (each process's episodes a mini-batch: the batch plan's rule), for a no-grad chunk the divisors of
    `share` (each process's episodes a rollout) where `must_divide` (train.exact_gradients), else the sizes of
    `share` cut into n equal chunks (the largest chunk ceil(share / n), for n = 1, 2, ...): the fewest chunks."""
    if name == "train.micro_batch_size" or must_divide:
        return [d for d in range(share, 0, -1) if share % d == 0]
    return sorted({-(-share // n) for n in range(1, share + 1)}, reverse=True)


def resolve_auto(cfg: Config, names: list[str], model_config, prompt_ids: list, plan, critic: Optional[dict], *,
                 memory: Optional[str], fsdp: bool, exact_chunks: bool, recorded: Optional[dict] = None,
                 smallest: Optional[Callable[[int], int]] = None) -> dict:
    """Set each knob of `names` (those `cfg` set to `auto`: `auto_knobs`) in `cfg` itself, before anything reads it,
    to the largest of its `candidates` whose phase of the memory plan fits the budget (`auto_budget`) less
    AUTO_MARGIN; the smallest where none fits
    (the memory check then names the fix). `plan`: the batch plan made with the auto knobs at 1; `exact_chunks`:
    the no-grad chunks must divide each process's episodes (train.exact_gradients). `recorded`: plan.json's
    `auto_batch_sizes` of the run being resumed, whose values are kept where the processes and the budget are the
    same (the host's available memory counts as the same budget: it moves from one start to the next), recomputed
    (and said so) where not: micro-batching changes no number of the plan. `smallest`: the least of a number over
    the run's processes (models.collectives.reduce_min), so that every process takes the same sizes whatever memory
    each one reads (a host's available memory moves; GPUs may differ). Returns plan.json's `auto_batch_sizes` (the
    values, the budget and its source, and whether they were recomputed)."""
    budget, source = auto_budget(cfg, memory)
    if smallest is not None and budget is not None:
        budget = smallest(budget)
    same = (recorded is not None and recorded.get("world_size") == plan.world_size
            and recorded.get("source") == source
            and (recorded.get("budget_bytes") == budget or source.startswith("the host's available memory")))
    per_minibatch, share = plan.episodes_per_minibatch_per_process, plan.episodes_per_rollout_per_process
    chosen, why = {}, ""
    if same:
        chosen = {n: recorded["values"][n] for n in names if n in recorded.get("values", {})}
        why = "kept from the run it resumes"
    elif recorded is not None:
        why = (f"recomputed for {plan.world_size} process(es) and {source} (the run it resumes had "
               f"{recorded.get('world_size')} and {recorded.get('source')}: "
               + ", ".join(f"{n}={v}" for n, v in recorded.get("values", {}).items()) + ")")
    if budget is None:
        raise ConfigError([f"{', '.join(names)}: auto needs to know the memory a process has, and this machine "
                           "does not say; set train.memory_budget (e.g. 24GiB) or a number"])
    usable = int(budget * (1 - AUTO_MARGIN))
    inputs = memory_inputs(cfg, model_config, prompt_ids, plan, critic, cuda=source.startswith("the CUDA"),
                           fsdp=fsdp, device_bytes=budget)
    for name in names:
        if name in chosen:
            continue
        options = candidates(name, per_minibatch if name == "train.micro_batch_size" else share, exact_chunks)
        chosen[name] = options[-1]
        for value in options:
            phases = memory_plan(_with_knob(inputs, name, value, per_minibatch)).phases
            phase = next((p for p in phases if p.name == AUTO_KNOBS[name]), None)
            if phase is None or phase.total <= usable:
                chosen[name] = value
                break
    for name in names:
        set_knob(cfg, name, chosen[name])
    return {"values": {n: chosen[n] for n in names}, "world_size": plan.world_size, "budget_bytes": budget,
            "source": source, "margin": AUTO_MARGIN, "fits": gib(usable), **({"note": why} if why else {})}


def _with_knob(inputs: MemoryInputs, name: str, value: int, per_minibatch: int) -> MemoryInputs:
    from dataclasses import replace

    if name == "train.micro_batch_size":
        return replace(inputs, micro_batch_size=value, accumulation_steps=per_minibatch // value)
    return replace(inputs, **{name.split(".")[1]: value})


def auto_line(auto: Optional[dict]) -> Optional[str]:
    """The run's first words on its `auto` batch sizes."""
    if not auto:
        return None
    values = ", ".join(f"{n}={v}" for n, v in auto["values"].items())
    return (f"auto batch sizes: {values} (the largest whose predicted peak fits {auto['fits']}: "
            f"{100 * (1 - auto['margin']):.0f} % of {gib(auto['budget_bytes'])}, {auto['source']})"
            + (f"; {auto['note']}" if auto.get("note") else ""))


def check_memory(cfg: Config, model_config, prompt_ids: list, plan, critic: Optional[dict],
                 memory: Optional[str] = None, fsdp: Optional[bool] = None) -> tuple[Optional[MemoryPlan], str]:
    """(the memory plan or None, a line for the run's report). Raises ConfigError naming each phase that would not
    fit the memory a process has (`memory_budget`), by how much, and what to change. `fsdp`: whether the policy is
    sharded with FSDP2 over the plan's processes (None: as the launch asks). A model config without the
    shape keys the formulas need gives no plan (and says so)."""
    budget, source = budget_of(cfg, memory)
    fsdp = plans_fsdp2(plan, fsdp)
    try:
        inputs = memory_inputs(cfg, model_config, prompt_ids, plan, critic, cuda=source.startswith("the CUDA"),
                               fsdp=fsdp, device_bytes=budget)
    except ValueError as err:
        return None, f"memory: not planned ({err})"
    return planned(inputs, budget, source, plan.episodes_per_minibatch_per_process)


def planned(inputs, budget: Optional[int], source: str, per_minibatch: int, detail: str = ""
            ) -> tuple[MemoryPlan, str]:
    """The memory plan of `inputs` and its line for the run's report (`detail` added to the peak's phase). Raises
    ConfigError naming each phase that would not fit `budget` (from `source`), by how much, and what to change
    (`fit_problems`, with `per_minibatch` examples or episodes a process per optimizer step)."""
    mplan = memory_plan(inputs)
    peak = mplan.peak
    line = f"memory: predicted peak {gib(peak.total)} per process ({peak.name}{detail})"
    if budget:
        problems = fit_problems(inputs, budget, per_minibatch=per_minibatch)
        if problems:
            raise ConfigError([f"memory ({source}): {p}" for p in problems])
        line += f", fits the {gib(budget)} of {source}"
    return mplan, line

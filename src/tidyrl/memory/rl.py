"""An RL run's memory plan from its config, before any weights load (`check_memory`, run by `check_rl_inputs` for
`tidyrl train` and `tidyrl plan`): the shapes from the models' configs, the sizes from the batch plan, the memory a
process has (`tidyrl plan --memory`, else the CUDA device's own where the run uses one), and the phases that would
not fit with what to change. The formulas are `tidyrl.memory.plan`'s (pure, no torch)."""

from __future__ import annotations

import os
import sys
from typing import Optional

from tidyrl.algorithms.table import ALGORITHMS
from tidyrl.config import Config, ConfigError
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


def memory_budget(memory: Optional[str]) -> tuple[Optional[int], str]:
    """(bytes a process has, where that figure comes from) for `memory`: a size ('24GiB'), 'available' (the host's
    available memory), or None: the CUDA device's total where the run uses one, else no budget (a CPU run is not
    refused on a prediction)."""
    if memory == "available":
        return available_host_bytes(), "the host's available memory (MemAvailable)"
    if memory is not None:
        return parse_size(memory), f"--memory {memory}"
    cuda = _cuda_bytes()
    return (cuda, "the CUDA device's memory") if cuda else (None, "")


def check_memory(cfg: Config, model_config, prompt_ids: list, plan, critic: Optional[dict],
                 memory: Optional[str] = None, fsdp: Optional[bool] = None) -> tuple[Optional[MemoryPlan], str]:
    """(the memory plan or None, a line for the run's report). Raises ConfigError naming each phase that would not
    fit the memory a process has (`memory_budget`), by how much, and what to change. `fsdp`: whether the policy is
    sharded with FSDP2 over the plan's processes (None: as the launch asks). A model config without the
    shape keys the formulas need gives no plan (and says so)."""
    from tidyrl.models.sharding import launch_sharding

    budget, source = memory_budget(memory)
    fsdp = plan.world_size > 1 and (launch_sharding() == "fsdp2" if fsdp is None else fsdp)
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

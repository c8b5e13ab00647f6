"""An offline stage's memory plan (sft, reward, dpo, kto) from its config and its tokenised data, before any weights
load (`check_offline_memory`, run by each offline loop and by `tidyrl plan`): the policy's shape from its config,
the longest sequence from the data as the stage cuts, packs and pads it, the memory a process has, and the phases
that would not fit with what to change. The formulas are `tidyrl.memory.plan`'s (pure, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from tidyrl.algorithms.choices import REFERENCE_FREE_LOSS_TYPES
from tidyrl.config import Config
from tidyrl.memory.plan import DTYPE_BYTES, MemoryPlan, OfflineInputs, Shape
from tidyrl.memory.rl import budget_of, planned, plans_fsdp2
from tidyrl.models.devices import WIDTH_MULTIPLE


@dataclass(frozen=True)
class StageMemory:
    """What an offline stage's memory plan reads of the stage."""

    sequences: Callable[[Any], list]
    """The token sequences one of the loop's items runs as (a row, a pair's two sides, a KTO example's one)."""
    reference: Callable[[Config], bool] = lambda cfg: False
    """Whether a frozen reference scores the data under this config."""
    mismatched: bool = False
    """The reference also scores a prompt of one training example with the completion of another (KTO's z0 pairs):
    at most the longest prompt and the longest completion, cut to data.max_length."""
    num_labels: Optional[int] = None
    """The outputs of the trained model's head where it is not the language-model head (a reward model's score)."""


STAGE_MEMORY = {
    "sft": StageMemory(sequences=lambda row: [row]),
    "reward": StageMemory(sequences=lambda pair: [pair.chosen, pair.rejected], num_labels=1),
    "dpo": StageMemory(sequences=lambda pair: [pair.chosen, pair.rejected],
                       reference=lambda cfg: cfg.dpo.loss_type not in REFERENCE_FREE_LOSS_TYPES),
    "kto": StageMemory(sequences=lambda example: [example.sequence], reference=lambda cfg: True, mismatched=True),
}
"""Offline stage (config.OFFLINE_STAGES) -> what its memory plan reads of it."""


def longest_tokens(stage: str, items: list, held_out: list, max_length: Optional[int]) -> tuple[int, int]:
    """(T: the longest sequence of the training and held-out items, as the loop forms them (after data.max_length's
    cut; sft.packing: its packed rows); the longest sequence the reference scores: T, or with the stage's
    mismatched pairs (StageMemory.mismatched) the longer of T and those)."""
    spec = STAGE_MEMORY[stage]
    T = max((len(s.input_ids) for item in [*items, *held_out] for s in spec.sequences(item)), default=0)
    if not spec.mismatched or not items:
        return T, T
    prompt = max(e.prompt_length for e in items)
    completion = max(len(e.sequence.input_ids) - e.prompt_length for e in items)
    mismatched = prompt + completion if max_length is None else min(prompt + completion, max_length)
    return T, max(T, mismatched)


def offline_memory_inputs(cfg: Config, model_config, tokens: int, reference_tokens: int, plan, *, cuda: bool,
                          fsdp: bool) -> OfflineInputs:
    """The memory plan's numbers for this offline config: the policy's shape from `model_config` (a reward model:
    one output, as the reward stage loads it), T and the reference's longest sequence (`longest_tokens`; on CUDA
    rounded up as pad_batch pads), the plan's micro-batch and accumulation."""
    spec = STAGE_MEMORY[cfg.algorithm]
    policy = Shape.of(model_config)
    if spec.num_labels is not None:  # reward_model.load_reward_model: a score head of one output
        policy = replace(policy, num_labels=spec.num_labels)
    multiple = WIDTH_MULTIPLE.get("cuda" if cuda else "cpu", 1)  # as pad_batch widens a micro-batch

    def widen(n: int) -> int:
        return n + -n % multiple

    return OfflineInputs(
        stage=cfg.algorithm, policy=policy, dtype_bytes=DTYPE_BYTES[cfg.model_dtype], tokens=widen(tokens),
        micro_batch_size=cfg.train.micro_batch_size, world_size=plan.world_size, fsdp=fsdp,
        lora_r=cfg.lora.r if cfg.lora.enabled else 0,
        lora_targets=tuple(cfg.lora.target_modules) if cfg.lora.enabled and cfg.lora.target_modules else None,
        gradient_checkpointing=cfg.train.gradient_checkpointing, sync_each_microbatch=cfg.train.sync_each_microbatch,
        accumulation_steps=plan.gradient_accumulation_steps, reference=spec.reference(cfg),
        reference_tokens=widen(reference_tokens) if reference_tokens > tokens else 0)


def memory_header(memory: Optional[MemoryPlan]) -> dict:
    """plan.json's `memory` (per process, each phase's predicted peak and its parts in bytes), or nothing."""
    return {"memory": memory.to_dict()} if memory is not None else {}


def check_offline_memory(cfg: Config, model_config, items: list, held_out: list, plan, memory: Optional[str] = None,
                         fsdp: Optional[bool] = None) -> tuple[Optional[MemoryPlan], str]:
    """(the memory plan or None, a line for the run's notes) of an offline stage on its tokenised `items` and
    `held_out` (the loop's own: pairs, examples or packed rows). Raises ConfigError naming each phase that would
    not fit the memory a process has (`memory`: a size, 'available', or None: the CUDA device's where the run uses
    one), by how much, and what to change. `fsdp`: whether the policy is sharded with FSDP2 over the plan's
    processes (None: as the launch asks). A model config without the shape keys the formulas need gives no plan."""
    budget, source = budget_of(cfg, memory)
    fsdp = plans_fsdp2(plan, fsdp)
    tokens, reference_tokens = longest_tokens(cfg.algorithm, items, held_out, cfg.data.max_length)
    try:
        inputs = offline_memory_inputs(cfg, model_config, tokens, reference_tokens, plan,
                                       cuda=source.startswith("the CUDA"), fsdp=fsdp)
    except ValueError as err:
        return None, f"memory: not planned ({err})"
    return planned(inputs, budget, source, plan.examples_per_process, f"; sequences of up to {inputs.tokens} tokens")

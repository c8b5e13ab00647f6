"""The engine interface: what turns prompts into completions for a rollout (`rollout.engine`).

    engine.sync(policy) -> seconds        before sampling: the engine holds exactly the policy's weights
    engine.generate(prompts, sample_keys, settings)
        -> (completion_ids (B, max_new_tokens), completion_mask (B, max_new_tokens), truncated (B,),
            logprobs (B, max_new_tokens): the sampler's log-prob of each sampled token, 0 past the end)
    engine.release()                      after generation: give memory back to training until the next sync

Prompts are token ids and completions come back as token ids (token in, token out: nothing is re-tokenised),
and each sample's random stream is its own key (`models.generation.sample_seed`), so a resumed run regenerates
the same rollout. What an engine can do it declares (`Capabilities`); the learner reads those and never an
engine's name. A new engine is one module here, a line in `engines.ENGINES`, and its tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence


@dataclass
class SamplingSettings:
    """What every sample of a generate call shares (rollout.* keys)."""

    max_new_tokens: int
    eos_ids: Sequence[int]
    pad_id: int
    batch_size: int = 64
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def of_rollout(cls, rollout, eos_ids: Sequence[int], pad_id: int) -> "SamplingSettings":
        """The settings of the `rollout` config section (max_new_tokens, generation_batch_size, min_new_tokens,
        temperature, top_p, top_k) with the model's end-of-sequence and padding ids."""
        return cls(max_new_tokens=rollout.max_new_tokens, eos_ids=eos_ids, pad_id=pad_id,
                   batch_size=rollout.generation_batch_size, min_new_tokens=rollout.min_new_tokens,
                   temperature=rollout.temperature, top_p=rollout.top_p, top_k=rollout.top_k)


class EngineError(RuntimeError):
    """An engine cannot be built or used as configured; the message names the key or the package."""


@dataclass(frozen=True)
class Capabilities:
    """What an engine declares about itself."""

    samples_trained_weights: bool
    """It samples from the training model itself (so under FSDP the full weights are gathered around a generate
    call, and its log-probs are the trainer's up to rounding); False: from its own copy of the weights."""
    needs_weight_sync: bool
    """Its copy must be refreshed from the policy before each rollout (`sync` takes time worth logging as
    time/weight_sync_s)."""
    can_sleep: bool
    """`release` frees its memory for training (vLLM's sleep mode on CUDA)."""
    default_tis_cap: float
    """The truncated importance sampling cap used when rollout.tis_cap is unset (0 = off): on where the sampler
    is another program whose log-probs differ from the trainer's (Yao et al. 2025)."""


class Engine(Protocol):
    """The interface every engine implements (see the module docstring)."""

    name: str
    capabilities: Capabilities

    def sync(self, policy) -> float: ...

    def generate(self, prompts: Sequence[Sequence[int]], sample_keys: Sequence[int], settings: "SamplingSettings"): ...

    def release(self) -> None: ...


def in_process_fsdp_problem(cfg) -> Optional[str]:
    """What an engine inside the training processes (builtin, vllm) refuses on an FSDP2-sharded policy, or None:
    rollout.lag, whose weights a version behind would be a whole copy on every process."""
    if not cfg.rollout.lag:
        return None
    return (f"rollout.lag={cfg.rollout.lag} under FSDP needs rollout.engine: vllm-server: the weights a version "
            "behind are the servers' (gathered once per launch into the first process, which syncs them); an "
            f"in-process engine ({cfg.rollout.engine}) would need a whole copy of the weights on every process. "
            "Start vLLM servers (docs/async.md) or set rollout.lag=0.")


class FullWeights(dict):
    """A policy's full weights as an engine loads them (`policy_parameters`: names, tensors) on the CPU, at
    one moment: what an engine with its own copy of the weights syncs from in place of the model (rollout.lag under
    FSDP2, where the weights of a launch are gathered on the learner's thread and synced later from another). Only
    the process that writes them for the servers keeps them; the others hold an empty one (`gathered_weights`)."""


def gathered_weights(policy, keep: bool) -> FullWeights:
    """The policy's weights now, as CPU tensors (`policy_parameters`), kept where `keep` (else an empty FullWeights).
    Under FSDP2 each parameter's all-gather is a collective: every process calls this at the same point, and only
    the keeper holds the whole model (one parameter at a time on the others)."""
    weights = FullWeights()
    for name, tensor in policy_parameters(policy):
        if keep:
            weights[name] = tensor.detach().to("cpu", copy=True).contiguous()
    return weights


def policy_parameters(policy):
    """The policy's weights as an engine loads them: (name, tensor) under the base model's Hugging Face names, LoRA
    folded in (`_merged_state_dict`); under FSDP2 each parameter gathered as it is reached, never the whole model
    at once (`full_parameters`). A `FullWeights` gives its own."""
    from tidyrl.models.lora import unwrap_peft
    from tidyrl.models.sharding import full_parameters

    if isinstance(policy, FullWeights):
        return iter(policy.items())
    peft = unwrap_peft(policy)
    return full_parameters(_merged_state_dict(peft) if peft is not None else policy.state_dict())


def _merged_state_dict(peft_model) -> dict:
    """The base model's state dict with the LoRA adapter folded in (W + B A * scale), under the base's names,
    without changing the training model (peft merges in place, so: merge, copy, unmerge)."""
    peft_model.merge_adapter()
    try:
        base = peft_model.get_base_model()
        state = {}
        for name, tensor in base.state_dict().items():
            if "lora_" in name:
                continue
            state[name.replace(".base_layer", "")] = tensor.detach().clone()
        return state
    finally:
        peft_model.unmerge_adapter()

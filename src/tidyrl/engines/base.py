"""The engine interface: what turns prompts into completions for a rollout (`rollout.engine`).

    engine.sync(policy) -> seconds        before sampling: the engine holds exactly the policy's weights
    engine.generate(prompts, sample_keys, settings)
        -> (completion_ids (B, max_new_tokens), completion_mask (B, max_new_tokens), truncated (B,),
            logprobs (B, max_new_tokens): the sampler's log-prob of each sampled token, 0 past the end)
           and with settings.record_routes (an engine whose capabilities say `records_routes`) two more:
           a mixture of experts' routes of the prompts (B, longest prompt, MoE layers, k), left-aligned, and of the
           completions (B, max_new_tokens, MoE layers, k) (`models.generation.generate`; None for a dense model)
    engine.release()                      after generation: give memory back to training until the next sync

Prompts are token ids and completions come back as token ids (token in, token out: nothing is re-tokenised),
and each sample's random stream is its own key (`models.sequences.sample_seed`), so a resumed run regenerates
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
    record_routes: bool = False
    """Return a mixture of experts' routes too (rollout routing replay; engines with `records_routes`)."""

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
    records_routes: bool = False
    """It returns the experts a mixture-of-experts policy chose for every token (`SamplingSettings.record_routes`),
    which the trainer replays (rollout.routing_replay)."""


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
    the process that writes them for the servers keeps them; the others hold an empty one (`gathered_weights`).
    `from_adapter`: the policy carried a LoRA adapter (folded into these weights)."""

    from_adapter: bool = False


def gathered_weights(policy, keep: bool) -> FullWeights:
    """The policy's weights now, as CPU tensors (`policy_parameters`), kept where `keep` (else an empty FullWeights).
    Under FSDP2 each parameter's all-gather is a collective: every process calls this at the same point, and only
    the keeper holds the whole model (one parameter at a time on the others)."""
    from tidyrl.models.lora import unwrap_peft

    weights = FullWeights()
    weights.from_adapter = unwrap_peft(policy) is not None
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


# --- LoRA: the adapter alone, or the merged weights ------------------------------------------------------------

ADAPTER_SYNC = True
"""With a LoRA policy, engines that can serve an adapter load the base once and receive only the adapter at each
sync (`lora_sync_plan`). Tests set it False to compare with the merged sync."""

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 takes for `max_lora_rank` (vllm.config.lora.MaxLoRARanks); an adapter's rank may be any
up to the one chosen."""


@dataclass(frozen=True)
class LoRASync:
    """How a policy's weights reach an engine that holds its own copy: `adapter` (the base loaded once, only the
    LoRA adapter sent at each sync, served as a LoRA request), `merged` (the whole model with the adapter folded
    in, every sync), or `full` (no adapter: the whole model). `why` says why, for the run's log."""

    mode: str
    why: str = ""
    rank: int = 0
    """adapter: the largest rank of the adapter's layers (the engine's max_lora_rank covers it)."""

    @property
    def max_lora_rank(self) -> int:
        """The smallest of vLLM's max_lora_rank values that holds `rank`."""
        return next(r for r in VLLM_LORA_RANKS if r >= self.rank)

    def note(self, engine: str) -> str:
        if self.mode == "adapter":
            return (f"{engine}: LoRA sync: adapter only (rank {self.rank}): the base weights are loaded once, "
                    "each sync sends the adapter")
        return f"{engine}: LoRA sync: merged weights, every sync: {self.why}"


def lora_sync_plan(policy) -> LoRASync:
    """How `policy`'s weights should reach an engine with its own copy (`LoRASync`): the adapter alone wherever
    vLLM's LoRA support can apply it, else the merged weights and why (`adapter_serving_problem`)."""
    from tidyrl.models.lora import unwrap_peft

    if isinstance(policy, FullWeights):
        if not policy.from_adapter:
            return LoRASync("full")
        return LoRASync("merged", "the policy is FSDP2-sharded: its weights are gathered whole (LoRA folded in)")
    peft = unwrap_peft(policy)
    if peft is None:
        return LoRASync("full")
    from tidyrl.models.sharding import is_sharded

    if is_sharded(peft):
        return LoRASync("merged", "the policy is FSDP2-sharded: its weights are gathered whole (LoRA folded in)")
    if not ADAPTER_SYNC:
        return LoRASync("merged", "adapter-only sync is turned off (tidyrl.engines.base.ADAPTER_SYNC)")
    problem, rank = adapter_serving_problem(peft)
    if problem:
        return LoRASync("merged", problem)
    return LoRASync("adapter", rank=rank)


def adapter_serving_problem(peft_model) -> tuple[Optional[str], int]:
    """(why vLLM's LoRA support cannot serve this adapter beside the base weights, or None; the adapter's largest
    rank). vLLM 0.32 applies LoRA to linear layers only (not to the embeddings or the output layer), without DoRA,
    trained biases, modules_to_save or layer replication, and up to rank 512."""
    from peft.tuners.lora import Embedding, LoraLayer

    config = peft_model.peft_config[peft_model.active_adapter]
    rank = max([config.r, *(config.rank_pattern or {}).values()])
    if config.use_dora:
        return "the adapter uses DoRA, which vLLM's LoRA does not serve", rank
    if config.modules_to_save:
        return f"the adapter trains whole modules (modules_to_save: {list(config.modules_to_save)})", rank
    if config.bias != "none":
        return f"the adapter trains biases (bias: {config.bias})", rank
    if config.layer_replication:
        return "the adapter replicates layers (layer_replication)", rank
    base = peft_model.get_base_model()
    heads = {id(m) for m in (base.get_input_embeddings(), base.get_output_embeddings()) if m is not None}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer) and (isinstance(module, Embedding) or id(module) in heads
                                              or id(module.get_base_layer()) in heads):
            return (f"the adapter trains the embeddings or the output layer ({name}), which vLLM's LoRA does not "
                    "serve", rank)
    if rank > VLLM_LORA_RANKS[-1]:
        return f"the adapter's rank {rank} is above vLLM's largest max_lora_rank {VLLM_LORA_RANKS[-1]}", rank
    return None, rank



"""`rollout.engine: builtin`: tidyrl's own decode loop (`models.generation.generate`, with the lean Llama decode
step and CUDA graphs where they apply), on the policy itself: nothing to copy or sync."""

from __future__ import annotations

from typing import Optional, Sequence

from tidyrl.engines.base import Capabilities, SamplingSettings, in_process_fsdp_problem


CAPABILITIES = Capabilities(samples_trained_weights=True, needs_weight_sync=False, can_sleep=False,
                            default_tis_cap=0.0, records_routes=True)
"""What the engine declares, known before it is built (the config's checks read it)."""


class BuiltinEngine:
    """tidyrl's decode loop on the policy (no copy of the weights, nothing to sync)."""

    name = "builtin"
    capabilities = CAPABILITIES

    def __init__(self, policy, fast_path: bool = True):
        self.policy, self.fast_path = policy, fast_path

    def sync(self, policy) -> float:
        self.policy = policy
        return 0.0

    def release(self) -> None:
        """Nothing to give back: the engine is the policy."""

    def generate(self, prompts: Sequence[Sequence[int]], sample_keys: Sequence[int], settings: SamplingSettings):
        from tidyrl.models.generation import generate

        return generate(self.policy, prompts, sample_keys=sample_keys, max_new_tokens=settings.max_new_tokens,
                        min_new_tokens=settings.min_new_tokens, eos_ids=settings.eos_ids, pad_id=settings.pad_id,
                        batch_size=settings.batch_size, temperature=settings.temperature, top_p=settings.top_p,
                        top_k=settings.top_k, return_logprobs=True, return_routes=settings.record_routes,
                        fast_path=self.fast_path)


def config_problems(cfg) -> list[str]:
    """The builtin engine takes every rollout setting."""
    return []


def fsdp_problem(cfg) -> Optional[str]:
    """What it refuses on an FSDP2-sharded policy (`base.in_process_fsdp_problem`), or None."""
    return in_process_fsdp_problem(cfg)


def resume_note(saved_state: dict) -> Optional[str]:
    """A resume's warning where the checkpoint's rollouts were drawn with another scheme than this engine's own
    draws (`models.generation.sampler_change_note`), or None."""
    from tidyrl.models.generation import sampler_change_note

    return sampler_change_note(saved_state)


def build(cfg, policy, device: str, max_model_len: int) -> BuiltinEngine:
    # train.exact_gradients: the model's own decode step, the one FSDP2 runs (its sampled log-probs are the old
    # log-probs: the same code path on any split)
    return BuiltinEngine(policy, fast_path=cfg.model_fast_paths and not cfg.train.exact_gradients)

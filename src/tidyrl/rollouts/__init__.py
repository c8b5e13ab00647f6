"""Rollouts: episodes made through an engine, and the `Rollout` record the learner reads (DESIGN §3, §6)."""

from tidyrl.rollouts.record import Rollout, chunks
from tidyrl.rollouts.scoring import score_logprobs, score_values

__all__ = ["Rollout", "chunks", "score_logprobs", "score_values"]

"""The `Rollout` record (DESIGN §3: one rollout's episodes and everything computed about them) and its no-grad
scoring (step 3: the reference's log-probs, the critic's values, the trainer's log-probs of what an engine
sampled), chunk by chunk so that at most one chunk's logits exist at a time.

Generation is an engine's (`tidyrl.engines`); the forward passes are `tidyrl.models.forward`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterator, Optional, Sequence

import torch



@dataclass
class Rollout:
    """One rollout's episodes, R of them (per process: R / W), prompt-major:
    episode p*k + j is sample j of prompt p.

    Shapes: R episodes, Lp = longest prompt, Tc = longest completion.
    """

    prompt_ids: torch.Tensor  # (R, Lp) long, left-padded
    prompt_mask: torch.Tensor  # (R, Lp) long, 1 = real token
    completion_ids: torch.Tensor  # (R, Tc) long, right-padded
    completion_mask: torch.Tensor  # (R, Tc) float, 1 up to and including EOS
    truncated: torch.Tensor  # (R,) bool, reached max_new_tokens without EOS
    old_logprobs: Optional[torch.Tensor] = None  # (R, Tc) policy before the updates; None when E*M == 1
    ref_logprobs: Optional[torch.Tensor] = None  # (R, Tc) frozen reference; None when no KL term
    advantages: Optional[torch.Tensor] = None  # (R,) or (R, Tc)
    old_values: Optional[torch.Tensor] = None  # (R, Tc) PPO: the critic's values before the updates
    returns: Optional[torch.Tensor] = None  # (R, Tc) PPO: GAE returns, the critic's targets
    action_mask: Optional[torch.Tensor] = None  # (R, Tc) multi-turn: 1 = the model's token, 0 = the environment's
    is_weights: Optional[torch.Tensor] = None  # (R, Tc) truncated importance weights min(pi_trainer/pi_sampler, cap)
    sampler_logprobs: Optional[torch.Tensor] = None  # (R, Tc) the engine's, when the weights are taken in the update
    teacher_logprobs: Optional[torch.Tensor] = None  # (R, Tc) on-policy distillation: the teacher's

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def sequences(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(prompt_ids, prompt_mask, completion_ids, completion_mask): what the model's forward takes
        (`models.forward.completion_logprobs(model, *batch.sequences, ...)`)."""
        return self.prompt_ids, self.prompt_mask, self.completion_ids, self.completion_mask

    def select(self, idx: Sequence[int] | torch.Tensor) -> "Rollout":
        """The episodes `idx`, with padding columns that none of them use trimmed away."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        pm = self.prompt_mask[idx]
        cm = self.completion_mask[idx]
        first = int((pm.sum(0) > 0).nonzero()[0]) if pm.numel() else 0  # left padding shared by all
        width = int(cm.sum(1).max().item()) if cm.numel() else 0
        width = max(width, 1)

        def cut(name: str, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if t is None:
                return None
            t = t[idx]
            if name.startswith("prompt"):  # left-padded: drop the columns every row pads
                return t[:, first:]
            return t[:, :width] if t.dim() == 2 else t  # per-token fields: right-padded

        return Rollout(**{f.name: cut(f.name, getattr(self, f.name)) for f in fields(self)})


def chunks(seq: Sequence[int], size: int) -> Iterator[list[int]]:
    seq = list(seq)
    for start in range(0, len(seq), size):
        yield seq[start: start + size]

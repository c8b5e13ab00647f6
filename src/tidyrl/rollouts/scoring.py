"""No-grad scoring of a rollout's episodes (DESIGN §3 step 3): the reference's log-probs, the critic's values, the
trainer's log-probs of what an engine sampled, chunk by chunk so that at most one chunk's logits exist at a time.
The forward passes are `tidyrl.models.forward`'s."""

from __future__ import annotations

import torch

from tidyrl.models.devices import to_device
from tidyrl.models.forward import completion_logprobs, completion_values
from tidyrl.rollouts.record import Rollout, chunks


@torch.no_grad()
def score_logprobs(model, rollout: Rollout, temperature: float, chunk_size: int, fast_path: bool = True
                   ) -> torch.Tensor:
    """No-grad log-probs (R, Tc) of every completion token, in chunks of `chunk_size`, so that at most one
    chunk's (chunk, Tc, V) logits exist at a time. Positions past EOS are 0."""
    out = None  # on the model's device: one copy to the host at the end, no synchronisation per chunk
    for idx in chunks(range(len(rollout)), chunk_size):
        part = rollout.select(idx)
        lp, _ = completion_logprobs(model, *part.sequences, temperature, fast_path=fast_path)
        if out is None:
            out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=lp.device)
        out[idx[0]: idx[-1] + 1, : lp.shape[1]] = lp.float() * to_device(part.completion_mask, lp.device)
    return out.cpu() if out is not None else torch.zeros(rollout.completion_ids.shape)


@torch.no_grad()
def score_values(critic, rollout: Rollout, chunk_size: int) -> torch.Tensor:
    """No-grad values (R, Tc) in chunks of `chunk_size`; positions past EOS are 0."""
    out = None  # as in score_logprobs: on the critic's device until the end
    for idx in chunks(range(len(rollout)), chunk_size):
        part = rollout.select(idx)
        v = completion_values(critic, *part.sequences)
        if out is None:
            out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=v.device)
        out[idx[0]: idx[-1] + 1, : v.shape[1]] = v.float() * to_device(part.completion_mask, v.device)
    return out.cpu() if out is not None else torch.zeros(rollout.completion_ids.shape)

"""The supervised fine-tuning loss: masked negative log-likelihood.

Pure tensor functions (no model, no config). Per micro-batch the SFT loop calls

    normaliser = sft_normaliser(mode, num_tokens=..., num_sequences=...)   # once, for the whole optimizer batch
    loss = sft_loss(logprobs_BT, mask_BT, mode, normaliser)

The normaliser counts the trained tokens (or examples) of the whole global
optimizer batch, so summing `sft_loss` over micro-batches and processes gives
the loss of the batch in one piece: `micro_batch_size` and the number of
processes never change the gradient (see `tidyrl.algorithms.losses.aggregate_loss`,
which this reuses).
"""

from __future__ import annotations

from torch import Tensor

from tidyrl.algorithms.choices import SFT_LOSS_AGGREGATIONS
from tidyrl.algorithms.losses import aggregate_loss, loss_normaliser


def sft_normaliser(mode: str, *, num_tokens: int | float, num_sequences: int) -> float:
    """Denominator of the SFT loss for one whole optimizer batch (all micro-batches, all processes).

        token_mean     ->  num_tokens     (trained tokens of the batch)
        sequence_mean  ->  num_sequences  (examples of the batch)

    A count of 0 gives 1 (the loss is then 0, not NaN).
    """
    if mode not in SFT_LOSS_AGGREGATIONS:
        raise ValueError(f"unknown SFT loss aggregation {mode!r}; valid values: {', '.join(SFT_LOSS_AGGREGATIONS)}")
    return loss_normaliser(mode, num_tokens=num_tokens, num_sequences=num_sequences, max_new_tokens=0)


def sft_loss(logprobs_BT: Tensor, mask_BT: Tensor, mode: str, normaliser: float) -> Tensor:
    """Masked negative log-likelihood of the target tokens: this micro-batch's share of the batch loss.

    The maximum-likelihood objective of supervised fine-tuning (Ouyang et al.
    2022, InstructGPT §3.5 "SFT"; the loss on completion tokens only, as there):

        token_mean:     L = -sum_{b,t} mask_{b,t} log p(x_{b,t} | x_{b,<t}) / normaliser
        sequence_mean:  L = -sum_b [ sum_t mask_{b,t} log p(x_{b,t} | x_{b,<t}) / sum_t mask_{b,t} ] / normaliser

    Args:
        logprobs_BT: [B, T] log-probs of each target token (position t predicts token t).
        mask_BT: [B, T] 1 for trained tokens (completion / assistant tokens by default), 0 elsewhere.
        mode: "token_mean" or "sequence_mean".
        normaliser: `sft_normaliser(...)` of the whole optimizer batch.

    Returns:
        Scalar tensor.
    """
    if mode not in SFT_LOSS_AGGREGATIONS:
        raise ValueError(f"unknown SFT loss aggregation {mode!r}; valid values: {', '.join(SFT_LOSS_AGGREGATIONS)}")
    return aggregate_loss(-logprobs_BT, mask_BT, mode, normaliser)

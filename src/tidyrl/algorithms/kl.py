"""Per-token estimators of KL(pi || pi_ref) from samples of pi.

Schulman 2020, "Approximating KL Divergence"
(http://joschu.net/blog/kl-approx.html). Tokens are sampled from the policy
pi, so with the log-ratio

    log r = log pi_ref(x) - log pi(x),    E_pi[r] = 1,

the estimators are

    k1 = -log r                   unbiased, high variance, negative on some samples
    k2 = 1/2 (log r)^2            biased (low bias when pi ~ pi_ref), always >= 0
    k3 = (r - 1) - log r          unbiased, always >= 0, low variance

k3 is GRPO's choice (Shao et al. 2024, DeepSeekMath, eq. 4); k1 is the
classic RLHF reward penalty used by RLOO.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tidyrl.algorithms.choices import KL_ESTIMATORS

K3_LOG_RATIO_CLAMP = 20.0
"""k3 clamps log r to [-20, 20] before exp(): e^20 ~ 5e8 is far beyond any
useful penalty, while without the clamp a single token whose reference
log-prob exceeds the policy's by ~89 nats overflows exp() to inf (float32 and
bf16 alike) and turns the whole loss and its gradients into NaN."""


def kl_per_token(logprobs_BT: Tensor, ref_logprobs_BT: Tensor, estimator: str) -> Tensor:
    """Estimate KL(pi || pi_ref) at each sampled token.

    Schulman 2020, "Approximating KL Divergence"; with log r = ref - logp:

        k1 = logp - ref                              (= -log r)
        k2 = 1/2 (ref - logp)^2                      (= 1/2 (log r)^2)
        k3 = exp(ref - logp) - (ref - logp) - 1      (= (r - 1) - log r; Shao et al. 2024 eq. 4)

    For k3, log r is clamped to [-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP]
    before exp() for numerical stability (the clamp also applies to the
    linear term so k3 stays >= 0; its gradient is zero where clamped).

    Args:
        logprobs_BT: [B, T] log pi of the sampled tokens (may carry grad: GRPO
            puts the KL in the loss).
        ref_logprobs_BT: [B, T] log pi_ref of the same tokens (no grad).
        estimator: "k1", "k2" or "k3".

    Returns:
        [B, T] per-token estimates (padding positions are not masked here).
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; valid values: {', '.join(KL_ESTIMATORS)}")
    # The reference model is frozen: never let gradient reach it.
    log_ratio_BT = ref_logprobs_BT.detach() - logprobs_BT  # log r
    if estimator == "k1":
        return -log_ratio_BT
    if estimator == "k2":
        return 0.5 * log_ratio_BT.square()
    log_ratio_BT = log_ratio_BT.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return torch.exp(log_ratio_BT) - log_ratio_BT - 1.0

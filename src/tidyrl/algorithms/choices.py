"""The values the algorithms' options (and the model kernels' options, `kernels.*`) take, each list owned here and
read by the functions that take it, the config's checks (tidyrl.config) and the field docstrings the configuration
reference is generated from.

Pure data: imports nothing. The modules whose functions take these values import torch, which the config must
not (a config's errors and `tidyrl plan` come back without loading it), so the lists live here and those
modules read them. `<section>.policy_loss` values are the algorithm table's (`table.POLICY_LOSSES`).
"""

from __future__ import annotations

LOSS_AGGREGATIONS = ("token_mean", "sequence_mean", "constant")
"""`<section>.loss_aggregation` of the RL algorithms: the modes of `losses.aggregate_loss` and
`losses.loss_normaliser`."""

KL_ESTIMATORS = ("k1", "k2", "k3")
"""`<section>.kl_estimator`: the estimators of `kl.kl_per_token` (Schulman 2020)."""

GRPO_SCALES = ("group", "batch", "none")
"""`grpo.scale_rewards`: the scales of `advantages.grpo_advantages`."""

SFT_LOSS_AGGREGATIONS = ("token_mean", "sequence_mean")
"""`sft.loss_aggregation`: the modes of `sft.sft_loss` and `sft.sft_normaliser`."""

DPO_LOSS_TYPES = ("sigmoid", "ipo", "robust")
"""`dpo.loss_type` values measured against a reference model: the loss types of `preference.dpo_loss`."""

LABEL_SMOOTHING_LOSS_TYPES = ("sigmoid", "robust")
"""The `DPO_LOSS_TYPES` that take `dpo.label_smoothing` (IPO does not)."""

REFERENCE_FREE_LOSS_TYPES = ("simpo", "orpo")
"""`dpo.loss_type` values that need no reference model (`preference.simpo_loss`,
`preference.orpo_odds_ratio_loss`)."""

DECODE_ATTENTIONS = ("kernel", "sdpa")
"""`kernels.decode_attention`: the attentions of the fused decoding step (`models.fused_decode`): kernel (one Triton
kernel over the cache positions written so far) or sdpa (one SDPA call over the whole cache)."""

LAYER_KERNEL_MODES = ("compile", "none")
"""`kernels.layer_kernels`: the modes of `models.layer_kernels` (compile the trained model's decoder layers where
it applies, or keep the model's own)."""

"""Offline-stage losses on hand-worked numbers: masked SFT NLL, Bradley–Terry (with margin), DPO sigmoid, IPO,
robust DPO, SimPO, ORPO and KTO."""

import math

import pytest
import torch

from tidyrl.algorithms.preference import (bradley_terry_loss, dpo_loss, kto_loss, kto_reference_point, log_odds,
                                         orpo_odds_ratio_loss, sequence_logps, simpo_loss)
from tidyrl.algorithms.sft import sft_loss, sft_normaliser


def softplus(x: float) -> float:
    """-log sigmoid(-x) = log(1 + e^x)."""
    return math.log1p(math.exp(x))


# ---------------------------------------------------------------- SFT


LOGPROBS = torch.tensor([[-1.0, -2.0, -float("inf")], [-0.5, -4.0, 0.0]])  # -inf under the mask: no NaN
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


def test_sft_token_mean_divides_by_the_batch_token_count():
    # Targets: 1 + 2 (row 0) and 0.5 (row 1): 3.5 over 3 tokens.
    normaliser = sft_normaliser("token_mean", num_tokens=3, num_sequences=2)
    assert normaliser == 3.0
    assert sft_loss(LOGPROBS, MASK, "token_mean", normaliser).item() == pytest.approx(3.5 / 3)


def test_sft_sequence_mean_averages_each_example_first():
    # Row 0: (1 + 2) / 2 = 1.5; row 1: 0.5 / 1 = 0.5; mean over 2 examples = 1.0.
    normaliser = sft_normaliser("sequence_mean", num_tokens=3, num_sequences=2)
    assert sft_loss(LOGPROBS, MASK, "sequence_mean", normaliser).item() == pytest.approx(1.0)


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean"])
def test_sft_micro_batches_sum_to_the_batch_loss(mode):
    normaliser = sft_normaliser(mode, num_tokens=3, num_sequences=2)
    whole = sft_loss(LOGPROBS, MASK, mode, normaliser)
    parts = sft_loss(LOGPROBS[:1], MASK[:1], mode, normaliser) + sft_loss(LOGPROBS[1:], MASK[1:], mode, normaliser)
    assert parts.item() == pytest.approx(whole.item())
    # A per-micro-batch mean would differ: row 0 alone is 1.5, row 1 alone 0.5, their mean 1.0 != 3.5/3.
    if mode == "token_mean":
        assert whole.item() != pytest.approx(1.0)


def test_sft_gradient_only_reaches_target_tokens():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    sft_loss(logprobs, torch.tensor([[0.0, 1.0, 1.0]]), "token_mean", 2.0).backward()
    assert logprobs.grad.tolist() == [[0.0, -0.5, -0.5]]


def test_sft_rejects_unknown_modes_and_counts_zero_as_one():
    with pytest.raises(ValueError, match="token_mean, sequence_mean"):
        sft_normaliser("constant", num_tokens=3, num_sequences=1)
    assert sft_normaliser("token_mean", num_tokens=0, num_sequences=0) == 1.0


def test_sequence_logps_sums_completion_tokens_only():
    assert sequence_logps(LOGPROBS, MASK).tolist() == [-3.0, -0.5]


# ---------------------------------------------------------------- Bradley–Terry


def test_bradley_terry_loss():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    # -log sigmoid(d) = log(1 + e^-d) for d = 2, 0, -2.
    assert bradley_terry_loss(chosen, rejected).tolist() == pytest.approx(
        [softplus(-2), math.log(2), softplus(2)])  # 0.126928, 0.693147, 2.126928
    # A margin of 1 on the first pair: -log sigmoid(2 - 1) = 0.313262.
    with_margin = bradley_terry_loss(chosen, rejected, torch.tensor([1.0, 0.0, 0.0]))
    assert with_margin.tolist() == pytest.approx([softplus(-1), math.log(2), softplus(2)])
    assert with_margin[0].item() == pytest.approx(0.3132617)


def test_bradley_terry_gradient_pushes_the_rewards_apart():
    chosen, rejected = torch.tensor([0.0], requires_grad=True), torch.tensor([0.0], requires_grad=True)
    bradley_terry_loss(chosen, rejected).sum().backward()
    # d/dr_c [-log sigmoid(r_c - r_r)] = -(1 - sigmoid(0)) = -0.5; +0.5 for r_r.
    assert chosen.grad.item() == pytest.approx(-0.5) and rejected.grad.item() == pytest.approx(0.5)


def test_bradley_terry_is_stable_for_large_differences():
    loss = bradley_terry_loss(torch.tensor([-200.0, 200.0]), torch.tensor([0.0, 0.0]))
    assert loss.tolist() == pytest.approx([200.0, 0.0])


# ---------------------------------------------------------------- DPO and IPO

# Policy log-probs: chosen -1, rejected -3; reference: -2 and -2.
# log-ratios: chosen +1, rejected -1, so h = 2.
POLICY_CHOSEN, POLICY_REJECTED = torch.tensor([-1.0]), torch.tensor([-3.0])
REF_CHOSEN, REF_REJECTED = torch.tensor([-2.0]), torch.tensor([-2.0])


def test_dpo_sigmoid_loss_and_implicit_rewards():
    loss, chosen_reward, rejected_reward = dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED,
                                                    beta=0.5)
    assert loss.item() == pytest.approx(softplus(-1.0))  # -log sigmoid(0.5 * 2) = 0.313262
    assert chosen_reward.item() == pytest.approx(0.5) and rejected_reward.item() == pytest.approx(-0.5)


def test_dpo_with_the_policy_equal_to_the_reference_is_log_2():
    same = torch.tensor([-4.0, -7.0])
    loss, chosen_reward, rejected_reward = dpo_loss(same, same + 1, same, same + 1, beta=0.1)
    assert loss.tolist() == pytest.approx([math.log(2)] * 2)
    assert chosen_reward.tolist() == [0.0, 0.0] and rejected_reward.tolist() == [0.0, 0.0]


def test_dpo_label_smoothing():
    loss, _, _ = dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5, label_smoothing=0.1)
    # 0.9 * -log sigmoid(1) + 0.1 * -log sigmoid(-1) = 0.9 * 0.313262 + 0.1 * 1.313262 = 0.413262
    assert loss.item() == pytest.approx(0.4132617)


def test_dpo_gradient():
    policy_chosen = POLICY_CHOSEN.clone().requires_grad_()
    policy_rejected = POLICY_REJECTED.clone().requires_grad_()
    ref_chosen = REF_CHOSEN.clone().requires_grad_()
    loss, _, _ = dpo_loss(policy_chosen, policy_rejected, ref_chosen, REF_REJECTED, beta=0.5)
    loss.sum().backward()
    # d/dlogp_c [-log sigmoid(beta h)] = -beta * sigmoid(-beta h) = -0.5 * sigmoid(-1) = -0.134471.
    assert policy_chosen.grad.item() == pytest.approx(-0.5 / (1 + math.e))
    assert policy_rejected.grad.item() == pytest.approx(0.5 / (1 + math.e))
    assert ref_chosen.grad is None  # the reference is a constant


def test_ipo_loss():
    # (h - 1 / (2 tau))^2 with h = 2: tau = 0.5 -> (2 - 1)^2 = 1; tau = 0.1 -> (2 - 5)^2 = 9.
    for beta, want in ((0.5, 1.0), (0.1, 9.0)):
        loss, chosen_reward, _ = dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta=beta,
                                          loss_type="ipo")
        assert loss.item() == pytest.approx(want)
        assert chosen_reward.item() == pytest.approx(beta * 1.0)
    # The gradient pulls h towards the target, from either side: d/dh = 2 (h - 5) = -6 at h = 2.
    policy_chosen = POLICY_CHOSEN.clone().requires_grad_()
    dpo_loss(policy_chosen, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.1, loss_type="ipo")[0].backward()
    assert policy_chosen.grad.item() == pytest.approx(-6.0)


def test_dpo_rejects_bad_options():
    args = (POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED)
    with pytest.raises(ValueError, match="sigmoid, ipo, robust"):
        dpo_loss(*args, beta=0.1, loss_type="hinge")
    with pytest.raises(ValueError, match="beta"):
        dpo_loss(*args, beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(*args, beta=0.1, loss_type="ipo", label_smoothing=0.1)


def test_robust_dpo_loss():
    loss, _, _ = dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5, loss_type="robust",
                          label_smoothing=0.1)
    # beta h = 1: [0.9 * -log sigmoid(1) + 0.1 * log sigmoid(-1)] / 0.8
    #           = (0.9 * 0.313262 - 0.1 * 1.313262) / 0.8 = 0.150609 / 0.8 = 0.188262
    assert loss.item() == pytest.approx(0.1882617)
    # eps = 0 is plain DPO: -log sigmoid(1) = 0.313262.
    plain, _, _ = dpo_loss(POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED, beta=0.5, loss_type="robust")
    assert plain.item() == pytest.approx(softplus(-1.0))


def test_robust_dpo_is_unbiased_under_label_flips():
    # Labels flipped with probability eps: the expected robust loss is the clean DPO loss (Chowdhury et al. Lemma 3.1).
    # cDPO's expectation is not.
    eps, args = 0.2, (POLICY_CHOSEN, POLICY_REJECTED, REF_CHOSEN, REF_REJECTED)
    flipped = (POLICY_REJECTED, POLICY_CHOSEN, REF_REJECTED, REF_CHOSEN)
    clean = dpo_loss(*args, beta=0.5)[0].item()
    for loss_type, unbiased in (("robust", True), ("sigmoid", False)):
        expected = ((1 - eps) * dpo_loss(*args, beta=0.5, loss_type=loss_type, label_smoothing=eps)[0]
                    + eps * dpo_loss(*flipped, beta=0.5, loss_type=loss_type, label_smoothing=eps)[0]).item()
        assert (expected == pytest.approx(clean)) is unbiased


# ---------------------------------------------------------------- SimPO


def test_simpo_loss():
    # Chosen: log-prob -2 over 2 tokens; rejected: -6 over 3 tokens. beta = 2, gamma = 1:
    # r_w = 2 * -2/2 = -2, r_l = 2 * -6/3 = -4; -log sigmoid(-2 + 4 - 1) = -log sigmoid(1) = 0.313262.
    loss, chosen_reward, rejected_reward = simpo_loss(torch.tensor([-2.0]), torch.tensor([-6.0]),
                                                      torch.tensor([2]), torch.tensor([3]), beta=2.0, gamma=1.0)
    assert loss.item() == pytest.approx(softplus(-1.0))
    assert chosen_reward.item() == pytest.approx(-2.0) and rejected_reward.item() == pytest.approx(-4.0)
    # Gradient: d/dlogp_w = -(beta / |y_w|) * sigmoid(-1) = -1 * 0.268941.
    chosen = torch.tensor([-2.0], requires_grad=True)
    simpo_loss(chosen, torch.tensor([-6.0]), torch.tensor([2]), torch.tensor([3]), beta=2.0, gamma=1.0)[0].backward()
    assert chosen.grad.item() == pytest.approx(-1 / (1 + math.e))
    with pytest.raises(ValueError, match="gamma"):
        simpo_loss(chosen, chosen, torch.tensor([1]), torch.tensor([1]), beta=2.0, gamma=-1.0)


# ---------------------------------------------------------------- ORPO


def test_orpo_odds_ratio_loss():
    # P_w = 0.5 -> odds 1, log odds 0; P_l = 0.2 -> odds 0.25, log odds -log 4.
    # L_OR = -log sigmoid(log 4) = log(1 + 1/4) = 0.223144.
    loss, ratio = orpo_odds_ratio_loss(torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.2)]))
    assert ratio.item() == pytest.approx(math.log(4))
    assert loss.item() == pytest.approx(math.log(1.25))
    # log odds is finite near P = 1 and P = 0: P = 1 - 1e-6 -> log((1 - 1e-6) / 1e-6) = 13.815510.
    assert log_odds(torch.tensor([math.log1p(-1e-6)], dtype=torch.float64)).item() == pytest.approx(13.8155096)


# ---------------------------------------------------------------- KTO


def test_kto_loss():
    # beta = 0.5, z0 = 1. Desirable, r = 3: 1 - sigmoid(0.5 * (3 - 1)) = 1 - sigmoid(1) = sigmoid(-1) = 0.268941.
    # Undesirable, r = -1, lambda_U = 2: 2 - 2 * sigmoid(0.5 * (1 + 1)) = 2 * sigmoid(-1) = 0.537883.
    policy = torch.tensor([1.0, -3.0], requires_grad=True)
    ref = torch.tensor([-2.0, -2.0])
    loss, rewards = kto_loss(policy, ref, torch.tensor([True, False]), 1.0, beta=0.5, undesirable_weight=2.0)
    assert loss.tolist() == pytest.approx([0.2689414, 0.5378828])
    assert rewards.tolist() == pytest.approx([1.5, -0.5])
    loss.sum().backward()
    # d/dr [1 - sigmoid(beta (r - z0))] = -beta s (1 - s) with s = sigmoid(1) = 0.731059: -0.5 * 0.196612 = -0.098306;
    # undesirable: +2 * 0.5 * 0.196612 = +0.196612.
    assert policy.grad.tolist() == pytest.approx([-0.0983060, 0.1966119])


def test_kto_reference_point_is_a_clamped_mean():
    # Mean log-ratio -3 / 3 = -1 -> max(0, -1) = 0; 3 / 2 = 1.5.
    assert kto_reference_point(-3.0, 3).item() == 0.0
    assert kto_reference_point(torch.tensor(3.0, requires_grad=True), 2).item() == 1.5
    assert not kto_reference_point(torch.tensor(3.0, requires_grad=True), 2).requires_grad


def test_config_names_match_the_loss_modules():
    from tidyrl import config
    from tidyrl.algorithms import preference, sft

    assert config.SFT_LOSS_AGGREGATIONS == sft.SFT_LOSS_AGGREGATIONS
    assert config.DPO_LOSS_TYPES == preference.DPO_LOSS_TYPES

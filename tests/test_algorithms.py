"""Hand-worked numbers for the pure maths of tidyrl.algorithms.

Every expected value is derived in the comment above it, so a failure points
at the formula, not at a snapshot.
"""

from __future__ import annotations

import math

import pytest
import torch

from tidyrl.algorithms.advantages import grpo_advantages, kl_shaped_rewards, rloo_advantages
from tidyrl.algorithms.kl import kl_per_token
from tidyrl.algorithms.losses import aggregate_loss, clipped_policy_loss, loss_normaliser, masked_mean


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# ---------------------------------------------------------------- advantages

# Two groups of k = 3: [1, 2, 3] (mean 2) and [4, 4, 10] (mean 6).
# Centred: [-1, 0, 1] and [-2, -2, 4].
REWARDS = torch.tensor([1.0, 2.0, 3.0, 4.0, 4.0, 10.0])
CENTRED = [-1.0, 0.0, 1.0, -2.0, -2.0, 4.0]


def test_grpo_group_scale_two_by_two():
    # rewards [1, 0, 0, 1], groups of 2 -> means [.5, .5] -> centred [.5, -.5, -.5, .5];
    # unbiased std of each group = sqrt((.25 + .25) / (2 - 1)) = 0.70711
    # -> A = .5 / (0.70711 + 1e-4) = 0.70700.
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    close(adv, [a, -a, -a, a])
    assert abs(a - 0.70700) < 1e-5


def test_grpo_group_scale():
    # group 1: unbiased var = (1 + 0 + 1) / 2 = 1, std 1 -> [-1, 0, 1]
    # group 2: unbiased var = (4 + 4 + 16) / 2 = 12, std 3.46410
    #          -> [-2, -2, 4] / 3.46410 = [-.57735, -.57735, 1.15470]
    adv = grpo_advantages(REWARDS, group_size=3, eps=0.0)
    close(adv, [-1.0, 0.0, 1.0, -0.57735, -0.57735, 1.15470])


def test_grpo_batch_scale():
    # Centred per group, scaled by the std of all six rewards:
    # mean 24 / 6 = 4, deviations [-3, -2, -1, 0, 0, 6], sum of squares 50,
    # unbiased var 50 / 5 = 10, std 3.16228 -> CENTRED / 3.16228.
    adv = grpo_advantages(REWARDS, group_size=3, scale="batch", eps=0.0)
    close(adv, [-0.316228, 0.0, 0.316228, -0.632456, -0.632456, 1.264911])


def test_grpo_no_scale_is_dr_grpo():
    close(grpo_advantages(REWARDS, group_size=3, scale="none"), CENTRED)


def test_grpo_constant_group_is_zero_not_nan():
    # All-equal group: centred 0, std 0 -> 0 / (0 + eps) = 0.
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 0.0, 1.0]), group_size=2)
    assert adv[0] == 0 and adv[1] == 0
    # A group of one has no spread: advantage 0 (torch.std alone would give NaN).
    close(grpo_advantages(torch.tensor([3.0, 5.0]), group_size=1), [0.0, 0.0])


def test_grpo_dtypes():
    assert grpo_advantages(torch.tensor([1, 0, 0, 1]), 2).dtype == torch.float32
    assert grpo_advantages(REWARDS.bfloat16(), 3).dtype == torch.float32
    assert grpo_advantages(REWARDS.double(), 3).dtype == torch.float64


def test_grpo_errors():
    with pytest.raises(ValueError, match="group, batch, none"):
        grpo_advantages(REWARDS, 3, scale="std")
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        grpo_advantages(REWARDS, 4)


def test_rloo_advantages():
    # group 1 [1, 2, 3]: baselines mean(2,3)=2.5, mean(1,3)=2, mean(1,2)=1.5 -> [-1.5, 0, 1.5]
    # group 2 [4, 4, 10]: baselines mean(4,10)=7, 7, mean(4,4)=4 -> [-3, -3, 6]
    # (= k/(k-1) * centred = 1.5 * CENTRED)
    adv = rloo_advantages(REWARDS, group_size=3)
    close(adv, [-1.5, 0.0, 1.5, -3.0, -3.0, 6.0])
    close(adv, [1.5 * c for c in CENTRED])
    assert rloo_advantages(REWARDS.double(), 3).dtype == torch.float64


def test_rloo_errors():
    with pytest.raises(ValueError, match=">= 2"):
        rloo_advantages(REWARDS, 1)
    with pytest.raises(ValueError, match="not a multiple"):
        rloo_advantages(REWARDS, 4)


def test_kl_shaped_rewards():
    # masked KL sums: [.1 + .2, .5 + .5] = [.3, 1.0] (masked 9 and inf ignored)
    # r = score - .5 * sum = [1 - .15, 2 - .5] = [.85, 1.5]
    scores = torch.tensor([1.0, 2.0])
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.5, 0.5, float("inf")]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    close(kl_shaped_rewards(scores, kl, mask, kl_coef=0.5), [0.85, 1.5])
    close(kl_shaped_rewards(scores, kl, mask, kl_coef=0.0), [1.0, 2.0])


# ---------------------------------------------------------------- KL estimators

# logp = [-1, -2], ref = [-2, -1] -> log r = ref - logp = [-1, 1]
LOGP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-2.0, -1.0]])


def test_kl_k1():
    # k1 = logp - ref = [1, -1]: unbiased but negative on some samples.
    close(kl_per_token(LOGP, REF, "k1"), [[1.0, -1.0]])


def test_kl_k2():
    # k2 = (log r)^2 / 2 = [.5, .5]
    close(kl_per_token(LOGP, REF, "k2"), [[0.5, 0.5]])


def test_kl_k3():
    # k3 = e^{log r} - log r - 1: e^-1 + 1 - 1 = 0.367879;  e^1 - 1 - 1 = 0.718282
    close(kl_per_token(LOGP, REF, "k3"), [[math.exp(-1), math.e - 2.0]])


def test_kl_zero_when_equal_and_nonnegative():
    torch.manual_seed(0)
    logp = torch.randn(4, 7)
    for est in ("k1", "k2", "k3"):
        assert torch.equal(kl_per_token(logp, logp, est), torch.zeros(4, 7))
    ref = torch.randn(4, 7)
    assert (kl_per_token(logp, ref, "k2") >= 0).all()
    assert (kl_per_token(logp, ref, "k3") >= 0).all()


def test_kl_k1_k3_unbiased_in_expectation():
    # Exact expectation over a small categorical pi (no sampling noise):
    # E_pi[k1] = E_pi[k3] = KL(pi || ref), since E_pi[r] = sum pi * ref/pi = 1.
    pi = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    ref = torch.tensor([0.2, 0.2, 0.6], dtype=torch.float64)
    true_kl = (pi * (pi / ref).log()).sum()
    for est in ("k1", "k3"):
        per_token = kl_per_token(pi.log()[None], ref.log()[None], est)[0]
        close((pi * per_token).sum(), true_kl.item(), atol=1e-12)


def test_kl_k3_clamped_is_finite():
    # ref - logp = 200 would give e^200 = inf in float32; the clamp at 20 keeps it finite.
    logp = torch.tensor([[-200.0]], requires_grad=True)
    k3 = kl_per_token(logp, torch.tensor([[0.0]]), "k3")
    assert torch.isfinite(k3).all()
    # e^20 - 20 - 1 = 485165174.4 (float32 rounds to a multiple of 32 there)
    close(k3.detach(), [[math.exp(20.0) - 21.0]], atol=64.0)
    k3.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_kl_gradient_only_through_policy():
    logp = torch.tensor([[-1.0]], requires_grad=True)
    ref = torch.tensor([[-2.0]], requires_grad=True)
    kl_per_token(logp, ref, "k3").sum().backward()
    # d k3 / d logp = -e^{ref - logp} + 1 = 1 - e^-1
    close(logp.grad, [[1 - math.exp(-1)]])
    assert ref.grad is None


def test_kl_invalid_estimator():
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_per_token(LOGP, REF, "k4")


# ---------------------------------------------------------------- clipped policy loss

# clip_eps = 0.2 -> clip range [0.8, 1.2]. One token per row; old logp = 0,
# so ratio = exp(logp) and logp = log(ratio).
#   row  A   ratio  ratio*A  clip*A   min     loss   clipped  dloss/dlogp
#   0   +1   1.1    1.1      1.1     1.1    -1.1    no       -A*ratio = -1.1
#   1   +1   1.5    1.5      1.2     1.2    -1.2    yes      0
#   2   -1   0.5    -.5      -.8     -.8     .8     yes      0
#   3   -1   1.5    -1.5     -1.2    -1.5    1.5    no       1.5
#   4   +1   0.5    .5       .8      .5     -.5     no       -.5
#   5   -1   0.9    -.9      -.9     -.9     .9     no       .9
RATIOS = [1.1, 1.5, 0.5, 1.5, 0.5, 0.9]
ADV = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0])


def _logp(ratios):
    return torch.tensor(ratios, dtype=torch.float64).log().unsqueeze(-1).requires_grad_(True)


def test_clipped_loss_all_branches():
    logp = _logp(RATIOS)
    old = torch.zeros_like(logp)
    loss, clipped = clipped_policy_loss(logp, old, ADV.double(), clip_eps=0.2)
    close(loss.detach(), [[-1.1], [-1.2], [0.8], [1.5], [-0.5], [0.9]])
    assert clipped.dtype == torch.bool
    assert clipped.squeeze(-1).tolist() == [False, True, True, False, False, False]
    # Clipped tokens get no gradient; the others the plain -A * ratio.
    loss.sum().backward()
    close(logp.grad, [[-1.1], [0.0], [0.0], [1.5], [-0.5], [0.9]])


def test_clipped_loss_clip_higher():
    # clip_eps = .2, clip_eps_high = .28 -> range [0.8, 1.28]:
    #   A=+1, ratio 1.25: inside now -> loss -1.25, not clipped (symmetric: -1.2, clipped)
    #   A=+1, ratio 1.30: clipped at 1.28 -> loss -1.28
    #   A=-1, ratio 0.75: the lower bound is still 0.8 -> loss .8, clipped
    logp = _logp([1.25, 1.30, 0.75])
    old = torch.zeros_like(logp)
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    loss, clipped = clipped_policy_loss(logp, old, adv, clip_eps=0.2, clip_eps_high=0.28)
    close(loss.detach(), [[-1.25], [-1.28], [0.8]])
    assert clipped.squeeze(-1).tolist() == [False, True, True]
    loss_sym, clipped_sym = clipped_policy_loss(logp, old, adv, clip_eps=0.2)
    close(loss_sym.detach(), [[-1.2], [-1.2], [0.8]])
    assert clipped_sym.squeeze(-1).tolist() == [True, True, True]


def test_clipped_loss_broadcast_and_detach():
    torch.manual_seed(0)
    logp = torch.randn(3, 5, requires_grad=True)
    old = (logp.detach() + 0.3 * torch.randn(3, 5)).requires_grad_(True)
    adv_B = torch.randn(3, requires_grad=True)
    loss_a, clip_a = clipped_policy_loss(logp, old, adv_B, 0.2)
    loss_b, clip_b = clipped_policy_loss(logp, old, adv_B.detach()[:, None].expand(3, 5), 0.2)
    assert loss_a.shape == (3, 5)
    torch.testing.assert_close(loss_a, loss_b)
    assert torch.equal(clip_a, clip_b)
    loss_a.sum().backward()
    assert logp.grad is not None
    assert old.grad is None and adv_B.grad is None  # constants of the objective


def test_clipped_loss_on_policy_is_policy_gradient():
    # E*M == 1: old = current (detached) -> ratio 1, nothing clipped,
    # loss = -A, gradient = -A per token.
    logp = torch.tensor([[-0.5, -1.5], [-2.0, -0.1]], requires_grad=True)
    adv = torch.tensor([2.0, -3.0])
    loss, clipped = clipped_policy_loss(logp, logp.detach(), adv, 0.2)
    close(loss.detach(), [[-2.0, -2.0], [3.0, 3.0]])
    assert not clipped.any()
    loss.sum().backward()
    close(logp.grad, [[-2.0, -2.0], [3.0, 3.0]])


# ---------------------------------------------------------------- aggregation

# Masked positions hold 100 to show they are ignored.
LOSS = torch.tensor([[1.0, 2.0, 3.0, 100.0], [5.0, 100.0, 100.0, 100.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
# masked row sums [6, 5], tokens [3, 1] -> 4 tokens, 2 sequences, max_new_tokens 4


def test_loss_normaliser():
    assert loss_normaliser("token_mean", num_tokens=37, num_sequences=8, max_new_tokens=16) == 37.0
    assert loss_normaliser("sequence_mean", num_tokens=37, num_sequences=8, max_new_tokens=16) == 8.0
    assert loss_normaliser("constant", num_tokens=37, num_sequences=8, max_new_tokens=16) == 128.0
    # An empty mini-batch gives 1, not a division by zero.
    assert loss_normaliser("token_mean", num_tokens=0, num_sequences=0, max_new_tokens=16) == 1.0


def _norm(mode, mask=MASK, max_new_tokens=4):
    return loss_normaliser(mode, num_tokens=int(mask.sum()), num_sequences=mask.shape[0], max_new_tokens=max_new_tokens)


def test_aggregate_token_mean():
    # (6 + 5) / 4 tokens = 2.75
    close(aggregate_loss(LOSS, MASK, "token_mean", _norm("token_mean")), 2.75)


def test_aggregate_sequence_mean():
    # row means 6/3 = 2 and 5/1 = 5 -> (2 + 5) / 2 sequences = 3.5
    close(aggregate_loss(LOSS, MASK, "sequence_mean", _norm("sequence_mean")), 3.5)


def test_aggregate_constant():
    # (6 + 5) / (2 sequences * 4 max_new_tokens) = 11 / 8 = 1.375
    close(aggregate_loss(LOSS, MASK, "constant", _norm("constant")), 1.375)


def test_aggregate_ignores_nan_in_padding():
    loss = LOSS.clone()
    loss[1, 2] = float("nan")
    close(aggregate_loss(loss, MASK.bool(), "token_mean", 4.0), 2.75)


@pytest.mark.parametrize("mode", ["token_mean", "sequence_mean", "constant"])
def test_microbatch_split_gives_the_same_loss_and_gradient(mode):
    # A mini-batch of 8 sequences with ragged lengths (one empty), split into
    # micro-batches of 3, 1 and 4 (as gradient accumulation or processes
    # would): the summed micro-batch losses equal the whole loss, and so do
    # the gradients.
    torch.manual_seed(0)
    B, T = 8, 6
    logits = torch.randn(B, T, requires_grad=True)
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 6, 4])
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    norm = _norm(mode, mask=mask, max_new_tokens=T)

    whole = aggregate_loss(logits.square(), mask, mode, norm)
    (grad_whole,) = torch.autograd.grad(whole, logits)

    parts, start = [], 0
    for size in (3, 1, 4):
        sl = slice(start, start + size)
        parts.append(aggregate_loss(logits[sl].square(), mask[sl], mode, norm))
        start += size
    split = torch.stack(parts).sum()
    (grad_split,) = torch.autograd.grad(split, logits)

    torch.testing.assert_close(split, whole, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_split, grad_whole, rtol=1e-6, atol=1e-6)


def test_per_microbatch_mean_would_differ():
    # The failure the global normaliser prevents: averaging per micro-batch
    # weights the lone token of row 1 like the three tokens of row 0.
    # Per micro-batch: (6/3 + 5/1) / 2 micro-batches = 3.5  !=  11/4 = 2.75.
    per_micro = (aggregate_loss(LOSS[:1], MASK[:1], "token_mean", 3.0) + aggregate_loss(LOSS[1:], MASK[1:], "token_mean", 1.0)) / 2
    global_norm = aggregate_loss(LOSS[:1], MASK[:1], "token_mean", 4.0) + aggregate_loss(LOSS[1:], MASK[1:], "token_mean", 4.0)
    close(per_micro, 3.5)
    close(global_norm, 2.75)


def test_aggregation_errors():
    with pytest.raises(ValueError, match="token_mean, sequence_mean, constant"):
        loss_normaliser("mean", num_tokens=1, num_sequences=1, max_new_tokens=1)
    with pytest.raises(ValueError, match="token_mean, sequence_mean, constant"):
        aggregate_loss(LOSS, MASK, "sum", 1.0)


def test_masked_mean():
    # (1 + 3 + 4) / 3 = 8/3
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    close(masked_mean(values, torch.tensor([[1, 0], [1, 1]])), 8 / 3)
    close(masked_mean(values, torch.zeros(2, 2)), 0.0)
    # bool values (e.g. the clipped flags) count as 0/1: 1 of 3 -> 1/3
    flags = torch.tensor([[True, True], [False, False]])
    close(masked_mean(flags, torch.tensor([[1, 0], [1, 1]])), 1 / 3)


def test_truncated_importance_weights_by_hand():
    """w = min(exp(log pi_trainer - log pi_sampler), cap) on the mask, 1 off it (Yao et al. 2025)."""
    from tidyrl.algorithms.corrections import mismatch_weights

    trainer = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, 0.0]])
    sampler = torch.tensor([[-1.5, -1.0, -0.5], [-2.1, -3.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    weights, delta, _, capped, _, _ = mismatch_weights(trainer, sampler, mask, "token_truncate", cap=2.0)
    # deltas: 0.5, -1, 0 | 2 (exp 7.39 -> capped at 2), 0 | off the mask
    torch.testing.assert_close(delta, torch.tensor([[0.5, -1.0, 0.0], [2.0, 0.0, 0.0]]))
    e = torch.e
    torch.testing.assert_close(weights, torch.tensor([[e ** 0.5, e ** -1, 1.0], [2.0, 1.0, 1.0]]))
    assert capped.tolist() == [[False, False, False], [True, False, False]]

"""Hand-worked numbers for tidyrl.algorithms.ppo (PPO with a value model, REINFORCE++).

Every expected value is derived in the comment above it, so a failure points
at the formula, not at a snapshot.
"""

from __future__ import annotations

import math

import pytest
import torch

from tidyrl.algorithms.ppo import (
    AdaptiveKLController,
    FixedKLController,
    clipped_value_loss,
    discounted_returns,
    explained_variance,
    gae,
    group_baseline_scores,
    masked_whiten,
    token_level_rewards,
)

NAN, INF = float("nan"), float("inf")


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


# Two completions in T = 4: the first has 3 tokens, the second 2.
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])


# ---------------------------------------------------------------- token_level_rewards


def test_token_level_rewards_score_on_last_real_token():
    # kl_coef = 0.5, r_t = -0.5 * kl_t, plus the score on the last masked token:
    #   seq 0: kl [.2, .4, .6 | pad 9]  -> [-.1, -.2, -.3 + 1.0, 0] = [-.1, -.2, .7, 0]
    #   seq 1: kl [.2, .2 | pad inf NaN] -> [-.1, -.1 + 2.0, 0, 0]  = [-.1, 1.9, 0, 0]
    scores = torch.tensor([1.0, 2.0])
    kl = torch.tensor([[0.2, 0.4, 0.6, 9.0], [0.2, 0.2, INF, NAN]])
    rewards = token_level_rewards(scores, kl, MASK, kl_coef=0.5)
    close(rewards, [[-0.1, -0.2, 0.7, 0.0], [-0.1, 1.9, 0.0, 0.0]])
    # kl_coef = 0: only the scores, on tokens 2 and 1.
    close(token_level_rewards(scores, kl, MASK, kl_coef=0.0), [[0, 0, 1.0, 0], [0, 2.0, 0, 0]])
    # Summed over t it is the sequence-level shaped reward: [1 - .6, 2 - .2] = [.4, 1.8]
    close(rewards.sum(-1), [0.4, 1.8])


def test_token_level_rewards_full_length_empty_and_dtype():
    # seq 0 fills T (score on t = 2), seq 1 has no completion tokens: all zeros, score dropped.
    scores = torch.tensor([3.0, 5.0], dtype=torch.float64)
    kl = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[True, True, True], [False, False, False]])
    rewards = token_level_rewards(scores, kl, mask, kl_coef=1.0)
    assert rewards.dtype == torch.float64
    close(rewards, [[0.0, 0.0, 3.0], [0.0, 0.0, 0.0]])
    assert token_level_rewards(scores.bfloat16(), kl.bfloat16(), mask, 1.0).dtype == torch.float32
    with pytest.raises(ValueError, match=r"scores_B must be \[B\]"):
        token_level_rewards(torch.ones(3), kl, mask, 1.0)


# ---------------------------------------------------------------- gae


def test_gae_hand_worked_three_tokens():
    # gamma = 0.9, lam = 0.8 (gamma * lam = 0.72), r = [-.1, -.1, 1], V = [.5, .6, .7], terminal V_3 = 0:
    #   delta_2 = 1   + .9 * 0  - .7 =  .3
    #   delta_1 = -.1 + .9 * .7 - .6 = -.07
    #   delta_0 = -.1 + .9 * .6 - .5 = -.06
    #   A_2 = .3
    #   A_1 = -.07 + .72 * .3   = .146
    #   A_0 = -.06 + .72 * .146 = .04512
    #   returns = A + V = [.54512, .746, 1.0]
    rewards = torch.tensor([[-0.1, -0.1, 1.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.6, 0.7]], dtype=torch.float64)
    adv, ret = gae(rewards, values, torch.ones(1, 3), gamma=0.9, lam=0.8)
    close(adv, [[0.04512, 0.146, 0.3]], atol=1e-12)
    close(ret, [[0.54512, 0.746, 1.0]], atol=1e-12)
    assert adv.dtype == ret.dtype == torch.float64


def test_gae_masking_and_short_sequence_terminal():
    # Row 0 is the 3-token example above, padded with garbage (inf reward, NaN value) at t = 3.
    # Row 1 has 2 tokens, r = [0, 2], V = [1, 3]; its terminal value (t = 2) is 0, not the pad's 99:
    #   delta_1 = 2 + .9 * 0 - 3 = -1
    #   delta_0 = 0 + .9 * 3 - 1 = 1.7
    #   A = [1.7 + .72 * -1, -1] = [.98, -1],  returns = A + V = [1.98, 2]
    rewards = torch.tensor([[-0.1, -0.1, 1.0, INF], [0.0, 2.0, 5.0, 5.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, NAN], [1.0, 3.0, 99.0, NAN]])
    adv, ret = gae(rewards, values, MASK, gamma=0.9, lam=0.8)
    close(adv, [[0.04512, 0.146, 0.3, 0.0], [0.98, -1.0, 0.0, 0.0]])
    close(ret, [[0.54512, 0.746, 1.0, 0.0], [1.98, 2.0, 0.0, 0.0]])
    # The padded batch gives the same numbers as each row on its own.
    adv_1, _ = gae(rewards[1:, :2], values[1:, :2], torch.ones(1, 2), gamma=0.9, lam=0.8)
    close(adv[1:, :2], adv_1)


def test_gae_gamma_lam_one_is_returns_minus_values():
    # gamma = lam = 1: the deltas telescope, A_t = sum_{s>=t} r_s - V_t, so returns = reward-to-go.
    # Row 1, r = [0, 2], V = [1, 3]: G = [2, 2], A = [2 - 1, 2 - 3] = [1, -1].
    torch.manual_seed(0)
    rewards, values = torch.randn(2, 4), torch.randn(2, 4)
    rewards[1, :2] = torch.tensor([0.0, 2.0])
    values[1, :2] = torch.tensor([1.0, 3.0])
    adv, ret = gae(rewards, values, MASK, gamma=1.0, lam=1.0)
    G = discounted_returns(rewards, MASK, gamma=1.0)
    close(adv, torch.where(MASK.bool(), G - values, 0.0), atol=1e-5)
    close(ret, G, atol=1e-5)
    close(adv[1], [1.0, -1.0, 0.0, 0.0])


def test_gae_lam_zero_is_one_step_td_and_no_grad():
    # lam = 0: A_t = delta_t.  r = [0, 1], V = [.5, .5], gamma = 1:
    #   delta_1 = 1 + 0 - .5 = .5;  delta_0 = 0 + .5 - .5 = 0
    values = torch.tensor([[0.5, 0.5]], requires_grad=True)
    adv, ret = gae(torch.tensor([[0.0, 1.0]]), values, torch.ones(1, 2), gamma=1.0, lam=0.0)
    close(adv, [[0.0, 0.5]])
    assert not adv.requires_grad and not ret.requires_grad


# ---------------------------------------------------------------- discounted_returns


def test_discounted_returns_by_hand():
    # gamma = 0.5, row 0 r = [1, 2, 4 | pad 8]: G_2 = 4, G_1 = 2 + .5 * 4 = 4, G_0 = 1 + .5 * 4 = 3
    #              row 1 r = [1, -2 | pad 7, 7]: G_1 = -2, G_0 = 1 + .5 * -2 = 0
    rewards = torch.tensor([[1.0, 2.0, 4.0, 8.0], [1.0, -2.0, 7.0, 7.0]])
    close(discounted_returns(rewards, MASK, gamma=0.5), [[3.0, 4.0, 4.0, 0.0], [0.0, -2.0, 0.0, 0.0]])
    # gamma = 1 (default): plain suffix sums [7, 6, 4, 0] and [-1, -2, 0, 0]
    close(discounted_returns(rewards, MASK), [[7.0, 6.0, 4.0, 0.0], [-1.0, -2.0, 0.0, 0.0]])


def test_reinforce_pp_token_advantage_is_score_minus_kl_to_go():
    # Hu 2025: A_t = score - beta * sum_{s>=t} KL_s. Row 0: score 1, beta .5, kl [.2, .4, .6]:
    #   [1 - .5 * 1.2, 1 - .5 * 1.0, 1 - .5 * .6] = [.4, .5, .7]
    # Row 1: score 2, kl [.2, .2]: [2 - .2, 2 - .1] = [1.8, 1.9]
    scores = torch.tensor([1.0, 2.0])
    kl = torch.tensor([[0.2, 0.4, 0.6, 9.0], [0.2, 0.2, INF, NAN]])
    G = discounted_returns(token_level_rewards(scores, kl, MASK, 0.5), MASK)
    close(G, [[0.4, 0.5, 0.7, 0.0], [1.8, 1.9, 0.0, 0.0]])


# ---------------------------------------------------------------- masked_whiten


def test_masked_whiten_by_hand():
    # Masked entries [1, 2, 3, 4, 10] (pad 100, NaN ignored): mean 20 / 5 = 4,
    # deviations [-3, -2, -1, 0, 6], sum of squares 50, population var 50 / 5 = 10, std 3.16228.
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 10.0, NAN, 100.0]], dtype=torch.float64)
    white = masked_whiten(values, MASK, eps=0.0)
    s = math.sqrt(10.0)
    close(white, [[-3 / s, -2 / s, -1 / s, 0.0], [0.0, 6 / s, 0.0, 0.0]], atol=1e-12)
    # Mean 0 and (population) variance 1 over the mask, zeros at padding.
    m = MASK.bool()
    assert abs(white[m].mean().item()) < 1e-12
    assert abs(white[m].var(unbiased=False).item() - 1.0) < 1e-12
    assert (white[~m] == 0).all()
    # Default eps = 1e-8: 1 / sqrt(10 + 1e-8) differs from 1 / sqrt(10) by ~5e-10.
    close(masked_whiten(values, MASK), white, atol=1e-8)


def test_masked_whiten_keep_mean():
    # shift_mean=False adds the mean (4) back: [4 - 3/s, 4 - 2/s, 4 - 1/s, 4, 4 + 6/s].
    values = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 10.0, NAN, 100.0]])
    white = masked_whiten(values, MASK, shift_mean=False, eps=0.0)
    s = math.sqrt(10.0)
    close(white, [[4 - 3 / s, 4 - 2 / s, 4 - 1 / s, 0.0], [4.0, 4 + 6 / s, 0.0, 0.0]], atol=1e-5)
    assert white.dtype == torch.float32


def test_masked_whiten_too_few_entries_no_nan():
    values = torch.tensor([[5.0, 7.0], [9.0, 1.0]])
    # One entry (5): centred to 0, not scaled; with shift_mean=False it stays 5.
    one = torch.tensor([[1, 0], [0, 0]])
    close(masked_whiten(values, one), [[0.0, 0.0], [0.0, 0.0]])
    close(masked_whiten(values, one, shift_mean=False), [[5.0, 0.0], [0.0, 0.0]])
    # Empty mask: all zeros. Constant values: centred 0, 0 / sqrt(0 + eps) = 0.
    close(masked_whiten(values, torch.zeros(2, 2)), torch.zeros(2, 2))
    close(masked_whiten(torch.full((2, 2), 3.0), torch.ones(2, 2)), torch.zeros(2, 2))


# ---------------------------------------------------------------- clipped_value_loss


def test_clipped_value_loss_branches_and_gradient():
    # old = 0, clip = 0.2, so v_clipped = clamp(v, -.2, .2); loss = .5 * max((v-R)^2, (v_clipped-R)^2).
    #  col 0  v = .1,  R = 1:   inside the clip, both terms .81       -> .405,  grad v - R = -.9
    #  col 1  v = .5,  R = 1:   unclipped .25 < clipped (.2-1)^2 = .64 -> .32,  clipped, grad 0 (flat)
    #  col 2  v = -.5, R = 1:   unclipped 2.25 > clipped (-.2-1)^2 = 1.44 -> 1.125, grad -1.5
    #  col 3  v = .5,  R = .3:  unclipped .04 > clipped (.2-.3)^2 = .01 -> .02,  grad .2
    #                           (moved past the clip but away from R: the unclipped term still wins)
    values = torch.tensor([[0.1, 0.5, -0.5, 0.5]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 4, dtype=torch.float64)
    returns = torch.tensor([[1.0, 1.0, 1.0, 0.3]], dtype=torch.float64)
    loss, clipped = clipped_value_loss(values, old, returns, clip=0.2)
    close(loss, [[0.405, 0.32, 1.125, 0.02]], atol=1e-12)
    assert clipped.tolist() == [[False, True, False, False]]
    loss.sum().backward()
    close(values.grad, [[-0.9, 0.0, -1.5, 0.2]], atol=1e-12)


def test_clipped_value_loss_no_clip_and_detached_targets():
    # clip None: .5 * (v - R)^2 = .5 * [.81, .25, 2.25, .04]; nothing flagged.
    values = torch.tensor([[0.1, 0.5, -0.5, 0.5]], requires_grad=True)
    old = torch.zeros(1, 4, requires_grad=True)
    returns = torch.tensor([[1.0, 1.0, 1.0, 0.3]], requires_grad=True)
    loss, clipped = clipped_value_loss(values, old, returns, clip=None)
    close(loss, [[0.405, 0.125, 1.125, 0.02]])
    assert not clipped.any()
    loss, _ = clipped_value_loss(values, old, returns, clip=0.2)
    loss.sum().backward()
    assert old.grad is None and returns.grad is None  # gradient reaches the values only
    with pytest.raises(ValueError, match=">= 0"):
        clipped_value_loss(values, old, returns, clip=-0.1)


# ---------------------------------------------------------------- KL controllers


def test_adaptive_kl_controller_by_hand():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    # KL 12: e = 12/6 - 1 = 1, clipped to .2; beta = .1 * (1 + .2 * 64/10000) = .1 * 1.00128 = .100128
    assert ctl.update(12.0, n_steps=64) == pytest.approx(0.100128, abs=1e-12)
    assert ctl.value == pytest.approx(0.100128, abs=1e-12)
    # KL 3: e = 3/6 - 1 = -.5, clipped to -.2; beta = .100128 * (1 - .00128) = .09999983616
    assert ctl.update(3.0, n_steps=64) == pytest.approx(0.09999983616, abs=1e-12)
    # KL 6.6: e = .1 (inside the clip); beta *= 1 + .1 * 64/10000 = 1.00064
    beta = ctl.value
    assert ctl.update(6.6, n_steps=64) == pytest.approx(beta * 1.00064, abs=1e-12)
    # On target: unchanged.
    beta = ctl.value
    assert ctl.update(6.0, n_steps=64) == pytest.approx(beta, abs=1e-15)


def test_kl_controller_state_dict_round_trip():
    ctl = AdaptiveKLController(0.1, 6.0, 10000)
    for kl in (12.0, 3.0, 7.0):
        ctl.update(kl, 64)
    resumed = AdaptiveKLController(0.1, 6.0, 10000)
    resumed.load_state_dict(ctl.state_dict())
    assert resumed.value == ctl.value
    # Identical from there on, bit for bit.
    assert resumed.update(9.0, 64) == ctl.update(9.0, 64)

    fixed = FixedKLController(0.05)
    assert fixed.update(100.0, 64) == 0.05 and fixed.value == 0.05
    other = FixedKLController(0.05)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.05

    with pytest.raises(ValueError, match="target"):
        AdaptiveKLController(0.1, 0.0, 10000)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 6.0, 0)


# ---------------------------------------------------------------- group_baseline_scores


def test_group_baseline_scores():
    # groups of 3: [1, 2, 3] (mean 2) -> [-1, 0, 1]; [4, 4, 10] (mean 6) -> [-2, -2, 4]. No std division.
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0, 4.0, 10.0])
    close(group_baseline_scores(scores, 3), [-1.0, 0.0, 1.0, -2.0, -2.0, 4.0])
    # group_size 1: every score is its own mean -> zeros.
    close(group_baseline_scores(scores, 1), torch.zeros(6))
    assert group_baseline_scores(scores.double(), 3).dtype == torch.float64
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        group_baseline_scores(scores, 4)


# ---------------------------------------------------------------- explained_variance


def test_explained_variance():
    # Masked returns [1, 2, 3] (pad garbage ignored): mean 2, population var 2/3.
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    returns = torch.tensor([[1.0, 2.0, 50.0], [3.0, NAN, -7.0]])
    # Perfect critic: Var[R - V] = 0 -> 1.
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    # Any constant prediction: Var[R - c] = Var[R] -> 0.
    assert explained_variance(torch.full((2, 3), 7.0), returns, mask) == pytest.approx(0.0)
    # V = [1.5, 2, 2.5]: R - V = [-.5, 0, .5], var 1/6 -> 1 - (1/6) / (2/3) = .75
    values = torch.tensor([[1.5, 2.0, 0.0], [2.5, 0.0, 0.0]])
    assert explained_variance(values, returns, mask) == pytest.approx(0.75)
    # Constant returns (Var[R] = 0) or an empty mask: 0.0, not NaN.
    assert explained_variance(values, torch.ones(2, 3), mask) == 0.0
    assert explained_variance(values, returns, torch.zeros(2, 3)) == 0.0
    assert isinstance(explained_variance(values, returns, mask), float)

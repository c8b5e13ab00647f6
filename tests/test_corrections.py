"""Hand-worked numbers for every sampler/trainer mismatch correction (`algorithms.corrections`)."""

from __future__ import annotations

import math

import pytest
import torch

from tidyrl.algorithms.corrections import DEFAULTS, MODES, TWO_SIDED, mismatch_weights

# Three sequences of four positions; the token ratios r_t = pi_trainer / pi_sampler on the mask are
#   row 0: 4, 0.25, 1, (pad)     R = prod r = 1      G = R^(1/3) = 1
#   row 1: 2, 2, 1, 1            R = 4               G = 4^(1/4) = sqrt(2) = 1.414...
#   row 2: 0.2, 0.8, (pad, pad)  R = 0.16            G = 0.16^(1/2) = 0.4
# The pads hold log-probs that would dominate if they leaked in (inf and NaN differences).
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
RATIOS = [[4.0, 0.25, 1.0], [2.0, 2.0, 1.0, 1.0], [0.2, 0.8]]
SAMPLER_ROW = [-1.0, -2.0, -0.5]
NAN = float("nan")


def example():
    sampler = torch.tensor([[-1.0, -1.0, -1.0, -math.inf], [-2.0] * 4, [-0.5, -0.5, 0.0, 0.0]])
    trainer = torch.tensor([[5.0, 5.0, 5.0, 5.0], [0.0] * 4, [0.0, 0.0, NAN, NAN]])
    for b, row in enumerate(RATIOS):
        for t, r in enumerate(row):
            trainer[b, t] = SAMPLER_ROW[b] + math.log(r)
    return trainer, sampler, MASK


def run(mode, cap, low=None):
    return mismatch_weights(*example(), mode=mode, cap=cap, low=low)


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected), rtol=1e-5, atol=1e-6)


def flags(actual, expected):
    assert torch.equal(actual, torch.tensor(expected, dtype=torch.bool))


F, T = False, True
NONE = [[F, F, F, F], [F, F, F, F], [F, F, F, F]]


@pytest.mark.parametrize("mode", MODES)
def test_off_the_mask_weight_is_one_delta_zero_ratio_one_and_nothing_flagged(mode):
    out = run(mode, cap=DEFAULTS[mode][1], low=DEFAULTS[mode][0])
    off = ~MASK.bool()
    assert torch.all(out.weights[off] == 1) and torch.all(out.delta[off] == 0) and torch.all(out.ratio[off] == 1)
    assert not out.clipped[off].any() and not out.masked[off].any()
    assert out.weights.shape == out.delta.shape == out.clipped.shape == out.masked.shape == (3, 4)
    assert out.masked_sequences.shape == (3,) and out.clipped.dtype == out.masked.dtype == torch.bool
    assert torch.isfinite(out.weights).all()


def test_delta_is_the_log_ratio_on_the_mask():
    out = run("token_mask", cap=3.0)
    close(out.delta, [[math.log(4), math.log(0.25), 0.0, 0.0], [math.log(2), math.log(2), 0.0, 0.0],
                      [math.log(0.2), math.log(0.8), 0.0, 0.0]])


def test_token_truncate():
    # cap 3: 4 -> 3 (clipped); the rest are below 3.
    out = run("token_truncate", cap=3.0)
    close(out.weights, [[3.0, 0.25, 1.0, 1.0], [2.0, 2.0, 1.0, 1.0], [0.2, 0.8, 1.0, 1.0]])
    flags(out.clipped, [[T, F, F, F], [F, F, F, F], [F, F, F, F]])
    flags(out.masked, NONE)
    # with low 0.5: 0.25 -> 0.5 and 0.2 -> 0.5 are clipped too.
    out = run("token_truncate", cap=3.0, low=0.5)
    close(out.weights, [[3.0, 0.5, 1.0, 1.0], [2.0, 2.0, 1.0, 1.0], [0.5, 0.8, 1.0, 1.0]])
    flags(out.clipped, [[T, T, F, F], [F, F, F, F], [T, F, F, F]])
    assert out.clipped.sum() == 3  # 3 of the 9 tokens: "fraction clipped" = 1/3
    flags(out.masked_sequences, [F, F, F])


def test_token_mask_keeps_the_ratio_inside_and_zeroes_outside():
    # cap 3: 4 > 3 -> 0; every other token keeps its own ratio (TRL multiplies by the ratio, not by 1).
    out = run("token_mask", cap=3.0)
    close(out.weights, [[0.0, 0.25, 1.0, 1.0], [2.0, 2.0, 1.0, 1.0], [0.2, 0.8, 1.0, 1.0]])
    flags(out.masked, [[T, F, F, F], [F, F, F, F], [F, F, F, F]])
    flags(out.clipped, NONE)
    flags(out.masked_sequences, [T, F, F])
    # low 0.5 masks 0.25 and 0.2 as well.
    out = run("token_mask", cap=3.0, low=0.5)
    close(out.weights, [[0.0, 0.0, 1.0, 1.0], [2.0, 2.0, 1.0, 1.0], [0.0, 0.8, 1.0, 1.0]])
    flags(out.masked, [[T, T, F, F], [F, F, F, F], [T, F, F, F]])
    flags(out.masked_sequences, [T, F, T])


def test_sequence_truncate_uses_the_product_of_the_token_ratios():
    # R = 1, 4, 0.16; cap 3: row 1's 4 -> 3 on all its four tokens.
    out = run("sequence_truncate", cap=3.0)
    close(out.ratio, [[1.0, 1.0, 1.0, 1.0], [4.0, 4.0, 4.0, 4.0], [0.16, 0.16, 1.0, 1.0]])
    close(out.weights, [[1.0, 1.0, 1.0, 1.0], [3.0, 3.0, 3.0, 3.0], [0.16, 0.16, 1.0, 1.0]])
    flags(out.clipped, [[F, F, F, F], [T, T, T, T], [F, F, F, F]])
    # low 0.5: row 2's 0.16 -> 0.5 on its two tokens.
    out = run("sequence_truncate", cap=3.0, low=0.5)
    close(out.weights, [[1.0, 1.0, 1.0, 1.0], [3.0, 3.0, 3.0, 3.0], [0.5, 0.5, 1.0, 1.0]])
    flags(out.clipped, [[F, F, F, F], [T, T, T, T], [T, T, F, F]])
    assert out.clipped.sum() == 6
    flags(out.masked, NONE)


def test_sequence_mask_keeps_the_sequence_ratio_inside_and_zeroes_whole_sequences_outside():
    # R = 1, 4, 0.16; cap 3: row 1 (R = 4) is masked; rows 0 and 2 keep R.
    out = run("sequence_mask", cap=3.0)
    close(out.weights, [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.16, 0.16, 1.0, 1.0]])
    flags(out.masked, [[F, F, F, F], [T, T, T, T], [F, F, F, F]])
    flags(out.masked_sequences, [F, T, F])  # "fraction of sequences masked" = 1/3
    # low 0.5 masks row 2 (R = 0.16) too, on its two tokens only.
    out = run("sequence_mask", cap=3.0, low=0.5)
    close(out.weights, [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    flags(out.masked_sequences, [F, T, T])
    assert out.masked.sum() == 6


def test_icepop_is_a_two_sided_token_mask_keeping_the_ratio():
    # [alpha, beta] = [0.5, 5]: 0.25 and 0.2 fall below alpha; 4 is inside and keeps weight 4.
    out = run("icepop", cap=5.0, low=0.5)
    close(out.weights, [[4.0, 0.0, 1.0, 1.0], [2.0, 2.0, 1.0, 1.0], [0.0, 0.8, 1.0, 1.0]])
    flags(out.masked, [[F, T, F, F], [F, F, F, F], [T, F, F, F]])
    flags(out.masked_sequences, [T, F, T])
    assert torch.equal(out.weights, run("token_mask", cap=5.0, low=0.5).weights)


def test_sequence_reject_tests_the_geometric_mean_and_keeps_weight_one():
    # G = 1, 1.414, 0.4; bounds [0.5, 1.5]: row 2 is rejected, rows 0 and 1 keep weight 1 (not G).
    out = run("sequence_reject", cap=1.5, low=0.5)
    close(out.ratio, [[1.0, 1.0, 1.0, 1.0], [math.sqrt(2)] * 4, [0.4, 0.4, 1.0, 1.0]])
    close(out.weights, [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
    flags(out.masked, [[F, F, F, F], [F, F, F, F], [T, T, F, F]])
    flags(out.masked_sequences, [F, F, T])
    # verl's default [0.999, 1.001]: only row 0 (G = 1) stays.
    out = run("sequence_reject", cap=DEFAULTS["sequence_reject"][1], low=DEFAULTS["sequence_reject"][0])
    close(out.weights, [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    flags(out.masked_sequences, [F, T, T])


def test_sequence_reject_token_is_gates_on_the_geometric_mean_and_keeps_the_token_ratio():
    # OpenRLHF's default [0.5, 5]: G = 1, 1.414 inside (tokens keep r_t, 4 included), G = 0.4 outside.
    out = run("sequence_reject_token_is", cap=5.0, low=0.5)
    close(out.weights, [[4.0, 0.25, 1.0, 1.0], [2.0, 2.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0]])
    flags(out.masked, [[F, F, F, F], [F, F, F, F], [T, T, F, F]])
    # bounds [0.5, 1.2]: row 1 (G = 1.414) goes too.
    out = run("sequence_reject_token_is", cap=1.2, low=0.5)
    close(out.weights, [[4.0, 0.25, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 1.0, 1.0]])
    flags(out.masked_sequences, [F, T, T])


def test_an_empty_sequence_is_never_flagged():
    out = mismatch_weights(torch.zeros(1, 3), torch.full((1, 3), -5.0), torch.zeros(1, 3), "sequence_reject", 1.1,
                           0.9)
    assert torch.all(out.weights == 1) and not out.masked_sequences.any()


def test_every_mode_has_defaults_and_the_two_sided_ones_a_lower_bound():
    assert set(DEFAULTS) == set(MODES) and set(TWO_SIDED) <= set(MODES)
    for mode, (low, cap) in DEFAULTS.items():
        assert cap > 0 and (low is None or 0 <= low < cap)
        assert (low is not None) or mode not in TWO_SIDED
    assert DEFAULTS["sequence_mask"] == (None, 3.0) and DEFAULTS["token_truncate"] == (None, 2.0)


def test_a_bad_mode_or_bad_bounds_are_refused_with_the_valid_values():
    with pytest.raises(ValueError, match="unknown mismatch correction 'tis'; valid values: token_truncate, "
                                         "token_mask, sequence_truncate, sequence_mask, icepop"):
        run("tis", cap=2.0)
    for cap in (0.0, -1.0, NAN):
        with pytest.raises(ValueError, match="cap of the mismatch correction token_mask must be a positive number"):
            run("token_mask", cap=cap)
    for mode in TWO_SIDED:
        with pytest.raises(ValueError, match=f"{mode} needs a lower bound `low`"):
            run(mode, cap=5.0)
    bounds = r"lower bound of the mismatch correction icepop must be in \[0, cap=3\.0\)"
    for low in (3.0, 4.0, -0.1, NAN):
        with pytest.raises(ValueError, match=bounds):
            run("icepop", cap=3.0, low=low)


def test_the_runs_correction_takes_its_mode_and_bounds_from_the_rollout_section():
    """rollout.correction and its bounds: tis_cap where set; unset, on where the sampler is not the trainer (an
    engine's default cap, a lag) with token_truncate's 2.0 or the mode's default; correction_low else the mode's."""
    from types import SimpleNamespace

    from tidyrl.rollouts.scoring import correction_of

    def of(default_tis_cap=0.0, **ro):
        ro = {"tis_cap": None, "lag": 0, "behaviour_logprobs": "sampler", "correction": "token_truncate",
              "correction_low": None, **ro}
        c = correction_of(SimpleNamespace(**ro), 2, default_tis_cap)
        return c.mode, c.tis_cap, c.low, c.where

    assert of() == ("token_truncate", 0.0, None, "none")  # builtin, on-policy: off
    assert of(2.0) == ("token_truncate", 2.0, None, "scoring")  # vLLM
    assert of(lag=1) == ("token_truncate", 2.0, None, "scoring")
    assert of(lag=1, correction="sequence_mask") == ("sequence_mask", 3.0, None, "scoring")
    assert of(2.0, correction="icepop") == ("icepop", 5.0, 0.5, "scoring")
    assert of(2.0, correction="sequence_reject", correction_low=0.99, tis_cap=1.01) == \
        ("sequence_reject", 1.01, 0.99, "scoring")
    assert of(correction="icepop") == ("icepop", 0.0, 0.5, "none")  # nothing to correct: off


def test_a_lagged_run_with_a_sequence_mask_reports_what_it_masked(tmp_path, prompt_file, tiny_model_dir):
    import tidyrl
    from conftest import grpo_config, read_jsonl

    out = tmp_path / "run"
    tidyrl.train(grpo_config(tiny_model_dir, prompt_file, out, 3, rollout={"lag": 1, "correction": "sequence_mask"}))
    rows = [m for m in read_jsonl(out / "metrics.jsonl") if "mismatch/masked_sequence_fraction" in m]
    assert rows and all(0.0 <= m["mismatch/masked_sequence_fraction"] <= 1.0 and
                        0.0 <= m["mismatch/masked_fraction"] <= 1.0 for m in rows)
    assert not any("mismatch/capped_fraction" in m for m in rows)
    with pytest.raises(Exception, match="rollout.correction"):
        tidyrl.train(grpo_config(tiny_model_dir, prompt_file, tmp_path / "bad", 1, rollout={"correction": "tis"}))

"""The algorithm table (tidyrl.algorithms.table) and what it drives: CISPO's loss on hand-worked numbers, the
estimators, the `cispo` algorithm added as one table entry, and a learner that never tests a name."""

from __future__ import annotations

import ast
import math
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from conftest import read_jsonl

import tidyrl
from tidyrl.algorithms.estimators import ESTIMATORS
from tidyrl.algorithms.losses import cispo_policy_loss, clipped_policy_loss, policy_loss
from tidyrl.algorithms.table import ALGORITHMS, POLICY_LOSSES
from tidyrl.config import Config

SRC = Path(__file__).resolve().parent.parent / "src" / "tidyrl"


def test_cispo_weights_each_token_by_its_capped_ratio_and_keeps_every_gradient():
    # Ratios 0.5/0.25 = 2.0 and 0.2/0.4 = 0.5; the cap is 1 + 0.2 = 1.2: weights 1.2 and 0.5 (no lower bound).
    logp = torch.log(torch.tensor([[0.5, 0.2]], dtype=torch.float64)).requires_grad_()
    old = torch.log(torch.tensor([[0.25, 0.4]], dtype=torch.float64))
    loss, capped = cispo_policy_loss(logp, old, torch.tensor([2.0], dtype=torch.float64), clip_eps_high=0.2)
    # loss_t = -w_t * A * logp_t = [-1.2 * 2 * ln 0.5, -0.5 * 2 * ln 0.2]
    assert loss[0].tolist() == pytest.approx([2.4 * math.log(2), math.log(5)], rel=1e-12)
    assert capped.tolist() == [[True, False]]
    loss.sum().backward()
    assert logp.grad[0].tolist() == pytest.approx([-2.4, -1.0], rel=1e-12)  # -w * A: the capped token keeps it
    # PPO's clip zeroes the first token's gradient (ratio 2 > 1.2 with A > 0): the difference CISPO is about.
    logp.grad = None
    ppo, _ = clipped_policy_loss(logp, old, torch.tensor([2.0], dtype=torch.float64), 0.2)
    ppo.sum().backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] == pytest.approx(-2.0 * 0.5)


def test_cispo_with_a_negative_advantage_has_no_lower_bound_and_its_default_cap_is_clip_eps():
    logp = torch.log(torch.tensor([[0.2]], dtype=torch.float64)).requires_grad_()
    old = torch.log(torch.tensor([[0.4]], dtype=torch.float64))
    loss, capped = policy_loss("cispo", logp, old, torch.tensor([[-1.0]], dtype=torch.float64), torch.ones(1, 1),
                               clip_eps=0.2, clip_eps_high=None)
    loss.sum().backward()
    assert logp.grad.item() == pytest.approx(0.5) and not capped.any()  # w = 0.5 (PPO would clip below 0.8)
    with pytest.raises(ValueError, match="unknown policy loss 'ppo'.*token, sequence, cispo"):
        policy_loss("ppo", logp, old, torch.tensor([1.0]), torch.ones(1, 1), 0.2, None)


def test_the_estimators_give_each_algorithms_hand_worked_advantages():
    scores = torch.tensor([1.0, 0.0, 0.0, 0.0])  # two prompts, k = 2
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 0.0]])
    zeros = torch.zeros_like(mask)
    common = dict(k=2, mask=mask, multi_turn=False, truncated=torch.zeros(4, dtype=torch.bool), kl=zeros, beta=0.0,
                  values=None)
    # GRPO: (r - mean) / (std + 1e-4) of the group (unbiased std of [1, 0] = sqrt(1/2)); a tied group: 0.
    grpo = ESTIMATORS["group"](scores, scale_rewards="group", **common)
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert grpo.advantages.tolist() == pytest.approx([a, -a, 0.0, 0.0], abs=1e-6)
    # RLOO: r_i - mean of the others: [1 - 0, 0 - 1, 0, 0].
    assert ESTIMATORS["leave_one_out"](scores, **common).advantages.tolist() == [1.0, -1.0, 0.0, 0.0]
    # REINFORCE++-baseline: scores less the group mean [0.5, -0.5, 0, 0], on each completion's last token, summed
    # to go (gamma 1), then whitened over the 6 tokens [.5, .5, -.5, 0, 0, 0] (mean 1/12, population variance).
    est = ESTIMATORS["group_returns"](scores, gamma=1.0, missing_eos_penalty=None, **common)
    tokens = torch.tensor([0.5, 0.5, -0.5, 0.0, 0.0, 0.0])
    whitened = (tokens - tokens.mean()) / tokens.var(unbiased=False).add(1e-8).sqrt()  # population variance
    assert est.advantages[mask.bool()].tolist() == pytest.approx(whitened.tolist(), abs=1e-5)
    assert est.stats == {"kl_coef": 0.0, "rollout_kl": 0.0}


def test_every_table_entry_names_an_estimator_a_loss_and_a_config_section():
    sections = {f.name for f in fields(Config)}
    for name, algorithm in ALGORITHMS.items():
        assert algorithm.advantages in ESTIMATORS, name
        assert algorithm.policy_loss in POLICY_LOSSES, name
        assert algorithm.section in sections and algorithm.kl_in in ("loss", "reward"), name
        assert not algorithm.critic or not algorithm.grouped, name


def _names_tested(path: Path) -> list[str]:
    """`x.algorithm == ...` / `... in (...)`, `engine == ...`, `.name == ...` comparisons in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            text = ast.unparse(node)
            if any(key in text for key in (".algorithm", ".engine ", ".engine==", "engine.name", "rollout.engine")):
                found.append(text)
    return found


@pytest.mark.parametrize("path", sorted([*(SRC / "loops").glob("rl*.py"), *(SRC / "rollouts").glob("*.py")]),
                         ids=lambda p: p.name)
def test_the_learner_and_the_rollouts_never_test_an_algorithms_or_an_engines_name(path):
    assert _names_tested(path) == [], "read the algorithm table or the engine's capabilities instead"


def test_cispo_is_grpo_with_cispos_loss(tiny_model_dir, prompt_file, tmp_path):
    """`algorithm: cispo` (one table entry): its options in the grpo section, its loss CISPO's. With one optimizer
    step per rollout its ratio is 1, so its gradient is GRPO's exactly (-A grad log pi): the same weights, another
    loss value. With two epochs the second step's ratios differ from 1, and so do the runs."""
    from safetensors.torch import load_file

    def run(name, algorithm, epochs):
        return tidyrl.train({
            "algorithm": algorithm, "model": str(tiny_model_dir), "output_dir": str(tmp_path / name), "seed": 1,
            "data": {"path": str(prompt_file)}, "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
            "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 4, "max_new_tokens": 6},
            "train": {"rollouts": 2, "epochs_per_rollout": epochs, "micro_batch_size": 4, "learning_rate": 1e-2},
            "grpo": {"clip_eps": 0.01}, "log": {"progress_bar": False}})

    grpo, cispo = run("grpo", "grpo", 1), run("cispo", "cispo", 1)
    a, b = load_file(grpo.final_dir / "model.safetensors"), load_file(cispo.final_dir / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert read_jsonl(grpo.output_dir / "metrics.jsonl")[0]["loss"] != read_jsonl(cispo.output_dir / "metrics.jsonl")[0]["loss"]
    assert "policy_loss: cispo" in (cispo.output_dir / "config.yaml").read_text()
    assert "policy_loss: token" in (grpo.output_dir / "config.yaml").read_text()
    grpo2, cispo2 = run("grpo2", "grpo", 2), run("cispo2", "cispo", 2)
    a, b = load_file(grpo2.final_dir / "model.safetensors"), load_file(cispo2.final_dir / "model.safetensors")
    assert not all(torch.equal(a[k], b[k]) for k in a)
    rows = read_jsonl(cispo2.output_dir / "metrics.jsonl")
    assert any(row["clip_fraction"] > 0 for row in rows[1::2])  # second epochs: ratios past 1 + 0.01 capped

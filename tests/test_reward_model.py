"""Reward models keep their own tokenizer and chat template; scoring does not depend on chunking."""

from __future__ import annotations

import json

import pytest
import torch

import tidyrl
from tidyrl.rewards.reward_models import RewardModel, RewardModelError, RunningMoments
from tidyrl.models.tiny import save_tiny_reward_model

PROMPTS = ["apple:", [{"role": "user", "content": "fig?"}], "a much longer prompt than the others:", "kiwi:"]
COMPLETIONS = ["pale", "gif", "x", "wiki and more"]


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return save_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm", seed=3)


def alone(rm: RewardModel, ids: list[int]) -> float:
    """The score of one sequence, no padding, straight through the model."""
    with torch.no_grad():
        return float(rm.model(input_ids=torch.tensor([ids])).logits[0, 0])


def test_the_reward_model_reads_its_own_chat_template_and_tokens(rm_dir, tiny_model_and_tokenizer):
    _, policy_tok = tiny_model_and_tokenizer
    rm = RewardModel(str(rm_dir))
    assert rm.texts(PROMPTS[:2], COMPLETIONS[:2]) == ["apple:pale", "[user] fig?</s>[assistant] gif</s>"]
    ids = rm.encode(["apple:"], ["pale"])[0]
    assert ids == rm.tokenizer("apple:pale")["input_ids"]
    assert ids != policy_tok("apple:pale")["input_ids"]  # another vocabulary: the policy's ids would be wrong
    assert rm.tokenizer.convert_ids_to_tokens(ids) == ["<s>", *"apple:pale"]


def test_scores_do_not_depend_on_forward_batch_size_and_pool_the_last_token(rm_dir):
    scores = {b: RewardModel(str(rm_dir), batch_size=b)(prompts=PROMPTS, completions=COMPLETIONS) for b in (1, 3, 64)}
    assert scores[1] == pytest.approx(scores[3], abs=1e-5) and scores[1] == pytest.approx(scores[64], abs=1e-5)
    rm = RewardModel(str(rm_dir)).load()
    for ids, score in zip(rm.encode(PROMPTS, COMPLETIONS), scores[64]):
        assert score == pytest.approx(alone(rm, ids), abs=1e-5)


def test_chunks_padded_to_a_width_multiple_score_the_same(rm_dir, monkeypatch):
    """On CUDA (models.devices.WIDTH_MULTIPLE) a chunk is left-padded to a multiple of 16 columns: same scores."""
    from tidyrl.models import devices

    rm = RewardModel(str(rm_dir), batch_size=3).load()
    want = rm(prompts=PROMPTS, completions=COMPLETIONS)
    widths = []
    real = rm.model.forward
    monkeypatch.setattr(rm.model, "forward", lambda *a, **kw: widths.append(kw["input_ids"].shape[1]) or real(*a, **kw))
    monkeypatch.setitem(devices.WIDTH_MULTIPLE, "cpu", 16)
    got = rm(prompts=PROMPTS, completions=COMPLETIONS)
    assert widths and all(w % 16 == 0 for w in widths)
    assert got == pytest.approx(want, abs=1e-5)


def test_an_input_longer_than_the_maximum_keeps_the_end_of_the_completion(rm_dir):
    rm = RewardModel(str(rm_dir), max_length=10).load()
    long_prompt = "q" * 40 + ":"
    ids = rm.encode([long_prompt], ["the end"])[0]
    assert len(ids) == 10
    assert rm.tokenizer.decode(ids) == ":the end"[-10:].rjust(10, "q")  # the last 10 characters
    score = rm(prompts=[long_prompt], completions=["the end"])[0]
    assert score == pytest.approx(alone(rm, ids), abs=1e-5)


def test_a_reward_model_without_pad_token_works(tmp_path):
    folder = save_tiny_reward_model(tmp_path / "nopad", pad_token=False)
    rm = RewardModel(str(folder), batch_size=4)
    assert rm.tokenizer.pad_token_id is None
    assert len(rm(prompts=PROMPTS, completions=COMPLETIONS)) == 4


def test_a_two_label_head_and_a_missing_template_fail_with_a_fix(tmp_path):
    two = save_tiny_reward_model(tmp_path / "two", num_labels=2)
    with pytest.raises(RewardModelError, match=r"rewards\[0\]\.model=.*2-label head.*num_labels=1"):
        RewardModel(str(two), key="rewards[0].model")
    plain = save_tiny_reward_model(tmp_path / "plain", chat_template=None)
    with pytest.raises(RewardModelError, match="prompts are chat messages.*no chat_template"):
        RewardModel(str(plain))(prompts=PROMPTS[1:2], completions=["x"])


def test_running_moments_by_hand():
    m = RunningMoments()
    m.update([1.0, 3.0])  # mean 2, population var 1
    assert (m.count, m.mean, m.std) == (2, 2.0, 1.0)
    m.update([5.0, 7.0])  # all four: mean 4, var (9+1+1+9)/4 = 5
    assert (m.mean, m.std) == (4.0, pytest.approx(5 ** 0.5))
    assert m.normalize(9.0) == pytest.approx(5 / 5 ** 0.5)
    again = RunningMoments()
    again.load_state_dict(m.state_dict())
    assert again.mean == 4.0 and again.count == 4


def test_grpo_with_a_reward_model_of_another_tokenizer_end_to_end(rm_dir, tiny_model_dir, prompt_file, tmp_path):
    out = tmp_path / "rm-run"
    cfg = {
        "model": str(tiny_model_dir), "output_dir": str(out), "data": {"path": str(prompt_file)},
        "rewards": [{"model": str(rm_dir), "weight": 0.5, "normalize": True, "name": "rm"},
                    {"function": "tidyrl.demo:anagram_reward", "weight": 1.0}],
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 4, "max_new_tokens": 5, "forward_batch_size": 3},
        "train": {"rollouts": 2, "micro_batch_size": 8, "learning_rate": 1e-3}, "log": {"progress_bar": False},
    }
    tidyrl.train(cfg)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all("reward/rm" in r and "reward/anagram_reward" in r for r in rows)
    # The raw reward-model score is logged; the total uses its running normalisation (mean 0 over rollout 1).
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert all(isinstance(s["rewards"]["rm"], float) for s in samples)

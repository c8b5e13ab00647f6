"""Reward-model training (`algorithm: reward`) end to end on a tiny local model: counts, accuracy rising on a
separable toy set, and a final/ folder that loads as a sequence classifier and that the RL stages' reward-model
scorer (tidyrl.rewards.reward_models.RewardModel) reads exactly as it was trained.

(tests/test_reward_model.py tests that scorer itself.)"""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import expected_lrs, read_jsonl, write_jsonl, torchrun_train, with_sections

import tidyrl
from tidyrl.data import DataError
from tidyrl.loops.offline.loop import OFFLINE_STEP_METRICS
from tidyrl.data.offline import reward_model_input_ids
from tidyrl.plan import make_offline_plan


def separable_pairs(n: int = 32, seed: int = 0) -> list[dict]:
    """Chosen completions are vowels, rejected ones consonants, of random lengths: separable, but a fresh
    score head ranks them at chance."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = rng.choice(["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon"])
        rows.append({"prompt": f"{word}:",
                     "chosen": "".join(rng.choice("aeiou") for _ in range(rng.randint(3, 6))),
                     "rejected": "".join(rng.choice("bcdfgkmnprst") for _ in range(rng.randint(3, 6)))})
    return rows


def reward_config(model_dir, data_file, out, **sections):
    cfg = {
        "algorithm": "reward",
        "model": str(model_dir),
        "output_dir": str(out),
        "seed": 0,
        "data": {"path": str(data_file)},
        "train": {"batch_size": 8, "micro_batch_size": 4, "dataset_epochs": 3.0, "learning_rate": 3e-3,
                  "lr_scheduler": "linear", "warmup_steps": 2},
        "log": {"progress_bar": False},
    }
    return with_sections(cfg, sections)


def scores(model, tokenizer, rows, pad_id):
    """Score prompt + completion texts as one right-padded batch, the way tidyrl trained them."""
    ids = [reward_model_input_ids(r["prompt"], r["completion"], tokenizer) for r in rows]
    width = max(map(len, ids))
    input_ids = torch.tensor([x + [pad_id] * (width - len(x)) for x in ids])
    mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=mask).logits.squeeze(-1)


def test_reward_model_learns_a_separable_preference(tiny_model_dir, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    pairs = separable_pairs()
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    out = tmp_path / "rm"
    result = tidyrl.train(reward_config(tiny_model_dir, data, out))

    # N = 32 pairs, B = 8, 3 epochs: 12 steps, 96 pairs; accumulation 8 / 4 = 2.
    plan = json.loads((out / "plan.json").read_text())
    assert "score_logits" in plan.pop("memory")["per_process_bytes"]["update"]  # a score head, no vocabulary
    assert set(plan.pop("memory_probe")["phases"]) == {"update"}  # the worst case first (test_memory_probe.py)
    assert plan == make_offline_plan(batch_size=8, micro_batch_size=4, dataset_epochs=3.0, num_examples=32,
                                     warmup_steps=2).to_dict()
    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == plan["total_optimizer_steps"] == 12
    assert [r["examples"] for r in rows] == [8 * s for s in range(1, 13)]
    assert [r["lr"] for r in rows] == pytest.approx(expected_lrs(12, 2, "linear", 3e-3), abs=1e-12)
    for row in rows:
        assert list(row)[: len(OFFLINE_STEP_METRICS)] == list(OFFLINE_STEP_METRICS)
        assert row["rewards/margin"] == pytest.approx(row["rewards/chosen"] - row["rewards/rejected"])
        assert "margin_mean" not in row  # no margin column configured
    # Accuracy rises from chance (the fresh score head) to every pair; the loss falls.
    assert (rows[0]["rewards/accuracy"] + rows[1]["rewards/accuracy"]) / 2 <= 0.75
    assert [r["rewards/accuracy"] for r in rows[-4:]] == [1.0] * 4
    assert rows[-1]["loss"] < rows[0]["loss"] / 3
    assert rows[-1]["rewards/margin"] > 1.0

    # final/ is a sequence classifier with one output and pad_token_id set; it ranks every pair right when
    # scored as a padded batch, and padding does not move a sequence's score.
    model = AutoModelForSequenceClassification.from_pretrained(result.final_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(result.final_dir)
    assert model.config.num_labels == 1 and model.config.pad_token_id == tokenizer.pad_token_id
    assert type(model).__name__ == "LlamaForSequenceClassification"
    chosen = scores(model, tokenizer, [{"prompt": p["prompt"], "completion": p["chosen"]} for p in pairs],
                    tokenizer.pad_token_id)
    rejected = scores(model, tokenizer, [{"prompt": p["prompt"], "completion": p["rejected"]} for p in pairs],
                      tokenizer.pad_token_id)
    assert bool((chosen > rejected).all())
    alone = scores(model, tokenizer, [{"prompt": pairs[0]["prompt"], "completion": pairs[0]["chosen"]}],
                   tokenizer.pad_token_id)
    assert alone.item() == pytest.approx(chosen[0].item(), abs=1e-5)

    # The RL stages load it as `rewards: [{model: .../final}]` and give the same scores.
    from tidyrl.rewards.reward_models import RewardModel

    rm = RewardModel(str(result.final_dir), batch_size=5)
    rl_scores = rm(prompts=[p["prompt"] for p in pairs], completions=[p["chosen"] for p in pairs])
    assert rl_scores == pytest.approx(chosen.tolist(), abs=1e-5)
    chat = [{"role": "user", "content": "fig"}]
    assert rm.encode([chat, "fig:"], ["gif", "gif"]) == [reward_model_input_ids(chat, "gif", tokenizer),
                                                        reward_model_input_ids("fig:", "gif", tokenizer)]


def test_margin_column_and_micro_batch_invariance(tiny_model_dir, tmp_path):
    rows = [dict(p, margin=1.0) for p in separable_pairs(8)]
    data = write_jsonl(tmp_path / "pairs.jsonl", rows)
    logs = {}
    for m in (1, 4):
        out = tmp_path / f"m{m}"
        tidyrl.train(reward_config(tiny_model_dir, data, out, reward={"margin_column": "margin"},
                                   train={"micro_batch_size": m, "dataset_epochs": 2.0}))
        logs[m] = read_jsonl(out / "metrics.jsonl")
    assert len(logs[1]) == 2 and logs[1][0]["margin_mean"] == 1.0
    for a, b in zip(logs[1], logs[4]):
        for key in ("loss", "rewards/chosen", "rewards/rejected", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6)


def test_pairs_are_tokenised_as_the_rl_reward_model_scorer_reads_them(tiny_model_dir):
    from transformers import AutoTokenizer

    from tidyrl.data.offline import reward_model_input_ids

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = [{"role": "user", "content": "fig"}]
    as_messages = reward_model_input_ids(prompt, [{"role": "assistant", "content": "gif"}], tok)
    as_text = reward_model_input_ids(prompt, "gif", tok)
    # A conversation goes through the chat template whole (BOS once, the assistant turn closed by its "\n");
    # a string completion after a message prompt becomes that assistant turn.
    assert tok.decode(as_messages) == tok.decode(as_text) == "<s><user>fig\n<assistant>gif\n"
    assert tok.decode(reward_model_input_ids("fig:", "gif", tok)) == "<s>fig:gif"  # no EOS: decoded text has none


def test_bad_pairs_are_reported_before_any_model_is_loaded(tiny_model_dir, tmp_path):
    def fails(rows, match, **sections):
        data = write_jsonl(tmp_path / "bad.jsonl", rows)
        with pytest.raises(DataError, match=match):
            tidyrl.train(reward_config(tiny_model_dir, data, tmp_path / "out", **sections))
        assert not (tmp_path / "out").exists()

    fails([{"prompt": "a", "good": "b", "rejected": "c"}],
          r"data.chosen_column = 'chosen' \(the preferred completion\) is not a column")
    fails([{"prompt": "a", "chosen": "b", "rejected": 3}], r"row 0 \(0-based\): data.rejected_column = 'rejected'")
    fails([{"prompt": "a", "chosen": "b", "rejected": "b"}], "chosen and rejected are the same tokens")
    fails([{"prompt": "a", "chosen": "b", "rejected": "c", "m": "big"}], r"reward.margin_column = 'm'.*finite number",
          reward={"margin_column": "m"})


@pytest.mark.extended  # (SFT, DPO on two processes: the default suite's)
def test_two_processes_match_one(tiny_model_dir, tmp_path):
    """W = 2 with m = 2 against W = 1 with m = 4 (8 pairs per step): the same losses and score head. The new
    head is initialised from the seed in every process alike."""
    from safetensors.torch import load_file

    data = write_jsonl(tmp_path / "pairs.jsonl", separable_pairs(16))
    torchrun_train(reward_config(tiny_model_dir, data, tmp_path / "two", train={"micro_batch_size": 2}), tmp_path)
    one = tidyrl.train(reward_config(tiny_model_dir, data, tmp_path / "one"))
    rows_one, rows_two = read_jsonl(one.output_dir / "metrics.jsonl"), read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert [r["lr"] for r in rows_one] == [r["lr"] for r in rows_two] and len(rows_one) == 6
    for key in ("loss", "rewards/accuracy", "rewards/margin"):
        assert [r[key] for r in rows_one] == pytest.approx([r[key] for r in rows_two], abs=1e-5), key
    a, b = load_file(one.final_dir / "model.safetensors"), load_file(tmp_path / "two" / "final" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_training_reads_the_score_at_the_last_token_also_where_pad_is_eos(tiny_model_dir):
    """With pad == eos, a sequence that ends with its EOS is padded with another id, so the score training reads is
    the head's output at that EOS: the same number the model gives the sequence alone (as the RL scorer reads it),
    not the token before it. The config keeps its pad id."""
    from tidyrl.data.offline import TokenizedPair, TokenizedSequence
    from tidyrl.loops.offline.reward_model import RewardStage, load_reward_model

    eos = 2
    torch.manual_seed(0)
    model = load_reward_model(str(tiny_model_dir), pad_id=eos)
    chosen = [5, 6, 7, 8, eos]  # ends with its EOS, the pad id
    rejected = [5, 6, 9]  # shorter: padded in the batch
    pair = TokenizedPair(TokenizedSequence(chosen, [1] * len(chosen)), TokenizedSequence(rejected, [1] * 3))
    stage = RewardStage(model, [pair], [], eos, "cpu", batch_size=1, with_margin=False)
    _, chosen_B, rejected_B, _, _ = stage._score([pair])

    def alone(ids):  # one unpadded row, pooled at its last token
        model.config.pad_token_id = 0
        try:
            return model(input_ids=torch.tensor([ids])).logits[0, 0].item()
        finally:
            model.config.pad_token_id = eos

    assert chosen_B.item() == pytest.approx(alone(chosen), abs=1e-6)
    assert rejected_B.item() == pytest.approx(alone(rejected), abs=1e-6)
    assert chosen_B.item() != pytest.approx(alone(chosen[:-1]), abs=1e-3)  # not the token before the EOS
    assert model.config.pad_token_id == eos

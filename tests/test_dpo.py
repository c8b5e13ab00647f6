"""DPO and IPO end to end on a tiny local model: counts, the first step against the reference (hand-worked),
the chosen-vs-rejected margin rising, micro-batch invariance, and the pairs tokenised as a rollout would be."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import expected_lrs, read_jsonl, torchrun_train, with_sections

import tidyrl
from tidyrl.loops.offline.loop import OFFLINE_STEP_METRICS
from tidyrl.plan import make_offline_plan

WORDS = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon", "mango", "peach", "grape", "melon"]






@pytest.fixture
def pairs_file(tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{w}:", "chosen": w[::-1], "rejected": "zz" + w}) + "\n"
                            for w in WORDS))
    return path


def dpo_config(model_dir, data_file, out, **sections):
    cfg = {
        "algorithm": "dpo",
        "model": str(model_dir),
        "output_dir": str(out),
        "seed": 1,
        "data": {"path": str(data_file)},
        "train": {"batch_size": 4, "micro_batch_size": 2, "dataset_epochs": 2.0, "learning_rate": 1e-2,
                  "lr_scheduler": "cosine", "warmup_steps": 0},
        "log": {"progress_bar": False},
    }
    return with_sections(cfg, sections)


def test_dpo_run_counts_and_raises_the_margin(tiny_model_dir, pairs_file, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "dpo"
    result = tidyrl.train(dpo_config(tiny_model_dir, pairs_file, out))
    # N = 12 pairs, B = 4, 2 epochs: 6 steps, 24 pairs.
    plan = json.loads((out / "plan.json").read_text())
    assert set(plan.pop("memory")["per_process_bytes"]) == {"scoring", "update"}  # tests/test_memory_plan.py
    assert set(plan.pop("memory_probe")["phases"]) == {"update"}  # the worst case first (test_memory_probe.py)
    assert plan == make_offline_plan(batch_size=4, micro_batch_size=2, dataset_epochs=2.0, num_examples=12).to_dict() | {
        "reference": "scored once before training, cached",
        "reference_sequences": 24, "reference_forward_passes": 6}  # 12 pairs in chunks of m = 2
    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == plan["total_optimizer_steps"] == 6
    assert [r["examples"] for r in rows] == [4, 8, 12, 16, 20, 24]
    assert [r["epoch"] for r in rows] == pytest.approx([s / 3 for s in range(1, 7)])
    assert [r["lr"] for r in rows] == pytest.approx(expected_lrs(6, 0, "cosine", 1e-2), abs=1e-12)
    for row in rows:
        assert list(row)[: len(OFFLINE_STEP_METRICS)] == list(OFFLINE_STEP_METRICS)
        assert row["rewards/margin"] == pytest.approx(row["rewards/chosen"] - row["rewards/rejected"], abs=1e-9)
    # Step 1: the policy is the reference, so every log-ratio is 0 and the loss is -log sigmoid(0) = log 2.
    first = rows[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert first["rewards/chosen"] == first["rewards/rejected"] == first["rewards/margin"] == 0.0
    assert first["rewards/accuracy"] == 0.0  # ties do not count as correct
    # Then the chosen completions gain on the rejected ones, relative to the reference.
    assert rows[-1]["rewards/margin"] > 0.5
    assert [r["rewards/accuracy"] for r in rows[-3:]] == [1.0] * 3
    assert rows[-1]["loss"] < 0.5
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    trained = AutoModelForCausalLM.from_pretrained(result.final_dir)
    assert any(not torch.equal(a, b) for a, b in zip(start.parameters(), trained.parameters()))


def test_ipo_first_step_is_the_squared_target(tiny_model_dir, pairs_file, tmp_path):
    out = tmp_path / "ipo"
    tidyrl.train(dpo_config(tiny_model_dir, pairs_file, out, dpo={"loss_type": "ipo", "beta": 0.25},
                            train={"dataset_epochs": None, "max_steps": 2, "learning_rate": 1e-3}))
    rows = read_jsonl(out / "metrics.jsonl")
    # h = 0 at the reference: (0 - 1 / (2 * 0.25))^2 = 4.
    assert rows[0]["loss"] == pytest.approx(4.0, abs=1e-5)
    assert rows[1]["rewards/margin"] > 0  # the first step moved h towards the target 2


def test_micro_batch_size_does_not_change_the_update(tiny_model_dir, pairs_file, tmp_path):
    from transformers import AutoModelForCausalLM

    finals, logs = [], []
    for m in (1, 4):
        result = tidyrl.train(dpo_config(tiny_model_dir, pairs_file, tmp_path / f"m{m}",
                                         train={"micro_batch_size": m, "dataset_epochs": None, "max_steps": 3}))
        finals.append(AutoModelForCausalLM.from_pretrained(result.final_dir))
        logs.append(read_jsonl(result.output_dir / "metrics.jsonl"))
    for a, b in zip(*logs):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["rewards/margin"] == pytest.approx(b["rewards/margin"], abs=1e-5)
    worst = max((pa - pb).abs().max().item() for pa, pb in zip(finals[0].parameters(), finals[1].parameters()))
    assert worst < 1e-5


def test_pairs_are_tokenised_like_a_rollout(tiny_model_dir, tmp_path):
    """Prompt tokens as the RL stage encodes them, the completion tokenised on its own, EOS appended; the
    targets (what the sequence log-prob sums) are the completion and EOS only."""
    from transformers import AutoTokenizer

    from tidyrl.config import load_config
    from tidyrl.data import encode_prompts
    from tidyrl.data.offline import completion_eos_ids, load_preference_pairs

    prompt = [{"role": "user", "content": "fig"}]
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"prompt": prompt, "chosen": "gif",
                                "rejected": [{"role": "assistant", "content": "fig"}]}) + "\n")
    cfg = load_config(dpo_config(tiny_model_dir, path, tmp_path / "unused"))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    pairs, notes = load_preference_pairs(cfg, tok, completion_eos_ids(tiny_model_dir, tok), whole_text=False)
    prompt_ids = encode_prompts([prompt], tok)[0]
    chosen = pairs[0].chosen
    assert chosen.input_ids == prompt_ids + tok("gif", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert chosen.target_mask == [0] * len(prompt_ids) + [1] * 4
    # A message completion: the assistant turn as the chat template closes it ("fig\n"), then EOS.
    rejected = pairs[0].rejected
    assert tok.decode(rejected.input_ids) == "<s><user>fig\n<assistant>fig\n</s>"
    assert rejected.input_ids[: len(prompt_ids)] == prompt_ids
    assert sum(rejected.target_mask) == 5 and notes == []


def test_two_processes_match_one(tiny_model_dir, pairs_file, tmp_path):
    """W = 2 (each process 2 of the 4 pairs per step, m = 1) against W = 1 with m = 4: the same losses, held-out
    metrics and parameters; the reference log-probs are per pair, so sharding the pairs changes nothing. Two of
    the twelve pairs are held out (10 train pairs, 2 epochs: 5 steps), scored after steps 2, 4 and 5."""
    from safetensors.torch import load_file

    held = {"data": {"eval_fraction": 0.2}, "log": {"eval_every": 2}}
    torchrun_train(dpo_config(tiny_model_dir, pairs_file, tmp_path / "two", train={"micro_batch_size": 1}, **held),
                   tmp_path)
    one = tidyrl.train(dpo_config(tiny_model_dir, pairs_file, tmp_path / "one", train={"micro_batch_size": 4}, **held))
    assert json.loads((tmp_path / "two" / "plan.json").read_text())["world_size"] == 2
    rows_one, rows_two = read_jsonl(one.output_dir / "metrics.jsonl"), read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert [r["step"] for r in rows_one] == [r["step"] for r in rows_two] == list(range(1, 6))
    assert [r["lr"] for r in rows_one] == [r["lr"] for r in rows_two]
    assert [r.get("eval/loss") is not None for r in rows_two] == [False, True, False, True, True]
    for key in ("eval/loss", "eval/accuracy", "eval/margin"):
        assert [r.get(key) for r in rows_one] == pytest.approx([r.get(key) for r in rows_two], abs=1e-5), key
    for key in ("loss", "rewards/margin", "rewards/accuracy"):
        assert [r[key] for r in rows_one] == pytest.approx([r[key] for r in rows_two], abs=1e-5), key
    a, b = load_file(one.final_dir / "model.safetensors"), load_file(tmp_path / "two" / "final" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_robust_dpo_first_step_is_log_2_and_the_margin_rises(tiny_model_dir, pairs_file, tmp_path):
    out = tmp_path / "robust"
    tidyrl.train(dpo_config(tiny_model_dir, pairs_file, out, dpo={"loss_type": "robust", "label_smoothing": 0.1},
                            train={"dataset_epochs": None, "max_steps": 3}))
    rows = read_jsonl(out / "metrics.jsonl")
    # h = 0 at the reference: [0.9 * log 2 - 0.1 * log 2] / 0.8 = log 2.
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert rows[-1]["rewards/margin"] > 0


def test_simpo_runs_without_a_reference_and_raises_the_margin(tiny_model_dir, pairs_file, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "simpo"
    result = tidyrl.train(dpo_config(tiny_model_dir, pairs_file, out,
                                     dpo={"loss_type": "simpo", "beta": 2.0, "simpo_gamma": 1.0},
                                     train={"dataset_epochs": None, "max_steps": 4}))
    assert "reference-free: no reference model loaded" in capsys.readouterr().out
    rows = read_jsonl(out / "metrics.jsonl")
    # rewards are beta * mean token log-probs: negative, and the chosen ones gain on the rejected ones.
    assert rows[0]["rewards/chosen"] < 0
    assert rows[-1]["rewards/margin"] > rows[0]["rewards/margin"]
    assert rows[-1]["loss"] < rows[0]["loss"]
    AutoModelForCausalLM.from_pretrained(result.final_dir)


def test_orpo_logs_its_terms_and_is_micro_batch_invariant(tiny_model_dir, pairs_file, tmp_path):
    from transformers import AutoModelForCausalLM

    finals, logs = [], []
    for m in (1, 4):
        result = tidyrl.train(dpo_config(tiny_model_dir, pairs_file, tmp_path / f"orpo{m}",
                                         dpo={"loss_type": "orpo", "orpo_lambda": 0.5},
                                         train={"micro_batch_size": m, "dataset_epochs": None, "max_steps": 4}))
        finals.append(AutoModelForCausalLM.from_pretrained(result.final_dir))
        logs.append(read_jsonl(result.output_dir / "metrics.jsonl"))
    rows = logs[0]
    for row in rows:
        # loss = SFT + lambda * L_OR, and L_OR >= 0.
        assert row["loss"] >= row["orpo/sft_loss"]
    assert rows[-1]["orpo/sft_loss"] < rows[0]["orpo/sft_loss"]
    assert rows[-1]["orpo/log_odds_ratio"] > rows[0]["orpo/log_odds_ratio"]
    # The SFT term is normalised by the global batch's chosen tokens: micro-batch size changes nothing.
    for a, b in zip(*logs):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["orpo/sft_loss"] == pytest.approx(b["orpo/sft_loss"], abs=1e-6)
    worst = max((pa - pb).abs().max().item() for pa, pb in zip(finals[0].parameters(), finals[1].parameters()))
    assert worst < 1e-5


def test_pairs_with_chosen_equal_to_rejected_are_refused_by_row(tiny_model_dir, tmp_path):
    from tidyrl.data import DataError

    path = tmp_path / "same.jsonl"
    rows = [{"prompt": f"{w}:", "chosen": w, "rejected": w if i in (1, 3) else "zz" + w} for i, w in enumerate(WORDS)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    with pytest.raises(DataError, match=r"2 of 12 rows have chosen and rejected the same tokens.*rows 1, 3 \(0-based\)"):
        tidyrl.train(dpo_config(tiny_model_dir, path, out))
    assert not out.exists()  # refused before anything was written


def test_reference_cache_does_not_depend_on_its_chunking(tiny_model_dir, pairs_file, tmp_path):
    """The cache scored in chunks of 5 padded pairs equals each pair scored alone (no padding), to 1e-6."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidyrl.config import load_config
    from tidyrl.loops.run.setup import make_accelerator
    from tidyrl.loops.offline.dpo import reference_logps_cache
    from tidyrl.loops.offline.loop import model_pad_id
    from tidyrl.data.offline import completion_eos_ids, load_preference_pairs

    cfg = load_config(dpo_config(tiny_model_dir, pairs_file, tmp_path / "unused"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    eos_ids = completion_eos_ids(str(tiny_model_dir), tokenizer)
    pairs, _ = load_preference_pairs(cfg, tokenizer, eos_ids, whole_text=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    accelerator, pad_id = make_accelerator(cfg), model_pad_id(tokenizer, eos_ids)
    alone = reference_logps_cache(accelerator, model, pairs, pad_id, chunk=1)
    chunked = reference_logps_cache(accelerator, model, pairs, pad_id, chunk=5)
    assert alone.shape == (12, 2) and (alone < 0).all()
    assert (alone - chunked).abs().max().item() < 1e-6

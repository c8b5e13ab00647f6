"""KTO end to end on a tiny local model: the first step's loss worked by hand, z0 recomputed from a checkpoint,
micro-batch and process invariance, and the data errors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import read_jsonl, torchrun_train, with_sections, write_jsonl

import tidyrl
from tidyrl.config import ConfigError, load_config
from tidyrl.data import DataError

WORDS = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon", "mango", "peach", "grape", "melon"]


def kto_rows():
    """Desirable: the word reversed; undesirable: a wrong answer. 7 desirable, 5 undesirable."""
    return [{"prompt": f"{w}:", "completion": w[::-1] if i % 5 not in (1, 3) else "zz" + w, "label": i % 5 not in (1, 3)}
            for i, w in enumerate(WORDS)]


def kto_config(model_dir, data_file, out, **sections):
    cfg = {
        "algorithm": "kto", "model": str(model_dir), "output_dir": str(out), "seed": 4,
        "data": {"path": str(data_file)},
        "kto": {"beta": 0.5, "desirable_weight": 1.0, "undesirable_weight": 1.5},
        "train": {"batch_size": 4, "micro_batch_size": 2, "dataset_epochs": 2.0, "learning_rate": 5e-3,
                  "warmup_steps": 0},
        "log": {"progress_bar": False},
    }
    return with_sections(cfg, sections)


@pytest.fixture
def kto_file(tmp_path):
    return write_jsonl(tmp_path / "kto.jsonl", kto_rows())


def test_kto_run_counts_and_its_first_step_by_hand(tiny_model_dir, kto_file, tmp_path, capsys):
    from tidyrl.data import PromptStream

    out = tmp_path / "run"
    result = tidyrl.train(kto_config(tiny_model_dir, kto_file, out))
    printed = capsys.readouterr().out
    assert "7 desirable and 5 undesirable examples" in printed
    assert "undesirable) = 0.93; the KTO paper recommends 1 to 4/3" in printed  # 1.0 * 7 / (1.5 * 5)
    plan = json.loads((out / "plan.json").read_text())
    # N = 12, B = 4, 2 epochs: 6 steps; the reference: 12 examples once, then 4 mismatched pairs a step.
    assert (plan["total_optimizer_steps"], plan["num_examples"]) == (6, 12)
    assert (plan["reference_sequences"], plan["z0_sequences_per_step"], plan["z0_sequences"]) == (12, 4, 24)
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))
    # Step 1: the policy is the reference, so every log-ratio is 0, z0 = 0, and each example's loss is
    # lambda - lambda * sigmoid(0) = lambda / 2: 0.5 for desirable, 0.75 for undesirable ones, over B = 4.
    labels = [row["label"] for row in kto_rows()]
    batch = PromptStream(12, 4).rollout_indices(0, 4)
    expected = sum(0.5 if labels[i] else 0.75 for i in batch) / 4
    assert rows[0]["kl"] == 0.0
    assert rows[0]["loss"] == pytest.approx(expected, abs=1e-7)
    assert rows[0]["desirable_fraction"] == sum(labels[i] for i in batch) / 4
    assert rows[0]["rewards/chosen"] == pytest.approx(0.0, abs=1e-6)
    # Training separates them: the desirable examples' implicit reward rises above the undesirable ones'.
    margins = [r["rewards/margin"] for r in rows if r["rewards/margin"] is not None]  # None: a one-class batch
    assert margins[0] == pytest.approx(0.0, abs=1e-6) and min(margins[1:]) > 0.1
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert (result.final_dir / "model.safetensors").exists()


def test_plan_prints_the_reference_cost_that_plan_json_holds(tiny_model_dir, kto_file, tmp_path, capsys):
    import yaml

    from tidyrl.cli import main

    path = tmp_path / "kto.yaml"
    path.write_text(yaml.safe_dump(kto_config(tiny_model_dir, kto_file, tmp_path / "run")))
    assert main(["plan", str(path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["reference"] == "examples scored once before training, cached; z0's mismatched pairs every step"
    assert (printed["reference_sequences"], printed["z0_sequences_per_step"], printed["z0_sequences"]) == (12, 4, 24)


def test_z0_is_the_mean_log_ratio_of_the_global_batch_mismatched_pairs(tiny_model_dir, kto_file, tmp_path):
    """Recomputed outside the loop: from checkpoint-2's weights and the reference, the pairs (prompt of
    batch[i], completion of batch[i+1 mod B]) of step 3's batch give the `kl` that step logged."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidyrl.algorithms.preference import sequence_logps
    from tidyrl.data import PromptStream
    from tidyrl.loops.offline.loop import pad_batch, target_logprobs
    from tidyrl.data.offline import completion_eos_ids, load_kto_examples, mismatched_sequence

    out = tmp_path / "run"
    cfg = kto_config(tiny_model_dir, kto_file, out, log={"save_every": 2, "keep_last": 5})
    tidyrl.train(cfg)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    examples, _ = load_kto_examples(load_config(cfg), tokenizer, completion_eos_ids(str(tiny_model_dir), tokenizer))
    batch = PromptStream(12, 4).rollout_indices(2, 4)  # step 3 (0-based 2)
    pairs = [mismatched_sequence(examples[batch[i]], examples[batch[(i + 1) % 4]], None) for i in range(4)]
    assert pairs[0].input_ids[: examples[batch[0]].prompt_length] == \
        examples[batch[0]].sequence.input_ids[: examples[batch[0]].prompt_length]
    ratios = []
    with torch.no_grad():
        inputs = pad_batch(pairs, tokenizer.pad_token_id, "cpu")
        for folder in (out / "checkpoint-2", tiny_model_dir):
            model = AutoModelForCausalLM.from_pretrained(folder).eval()
            ratios.append(sequence_logps(*target_logprobs(model, inputs)))
    z0 = max(0.0, float((ratios[0] - ratios[1]).mean()))
    rows = read_jsonl(out / "metrics.jsonl")
    assert rows[2]["kl"] == pytest.approx(z0, abs=1e-5)
    assert any(r["kl"] > 0 for r in rows[1:])  # the policy moved away from the reference


@pytest.mark.extended  # (SFT, DPO on two processes: the default suite's; KTO's sums are theirs)
def test_micro_batch_size_and_two_processes_change_nothing(tiny_model_dir, kto_file, tmp_path):
    from safetensors.torch import load_file

    held = {"data": {"eval_fraction": 0.25}, "log": {"eval_every": 2}}
    one = tidyrl.train(kto_config(tiny_model_dir, kto_file, tmp_path / "m1", train={"micro_batch_size": 1}, **held))
    four = tidyrl.train(kto_config(tiny_model_dir, kto_file, tmp_path / "m4", train={"micro_batch_size": 4}, **held))
    torchrun_train(kto_config(tiny_model_dir, kto_file, tmp_path / "w2", train={"micro_batch_size": 1}, **held),
                   tmp_path)
    runs = [read_jsonl(d / "metrics.jsonl") for d in (tmp_path / "m1", tmp_path / "m4", tmp_path / "w2")]
    assert json.loads((tmp_path / "w2" / "plan.json").read_text())["world_size"] == 2
    assert [r["step"] for r in runs[0]] == [1, 2, 3, 4, 5] and [r["step"] for r in runs[0] if "eval/loss" in r] == [2, 4, 5]
    for other in runs[1:]:
        for key in ("loss", "kl", "rewards/margin", "eval/loss", "eval/margin"):
            assert [r.get(key) for r in other] == pytest.approx([r.get(key) for r in runs[0]], abs=2e-6), key
    a = load_file(one.final_dir / "model.safetensors")
    for folder in (four.final_dir, tmp_path / "w2" / "final"):
        b = load_file(folder / "model.safetensors")
        assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_bad_kto_data_is_refused_before_any_model_loads(tiny_model_dir, tmp_path):
    def fails(rows, match):
        path = write_jsonl(tmp_path / "bad.jsonl", rows)
        with pytest.raises(DataError, match=match):
            tidyrl.train(kto_config(tiny_model_dir, path, tmp_path / "out"))
        assert not (tmp_path / "out").exists()

    rows = kto_rows()
    fails([{**r, "label": True} for r in rows], "KTO needs both desirable and undesirable examples, but all 12 rows "
                                                "have label=true")
    # A string among booleans: some `datasets` versions refuse the column on reading (line 4), others read it
    # and tidyrl names the row (row 3, 0-based); either way before any model loads.
    fails(rows[:3] + [{**rows[3], "label": "yes"}], r"(row 3 \(0-based\): the label \(data.label_column = 'label'\) "
                                                   r"holds 'yes'; it must be true|column 'label' holds a str on line 4)")
    fails([{**r, "label": 1} for r in rows], r"row 0 \(0-based\): the label .* holds 1; it must be true")
    fails([{"prompt": r["prompt"], "completion": r["completion"]} for r in rows], r"data.label_column = 'label'")
    with pytest.raises(ConfigError, match="kto.beta: must be a number > 0"):
        load_config(kto_config(tiny_model_dir, "x.jsonl", "out", kto={"beta": 0}))

"""The run contract of the offline stages (sft, reward, dpo), the RL loop's: checkpoints that resume bit for bit,
a stop on a signal with a checkpoint, trackers, the summary, held-out evaluation and the best model."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from conftest import read_jsonl, write_jsonl
from safetensors.torch import load_file
from test_dpo import dpo_config
from test_reward_training import reward_config
from test_sft import sft_config

import tidyrl

WORDS = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon", "mango", "peach"]
TIMING = ("time_s", "time/update_s", "time/eval_s", "tokens_per_s")


def sft_rows():
    return [{"prompt": f"{w}:", "completion": w[::-1]} for w in WORDS]


def pair_rows():
    return [{"prompt": f"{w}:", "chosen": w[::-1], "rejected": "zz" + w} for w in WORDS]


def weights(folder):
    found = sorted(folder.glob("*.safetensors"))
    assert found, f"no weights in {folder}"
    return load_file(str(found[0]))


def untimed(path):
    return [{k: v for k, v in row.items() if k not in TIMING} for row in read_jsonl(path)]


def same_weights(a, b):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def same_weights_within(a, b, tolerance):
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    worst = max(float((wa[k] - wb[k]).abs().max()) for k in wa)
    assert worst < tolerance, worst


STAGES = {
    "sft": (sft_config, sft_rows, {"sft": {"packing": True}, "data": {"max_length": 24}}),
    "reward": (reward_config, pair_rows, {}),
    "dpo": (dpo_config, pair_rows, {}),
    "simpo": (dpo_config, pair_rows, {"dpo": {"loss_type": "simpo", "beta": 2.0}}),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_resume_from_a_checkpoint_replays_the_rest_bit_for_bit(stage, tiny_model_dir, tmp_path):
    make_config, rows, sections = STAGES[stage]
    data = write_jsonl(tmp_path / "data.jsonl", rows())
    out = tmp_path / "run"
    cfg = make_config(tiny_model_dir, data, out, **sections)
    cfg["log"].update(save_every=2, keep_last=10)
    result = tidyrl.train(cfg)
    total = result.plan.total_optimizer_steps
    assert total >= 4
    kept = sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))
    assert kept == list(range(2, total, 2))  # every 2 steps, none at the last (final/ is that)
    state = json.loads((out / "checkpoint-2" / "trainer_state" / "state.json").read_text())
    assert state["step"] == 2 and state["plan"] == result.plan.to_dict()

    straight_rows, straight_final = untimed(out / "metrics.jsonl"), tmp_path / "straight-final"
    shutil.copytree(out / "final", straight_final)
    # Resume from step 2 as after a kill there: the rows after it are dropped and written again, equal.
    resumed = tidyrl.train(cfg, ["resume_from=" + str(out / "checkpoint-2")])
    assert resumed.metrics["step"] == total
    assert untimed(out / "metrics.jsonl") == straight_rows
    same_weights(out / "final", straight_final)


def test_a_stop_signal_saves_a_checkpoint_and_resume_finishes_the_run(tiny_model_dir, tmp_path, monkeypatch):
    import tidyrl.loops.run.steps as training

    data = write_jsonl(tmp_path / "data.jsonl", sft_rows())
    straight = tidyrl.train(sft_config(tiny_model_dir, data, tmp_path / "straight"))
    out = tmp_path / "run"
    cfg = sft_config(tiny_model_dir, data, out)
    calls = []

    def stop_at_step_3(accelerator, flag):  # as if SIGTERM arrived during step 3
        calls.append(flag)
        return len(calls) == 3

    monkeypatch.setattr(training, "agree", stop_at_step_3)
    with pytest.raises(training.TrainingInterrupted, match="after optimizer step 3 of 8.*resume_from=latest"):
        tidyrl.train(cfg)
    assert [p.name for p in out.glob("checkpoint-*")] == ["checkpoint-3"] and not (out / "final").exists()
    monkeypatch.undo()
    tidyrl.train(cfg, ["resume_from=latest"])
    assert untimed(out / "metrics.jsonl") == untimed(straight.output_dir / "metrics.jsonl")
    same_weights(out / "final", straight.final_dir)


def test_resume_refuses_a_changed_learning_rate(tiny_model_dir, tmp_path):
    from tidyrl.checkpoint import CheckpointError

    data = write_jsonl(tmp_path / "data.jsonl", pair_rows())
    cfg = reward_config(tiny_model_dir, data, tmp_path / "run", log={"save_every": 2})
    tidyrl.train(cfg)
    with pytest.raises(CheckpointError, match="train.learning_rate: 0.003 -> 0.01"):
        tidyrl.train(cfg, ["resume_from=latest", "train.learning_rate=0.01"])


def test_summary_and_progress_bar_show_the_loss(tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "data.jsonl", pair_rows())
    result = tidyrl.train(dpo_config(tiny_model_dir, data, tmp_path / "run", log={"progress_bar": True}))
    captured = capsys.readouterr()
    first = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert "tidyrl: finished dpo: 5 optimizer steps (20 examples, 2 dataset epochs)" in captured.out
    assert f"loss: {first['loss']:.4f} (step 1) -> {result.metrics['loss']:.4f} (last step)" in captured.out
    assert f"rewards/accuracy: {first['rewards/accuracy']:.4f} (step 1)" in captured.out
    assert "loss=" in captured.err and "accuracy=" in captured.err  # the bar's postfix


def test_sft_eval_split_scores_held_out_examples_and_keeps_the_best(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidyrl.loops.offline.loop import pad_batch, target_logprobs
    from tidyrl.data.offline import completion_eos_ids, held_out_rows, load_sft_examples

    data = write_jsonl(tmp_path / "data.jsonl", sft_rows())
    out = tmp_path / "run"
    cfg = sft_config(tiny_model_dir, data, out, data={"eval_fraction": 0.2},
                     log={"eval_every": 3, "best_metric": "eval/loss"})
    result = tidyrl.train(cfg)
    # 2 of 10 rows held out (seed 3): N = 8, B = 4, 3 epochs -> 6 steps; eval after steps 3 and 6.
    assert result.plan.num_examples == 8 and result.plan.total_optimizer_steps == 6
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval/loss" in r] == [3, 6]
    assert "eval: 2 held-out examples (data.eval_fraction = 0.2)" in capsys.readouterr().out

    # eval/loss after the last step is the final model's NLL per target token of the held-out rows.
    held = held_out_rows(10, 0.2, 3)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    loaded = tidyrl.config.load_config(cfg)
    examples, _ = load_sft_examples(loaded, tokenizer, completion_eos_ids(str(tiny_model_dir), tokenizer))
    model = AutoModelForCausalLM.from_pretrained(result.final_dir).eval()
    with torch.no_grad():
        logprobs, mask = target_logprobs(model, pad_batch([examples[i] for i in held], tokenizer.pad_token_id
                                                          or tokenizer.eos_token_id, "cpu"))
    assert rows[-1]["eval/loss"] == pytest.approx(float(-(logprobs * mask).sum() / mask.sum()), rel=1e-5)

    best = json.loads((out / "best.json").read_text())
    evals = {r["step"]: r["eval/loss"] for r in rows if "eval/loss" in r}
    assert best["metric"] == "eval/loss" and best["value"] == pytest.approx(min(evals.values()))
    assert best["step"] == min(evals, key=evals.get)
    assert AutoModelForCausalLM.from_pretrained(out / "best") is not None


def test_reward_and_dpo_eval_report_accuracy_and_margin(tiny_model_dir, tmp_path):
    pairs = pair_rows()
    data = write_jsonl(tmp_path / "data.jsonl", pairs[:8])
    held = write_jsonl(tmp_path / "held.jsonl", pairs[6:])  # rows 6, 7 are also training rows
    for name, make_config in (("reward", reward_config), ("dpo", dpo_config)):
        out = tmp_path / name
        result = tidyrl.train(make_config(tiny_model_dir, data, out, data={"eval_path": str(held)}))
        last = result.metrics
        assert set(k for k in last if k.startswith("eval/")) == {"eval/loss", "eval/accuracy", "eval/margin"}
        assert last["eval/accuracy"] in (0.0, 0.25, 0.5, 0.75, 1.0)  # 4 held-out pairs
        assert math.isfinite(last["eval/loss"]) and last["eval/loss"] > 0
        rows = read_jsonl(out / "metrics.jsonl")
        assert [r["step"] for r in rows if "eval/loss" in r] == [result.plan.total_optimizer_steps]


def test_an_eval_split_that_shares_rows_with_training_is_counted(tiny_model_dir, tmp_path, capsys):
    data = write_jsonl(tmp_path / "data.jsonl", sft_rows()[:8])
    held = write_jsonl(tmp_path / "held.jsonl", sft_rows()[5:])
    tidyrl.train(sft_config(tiny_model_dir, data, tmp_path / "run", data={"eval_path": str(held)},
                            train={"dataset_epochs": None, "max_steps": 1}))
    out = capsys.readouterr().out
    assert "warning: 3 of 5 eval examples also appear in the training data" in out


def test_sft_reports_padding_and_packing_lowers_it(tiny_model_dir, tmp_path):
    mixed = [{"prompt": f"{w}:", "completion": " ".join([w[::-1]] * (1 + 3 * (i % 3)))} for i, w in enumerate(WORDS)]
    data = write_jsonl(tmp_path / "data.jsonl", mixed)  # completions of 1, 4 and 7 words
    plain = tidyrl.train(sft_config(tiny_model_dir, data, tmp_path / "plain", data={"max_length": 64}))
    packed = tidyrl.train(sft_config(tiny_model_dir, data, tmp_path / "packed", data={"max_length": 64},
                                     sft={"packing": True}, train={"batch_size": 2, "micro_batch_size": 1}))
    pad = [r["padding_fraction"] for r in read_jsonl(tmp_path / "plain" / "metrics.jsonl")]
    pad_packed = [r["padding_fraction"] for r in read_jsonl(tmp_path / "packed" / "metrics.jsonl")]
    assert all(0 <= p < 1 for p in pad + pad_packed) and max(pad) > 0
    assert pad_packed == [0.0] * len(pad_packed)  # one packed row per micro-batch: nothing to pad
    assert plain.metrics["tokens_per_s"] > 0 and packed.metrics["tokens_per_s"] > 0


def test_a_checkpoint_from_before_a_key_existed_resumes_at_that_keys_default(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "data.jsonl", pair_rows())
    out = tmp_path / "run"
    cfg = reward_config(tiny_model_dir, data, out, log={"save_every": 2, "keep_last": 10})
    tidyrl.train(cfg)
    straight = untimed(out / "metrics.jsonl")
    state_file = out / "checkpoint-2" / "trainer_state" / "state.json"
    state = json.loads(state_file.read_text())
    for section, key in (("train", "group_by_length"), ("log", "eval_decoding"), ("data", "reasoning_gym_size")):
        del state["config"][section][key]  # as an earlier tidyrl wrote it
    state_file.write_text(json.dumps(state))
    from tidyrl.checkpoint import CheckpointError

    with pytest.raises(CheckpointError, match="data.reasoning_gym_size: 1000 -> 5"):  # not the default: a change
        tidyrl.train(cfg, ["resume_from=" + str(out / "checkpoint-2"), "data.reasoning_gym_size=5"])
    tidyrl.train(cfg, ["resume_from=" + str(out / "checkpoint-2")])
    assert untimed(out / "metrics.jsonl") == straight

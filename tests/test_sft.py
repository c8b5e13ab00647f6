"""SFT end to end on a tiny local model: exact counts, the example stream, masks, packing, invariance, errors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import expected_lrs, free_port, gloo_cpu_env, read_jsonl, write_jsonl, with_sections

import tidyrl
from tidyrl.data import DataError, PromptStream
from tidyrl.loops.offline.loop import OFFLINE_STEP_METRICS
from tidyrl.plan import PlanError, make_offline_plan

WORDS = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon", "mango", "peach"]








@pytest.fixture
def sft_file(tmp_path):
    return write_jsonl(tmp_path / "sft.jsonl", [{"prompt": f"{w}:", "completion": w[::-1]} for w in WORDS])


def sft_config(model_dir, data_file, out, **sections):
    cfg = {
        "algorithm": "sft",
        "model": str(model_dir),
        "output_dir": str(out),
        "seed": 3,
        "data": {"path": str(data_file)},
        "train": {"batch_size": 4, "micro_batch_size": 2, "dataset_epochs": 3.0, "learning_rate": 1e-2,
                  "lr_scheduler": "cosine", "warmup_steps": 1},
        "log": {"progress_bar": False},
    }
    return with_sections(cfg, sections)


def test_sft_run_writes_exact_counts_and_lowers_the_loss(tiny_model_dir, sft_file, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    result = tidyrl.train(sft_config(tiny_model_dir, sft_file, out, log={"progress_bar": True}))

    # N = 10, B = 4, 3 epochs: ceil(30 / 4) = 8 steps, 32 examples; accumulation 4 / (1 * 2) = 2.
    plan = json.loads((out / "plan.json").read_text())
    assert plan.pop("memory")["peak_phase"] == "update"  # the memory plan (tests/test_memory_plan.py)
    assert set(plan.pop("memory_probe")["phases"]) == {"update"}  # the worst case first (test_memory_probe.py)
    assert plan == make_offline_plan(batch_size=4, micro_batch_size=2, dataset_epochs=3.0, num_examples=10,
                                     warmup_steps=1).to_dict()
    assert (plan["total_optimizer_steps"], plan["total_examples"], plan["gradient_accumulation_steps"]) == (8, 32, 2)

    rows = read_jsonl(out / "metrics.jsonl")
    assert len(rows) == 8
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["examples"] for r in rows] == [4 * s for s in range(1, 9)]
    assert [r["epoch"] for r in rows] == pytest.approx([0.4 * s for s in range(1, 9)])
    assert [r["lr"] for r in rows] == pytest.approx(expected_lrs(8, 1, "cosine", 1e-2), abs=1e-12)
    for row in rows:
        assert list(row)[: len(OFFLINE_STEP_METRICS)] == list(OFFLINE_STEP_METRICS)
        assert row["grad_norm"] > 0 and "time/update_s" in row
    # The stream: step s takes positions [4s, 4s + 4) of back-to-back shuffles (seed 3), across epoch ends;
    # each example trains its completion and EOS: len(word) + 1 target tokens.
    stream = PromptStream(10, 3)
    for s, row in enumerate(rows):
        assert row["tokens"] == sum(len(WORDS[i]) + 1 for i in stream.rollout_indices(s, 4))
    # token_mean: the loss is the mean NLL over the step's target tokens.
    assert [r["loss"] for r in rows] == pytest.approx([r["nll_token_mean"] for r in rows], rel=1e-5)
    assert sum(r["loss"] for r in rows[-2:]) / 2 < rows[0]["loss"] - 0.5

    model = AutoModelForCausalLM.from_pretrained(result.final_dir)
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), start.parameters()))
    assert result.plan.total_optimizer_steps == 8 and result.metrics["step"] == 8
    err = capsys.readouterr().err
    assert "8/8" in err and "9/8" not in err  # the bar ends at total optimizer steps


def test_max_steps_and_drop_last(tiny_model_dir, sft_file, tmp_path):
    out = tmp_path / "max"
    tidyrl.train(sft_config(tiny_model_dir, sft_file, out, train={"dataset_epochs": None, "max_steps": 3}))
    assert [r["examples"] for r in read_jsonl(out / "metrics.jsonl")] == [4, 8, 12]
    out = tmp_path / "drop"
    tidyrl.train(sft_config(tiny_model_dir, sft_file, out, train={"dataset_epochs": 1.0, "drop_last": True},
                            log={"log_every": 2}))
    # floor(10 / 4) = 2 steps; log_every 2 writes step 2 (the last) only.
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [2]
    assert json.loads((out / "plan.json").read_text())["dataset_epochs"] == 0.8


def test_micro_batch_size_does_not_change_the_update(tiny_model_dir, sft_file, tmp_path):
    """m = 1 (4 accumulation steps) vs m = 4 (one): same losses and parameters within 1e-5."""
    from transformers import AutoModelForCausalLM

    def run(name, m):
        result = tidyrl.train(sft_config(tiny_model_dir, sft_file, tmp_path / name,
                                         train={"micro_batch_size": m, "dataset_epochs": 1.2}))
        return read_jsonl(result.output_dir / "metrics.jsonl"), AutoModelForCausalLM.from_pretrained(result.final_dir)

    rows_a, model_a = run("a", 1)
    rows_b, model_b = run("b", 4)
    assert len(rows_a) == 3
    for ra, rb in zip(rows_a, rows_b):
        assert ra["loss"] == pytest.approx(rb["loss"], abs=1e-6)
        assert ra["grad_norm"] == pytest.approx(rb["grad_norm"], rel=1e-4)
    worst = max((pa - pb).abs().max().item() for pa, pb in zip(model_a.parameters(), model_b.parameters()))
    assert worst < 1e-5


def test_sequence_mean_gives_each_example_equal_weight(tiny_model_dir, sft_file, tmp_path):
    rows = {}
    for mode in ("token_mean", "sequence_mean"):
        result = tidyrl.train(sft_config(tiny_model_dir, sft_file, tmp_path / mode, sft={"loss_aggregation": mode},
                                         train={"dataset_epochs": None, "max_steps": 1}))
        rows[mode] = read_jsonl(result.output_dir / "metrics.jsonl")[0]
    # Same batch, same model: token_mean is the token-weighted NLL; sequence_mean differs (words differ in length).
    assert rows["token_mean"]["loss"] == pytest.approx(rows["token_mean"]["nll_token_mean"], rel=1e-6)
    assert rows["sequence_mean"]["tokens"] == rows["token_mean"]["tokens"]
    assert rows["sequence_mean"]["loss"] != pytest.approx(rows["token_mean"]["loss"], rel=1e-6)


def show(tokenizer, seq) -> str:
    """The sequence as text, target tokens in brackets."""
    return "".join(f"[{tokenizer.convert_ids_to_tokens(t)}]" if m else tokenizer.convert_ids_to_tokens(t)
                   for t, m in zip(seq.input_ids, seq.target_mask))


def load_examples(model_dir, data_file, **sections):
    from transformers import AutoTokenizer

    from tidyrl.config import load_config
    from tidyrl.data.offline import completion_eos_ids, load_sft_examples

    cfg = load_config(sft_config(model_dir, data_file, "unused", **sections))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer, load_sft_examples(cfg, tokenizer, completion_eos_ids(model_dir, tokenizer))


def test_targets_are_the_completion_and_eos(tiny_model_dir, sft_file):
    tok, (examples, notes) = load_examples(tiny_model_dir, sft_file)
    assert show(tok, examples[0]) == "<s>apple:[e][l][p][p][a][</s>]"
    assert notes == []
    tok, (examples, _) = load_examples(tiny_model_dir, sft_file, sft={"completion_only_loss": False})
    assert show(tok, examples[0]) == "<s>[a][p][p][l][e][:][e][l][p][p][a][</s>]"  # all but the first token


def test_conversations_train_on_assistant_turns_rendered_as_the_rl_prompt(tiny_model_dir, tmp_path):
    from tidyrl.data import encode_prompts

    conversation = [{"role": "system", "content": "reverse"}, {"role": "user", "content": "fig"},
                    {"role": "assistant", "content": "gif"}, {"role": "user", "content": "again"},
                    {"role": "assistant", "content": "gif"}, {"role": "user", "content": "(dropped)"}]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": conversation}])
    tok, (examples, _) = load_examples(tiny_model_dir, path)
    # The tiny ChatML-like template: "<role>content\n"; the generation prompt is "<assistant>". Messages after
    # the last assistant turn carry no loss and are left out; EOS ends the last turn (the template has none).
    assert show(tok, examples[0]) == ("<s><system>reverse\n<user>fig\n<assistant>[g][i][f][\n]"
                                      "<user>again\n<assistant>[g][i][f][\n][</s>]")
    # A message-list prompt with a string completion: the prompt tokens are exactly the RL stage's.
    prompt = conversation[:2]
    path = write_jsonl(tmp_path / "pc.jsonl", [{"prompt": prompt, "completion": "gif"}])
    tok, (examples, _) = load_examples(tiny_model_dir, path)
    rl_prompt = encode_prompts([prompt], tok)[0]
    assert examples[0].input_ids[: len(rl_prompt)] == rl_prompt
    assert show(tok, examples[0]).endswith("<assistant>[g][i][f][</s>]")
    # A message-list completion: the assistant turn as the template closes it, then EOS.
    path = write_jsonl(tmp_path / "pm.jsonl", [{"prompt": prompt, "completion": [conversation[2]]}])
    tok, (examples, _) = load_examples(tiny_model_dir, path)
    assert show(tok, examples[0]) == "<s><system>reverse\n<user>fig\n<assistant>[g][i][f][\n][</s>]"


def test_packing_keeps_examples_apart(tiny_model_dir, sft_file, tmp_path):
    """One step over all 10 examples, packed into rows of 24 tokens or not: the same loss and gradient, so
    packed examples neither see each other nor get shifted positions."""
    from tidyrl.data.offline import pack_examples

    tok, (examples, _) = load_examples(tiny_model_dir, sft_file, data={"max_length": 24}, sft={"packing": True})
    rows, note = pack_examples(examples, 24)
    assert len(rows) < len(WORDS) and "packed 10 examples into" in note
    assert rows[0].position_ids[:14] == list(range(13)) + [0]  # "apple:elppa</s>" after BOS is 13 tokens
    results = {}
    for name, extra, batch in (("plain", {}, 10), ("packed", {"sft": {"packing": True}}, len(rows))):
        result = tidyrl.train(sft_config(tiny_model_dir, sft_file, tmp_path / name, data={"max_length": 24},
                                         train={"batch_size": batch, "micro_batch_size": 1, "dataset_epochs": None,
                                                "max_steps": 1}, **extra))
        results[name] = read_jsonl(result.output_dir / "metrics.jsonl")[0]
    assert results["packed"]["tokens"] == results["plain"]["tokens"] == sum(len(w) + 1 for w in WORDS)
    assert results["packed"]["loss"] == pytest.approx(results["plain"]["loss"], rel=1e-5)
    assert results["packed"]["grad_norm"] == pytest.approx(results["plain"]["grad_norm"], rel=1e-4)


def test_bad_data_is_reported_before_any_model_is_loaded(tiny_model_dir, tmp_path):
    def fails(rows, match, **sections):
        path = write_jsonl(tmp_path / "bad.jsonl", rows)
        with pytest.raises(DataError, match=match):
            tidyrl.train(sft_config(tiny_model_dir, path, tmp_path / "out", **sections))
        assert not (tmp_path / "out").exists()

    fails([{"question": "a", "answer": "b"}], r"neither a completion column \(data.completion_column = 'completion'\)"
          r".*columns present are \['question', 'answer'\]")
    fails([{"question": "a", "completion": "b"}], r"data.prompt_column = 'prompt'.*Rename the column or set")
    fails([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": ""}], r"row 1 \(0-based\).*empty string")
    fails([{"prompt": "a", "completion": [{"role": "assistant", "content": "b"}]}],
          "chat messages after a string prompt")
    fails([{"messages": [{"role": "user", "content": "hi"}]}], "has no assistant message")
    fails([{"messages": "hello"}], r"row 0 \(0-based\).*'hello', which is a string, not a list of messages")
    fails([{"prompt": "x" * 30, "completion": "b"}], "the prompt alone fills data.max_length=8",
          data={"max_length": 8})


def test_sizes_that_do_not_divide_are_rejected_with_valid_values(tiny_model_dir, sft_file, tmp_path):
    with pytest.raises(PlanError, match=r"train.micro_batch_size=3 does not divide .* valid values: 1, 2, 4"):
        tidyrl.train(sft_config(tiny_model_dir, sft_file, tmp_path / "out", train={"micro_batch_size": 3}))
    assert not (tmp_path / "out").exists()


def test_two_processes_match_one(tiny_model_dir, sft_file, tmp_path):
    """torchrun with W = 2 (each process 2 of the 4 examples per step, m = 1) gives the parameters of one
    process with m = 4: the loss is normalised over the global batch and scaled by W for DDP's average."""
    import subprocess
    import sys

    import yaml
    from safetensors.torch import load_file

    cfg = sft_config(tiny_model_dir, sft_file, tmp_path / "two", train={"micro_batch_size": 1, "dataset_epochs": 1.2})
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(cfg))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "-m", "tidyrl", "train", str(path)],
                          env=gloo_cpu_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "two" / "plan.json").read_text())["world_size"] == 2
    one = tidyrl.train(sft_config(tiny_model_dir, sft_file, tmp_path / "one",
                                  train={"micro_batch_size": 4, "dataset_epochs": 1.2}))
    rows_one, rows_two = read_jsonl(one.output_dir / "metrics.jsonl"), read_jsonl(tmp_path / "two" / "metrics.jsonl")
    assert [r["loss"] for r in rows_one] == pytest.approx([r["loss"] for r in rows_two], abs=1e-6)
    a = load_file(one.final_dir / "model.safetensors")
    b = load_file(tmp_path / "two" / "final" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_an_sft_run_extends_to_more_steps_with_its_schedule_rebuilt(tiny_model_dir, sft_file, tmp_path):
    """extend=true in an offline stage: from checkpoint-2 of a 4-step run to 6 steps, the later rates from the
    cosine over 6 steps, plan.json's `extended` saying so."""
    out = tmp_path / "run"
    cfg = sft_config(tiny_model_dir, sft_file, out, train={"dataset_epochs": None, "max_steps": 4},
                     log={"save_every": 2})
    tidyrl.train(cfg)
    tidyrl.train(cfg, ["resume_from=latest", "train.max_steps=6", "extend=true", "log.save_every=0"])
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 7))
    old, new = expected_lrs(4, 1, "cosine", 1e-2), expected_lrs(6, 1, "cosine", 1e-2)
    assert [r["lr"] for r in rows] == pytest.approx(old[:2] + new[2:], rel=1e-12)
    assert json.loads((out / "plan.json").read_text())["extended"] == [
        {"step": 2, "from_total_optimizer_steps": 4, "to_total_optimizer_steps": 6}]

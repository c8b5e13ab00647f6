"""The command line as a user types it: plan, train from YAML, mistakes caught with a suggestion."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from conftest import free_port, gloo_cpu_env
import yaml

from tidyrl.cli import main
from tidyrl.plan import make_plan

REWARD_FILE = textwrap.dedent('''
    def has_vowel(prompts, completions, **kwargs):
        return [float(any(c in "aeiou" for c in text)) for text in completions]
''')



@pytest.fixture
def yaml_run(tmp_path, tiny_model_dir, prompt_file):
    """A YAML config whose reward function is a file given relative to the YAML's folder."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "my_rewards.py").write_text(REWARD_FILE)
    cfg = {
        "algorithm": "grpo",
        "model": str(tiny_model_dir),
        "output_dir": str(tmp_path / "out"),
        "data": {"path": str(prompt_file)},
        "rewards": [{"function": "my_rewards.py:has_vowel", "weight": 1.0}],
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 4, "max_new_tokens": 4},
        "train": {"rollouts": 2, "micro_batch_size": 4, "minibatches_per_epoch": 2, "learning_rate": 1e-3},
        "log": {"progress_bar": False},
    }
    path = folder / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_plan_prints_the_plan_as_json(yaml_run, capsys):
    assert main(["plan", str(yaml_run), "rollout.prompts_per_rollout=4", "--num-processes", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert set(printed.pop("memory")["per_process_bytes"]) == {"generation", "update"}  # tests/test_memory_plan.py
    assert printed == {**make_plan(prompts_per_rollout=4, samples_per_prompt=4, minibatches_per_epoch=2,
                                   micro_batch_size=4, world_size=2, rollouts=2, num_prompts=10).to_dict(),
                       "engine": "builtin",  # and the engine that generates
                       "paths": {"policy": "fast path (llama)"}}  # and which forward each model takes
    assert printed["gradient_accumulation_steps"] == 1 and printed["total_optimizer_steps"] == 4


def test_plan_says_when_a_rollout_holds_more_prompts_than_the_data_set(yaml_run, capsys):
    """10 prompts, 16 a rollout, 2 rollouts: correct by the plan's formula (1.6 passes a rollout, 3.2 in all),
    rarely what was meant; the plan says so on stderr and still prints."""
    assert main(["plan", str(yaml_run), "rollout.prompts_per_rollout=16"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["prompts_per_rollout"] == 16
    assert ("tidyrl: warning: rollout.prompts_per_rollout = 16 is more than the 10 prompts of the data set: every "
            "rollout repeats prompts (1.6 passes over the data per rollout, 3.2 in all over 2 rollouts)") in err
    assert main(["plan", str(yaml_run)]) == 0 and "warning" not in capsys.readouterr().err


def test_relative_paths_are_found_in_the_current_directory_then_beside_the_config(yaml_run, prompt_file, tmp_path,
                                                                                 monkeypatch, capsys):
    """One rule for the data file, the models and the reward files: the current directory first, then the YAML's
    folder. Run from elsewhere, a prompt file beside the YAML is found, and config.yaml records where."""
    import shutil

    from tidyrl.config import load_config

    shutil.copy(prompt_file, yaml_run.parent / "beside.jsonl")
    cfg = yaml.safe_load(yaml_run.read_text())
    cfg["data"]["path"] = "beside.jsonl"
    yaml_run.write_text(yaml.safe_dump(cfg))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["plan", str(yaml_run)]) == 0 and json.loads(capsys.readouterr().out)["num_prompts"] == 10
    assert load_config(str(yaml_run)).data.path == str(yaml_run.parent / "beside.jsonl")
    cfg["data"]["path"] = "missing.jsonl"
    yaml_run.write_text(yaml.safe_dump(cfg))
    assert main(["plan", str(yaml_run)]) == 2
    assert "then beside the config file" in capsys.readouterr().err
    # A missing reward file lists each place it looked once (the two are one when the YAML is in the current folder).
    cfg["data"]["path"], cfg["rewards"][0]["function"] = str(prompt_file), "nope.py:f"
    yaml_run.write_text(yaml.safe_dump(cfg))
    monkeypatch.chdir(yaml_run.parent)
    assert main(["plan", str(yaml_run)]) == 2
    err = capsys.readouterr().err
    assert f"looked at ['{yaml_run.parent / 'nope.py'}']" in err


def test_plan_of_an_sft_stage_counts_its_examples_even_without_a_prompt_column(tiny_model_dir, tmp_path, capsys):
    from tidyrl.plan import make_offline_plan

    data = tmp_path / "chats.jsonl"  # messages only: there is no `prompt` column to count
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": w},
                                                     {"role": "assistant", "content": w[::-1]}]}) + "\n"
                            for w in ["apple", "pear", "fig", "kiwi", "lime", "plum", "date"]))
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump({"algorithm": "sft", "model": str(tiny_model_dir), "data": {"path": str(data)},
                                    "train": {"dataset_epochs": 2, "batch_size": 2, "micro_batch_size": 1}}))
    assert main(["plan", str(path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert "update" in printed.pop("memory")["per_process_bytes"]  # the memory plan (tests/test_memory_plan.py)
    assert printed == make_offline_plan(num_examples=7, batch_size=2, micro_batch_size=1,
                                        dataset_epochs=2).to_dict()
    assert printed["total_optimizer_steps"] == 7  # ceil(2 * 7 / 2)


def test_plan_of_a_dpo_stage_counts_held_out_pairs_and_the_reference_cost(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps({"prompt": w, "chosen": w[::-1], "rejected": w}) + "\n"
                            for w in ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon", "mango", "peach"]))
    path = tmp_path / "dpo.yaml"
    cfg = {"algorithm": "dpo", "model": str(tiny_model_dir), "data": {"path": str(data), "eval_fraction": 0.2},
           "train": {"dataset_epochs": 1, "batch_size": 6, "micro_batch_size": 3}}
    path.write_text(yaml.safe_dump(cfg))
    assert main(["plan", str(path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    # 2 of 10 pairs held out; the reference scores 2 x (8 + 2) sequences in ceil(8/3) + ceil(2/3) = 4 passes.
    assert (printed["num_examples"], printed["eval_examples"]) == (8, 2)
    assert (printed["reference_sequences"], printed["reference_forward_passes"]) == (20, 4)
    cfg["dpo"] = {"loss_type": "simpo"}
    path.write_text(yaml.safe_dump(cfg))
    assert main(["plan", str(path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["reference"] == "none (reference-free loss)" and "reference_sequences" not in printed


def test_plan_rejects_sizes_that_do_not_divide(yaml_run, capsys):
    # R = 2*4 = 8 episodes; M = 3 does not divide 8.
    assert main(["plan", str(yaml_run), "train.minibatches_per_epoch=3"]) == 2
    err = capsys.readouterr().err
    assert "train.minibatches_per_epoch" in err and "1, 2, 4, 8" in err


def test_mistyped_key_is_caught_with_a_suggestion(yaml_run, capsys):
    assert main(["train", str(yaml_run), "rollout.prompts_per_rolout=8"]) == 2
    err = capsys.readouterr().err
    assert "rollout.prompts_per_rolout" in err and "rollout.prompts_per_rollout" in err
    assert not (yaml_run.parent.parent / "out").exists()  # refused before anything was written


def test_train_from_yaml_on_the_command_line(yaml_run, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tidyrl", "train", str(yaml_run), "seed=1"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr
    assert "4 optimizer steps, 16 episodes" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert "reward/has_vowel" in rows[0]
    assert yaml.safe_load((tmp_path / "out" / "config.yaml").read_text())["seed"] == 1


@pytest.mark.extended
def test_two_processes_with_torchrun_match_one_process(yaml_run, tmp_path):
    """W = 2 gloo processes on CPU: same plan totals, lr, counts, losses and final weights as W = 1.
    Each process generates half the episodes (keyed sampling makes them the same completions), every
    process holds the gathered rollout, and the loss is normalised over the global mini-batch."""
    from safetensors.torch import load_file

    outs = {}
    for world in (1, 2):
        out = tmp_path / f"w{world}"
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                    "--master_port", str(free_port())] if world == 2 else [sys.executable]
        # R = 2*4 = 8, M = 2: 4 episodes per mini-batch, 2 per process with W = 2; m = 2 suits both.
        cmd = launcher + ["-m", "tidyrl", "train", str(yaml_run), f"output_dir={out}", "train.micro_batch_size=2"]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=900, env=gloo_cpu_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert proc.stdout.count("done:") == 1  # printed by the main process only
        outs[world] = out
    plan1, plan2 = (json.loads((outs[w] / "plan.json").read_text()) for w in (1, 2))
    assert plan2["world_size"] == 2 and plan1["world_size"] == 1
    assert (plan1["gradient_accumulation_steps"], plan2["gradient_accumulation_steps"]) == (2, 1)
    for key in ("total_optimizer_steps", "total_episodes", "rollouts", "warmup_steps"):
        assert plan1[key] == plan2[key]
    rows1, rows2 = ([json.loads(x) for x in (outs[w] / "metrics.jsonl").read_text().splitlines()] for w in (1, 2))
    assert len(rows1) == len(rows2) == 4
    for a, b in zip(rows1, rows2):
        for key in ("step", "rollout", "episodes", "lr"):
            assert a[key] == b[key]
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-6)
    w1, w2 = (load_file(outs[w] / "final" / "model.safetensors") for w in (1, 2))
    # Two processes sum the gradients in another order; AdamW divides by sqrt(v), so where a gradient is near 0 its
    # rounding can become a step of up to lr (1e-3). 1e-4 is 10x under one step, which a wrong normaliser or a
    # doubled episode would move every weight by (as tests/test_multiprocess.py bounds it).
    assert max((w1[k] - w2[k]).abs().max().item() for k in w1) < 1e-4


def test_the_demo_prints_one_summary(tmp_path, capsys):
    """The run's reward summary (first/last rollout) is the only one the demo prints, so one quantity has one
    number; the demo adds examples."""
    from tidyrl.demo import run_demo

    run_demo(tmp_path / "demo", ("train.rollouts=3", "log.progress_bar=false"))
    out = capsys.readouterr().out
    assert out.count("reward_mean") == 1 and "mean reward" not in out  # one line says what the reward did
    assert out.count("written to") == 1 and out.count("optimizer steps") == 1
    assert "  examples: rollout 1 '" in out and "rollout 3 '" in out


def test_tidyrl_tiny_writes_model_folders_that_load_and_train(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    import tidyrl
    from tidyrl.cli import main

    assert main(["tiny", str(tmp_path / "policy"), "--seed", "3"]) == 0
    assert main(["tiny", str(tmp_path / "rm"), "--reward-model"]) == 0
    out = capsys.readouterr().out
    assert f"use it as  model: {tmp_path / 'policy'}" in out and "rewards: [{model: " in out
    policy = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    assert policy.config.hidden_size == 64 and policy.config.num_hidden_layers == 2
    assert AutoTokenizer.from_pretrained(tmp_path / "policy").chat_template
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").config.num_labels == 1
    before = (tmp_path / "policy" / "model.safetensors").read_bytes()
    assert main(["tiny", str(tmp_path / "policy")]) == 2  # never writes over a folder
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "policy" / "model.safetensors").read_bytes() == before

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{w}:", "word": w}) + "\n" for w in ["fig", "kiwi"]))
    result = tidyrl.train({"model": str(tmp_path / "policy"), "output_dir": str(tmp_path / "run"),
                           "data": {"path": str(prompts)}, "rewards": [{"model": str(tmp_path / "rm")}],
                           "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 2, "max_new_tokens": 4},
                           "train": {"rollouts": 1, "micro_batch_size": 4}, "log": {"progress_bar": False}})
    assert result.plan.total_episodes == 4 and (result.final_dir / "model.safetensors").exists()


def test_plan_answers_a_wrong_config_without_importing_torch_transformers_or_datasets(tmp_path):
    """`tidyrl plan` imports the heavy libraries only where its checks need them (the tokenizer, the model config,
    the data file; about 3 s, docs/concepts.md): a typo or an invalid value is answered before any of them is
    imported (in 0.1 s)."""
    import os
    import subprocess
    import sys

    configs = {
        "typo": "algorithm: grpo\nmodel: m\ndata: {path: p.jsonl}\nrollout: {prompts_per_rolout: 8}\n",
        "invalid": "algorithm: grpo\nmodel: m\ndata: {path: p.jsonl}\ntrain: {rollouts: 2}\n",
    }
    for name, text in configs.items():
        path = tmp_path / f"{name.replace(' ', '_')}.yaml"
        path.write_text(text)
        code = ("import sys; from tidyrl.cli import main; rc = main(['plan', sys.argv[1]]); "
                "print(rc, [m for m in ('torch', 'transformers', 'datasets') if m in sys.modules])")
        done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ), cwd=tmp_path)
        assert done.stdout.strip() == "2 []", (name, done.stdout, done.stderr[-2000:])
        assert "tidyrl: error:" in done.stderr


def test_help_lists_every_algorithm_with_its_line_from_the_table(capsys):
    """`tidyrl --help` reads the stages from config.SUMMARIES: the algorithm table's summaries and the offline
    stages' lines, so a new algorithm appears with its line and none is left without one."""
    from tidyrl.algorithms.table import ALGORITHMS as TABLE
    from tidyrl.config import ALGORITHMS, OFFLINE_STAGES

    with pytest.raises(SystemExit):
        main(["--help"])
    lines = capsys.readouterr().out.splitlines()
    for name in ALGORITHMS:
        summary = TABLE[name].summary if name in TABLE else OFFLINE_STAGES[name]
        assert any(line.split() == [name, *summary.split()] for line in lines), (name, summary)


def test_plan_says_which_forward_each_model_takes_and_why(yaml_run, capsys):
    """plan.json's `paths`: the policy on the fast path of its family; with train.exact_gradients its scoring and
    update (and the reference's) through the model's own forward; with model_fast_paths off, everything."""
    assert main(["plan", str(yaml_run)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["paths"] == {"policy": "fast path (llama)"} and "tidyrl: policy: fast path (llama)" in err
    assert main(["plan", str(yaml_run), "train.exact_gradients=true", "grpo.kl_coef=0.1", "rollout.forward_batch_size=8",
                 "rollout.generation_batch_size=8"]) == 0
    assert json.loads(capsys.readouterr().out)["paths"] == {
        "policy": "fast path (llama) for generation; its own forward for scoring and the update "
                  "(train.exact_gradients)", "reference": "its own forward (train.exact_gradients)"}
    assert main(["plan", str(yaml_run), "model_fast_paths=false"]) == 0
    assert json.loads(capsys.readouterr().out)["paths"] == {"policy": "its own forward (model_fast_paths is false)"}

"""`tidyrl eval`: score a model before and after training on the same prompts and sampling keys."""

from __future__ import annotations

import json

import pytest

import tidyrl
from tidyrl.cli import main
from conftest import read_jsonl




def test_eval_shows_the_gain_of_a_short_demo_training(tmp_path, capsys):
    from tidyrl.demo import prepare_demo

    config = prepare_demo(tmp_path)
    # The demo's settings, 16 rollouts instead of 200: enough to move the anagram reward clearly (by 0.07; 8 moved
    # it by 0.02 to 0.065, depending on the draws).
    result = tidyrl.train(config, ["train.rollouts=16", "train.warmup_steps=0", "log.progress_bar=false"])
    capsys.readouterr()

    flags = ["--num-prompts", "16", "--samples-per-prompt", "4"]
    assert main(["eval", str(config), *flags]) == 0
    before_printed = capsys.readouterr().out
    assert main(["eval", str(config), "--model", str(result.final_dir), *flags]) == 0

    # Beside the model; for a model inside a run's folder, beside the run (the run's folder gets nothing added).
    before_dir, after_dir = tmp_path / "eval-base-model", tmp_path / "run-eval-final"
    assert not (tmp_path / "run" / "eval-final").exists()
    before = json.loads((before_dir / "eval.json").read_text())
    after = json.loads((after_dir / "eval.json").read_text())
    assert before["model"] == str(tmp_path / "base-model") and after["model"] == str(result.final_dir)
    for summary in (before, after):
        assert (summary["num_prompts"], summary["samples_per_prompt"], summary["n"]) == (16, 4, 64)
        assert summary["rewards"]["reward/anagram_reward"] == pytest.approx(summary["reward_mean"])
        assert summary["settings"]["max_new_tokens"] == 10 and summary["settings"]["greedy"] is False
    assert after["reward_mean"] > before["reward_mean"] + 0.03

    samples = read_jsonl(after_dir / "eval_samples.jsonl")
    assert len(samples) == 64
    assert [s["prompt_index"] for s in samples[:8]] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert sum(s["reward"] for s in samples) / 64 == pytest.approx(after["reward_mean"])
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "prompts.jsonl").read_text().splitlines()[:16]]
    assert [s["prompt"] for s in samples[::4]] == prompts  # the first 16 prompts of the file, in order
    assert f"reward_mean: {before['reward_mean']:.4f}" in before_printed and "e.g. " in before_printed


def test_eval_a_model_folder_with_data_and_reward_flags_greedy(tiny_model_dir, prompt_file, tmp_path):
    (tmp_path / "my_rewards.py").write_text(
        "def vowels(completions, **kw):\n    return [sum(c in 'aeiou' for c in t) / 4 for t in completions]\n")
    outs = []
    for seed in ("1", "2"):
        out = tmp_path / f"eval-{seed}"
        assert main(["eval", str(tiny_model_dir), "--data", str(prompt_file), "--reward",
                     str(tmp_path / "my_rewards.py") + ":vowels", "--greedy", "--num-prompts", "all",
                     "--seed", seed, "--output-dir", str(out), "rollout.max_new_tokens=5"]) == 0
        outs.append(out)
    first, second = (json.loads((o / "eval.json").read_text()) for o in outs)
    assert (first["num_prompts"], first["samples_per_prompt"], first["n"]) == (10, 1, 10)  # all 10, 1 when greedy
    assert first["settings"]["top_k"] == 1 and first["settings"]["max_new_tokens"] == 5
    # Greedy decoding does not depend on the sampling seed.
    completions = [[s["completion"] for s in read_jsonl(o / "eval_samples.jsonl")] for o in outs]
    assert completions[0] == completions[1] and first["reward_mean"] == second["reward_mean"]


def test_sampled_eval_is_reproducible_and_keyed_by_seed(tiny_model_dir, prompt_file, tmp_path):
    from tidyrl.evaluate import evaluate

    def run(seed, out):
        return evaluate(model=str(tiny_model_dir), data=str(prompt_file),
                        rewards=["tidyrl.demo:anagram_reward"], num_prompts=3, samples_per_prompt=2, seed=seed,
                        output_dir=tmp_path / out, quiet=True, overrides=["rollout.max_new_tokens=6"])

    a, b, c = run(0, "a"), run(0, "b"), run(1, "c")
    assert [s["completion"] for s in a.samples] == [s["completion"] for s in b.samples]
    assert [s["completion"] for s in a.samples] != [s["completion"] for s in c.samples]


def test_eval_errors_name_what_is_missing(tiny_model_dir, prompt_file, tmp_path, capsys):
    assert main(["eval", str(tiny_model_dir)]) == 2
    err = capsys.readouterr().err
    assert "--data" in err and "--reward" in err and "--config" in err
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {tiny_model_dir}\ndata: {{path: {prompt_file}}}\n"
                      "rewards: [{function: 'tidyrl.demo:anagram_reward'}]\ntrain: {rollouts: 1}\n")
    assert main(["eval", str(config), "--config", str(config)]) == 2
    assert "drop --config" in capsys.readouterr().err
    assert main(["eval", str(config), "rollout.max_new_tokns=3", "--output-dir", str(tmp_path / "e")]) == 2
    assert "rollout.max_new_tokens" in capsys.readouterr().err  # the suggestion for the mistyped key


def test_an_evaluation_never_replaces_another(tiny_model_dir, prompt_file, tmp_path):
    """The first evaluation of a model writes eval-<model>/, the next ones eval-<model>-2, -3, ..., so none
    replaces another's files; an explicit --output-dir that holds an evaluation is refused."""
    import shutil

    from tidyrl.evaluate import EvalError, evaluate

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    common = dict(model=str(model), data=str(prompt_file), rewards=["tidyrl.demo:anagram_reward"], num_prompts=2,
                  samples_per_prompt=1, quiet=True, overrides=["rollout.max_new_tokens=4"])
    first, second = evaluate(seed=0, **common), evaluate(seed=1, **common)
    assert (first.output_dir, second.output_dir) == (tmp_path / "eval-m", tmp_path / "eval-m-2")
    assert json.loads((first.output_dir / "eval.json").read_text())["settings"]["seed"] == 0  # kept as it was
    before = (first.output_dir / "eval.json").read_bytes()
    with pytest.raises(EvalError, match="already holds an evaluation"):
        evaluate(output_dir=first.output_dir, **common)
    assert (first.output_dir / "eval.json").read_bytes() == before


def test_eval_says_a_normalized_reward_is_reported_raw(tiny_model_dir, prompt_file, tmp_path, capsys):
    """Training normalises a `normalize: true` reward with its run's moments; eval reports the raw scores and
    says so (in eval.json and in print), so reward_mean is the weighted total of the raw means."""
    from tidyrl.evaluate import evaluate

    config = {"model": str(tiny_model_dir), "data": {"path": str(prompt_file)}, "train": {"rollouts": 1},
              "rewards": [{"function": "tidyrl.demo:anagram_reward", "weight": 2.0, "normalize": True}]}
    result = evaluate(config, num_prompts=4, samples_per_prompt=2, output_dir=tmp_path / "e",
                      overrides=["rollout.max_new_tokens=4"])
    summary = json.loads((tmp_path / "e" / "eval.json").read_text())
    assert summary["normalize_not_applied"] == ["reward/anagram_reward"]
    assert summary["reward_mean"] == pytest.approx(2.0 * summary["rewards"]["reward/anagram_reward"])
    assert "note: reward/anagram_reward set normalize: true; eval scores are raw" in capsys.readouterr().out
    assert result.summary == summary


def test_rl_eval_during_training_scores_held_out_prompts_as_tidyrl_eval_does(tiny_model_dir, prompt_file, tmp_path,
                                                                            capsys):
    from tidyrl.data.offline import held_out_rows

    (tmp_path / "my_rewards.py").write_text(
        "def vowels(completions, word, **kw):\n    return [sum(c in 'aeiou' for c in t) / 4 for t in completions]\n")
    cfg = {
        "algorithm": "grpo", "model": str(tiny_model_dir), "output_dir": str(tmp_path / "run"), "seed": 2,
        "data": {"path": str(prompt_file), "eval_fraction": 0.3},
        "rewards": [{"function": str(tmp_path / "my_rewards.py") + ":vowels"}],
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 2, "max_new_tokens": 5},
        "train": {"rollouts": 3, "learning_rate": 1e-2, "micro_batch_size": 4},
        "log": {"progress_bar": False, "eval_every": 2, "best_metric": "eval/reward_mean"},
    }
    result = tidyrl.train(cfg)
    printed = capsys.readouterr().out
    assert "eval: 3 held-out prompts (data.eval_fraction = 0.3), 1 greedy completion(s) each" in printed
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert (plan["num_prompts"], plan["eval_prompts"]) == (7, 3)  # 3 of 10 held out, never trained on
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval/reward_mean" in r] == [2, 3]
    last = rows[-1]
    assert last["eval/reward/vowels"] == pytest.approx(last["eval/reward_mean"])

    # The same numbers as `tidyrl eval` of final/ on the held-out prompts, greedy.
    lines = prompt_file.read_text().splitlines()
    held = tmp_path / "held.jsonl"
    held.write_text("".join(lines[i] + "\n" for i in held_out_rows(10, 0.3, 2)))
    summary = tidyrl.evaluate.evaluate(cfg, model=str(result.final_dir), data=str(held), greedy=True, num_prompts=None,
                              output_dir=tmp_path / "check", quiet=True).summary
    assert summary["n"] == 3
    assert last["eval/reward_mean"] == pytest.approx(summary["reward_mean"], abs=1e-9)
    assert last["eval/completion_length_mean"] == pytest.approx(summary["completion_length_mean"])
    # And `tidyrl eval` of the run's own config: the held-out prompts by default, greedy as log.eval_decoding says.
    assert main(["eval", str(tmp_path / "run" / "config.yaml"), "--model", str(result.final_dir), "--output-dir",
                 str(tmp_path / "default")]) == 0
    default = json.loads((tmp_path / "default" / "eval.json").read_text())
    assert (default["n"], default["settings"]["greedy"], default["reward_mean"]) == (3, True, last["eval/reward_mean"])
    best = json.loads((tmp_path / "run" / "best.json").read_text())
    assert best["metric"] == "eval/reward_mean" and best["step"] in (2, 3)
    assert f"eval/reward_mean: {last['eval/reward_mean']:.4f} (held-out prompts, after the last step)" in printed


TOOL_ENV = '''
from tidyrl.environments import ToolEnvironment


def capital(country: str) -> str:
    """The capital of a country.

    Args:
        country: the country's name
    """
    return {"Borduria": "Szohod"}.get(country, "unknown")


class Capitals(ToolEnvironment):
    """A turn without a tool call is the answer: scored by its vowels."""

    tools = (capital,)

    def reward(self, messages):
        return sum(c in "aeiou" for c in messages[-1]["content"]) / 10
'''


def test_tidyrl_eval_of_a_multiturn_tool_run_gives_its_last_eval_metrics(tmp_path, capsys):
    """A multi-turn run with a tool environment and no reward function (the environment's reward only), its
    held-out prompts evaluated during training: `tidyrl eval <run>/config.yaml --model <run>/final` evaluates the
    same held-out prompts through the same producer, environment and tools, and writes the run's last eval/*
    numbers, exactly; eval.json says what produced it."""
    (tmp_path / "envs.py").write_text(TOOL_ENV)
    assert main(["tiny", str(tmp_path / "model"), "--tokenizer", "bytes", "--hidden-size", "32"]) == 0
    words = ["Borduria", "Syldavia", "Ruritania", "Elbonia", "Freedonia", "Latveria", "Genovia", "Zubrowka"]
    (tmp_path / "prompts.jsonl").write_text("".join(
        json.dumps({"prompt": f"The capital of {w}?", "country": w}) + "\n" for w in words))
    cfg = {
        "algorithm": "grpo", "model": str(tmp_path / "model"), "output_dir": str(tmp_path / "run"), "seed": 3,
        "data": {"path": str(tmp_path / "prompts.jsonl"), "eval_fraction": 0.25},
        "environment": {"factory": f"{tmp_path / 'envs.py'}:Capitals", "max_turns": 3, "max_turn_tokens": 6},
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 2, "max_new_tokens": 300},
        "train": {"rollouts": 2, "learning_rate": 1e-2, "micro_batch_size": 4},
        "log": {"progress_bar": False, "eval_every": 2, "eval_decoding": "sampled"},
    }
    result = tidyrl.train(cfg)
    last = read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]
    assert last["eval/reward_mean"] == pytest.approx(last["eval/reward/env"]) and last["eval/reward_mean"] > 0
    capsys.readouterr()

    out = tmp_path / "evaluated"
    assert main(["eval", str(tmp_path / "run" / "config.yaml"), "--model", str(result.final_dir),
                 "--output-dir", str(out)]) == 0
    summary = json.loads((out / "eval.json").read_text())
    assert (summary["num_prompts"], summary["samples_per_prompt"], summary["n"]) == (2, 2, 4)  # 2 of 8 held out
    assert summary["data"] == "held out: data.eval_fraction = 0.25"
    assert summary["reward_mean"] == last["eval/reward_mean"]
    assert summary["rewards"] == {"reward/env": last["eval/reward/env"]}
    assert summary["completion_length_mean"] == last["eval/completion_length_mean"]
    assert summary["truncated_fraction"] == last["eval/truncated_fraction"]
    assert summary["produced_by"]["engine"] == "builtin" and summary["produced_by"]["model"] == str(result.final_dir)
    assert summary["produced_by"]["versions"]["tidyrl"] == tidyrl.__version__
    samples = read_jsonl(out / "eval_samples.jsonl")
    assert len(samples) == 4 and all(s["rewards"]["env"] == s["reward"] for s in samples)
    assert sum(s["reward"] for s in samples) / 4 == pytest.approx(summary["reward_mean"])
    assert all("<tools>" not in s["completion"] and s["completion"] for s in samples)
    # each episode's model turns (1 to max_turns), and their mean in eval.json
    assert all(1 <= s["turns"] <= 3 for s in samples)
    assert summary["turns_mean"] == sum(s["turns"] for s in samples) / 4
    assert "reward/env" in capsys.readouterr().out


@pytest.mark.slow
def test_tidyrl_eval_on_two_processes_writes_what_one_writes(tiny_model_dir, prompt_file, tmp_path):
    """Under torchrun each process takes a share of the episodes; the sums are reduced and the samples gathered:
    the same eval.json numbers and eval_samples.jsonl as one process."""
    import subprocess
    import sys

    import yaml
    from conftest import free_port, gloo_cpu_env

    from tidyrl.evaluate import evaluate

    cfg = {"algorithm": "grpo", "model": str(tiny_model_dir), "data": {"path": str(prompt_file)},
           "rewards": [{"function": "tidyrl.demo:anagram_reward"}], "train": {"rollouts": 1},
           "rollout": {"samples_per_prompt": 3, "max_new_tokens": 6}}
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(cfg))
    one = evaluate(str(path), num_prompts=5, output_dir=tmp_path / "one", quiet=True)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "-m", "tidyrl", "eval", str(path), "--num-prompts", "5",
                           "--output-dir", str(tmp_path / "two")], env=gloo_cpu_env(), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    two = json.loads((tmp_path / "two" / "eval.json").read_text())
    for key in ("n", "reward_mean", "rewards", "completion_length_mean", "truncated_fraction"):
        assert two[key] == pytest.approx(one.summary[key], abs=1e-12), key
    assert read_jsonl(tmp_path / "two" / "eval_samples.jsonl") == one.samples

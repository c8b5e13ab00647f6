"""Bad input costs seconds, not a night: each mistake is caught (before the weights load where it can
be), the message names the problem and the fix, and nothing already written is lost."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import grpo_config

import tidyrl
from tidyrl.checkpoint import complete_checkpoints


def config(model_dir, prompt_file, out, **sections) -> dict:
    return grpo_config(model_dir, prompt_file, out, rollouts=3, **sections)


@pytest.fixture
def earlier_run(tmp_path, tiny_model_dir, prompt_file):
    """A finished run with checkpoints, whose files must survive every failed attempt below."""
    out = tmp_path / "run"
    tidyrl.train(config(tiny_model_dir, prompt_file, out, log={"save_every": 2, "progress_bar": False}))
    return out, snapshot(out)


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_model_path_that_does_not_exist(tmp_path, prompt_file, earlier_run):
    out, before = earlier_run
    with pytest.raises(RuntimeError, match=r"model='/nowhere/model': no such folder or hub id"):
        tidyrl.train(config("/nowhere/model", prompt_file, out, overwrite=True))
    assert snapshot(out) == before


ANAGRAM = [{"function": "tidyrl.demo:anagram_reward"}]
"""A reward function a YAML file can name (the callables above cannot be written to one)."""


@pytest.fixture
def offline(monkeypatch):
    """As on a machine that cannot reach the hub (this one, CI's, or HF_HUB_OFFLINE=1): decided once, no retry."""
    from tidyrl.models import loading

    monkeypatch.setattr(loading, "hub_reachable", lambda: False)


def test_a_mistyped_hub_id_fails_at_once_when_offline(tiny_model_dir, prompt_file, tmp_path, offline, capsys):
    """It took ~25 s of hub retries before: each model key fails in well under a second of checking, naming
    the key, before any weights load or any file is written."""
    import time

    from tidyrl.cli import main
    from tidyrl.models.tiny import save_tiny_reward_model

    rm = save_tiny_reward_model(tmp_path / "rm", seed=1)
    cases = {
        "model": config("nosuch/model-id", prompt_file, tmp_path / "a"),
        "tokenizer": {**config(tiny_model_dir, prompt_file, tmp_path / "b"), "tokenizer": "nosuch/tok"},
        "rewards[0].model": config(tiny_model_dir, prompt_file, tmp_path / "c", rewards=[{"model": "nosuch/rm"}]),
        "critic.model": config(tiny_model_dir, prompt_file, tmp_path / "d", algorithm="ppo",
                               rewards=[{"model": str(rm)}], critic={"model": "nosuch/critic"}),
    }
    for key, cfg in cases.items():
        start = time.perf_counter()
        with pytest.raises(RuntimeError, match=rf"{re.escape(key)}='nosuch/\w+(-id)?': no such folder or hub id .*"
                                               r"not in the local cache"):
            tidyrl.train(cfg)
        assert time.perf_counter() - start < 5, key
        assert not Path(cfg["output_dir"]).exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(config("nosuch/model-id", prompt_file, tmp_path / "e", rewards=ANAGRAM)))
    assert main(["plan", str(bad)]) == 2
    assert "model='nosuch/model-id': no such folder or hub id" in capsys.readouterr().err


def test_hub_reachable_is_false_offline(monkeypatch):
    from huggingface_hub import constants

    from tidyrl.models.loading import hub_reachable

    hub_reachable.cache_clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert hub_reachable() is False
    hub_reachable.cache_clear()


def test_prompt_and_completion_must_fit_the_context_before_anything_loads(tiny_model_dir, prompt_file, tmp_path,
                                                                         capsys):
    """The tiny model's context is 256 positions: max_new_tokens that leave no room, or an explicit
    max_prompt_length that overflows with them, are refused by `tidyrl plan` and `train` alike."""
    from tidyrl.cli import main
    from tidyrl.config import ConfigError

    overflows = {
        "rollout.max_new_tokens=256": "rollout.max_new_tokens=256 leaves no room for a prompt in the model's "
                                      "context of 256 tokens",
        "data.max_prompt_length=20 rollout.max_new_tokens=250":
            "data.max_prompt_length=20 + rollout.max_new_tokens=250 = 270 tokens overflow the model's context "
            "of 256 (max_position_embeddings); lower one of them (e.g. data.max_prompt_length=6)",
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config(tiny_model_dir, prompt_file, tmp_path / "out", rewards=ANAGRAM)))
    for overrides, message in overflows.items():
        with pytest.raises(ConfigError) as err:
            tidyrl.train(path, overrides.split())
        assert message in str(err.value)
        assert main(["plan", str(path), *overrides.split()]) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def needs_answer(completions, answer):
    return [float(c == a) for c, a in zip(completions, answer)]


def test_plan_checks_the_rewards_before_train_would(tiny_model_dir, prompt_file, tmp_path, capsys):
    """`tidyrl plan` runs the checks `train` makes before loading weights: a reward function that does not
    import, a reward model that does not exist, a column a reward function needs that the data lacks."""
    from tidyrl.cli import main

    cases = {
        "tidyrl.nosuch:fn": "rewards[0].function",
        f"{Path(__file__).resolve()}:nosuch_function": "nosuch_function",
        f"{Path(__file__).resolve()}:needs_answer": "reward function 'needs_answer' requires argument(s) ['answer'], "
                                                    "which are neither prompts, completions, completion_ids nor "
                                                    "columns of data.path (columns: ['word'])",
    }
    for spec, message in cases.items():
        path = tmp_path / "run.yaml"
        path.write_text(yaml.safe_dump(config(tiny_model_dir, prompt_file, tmp_path / "out",
                                              rewards=[{"function": spec}])))
        assert main(["plan", str(path)]) == 2, spec
        assert message in capsys.readouterr().err, spec
    path.write_text(yaml.safe_dump(config(tiny_model_dir, prompt_file, tmp_path / "out",
                                          rewards=[{"model": str(tmp_path / "no-rm")}])))
    assert main(["plan", str(path)]) == 2
    assert f"rewards[0].model='{tmp_path / 'no-rm'}': no such folder or hub id" in capsys.readouterr().err
    path.write_text(yaml.safe_dump(config(tiny_model_dir, prompt_file, tmp_path / "out", rewards=ANAGRAM)))
    assert main(["plan", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["total_optimizer_steps"] == 6


def test_a_data_path_that_does_not_exist(tmp_path, tiny_model_dir, earlier_run):
    out, before = earlier_run
    with pytest.raises(ValueError, match=r"data.path = '/nowhere/prompts.jsonl' does not exist"):
        tidyrl.train(config(tiny_model_dir, "/nowhere/prompts.jsonl", out, overwrite=True))
    assert snapshot(out) == before  # refused before overwrite removed anything


def test_an_empty_dataset_and_a_missing_prompt_column(tmp_path, tiny_model_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="holds no rows"):
        tidyrl.train(config(tiny_model_dir, empty, tmp_path / "a"))
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"question": "fig:", "word": "fig"}) + "\n")
    with pytest.raises(ValueError, match=r"data.prompt_column = 'prompt' is not a column.*\['question', 'word'\]"):
        tidyrl.train(config(tiny_model_dir, other, tmp_path / "b"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_a_tokenizer_without_a_pad_token_works(tmp_path, prompt_file):
    from tidyrl.models.tiny import build_char_tokenizer, build_tiny_llama

    tok = build_char_tokenizer()
    model = build_tiny_llama(len(tok), hidden_size=32, num_heads=2, seed=1, pad_token_id=None)
    folder = tmp_path / "nopad"
    model.save_pretrained(folder)
    tok.pad_token = None
    tok.save_pretrained(folder)
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(folder).pad_token_id is None
    result = tidyrl.train(config(folder, prompt_file, tmp_path / "out", train={"rollouts": 1}))
    assert result.metrics["step"] == 2  # padding uses EOS as filler; padded positions are masked anyway


def test_prompts_longer_than_the_context(tmp_path, tiny_model_dir, capsys):
    long_prompts = tmp_path / "long.jsonl"
    lines = [{"prompt": "x" * 300 + ":", "word": "x"}] * 3 + [{"prompt": f"{w}:", "word": w} for w in "ab"]
    long_prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    # The tiny model's context is 256 positions; with 5 new tokens a prompt may have 251 (BOS included).
    with pytest.raises(ValueError, match=r"3 of 5 prompts are longer than 251 tokens.*row 0 with 302 tokens"):
        tidyrl.train(config(tiny_model_dir, long_prompts, tmp_path / "err"))
    assert not (tmp_path / "err").exists()

    tidyrl.train(config(tiny_model_dir, long_prompts, tmp_path / "skip",
                        data={"path": str(long_prompts), "overlong_prompts": "skip"}))
    assert "3 of 5 prompts are longer than 251 tokens: skipped them" in capsys.readouterr().out
    plan = json.loads((tmp_path / "skip" / "plan.json").read_text())
    assert plan["num_prompts"] == 2
    # `tidyrl plan` counts the same prompts (it loads the tokenizer for that, not the model).
    import yaml

    from tidyrl.cli import main

    cfg = config(tiny_model_dir, long_prompts, tmp_path / "plan-only", rewards=[{"function": "tidyrl.demo:anagram_reward"}],
                 data={"path": str(long_prompts), "overlong_prompts": "skip"})
    (tmp_path / "skip.yaml").write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    assert main(["plan", str(tmp_path / "skip.yaml")]) == 0
    assert json.loads(capsys.readouterr().out)["num_prompts"] == 2

    tidyrl.train(config(tiny_model_dir, long_prompts, tmp_path / "cut",
                        data={"path": str(long_prompts), "overlong_prompts": "truncate", "max_prompt_length": 20}))
    assert "truncated to their last 20 tokens" in capsys.readouterr().out
    assert json.loads((tmp_path / "cut" / "plan.json").read_text())["num_prompts"] == 5


def test_a_reward_function_that_raises_mid_run(tmp_path, tiny_model_dir, prompt_file):
    batches, target = [], []

    def flaky(completions, word, **_):
        if len(completions) > 1:
            batches.append(1)
            if len(batches) == 3:  # the third rollout: its last prompt's samples (4 to 7) fail
                target.append(word[-1])
        return [1 / 0 if target and w == target[0] else 0.5 for w in word]

    out = tmp_path / "flaky"
    with pytest.raises(RuntimeError, match=r"reward function 'flaky' raised on sample 4 .*ZeroDivisionError"):
        tidyrl.train(config(tiny_model_dir, prompt_file, out, rewards=[{"function": flaky}],
                            log={"save_every": 2, "progress_bar": False}))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # everything before the failure is kept
    assert [s for s, _ in complete_checkpoints(out)] == [2, 4]


def test_a_reward_function_that_returns_the_wrong_length(tmp_path, tiny_model_dir, prompt_file):
    def short(completions, **_):
        return [1.0] * (len(completions) - 2)

    with pytest.raises(RuntimeError, match=r"'short' returned the wrong number of scores: expected 8, got 6"):
        tidyrl.train(config(tiny_model_dir, prompt_file, tmp_path / "x", rewards=[{"function": short}]))


def test_a_nan_loss_stops_before_the_update_and_keeps_the_last_good_checkpoint(tmp_path, tiny_model_dir,
                                                                              prompt_file, monkeypatch):
    import torch

    import tidyrl.loops.rl.update as losses  # the learner's step, where the loss is aggregated

    real, calls = losses.aggregate_loss, []

    def poisoned(*args, **kwargs):
        calls.append(1)
        loss = real(*args, **kwargs)
        return loss * torch.tensor(float("nan")) if len(calls) >= 5 else loss  # one micro-batch a step

    monkeypatch.setattr(losses, "aggregate_loss", poisoned)
    out = tmp_path / "nan"
    with pytest.raises(RuntimeError, match=r"optimizer step 5: the loss is nan.*not applied.*checkpoint-4"):
        # (no worst-case probe: its micro-batch would be the first call)
        tidyrl.train(config(tiny_model_dir, prompt_file, out, log={"save_every": 2, "progress_bar": False},
                            train={"memory_probe": False}))
    assert [s for s, _ in complete_checkpoints(out)] == [2, 4]
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert not (out / "final").exists()


def test_run_folders_hold_no_credentials(tmp_path, tiny_model_dir, prompt_file, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_123")
    monkeypatch.setenv("WANDB_API_KEY", "wandb_secret_456")
    out = tmp_path / "clean"
    tidyrl.train(config(tiny_model_dir, prompt_file, out, train={"rollouts": 1}, log={"save_every": 1,
                                                                                     "progress_bar": False}))
    for path in out.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert b"secret" not in data, path

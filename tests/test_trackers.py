"""Trackers (log.report_to), the RunLogger that feeds them, and the end-of-run summary.

TensorBoard is tested for real: a tiny run writes event files that are read back. W&B and Trackio are
tested through fake modules injected into sys.modules that record the calls (no network, nothing to
install); a real offline W&B run is checked when wandb happens to be installed.
"""

from __future__ import annotations

import importlib.machinery
import json
import sys
import types

import pytest

import tidyrl
from tidyrl.config import ConfigError, load_config
from tidyrl.metrics import RunLogger, format_summary
from tidyrl.plan import make_plan
from conftest import read_jsonl


def letters(prompts, completions, word, **_):
    return [sum(c in w for c in t) / len(t) if t else 0.0 for t, w in zip(completions, word)]


def small_run(model_dir, prompt_file, out, report_to):
    return {
        "model": str(model_dir), "output_dir": str(out), "data": {"path": str(prompt_file)},
        "rewards": [{"function": letters}],
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 4, "max_new_tokens": 4},
        "train": {"rollouts": 2, "micro_batch_size": 4, "minibatches_per_epoch": 2, "learning_rate": 1e-3},
        "log": {"progress_bar": False, "report_to": report_to, "samples_per_rollout": 2},
    }




def test_tensorboard_gets_the_metrics_rows_at_their_steps_and_the_summary_is_printed(
        tiny_model_dir, prompt_file, tmp_path, capsys):
    pytest.importorskip("tensorboard")  # in the `test` extra; a bare install skips
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    tidyrl.train(small_run(tiny_model_dir, prompt_file, out, ["tensorboard"]))
    rows = read_jsonl(out / "metrics.jsonl")
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    tags = events.Tags()
    for name in ("reward_mean", "reward/letters", "lr", "loss", "entropy", "clip_fraction", "time/generate_s"):
        logged = events.Scalars(name)
        assert [e.step for e in logged] == [r["step"] for r in rows] == [1, 2, 3, 4]
        assert [e.value for e in logged] == pytest.approx([r[name] for r in rows], rel=1e-6)
    assert "kl" not in tags["scalars"]  # null in every row (no reference model): skipped, not logged as 0
    assert "step" not in tags["scalars"]  # the x-axis, not a metric
    # Samples: one Markdown table per rollout, at the first step logged after it was generated.
    tables = events.Tensors("samples/text_summary")
    assert [t.step for t in tables] == [1, 3]
    samples = read_jsonl(out / "samples.jsonl")
    text = tables[0].tensor_proto.string_val[0].decode()
    assert text.startswith("| rollout | step | prompt | completion |")
    assert samples[0]["prompt"] in text and samples[1]["prompt"] in text

    printed = capsys.readouterr().out
    assert "finished 4 optimizer steps (2 rollouts, 16 episodes)" in printed
    assert "generate" in printed and "update" in printed
    assert f"tensorboard: {out / 'tensorboard'}" in printed and f"model: {out / 'final'}" in printed


# --------------------------------------------------------------------------- fake wandb / trackio


class Recorder:
    """A stand-in for the wandb or trackio module: records init/log/finish and builds tables."""

    def __init__(self, name):
        self.module = types.ModuleType(name)
        self.module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # find_spec sees it as installed
        self.calls = []
        recorder = self

        class Table:
            def __init__(self, columns=None, data=None):
                self.columns, self.data = columns, data

        class Run:
            url = None

            def log(self, data, step=None):
                recorder.calls.append(("log", data, step))

            def finish(self):
                recorder.calls.append(("finish",))

        def init(**kwargs):
            recorder.calls.append(("init", kwargs))
            return Run()

        self.module.Table = Table
        self.module.init = init
        self.module.log = Run().log  # trackio's module-level API
        self.module.finish = Run().finish


def logger_inputs(tmp_path, report_to):
    cfg = load_config({"model": "m", "data": {"path": "p.jsonl"}, "rewards": [{"function": "x.py:f"}],
                       "output_dir": str(tmp_path / "my-run"), "train": {"rollouts": 2, "micro_batch_size": 4},
                       "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 2},
                       "log": {"report_to": report_to}})
    plan = make_plan(prompts_per_rollout=2, samples_per_prompt=2, micro_batch_size=4, rollouts=2)
    return cfg, plan


@pytest.mark.parametrize("name", ["wandb", "trackio"])
def test_wandb_and_trackio_get_the_rows_at_their_steps_with_sample_tables(name, tmp_path, monkeypatch):
    fake = Recorder(name)
    monkeypatch.setitem(sys.modules, name, fake.module)
    monkeypatch.delenv("WANDB_PROJECT", raising=False)
    monkeypatch.delenv("TRACKIO_PROJECT", raising=False)
    cfg, plan = logger_inputs(tmp_path, [name])
    out = tmp_path / "my-run"
    out.mkdir()
    log = RunLogger(out, cfg, plan)
    log.samples.write({"rollout": 1, "step": 0, "prompt": [{"role": "user", "content": "hi"}],
                       "completion": "yo", "reward": 0.5, "rewards": {"f": 0.5}, "advantage": 0.1,
                       "truncated": False})
    log.write({"step": 1, "rollout": 1, "reward_mean": 0.5, "kl": None, "lr": 1e-3})
    log.write({"step": 2, "rollout": 1, "reward_mean": 0.5, "kl": None, "lr": 5e-4})
    log.close()

    kind, init = fake.calls[0]
    assert kind == "init" and init["project"] == "tidyrl" and init["name"] == "my-run"
    assert init["config"]["log"]["report_to"] == [name] and init["config"]["plan"]["total_optimizer_steps"] == 2
    logs = [c for c in fake.calls if c[0] == "log"]
    assert [step for _, _, step in logs] == [1, 2]
    first, second = logs[0][1], logs[1][1]
    assert {k: v for k, v in first.items() if k != "samples"} == {"rollout": 1.0, "reward_mean": 0.5, "lr": 1e-3}
    table = first["samples"]  # the samples ride with the next logged row, once
    assert table.columns[:4] == ["rollout", "step", "prompt", "completion"]
    assert table.data == [[1, 0, '[{"role": "user", "content": "hi"}]', "yo", 0.5, '{"f": 0.5}', 0.1, False]]
    assert "samples" not in second
    assert fake.calls[-1] == ("finish",)
    assert read_jsonl(out / "metrics.jsonl")[1]["lr"] == 5e-4  # metrics.jsonl is written all the same


def test_only_the_main_process_opens_trackers_and_writes(tmp_path, monkeypatch):
    fake = Recorder("wandb")
    monkeypatch.setitem(sys.modules, "wandb", fake.module)
    cfg, plan = logger_inputs(tmp_path, ["wandb"])
    (tmp_path / "my-run").mkdir()
    log = RunLogger(tmp_path / "my-run", cfg, plan, enabled=False)
    log.write({"step": 1, "reward_mean": 0.0})
    log.close()
    assert fake.calls == [] and not (tmp_path / "my-run" / "metrics.jsonl").exists()


def test_a_tracker_that_is_not_installed_is_refused_before_any_model_loads(tiny_model_dir, prompt_file, tmp_path,
                                                                          monkeypatch):
    import tidyrl.trackers

    monkeypatch.setitem(tidyrl.trackers.TRACKERS, "wandb", "tidyrl_test_not_installed_module")
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as err:
        tidyrl.train(small_run(tiny_model_dir, prompt_file, out, ["wandb"]))
    message = str(err.value)
    assert "log.report_to" in message and "pip install 'tidyrl[wandb]'" in message
    assert not out.exists()


def test_an_unknown_tracker_name_lists_the_known_ones():
    from tidyrl.api import check_parts

    with pytest.raises(ConfigError) as err:
        check_parts(load_config({"model": "m", "data": {"path": "p"}, "rewards": [{"function": "a:b"}],
                                 "train": {"rollouts": 1}, "log": {"report_to": ["tensorbored"]}}))
    assert "log.report_to: 'tensorbored'" in str(err.value) and "tensorboard, wandb, trackio" in str(err.value)


def test_real_wandb_offline_run_records_the_samples_table(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")  # not in the test extra: runs where wandb is installed
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg, plan = logger_inputs(tmp_path, ["wandb"])
    out = tmp_path / "my-run"
    out.mkdir()
    log = RunLogger(out, cfg, plan)
    log.samples.write({"rollout": 1, "step": 0, "prompt": "p", "completion": "c", "reward": 1.0,
                       "rewards": {"f": 1.0}, "advantage": 0.0, "truncated": False})
    log.write({"step": 1, "reward_mean": 1.0, "kl": None})
    log.close()
    assert wandb.run is None  # finished
    tables = list((out / "wandb").glob("offline-run-*/files/media/table/samples_*.table.json"))
    assert len(tables) == 1
    assert json.loads(tables[0].read_text())["data"] == [[1, 0, "p", "c", 1.0, '{"f": 1.0}', 0.0, False]]


# --------------------------------------------------------------------------- summary


def test_observe_counts_per_rollout_times_once_and_update_times_every_step(tmp_path):
    cfg, plan = logger_inputs(tmp_path, [])
    (tmp_path / "my-run").mkdir()
    log = RunLogger(tmp_path / "my-run", cfg, plan)
    for rollout, gen in ((1, 1.0), (2, 2.0)):
        for _ in range(2):  # two optimizer steps per rollout, both rows carry the rollout's times
            log.observe({"rollout": rollout, "time/generate_s": gen, "time/reward_s": 0.25, "time/score_s": 0.5,
                         "time/update_s": 0.75})
    log.close()
    assert log.timings == {"generate": 3.0, "reward": 0.5, "score": 1.0, "update": 3.0, "steps": 4}


def test_format_summary_gives_totals_time_split_rewards_and_locations(tmp_path):
    plan = make_plan(prompts_per_rollout=4, samples_per_prompt=4, epochs_per_rollout=2, minibatches_per_epoch=2,
                     micro_batch_size=2, rollouts=3)
    timings = {"generate": 5.0, "reward": 1.0, "score": 2.0, "update": 10.0, "steps": 12}
    text = format_summary(plan, timings, 20.0, 0.1, 0.5, tmp_path, tmp_path / "final",
                          {"tensorboard": str(tmp_path / "tensorboard")})
    lines = text.splitlines()
    assert lines[0] == "tidyrl: finished 12 optimizer steps (3 rollouts, 48 episodes) in 20.0 s"
    with_engine = format_summary(plan, timings, 20.0, 0.1, 0.5, tmp_path, tmp_path / "final", engine="vllm")
    assert with_engine.splitlines()[0].endswith("in 20.0 s, generated by the vllm engine")
    assert lines[1] == ("  time: generate 5.0 s (25%), reward 1.0 s (5%), score 2.0 s (10%), update 10.0 s (50%), "
                        "other 2.0 s (10%)")
    assert "reward_mean: 0.1000 (first rollout) -> 0.5000 (last rollout)" in text
    assert f"model: {tmp_path / 'final'}" in text and f"tensorboard: {tmp_path / 'tensorboard'}" in text
    long = format_summary(plan, timings | {"steps": 6}, 3725.0, None, None, tmp_path, tmp_path / "final")
    assert "in 1:02:05 (3725 s)" in long and "the 6 steps run since resuming" in long and "n/a" in long

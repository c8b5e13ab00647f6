"""Run safety: one run per output folder (a lock, stale ones taken over), checkpoints that are only ever
read as data (a tampered or damaged one is refused, never executed), and stops that say where to resume."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import grpo_config

import tidyrl
from tidyrl.checkpoint import CheckpointError, complete_checkpoints, load_trainer_state
from tidyrl.run_lock import LOCK_NAME, RunLock, RunLockError

# A reward that waits until the test opens a gate file: the run is certainly still going while the test acts.
GATED_REWARD = textwrap.dedent('''
    import os, time

    def gated(completions, **kwargs):
        open(os.environ["TIDYRL_TEST_GATE"] + ".waiting", "w").close()  # the run has written all it will before
        deadline = time.time() + 120
        while not os.path.exists(os.environ["TIDYRL_TEST_GATE"]) and time.time() < deadline:
            time.sleep(0.02)
        return [len(c) / 10 for c in completions]
''')


def config(model_dir, prompt_file, out, **sections) -> dict:
    return grpo_config(model_dir, prompt_file, out, rollouts=2, **sections)


def yaml_config(tmp_path, cfg: dict, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def wait_for(condition, proc, seconds=120):
    deadline = time.time() + seconds
    while not condition():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------------- one run per folder
def test_a_second_run_on_a_folder_in_use_is_refused_and_names_the_first(tmp_path, tiny_model_dir, prompt_file,
                                                                        monkeypatch):
    (tmp_path / "gated_rewards.py").write_text(GATED_REWARD)
    out, gate = tmp_path / "run", tmp_path / "gate"
    monkeypatch.setenv("TIDYRL_TEST_GATE", str(gate))
    cfg = config(tiny_model_dir, prompt_file, out, rewards=[{"function": str(tmp_path / "gated_rewards.py:gated")}])
    path = yaml_config(tmp_path, cfg, "first")
    first = subprocess.Popen([sys.executable, "-m", "tidyrl", "train", str(path)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        # It holds the folder and waits in its first reward (every file it opens before that exists by then).
        wait_for(lambda: Path(f"{gate}.waiting").exists(), first)
        before = files(out)
        for overrides in (["overwrite=true"], ["resume_from=latest"], []):
            with pytest.raises(RunLockError) as err:
                tidyrl.train(path, overrides)
            text = str(err.value)
            assert f"output_dir {out} is in use by another tidyrl run (pid {first.pid} on host " in text
            assert "started 20" in text and f"tidyrl train {path}" in text and "choose another `output_dir`" in text
        assert files(out) == before  # nothing of the first run was touched (overwrite=true deleted nothing)
    finally:
        gate.touch()
    assert first.wait(timeout=240) == 0, first.communicate()
    assert (out / "final" / "model.safetensors").exists() and not (out / LOCK_NAME).exists()
    tidyrl.train(path, ["overwrite=true"])  # the folder is free again once the first run is over


def test_the_cli_reports_a_folder_in_use_without_a_traceback(tmp_path, tiny_model_dir, prompt_file, capsys):
    from tidyrl.cli import main

    out = tmp_path / "held"
    cfg = config(tiny_model_dir, prompt_file, out, rewards=[{"function": "tidyrl.demo:anagram_reward"}])
    holder = RunLock(out).acquire()  # as another process would (flock locks conflict between open files)
    try:
        assert main(["train", str(yaml_config(tmp_path, cfg, "held"))]) == 2
    finally:
        holder.release()
    err = capsys.readouterr().err
    assert f"tidyrl: error: output_dir {out} is in use by another tidyrl run (pid {os.getpid()}" in err
    assert not (out / "config.yaml").exists()


def test_a_lock_left_by_a_killed_run_is_taken_over_and_reported(tmp_path, tiny_model_dir, prompt_file, capsys):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from tidyrl.run_lock import RunLock
        RunLock({str(out)!r}).acquire()
        print("held", flush=True)
        time.sleep(300)
    """)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(RunLockError, match=f"pid {holder.pid} on host"):
        RunLock(out).acquire()
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert json.loads((out / LOCK_NAME).read_text())["pid"] == holder.pid  # its record is left behind
    tidyrl.train(config(tiny_model_dir, prompt_file, out, train={"rollouts": 1}))
    said = capsys.readouterr().out
    assert f"had a lock left by a run that is gone (pid {holder.pid} on host" in said and "taking it over" in said
    assert (out / "final").exists() and not (out / LOCK_NAME).exists()


def test_a_record_of_a_dead_process_does_not_hold_the_folder(tmp_path):
    """A record whose process is gone (nobody holds the kernel lock) is replaced, and the new lock says whose it
    was; a second RunLock while it is held is refused; releasing removes the record."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = {"pid": int(dead.stdout), "host": "elsewhere", "started": "2026-01-01 00:00:00", "command": "tidyrl x"}
    (tmp_path / LOCK_NAME).write_text(json.dumps(record))
    lock = RunLock(tmp_path).acquire()
    assert lock.stale == record
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    with pytest.raises(RunLockError, match=f"pid {os.getpid()} on host"):
        RunLock(tmp_path).acquire()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    RunLock(tmp_path).acquire().release()


def test_every_process_of_a_multi_process_run_refuses_a_held_folder(tmp_path, tiny_model_dir, prompt_file):
    """Only the main process takes the lock; when it cannot, every process stops with its message (none waits
    at a barrier for a sibling that gave up, none reports the lock as held by a sibling)."""
    from conftest import free_port

    out = tmp_path / "held"
    cfg = config(tiny_model_dir, prompt_file, out, rewards=[{"function": "tidyrl.demo:anagram_reward"}],
                 train={"micro_batch_size": 2})
    path = yaml_config(tmp_path, cfg, "held")
    holder = RunLock(out).acquire()
    try:
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                               "--master_port", str(free_port()), "-m", "tidyrl", "train", str(path)],
                              env=env, capture_output=True, text=True, timeout=240)
    finally:
        holder.release()
    assert done.returncode != 0
    refusals = done.stderr.count(f"output_dir {out} is in use by another tidyrl run (pid {os.getpid()} on host")
    assert refusals == 2, done.stderr[-3000:]
    assert not (out / "config.yaml").exists()


# ---------------------------------------------------------------------------------------------- checkpoints are data
@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory, tiny_model_dir):
    """A finished run with checkpoint-2, -4 and -6 (2 rollouts x 4 optimizer steps, save_every=2); -2 and -6
    fall inside a rollout (they hold rollout.pt)."""
    folder = tmp_path_factory.mktemp("checkpointed")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{w}:", "word": w}) + "\n" for w in ["fig", "kiwi", "lime"]))
    cfg = config(tiny_model_dir, prompts, folder / "run", train={"epochs_per_rollout": 2},
                 log={"save_every": 2, "keep_last": 10, "progress_bar": False})
    tidyrl.train(cfg)
    assert [s for s, _ in complete_checkpoints(folder / "run")] == [2, 4, 6]
    return cfg


def copy_of(run_cfg: dict, tmp_path) -> tuple[dict, Path]:
    out = tmp_path / "run"
    shutil.copytree(run_cfg["output_dir"], out)
    return {**run_cfg, "output_dir": str(out)}, out


class Payload:
    """Unpickling this calls os.system: what a checkpoint from elsewhere could hold."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_tampered_checkpoint_is_refused_and_never_executed(checkpointed_run, tmp_path):
    cfg, out = copy_of(checkpointed_run, tmp_path)
    marker = tmp_path / "pwned"
    rng = out / "checkpoint-6" / "trainer_state" / "rng.pt"
    torch.save({"python": Payload(f"touch {marker}"), "numpy": None, "torch": None}, rng)
    before = files(out)
    with pytest.raises(CheckpointError) as err:
        tidyrl.train(cfg, ["resume_from=latest"])
    assert f"{rng} holds more than tensors and plain values (posix.system)" in str(err.value)
    assert "could run arbitrary code" in str(err.value)
    assert not marker.exists()  # never executed
    assert files(out) == before  # and nothing was written


@pytest.mark.parametrize("name", ["trainer_state/optimizer.pt", "trainer_state/rollout.pt", "model.safetensors",
                                  "trainer_state/state.json"])
def test_a_truncated_checkpoint_file_is_named_with_an_earlier_checkpoint(checkpointed_run, tmp_path, name):
    cfg, out = copy_of(checkpointed_run, tmp_path)
    damaged = out / "checkpoint-6" / name
    data = damaged.read_bytes()
    damaged.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError) as err:
        tidyrl.train(cfg, ["resume_from=latest"])
    text = str(err.value)
    assert text.startswith(f"{damaged} is damaged or truncated (")
    assert "checkpoint-6 cannot be resumed: resume from an earlier one instead (resume_from=path/to/checkpoint-4" in text
    load_trainer_state(out / "checkpoint-4")  # which is whole


def test_the_trainer_state_loads_as_data_and_restores_every_rng(checkpointed_run):
    """What tidyrl writes loads with weights_only=True: the RNG states round-trip exactly."""
    import random

    import numpy as np

    from tidyrl.checkpoint import rng_state, set_rng_state

    loaded = load_trainer_state(Path(checkpointed_run["output_dir"]) / "checkpoint-6")
    assert set(loaded) >= {"state", "optimizer", "scheduler", "rng", "rollout"} and loaded["rollout"] is not None
    saved = rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1))
    set_rng_state(loaded["rng"])
    set_rng_state(saved)
    assert (random.random(), np.random.rand(), torch.rand(1)) == expected


# ---------------------------------------------------------------------------------------------- stops that say where
NAN_REWARD = textwrap.dedent('''
    calls = []

    def third_is_nan(completions, **kwargs):
        calls.append(1)
        return [float("nan") if len(calls) == 3 else len(c) / 10 for c in completions]
''')


def test_a_nan_reward_stops_cleanly_naming_the_step_and_the_checkpoint(tmp_path, tiny_model_dir, prompt_file):
    """On the command line: exit status 2, one message (no traceback) that names the rollout, the step and the
    checkpoint to resume from; the metrics rows and checkpoints written so far are kept; the folder is free."""
    (tmp_path / "nan_rewards.py").write_text(NAN_REWARD)
    out = tmp_path / "nan"
    cfg = config(tiny_model_dir, prompt_file, out, rewards=[{"function": str(tmp_path / "nan_rewards.py:third_is_nan")}],
                 train={"rollouts": 3}, log={"save_every": 2, "progress_bar": False})
    done = subprocess.run([sys.executable, "-m", "tidyrl", "train", str(yaml_config(tmp_path, cfg, "nan"))],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert "reward function 'third_is_nan' returned nan for sample 0; a score must be finite" in done.stderr
    assert (f"Stopped in rollout 3, after optimizer step 4; the last good checkpoint is {out / 'checkpoint-4'} "
            "(resume_from=latest)") in done.stderr
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert [s for s, _ in complete_checkpoints(out)] == [2, 4]
    assert not (out / "final").exists() and not (out / LOCK_NAME).exists()


def test_a_nan_loss_stops_an_offline_stage_before_the_update(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """sft, reward and dpo share the optimizer step (loops/offline/loop.py): a NaN loss stops there, naming the step,
    and no final/ is written from poisoned weights."""
    import tidyrl.algorithms.sft as sft
    from tidyrl.cli import main

    real, calls = sft.sft_loss, []

    def poisoned(*args, **kwargs):
        calls.append(1)
        loss = real(*args, **kwargs)
        # the worst-case probe's micro-batch, then 2 a step: NaN from step 3
        return loss * float("nan") if len(calls) > 5 else loss

    monkeypatch.setattr(sft, "sft_loss", poisoned)
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{w}:", "completion": w[::-1]}) + "\n"
                            for w in ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon"]))
    out = tmp_path / "sft"
    cfg = {"algorithm": "sft", "model": str(tiny_model_dir), "output_dir": str(out), "data": {"path": str(data)},
           "train": {"batch_size": 4, "micro_batch_size": 2, "dataset_epochs": 3.0}, "log": {"progress_bar": False}}
    assert main(["train", str(yaml_config(tmp_path, cfg, "sft"))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tidyrl: error: optimizer step 3: the loss is nan and the gradient norm nan; the update was "
                          "not applied and training stopped")
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert not (out / "final").exists() and not (out / LOCK_NAME).exists()


def test_an_output_dir_that_cannot_be_created_is_a_clear_error(tmp_path, tiny_model_dir, prompt_file):
    (tmp_path / "a-file").write_text("not a folder")
    with pytest.raises(RunLockError, match=r"output_dir .*a-file/run cannot be created or written \((FileExists|NotADirectory)"):
        tidyrl.train(config(tiny_model_dir, prompt_file, tmp_path / "a-file" / "run"))

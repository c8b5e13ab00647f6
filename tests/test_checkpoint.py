"""Checkpoints, exact resume after SIGKILL / SIGTERM, and crashes during a save."""

from __future__ import annotations

import errno
import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

import tidyrl
from tidyrl.checkpoint import CheckpointError, complete_checkpoints

# A reward that takes a moment, so a test can kill the run between two checkpoints.
SLOW_REWARD = textwrap.dedent('''
    import time

    def letters(prompts, completions, word, **kwargs):
        time.sleep(0.25)
        return [sum(c in w for c in t) / len(t) if t else 0.0 for t, w in zip(completions, word)]
''')

PROMPT_WORDS = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon", "mango", "peach"]  # as conftest
TIMING = ("time_s", "time/generate_s", "time/reward_s", "time/score_s", "time/update_s")


def write_config(tmp_path, tiny_model_dir, prompt_file, name, **train):
    (tmp_path / "slow_rewards.py").write_text(SLOW_REWARD)
    cfg = {
        "algorithm": "grpo",
        "model": str(tiny_model_dir),
        "output_dir": str(tmp_path / name),
        "seed": 5,
        "data": {"path": str(prompt_file)},
        "rewards": [{"function": str(tmp_path / "slow_rewards.py") + ":letters"}],
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 4, "max_new_tokens": 5},
        "train": {"rollouts": 3, "epochs_per_rollout": 2, "minibatches_per_epoch": 2, "micro_batch_size": 2,
                  "learning_rate": 1e-3, "lr_scheduler": "cosine", "warmup_steps": 1, **train},
        "log": {"progress_bar": False, "samples_per_rollout": 8, "save_every": 0, "keep_last": 10},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def tidyrl_cmd(config, *overrides):
    return [sys.executable, "-m", "tidyrl", "train", str(config), *overrides]


def rows(path: Path, drop=TIMING) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in drop} for line in path.read_text().splitlines()]


def weights(folder: Path) -> bytes:
    from safetensors.torch import load_file

    tensors = load_file(folder / "model.safetensors")
    return b"".join(tensors[k].numpy().tobytes() for k in sorted(tensors))


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, tiny_model_dir):
    """The uninterrupted run: 3 rollouts x E*M = 4 -> 12 optimizer steps (same prompts as `prompt_file`)."""
    folder = tmp_path_factory.mktemp("reference")
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"{w}:", "word": w}) + "\n" for w in PROMPT_WORDS))
    config = write_config(folder, tiny_model_dir, prompts, "reference")
    tidyrl.train(config)
    return folder / "reference"


def kill_after_checkpoint(cmd, out: Path, step: int, sig=signal.SIGKILL, cwd=None) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd)
    deadline = time.time() + 240
    while not (out / f"checkpoint-{step}" / "trainer_state" / "state.json").exists():
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline
        time.sleep(0.01)
    proc.send_signal(sig)
    proc.wait(timeout=120)
    return proc


@pytest.mark.parametrize("save_every,first", [(3, 3), pytest.param(4, 4, marks=[pytest.mark.extended])],
                         ids=["inside-a-rollout", "rollout-boundary"])
def test_sigkill_then_resume_matches_the_uninterrupted_run(tmp_path, tiny_model_dir, prompt_file, reference_run,
                                                           save_every, first):
    config = write_config(tmp_path, tiny_model_dir, prompt_file, "killed")
    out = tmp_path / "killed"
    proc = kill_after_checkpoint(tidyrl_cmd(config, f"log.save_every={save_every}"), out, first)
    assert proc.returncode == -signal.SIGKILL
    assert not (out / "final").exists()
    resumed = subprocess.run(tidyrl_cmd(config, f"log.save_every={save_every}", "resume_from=latest"),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert rows(out / "metrics.jsonl") == rows(reference_run / "metrics.jsonl")  # none duplicated, none missing
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == list(range(1, 13))
    assert rows(out / "samples.jsonl") == rows(reference_run / "samples.jsonl")
    assert weights(out / "final") == weights(reference_run / "final")  # bit for bit


def test_sigterm_stops_cleanly_saves_and_resumes_exactly(tmp_path, tiny_model_dir, prompt_file, reference_run):
    config = write_config(tmp_path, tiny_model_dir, prompt_file, "term")
    out = tmp_path / "term"
    # save_every=2 only to know when training is under way; SIGTERM then saves wherever it stops.
    proc = kill_after_checkpoint(tidyrl_cmd(config, "log.save_every=2"), out, 2, sig=signal.SIGTERM)
    stderr = proc.stderr.read()
    assert proc.returncode == 130, stderr
    assert "SIGTERM" in stderr and "resume_from=latest" in stderr
    stopped_at = complete_checkpoints(out)[-1][0]
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == list(range(1, stopped_at + 1))
    resumed = subprocess.run(tidyrl_cmd(config, "log.save_every=2", "resume_from=latest"), capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "draws" not in resumed.stdout + resumed.stderr  # the same draw scheme: no warning
    assert rows(out / "metrics.jsonl") == rows(reference_run / "metrics.jsonl")
    assert weights(out / "final") == weights(reference_run / "final")


def test_a_checkpoint_is_a_hugging_face_folder_and_keep_last_holds(tmp_path, tiny_model_dir, prompt_file):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = write_config(tmp_path, tiny_model_dir, prompt_file, "keep")
    tidyrl.train(config, ["log.save_every=1", "log.keep_last=2"])
    out = tmp_path / "keep"
    assert [step for step, _ in complete_checkpoints(out)] == [10, 11]  # the final model is final/, not 12
    AutoModelForCausalLM.from_pretrained(out / "checkpoint-11")
    AutoTokenizer.from_pretrained(out / "checkpoint-11")
    state = json.loads((out / "checkpoint-11" / "trainer_state" / "state.json").read_text())
    assert state["step"] == 11 and state["rollouts_started"] == 3
    assert (out / "checkpoint-11" / "trainer_state" / "rollout.pt").exists()  # inside rollout 3
    assert not list(out.glob(".checkpoint-*"))


def test_a_full_disk_during_a_save_keeps_the_earlier_checkpoints(tmp_path, tiny_model_dir, prompt_file,
                                                                  reference_run, monkeypatch):
    import torch

    from transformers import AutoModelForCausalLM

    config = write_config(tmp_path, tiny_model_dir, prompt_file, "full")
    out = tmp_path / "full"
    real_save, calls = torch.save, []

    def save(obj, path, *args, **kwargs):
        calls.append(path)
        if "checkpoint-8" in str(path) and str(path).endswith("scheduler.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(CheckpointError, match="checkpoint-8 .the disk is full.*checkpoint-4.*resume_from=latest"):
        tidyrl.train(config, ["log.save_every=4"])
    assert [step for step, _ in complete_checkpoints(out)] == [4]
    assert not (out / "checkpoint-8").exists() and not list(out.glob(".checkpoint-*"))
    AutoModelForCausalLM.from_pretrained(out / "checkpoint-4")
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == list(range(1, 9))  # nothing lost
    monkeypatch.setattr(torch, "save", real_save)
    tidyrl.train(config, ["log.save_every=4", "resume_from=latest"])
    assert rows(out / "metrics.jsonl") == rows(reference_run / "metrics.jsonl")
    assert weights(out / "final") == weights(reference_run / "final")


# `tidyrl train` in a process that is killed (kill -9) halfway through writing checkpoint-8.
KILL_MID_SAVE = textwrap.dedent('''
    import os, signal, sys

    import torch

    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if ".checkpoint-8.tmp" in str(path) and str(path).endswith("scheduler.pt"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, path, *args, **kwargs)

    torch.save = save
    from tidyrl.cli import main

    sys.exit(main(sys.argv[1:]))
''')


def test_kill_9_during_a_save_keeps_the_previous_checkpoint_and_resume_is_exact(tmp_path, tiny_model_dir,
                                                                                prompt_file, reference_run):
    config = write_config(tmp_path, tiny_model_dir, prompt_file, "torn")
    out = tmp_path / "torn"
    (tmp_path / "kill_mid_save.py").write_text(KILL_MID_SAVE)
    killed = subprocess.run([sys.executable, str(tmp_path / "kill_mid_save.py"), "train", str(config),
                             "log.save_every=4"], capture_output=True, text=True, timeout=300)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert (out / ".checkpoint-8.tmp" / "trainer_state" / "optimizer.pt").exists()  # died mid-write
    assert [step for step, _ in complete_checkpoints(out)] == [4]
    assert (out / ".tidyrl.lock").exists()  # its lock record too: the kernel lock died with it
    resumed = subprocess.run(tidyrl_cmd(config, "log.save_every=4", "resume_from=latest"), capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "had a lock left by a run that is gone" in resumed.stdout
    assert rows(out / "metrics.jsonl") == rows(reference_run / "metrics.jsonl")
    assert weights(out / "final") == weights(reference_run / "final")
    assert not list(out.glob(".checkpoint-*")) and not (out / ".tidyrl.lock").exists()


def test_a_full_disk_while_saving_the_final_model_leaves_no_partial_folder(tmp_path, tiny_model_dir, prompt_file,
                                                                           monkeypatch):
    from transformers import PreTrainedModel

    real = PreTrainedModel.save_pretrained

    def save(self, path, *args, **kwargs):
        real(self, path, *args, **kwargs)
        if ".final.tmp" in str(path):  # the weights are written, then the tokenizer does not fit
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", save)
    config = write_config(tmp_path, tiny_model_dir, prompt_file, "full-final")
    out = tmp_path / "full-final"
    with pytest.raises(CheckpointError, match=r"could not save .*final \(the disk is full\); nothing partial was "
                                              r"left behind.*checkpoint-8 \(resume_from=latest\)"):
        tidyrl.train(config, ["log.save_every=4"])
    assert not (out / "final").exists() and not list(out.glob(".final*"))
    assert [step for step, _ in complete_checkpoints(out)] == [4, 8]
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == list(range(1, 13))


def test_resume_refuses_changes_to_the_maths_and_allows_memory_knobs(tmp_path, tiny_model_dir, prompt_file,
                                                                     reference_run, capsys):
    config = write_config(tmp_path, tiny_model_dir, prompt_file, "changed")
    out = tmp_path / "changed"
    tidyrl.train(config, ["log.save_every=6", "train.rollouts=2"])  # a shorter run leaves checkpoint-6
    with pytest.raises(CheckpointError) as err:
        tidyrl.train(config, ["resume_from=latest", "train.learning_rate=0.01", "rollout.samples_per_prompt=2",
                              "train.micro_batch_size=1"])
    text = str(err.value)
    assert "train.learning_rate: 0.001 -> 0.01" in text and "rollout.samples_per_prompt: 4 -> 2" in text
    assert "train.rollouts: 2 -> 3" in text and "micro_batch_size" not in text
    # Memory knobs may change: resuming checkpoint-6 of a 12-step run with another micro-batch size.
    path = out / "checkpoint-6"
    saved = yaml.safe_load(config.read_text())
    saved["train"]["rollouts"] = 2
    config.write_text(yaml.safe_dump(saved))
    # ...and a checkpoint whose rollouts were drawn with another scheme (here per-token Gumbel noise) resumes with
    # a warning that the later samples are not the uninterrupted run's.
    state_file = path / "trainer_state" / "state.json"
    state = json.loads(state_file.read_text())
    assert state["sampler"] == "inverse-transform-float64"
    state_file.write_text(json.dumps({**state, "sampler": "gumbel-max"}))
    capsys.readouterr()
    tidyrl.train(config, [f"resume_from={path}", "train.micro_batch_size=4", "rollout.generation_batch_size=3",
                          "log.save_every=6"])
    assert [r["step"] for r in rows(out / "metrics.jsonl")] == list(range(1, 9))
    assert ("tidyrl: warning: the checkpoint's rollouts were sampled with 'gumbel-max' draws, this version of tidyrl "
            "draws with 'inverse-transform-float64'") in capsys.readouterr().out


def test_extend_continues_a_run_to_a_new_length_and_says_it_is_another_run(tmp_path, tiny_model_dir, prompt_file,
                                                                            capsys):
    """"Train longer": refused by default (with the way to do it), then with extend=true the run goes on from its
    checkpoint to the new length, its LR schedule rebuilt over the new total (the rates of the later steps are
    the new cosine's), plan.json records the extension, and the run says the result is not the longer run made
    from the start. Shorter is refused."""
    from conftest import expected_lrs

    config = write_config(tmp_path, tiny_model_dir, prompt_file, "longer", rollouts=2)
    out = tmp_path / "longer"
    tidyrl.train(config, ["log.save_every=4"])  # 8 steps, checkpoint-4
    with pytest.raises(CheckpointError, match=r"train.rollouts: 2 -> 3(.|\n)*add extend=true"):
        tidyrl.train(config, ["resume_from=latest", "train.rollouts=3"])
    with pytest.raises(CheckpointError, match="only makes a run longer: the checkpoint is at optimizer step 4, and "
                                              "the new length is 4 steps"):
        tidyrl.train(config, ["resume_from=latest", "train.rollouts=1", "extend=true"])
    capsys.readouterr()
    tidyrl.train(config, ["resume_from=latest", "train.rollouts=3", "extend=true", "log.save_every=0"])
    assert ("tidyrl: warning: extend=true: this run continues from optimizer step 4 of 8 to 12, its LR schedule "
            "rebuilt over 12 steps; the result is not the run that 12 steps from the start would have made") \
        in capsys.readouterr().out
    got = rows(out / "metrics.jsonl")
    assert [r["step"] for r in got] == list(range(1, 13))
    old, new = expected_lrs(8, 1, "cosine", 1e-3), expected_lrs(12, 1, "cosine", 1e-3)
    assert [r["lr"] for r in got] == pytest.approx(old[:4] + new[4:], rel=1e-12)
    plan = json.loads((out / "plan.json").read_text())
    assert plan["total_optimizer_steps"] == 12 and plan["rollouts"] == 3 and plan["engine"] == "builtin"
    assert plan["extended"] == [{"step": 4, "from_total_optimizer_steps": 8, "to_total_optimizer_steps": 12}]


def test_resume_without_a_checkpoint_says_what_to_do(tmp_path, tiny_model_dir, prompt_file):
    config = write_config(tmp_path, tiny_model_dir, prompt_file, "none")
    with pytest.raises(CheckpointError, match="holds no complete checkpoint-N.*log.save_every"):
        tidyrl.train(config, ["resume_from=latest"])


def test_loaded_weights_get_their_own_aligned_memory(tmp_path):
    """from_pretrained leaves weights inside the memory-mapped file, at whatever alignment the file's header
    gives (48 mod 64 for the test model); matmul rounding can depend on it, which broke exact resume on one
    CPU. Loaded models own their memory: every tensor 64-byte aligned, the same values, tied weights still one
    tensor."""
    from safetensors.torch import load_file

    from conftest import llama
    from tidyrl.models.loading import in_own_memory, load_causal_lm

    model = llama(tie_word_embeddings=True)
    weight = model.model.embed_tokens.weight
    values = weight.detach().clone()
    misaligned = torch.empty(weight.numel() + 16)[4: 4 + weight.numel()].view(weight.shape)  # 16 bytes off
    misaligned.copy_(values)
    weight.data = misaligned
    assert weight.data_ptr() % 64 == 16
    assert in_own_memory(model) is model
    assert weight.data_ptr() % 64 == 0 and torch.equal(weight, values)
    assert model.lm_head.weight is model.model.embed_tokens.weight

    model.save_pretrained(tmp_path / "m")
    loaded = load_causal_lm(str(tmp_path / "m"))
    assert all(t.data_ptr() % 64 == 0 for t in [*loaded.parameters(), *loaded.buffers()])
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    state = loaded.state_dict()
    assert all(torch.equal(state[k], v) for k, v in load_file(tmp_path / "m" / "model.safetensors").items())


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names an fd's file through /proc (Linux)")
def test_a_checkpoint_is_on_disk_before_the_rename_publishes_it(tmp_path, tiny_model_dir, monkeypatch):
    """After a power cut, a checkpoint-N that exists must hold its data: every file and folder of the hidden
    .checkpoint-N.tmp is fsynced before the rename, and the output folder (the rename itself) after it."""
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidyrl.checkpoint import save_checkpoint

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src)))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    save_checkpoint(tmp_path, 3, model=model, tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir),
                    optimizer=optimizer, scheduler=scheduler, state={"step": 3}, rollout=None, keep_last=2)
    tmp = tmp_path / ".checkpoint-3.tmp"
    published = events.index(("replace", str(tmp)))
    synced = {path for kind, path in events[:published] if kind == "fsync"}
    written = {str(tmp / p.relative_to(tmp_path / "checkpoint-3")) for p in (tmp_path / "checkpoint-3").rglob("*")}
    assert len(written) > 5 and written | {str(tmp)} <= synced
    assert ("fsync", str(tmp_path)) in events[published:]


def test_sigkill_of_a_lagged_run_then_resume_matches_the_uninterrupted_run(tmp_path, tiny_model_dir, prompt_file):
    """rollout.lag = 1, killed (SIGKILL) after checkpoint-6, inside rollout 2, while rollout 3 is being made ahead
    by the weights after rollout 1: the checkpoint holds rollout 3 as made, and the resumed run is the
    uninterrupted one, bit for bit."""
    reference = write_config(tmp_path, tiny_model_dir, prompt_file, "reference-lag")
    lagged = ["rollout.lag=1"]
    done = subprocess.run(tidyrl_cmd(reference, *lagged), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    config = write_config(tmp_path, tiny_model_dir, prompt_file, "killed-lag")
    out = tmp_path / "killed-lag"
    proc = kill_after_checkpoint(tidyrl_cmd(config, *lagged, "log.save_every=6"), out, 6)
    assert proc.returncode == -signal.SIGKILL and not (out / "final").exists()
    held = torch.load(out / "checkpoint-6" / "trainer_state" / "ahead.pt", weights_only=True)
    assert list(held) == [2]  # rollout 3 (index 2), made ahead
    resumed = subprocess.run(tidyrl_cmd(config, *lagged, "log.save_every=6", "resume_from=latest"),
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    ref = tmp_path / "reference-lag"
    assert rows(out / "metrics.jsonl", TIMING + ("time/wait_rollout_s",)) == \
        rows(ref / "metrics.jsonl", TIMING + ("time/wait_rollout_s",))
    assert rows(out / "samples.jsonl") == rows(ref / "samples.jsonl")
    assert weights(out / "final") == weights(ref / "final")

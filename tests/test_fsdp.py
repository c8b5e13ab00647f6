"""The whole loop under FSDP2, on 2 gloo processes on CPU, launched as a user launches it: `accelerate launch
--config_file examples/accelerate/fsdp.yaml --num_processes 2 -m tidyrl train CONFIG.yaml`.

Tolerance (TOL = 1e-5, as tests/test_multiprocess.py). The completions are the same on 1 and 2 processes (keyed
sampling), and so are the learning rates (the schedule is stepped once per optimizer step). Losses, gradient norms
and weights differ from the 1-process run only by float32 rounding: under FSDP2 each process computes half of each
mini-batch's gradient and the halves are reduce-scattered (summed in another order), and the gradient norm is summed
from each process's shards. After 8 AdamW steps at lr 1e-3 that stays below 1e-6 per parameter here (measured
4e-7); a real mistake (an unsharded half, a per-process normaliser, a clip over one shard only) moves a parameter by
~lr = 1e-3 per step. A resume on the same number of processes replays the same operations on the same shards: bit
for bit; on another number (2 -> 1, 2 -> 4, 4 -> 2) the gradients are summed over another split: within TOL.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import free_port, gloo_cpu_env, read_jsonl, write_jsonl

from tidyrl.checkpoint import complete_checkpoints, load_trainer_state

TOL = 1e-5
FSDP_YAML = Path(__file__).resolve().parents[1] / "examples" / "accelerate" / "fsdp.yaml"


def _accelerate_launches_fsdp2() -> bool:
    """accelerate before 1.6 has no fsdp_version (its launcher always sets up FSDP1, which tidyrl refuses with
    the upgrade to make: tests/test_sharding.py)."""
    import dataclasses

    from accelerate.utils import FullyShardedDataParallelPlugin

    return "fsdp_version" in {f.name for f in dataclasses.fields(FullyShardedDataParallelPlugin)}


pytestmark = pytest.mark.skipif(not _accelerate_launches_fsdp2(),
                                reason="this accelerate has no fsdp_version: it launches FSDP1 only (1.6+ needed)")
WORDS = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon"]
EXACT = ("step", "lr", "loss", "grad_norm", "reward_mean", "kl", "entropy")


def train(config: Path, out: Path, processes: int, *overrides: str, check: bool = True):
    """`tidyrl train` on one process, or under FSDP2 with `processes` gloo processes (the shipped accelerate
    config). Returns the finished process (its stdout holds the summary)."""
    if processes == 1:
        launcher = [sys.executable, "-m", "tidyrl"]
    else:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_YAML),
                    "--num_processes", str(processes), "--main_process_port", str(free_port()), "-m", "tidyrl"]
    proc = subprocess.run(launcher + ["train", str(config), f"output_dir={out}", *overrides],
                          capture_output=True, text=True, timeout=600, env=gloo_cpu_env())
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def max_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    assert x.keys() == y.keys()
    return max((x[k] - y[k]).abs().max().item() for k in x)


def identical(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    x, y = load_file(a), load_file(b)
    return x.keys() == y.keys() and all((x[k] == y[k]).all() for k in x)


def completions(out: Path) -> list[str]:
    return [row["completion"] for row in read_jsonl(out / "samples.jsonl")]


@pytest.fixture(scope="module")
def rl_yaml(tmp_path_factory, tiny_model_dir):
    folder = tmp_path_factory.mktemp("fsdp")
    prompts = write_jsonl(folder / "prompts.jsonl", [{"prompt": f"{w}:", "word": w} for w in WORDS])
    cfg = {
        "algorithm": "grpo", "model": str(tiny_model_dir), "seed": 1, "data": {"path": str(prompts)},
        "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
        "rollout": {"prompts_per_rollout": 4, "samples_per_prompt": 2, "max_new_tokens": 6,
                    "forward_batch_size": 3, "generation_batch_size": 3},
        # max_grad_norm well below the norms (0.6-1.0): every step is clipped, by the norm over both shards
        "train": {"rollouts": 2, "epochs_per_rollout": 2, "minibatches_per_epoch": 2, "micro_batch_size": 1,
                  "learning_rate": 1e-3, "warmup_steps": 1, "max_grad_norm": 0.05},
        "log": {"progress_bar": False, "samples_per_rollout": 8},
    }
    path = folder / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_grpo_under_fsdp2_matches_one_process_and_its_checkpoints_resume_exactly(rl_yaml, tmp_path):
    one = tmp_path / "one"
    train(rl_yaml, one, 1)
    sharded = tmp_path / "fsdp"
    done = train(rl_yaml, sharded, 2, "log.save_every=3", "log.keep_last=5")

    plan1, plan2 = (json.loads((d / "plan.json").read_text()) for d in (one, sharded))
    assert plan2["distribution"] == "fsdp2, 2 shards" and plan2["world_size"] == 2
    assert "in " in done.stdout and ", fsdp2, 2 shards, generated by" in done.stdout  # the summary says it
    for key in ("total_optimizer_steps", "total_episodes", "rollouts", "warmup_steps"):
        assert plan1[key] == plan2[key]
    assert completions(one) == completions(sharded)
    r1, r2 = read_jsonl(one / "metrics.jsonl"), read_jsonl(sharded / "metrics.jsonl")
    assert [(a["step"], a["lr"]) for a in r1] == [(b["step"], b["lr"]) for b in r2]
    for a, b in zip(r1, r2):
        for key in ("loss", "grad_norm", "reward_mean", "entropy"):
            assert a[key] == pytest.approx(b[key], abs=TOL), key
    assert min(r["grad_norm"] for r in r2[1:]) > 0.05  # clipped at every step after the first (whose norm is 0)
    assert max_diff(one / "final" / "model.safetensors", sharded / "final" / "model.safetensors") < TOL

    # checkpoint-3 (inside rollout 1): the model folder in full, the optimizer state as each process's shards
    checkpoint = sharded / "checkpoint-3"
    shards = checkpoint / "trainer_state" / "shards"
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (checkpoint / "trainer_state" / "optimizer.pt").exists()
    assert json.loads((checkpoint / "trainer_state" / "state.json").read_text())["distribution"] == "fsdp2, 2 shards"
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert json.loads((checkpoint / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]

    # resumed from checkpoint-3 on 2 processes: the uninterrupted run, bit for bit; on 1 process: to rounding
    for processes in (2, 1):
        cut = tmp_path / f"cut{processes}"
        shutil.copytree(sharded, cut)
        for later in [cut / "checkpoint-6", cut / "final"]:
            shutil.rmtree(later)
        resumed = train(rl_yaml, cut, processes, "log.save_every=3", "log.keep_last=5", "resume_from=latest")
        assert ("fsdp2, 2 shards" if processes == 2 else "one process") in resumed.stdout
        plan = json.loads((cut / "plan.json").read_text())  # this run's processes
        assert plan["world_size"] == processes and plan.get("distribution") == ("fsdp2, 2 shards" if processes == 2
                                                                                else None)
        assert completions(cut) == completions(sharded)
        rows = read_jsonl(cut / "metrics.jsonl")
        if processes == 2:
            assert [[r[k] for k in EXACT if k in r] for r in rows] == [[r[k] for k in EXACT if k in r] for r in r2]
            assert identical(cut / "final" / "model.safetensors", sharded / "final" / "model.safetensors")
        else:
            assert [(a["step"], a["lr"]) for a in rows] == [(b["step"], b["lr"]) for b in r2]
            assert max_diff(cut / "final" / "model.safetensors", sharded / "final" / "model.safetensors") < TOL


@pytest.fixture(scope="module")
def uninterrupted(rl_yaml, tmp_path_factory):
    """The GRPO run of `rl_yaml` on `processes` FSDP2 processes, uninterrupted, with checkpoint-3 (inside rollout 1)
    and checkpoint-6 kept: made once per number of processes for the module's slow tests."""
    runs = {}

    def run(processes: int) -> Path:
        if processes not in runs:
            out = tmp_path_factory.mktemp(f"fsdp{processes}") / "run"
            train(rl_yaml, out, processes, "log.save_every=3", "log.keep_last=5")
            runs[processes] = out
        return runs[processes]

    return run


PLAN_COUNTS = ("prompts_per_rollout", "samples_per_prompt", "episodes_per_rollout", "epochs_per_rollout",
               "minibatches_per_epoch", "optimizer_steps_per_rollout", "rollouts", "total_optimizer_steps",
               "total_episodes", "warmup_steps", "episodes_per_minibatch")


@pytest.mark.slow
@pytest.mark.parametrize("saved_on, resumed_on", [(2, 4), (4, 2)])
def test_grpo_checkpoints_under_fsdp2_resume_on_another_number_of_processes(saved_on, resumed_on, rl_yaml, tmp_path,
                                                                            uninterrupted):
    """checkpoint-3 of a run on `saved_on` processes (its optimizer states: `saved_on` shards of every parameter's
    moments, keyed by name) resumed on `resumed_on`: each process reads its new shards of them, and the run ends as
    the uninterrupted one, to float32 rounding (the gradients are summed over another split; the completions, plan
    counts and learning rates are the same). plan.json then describes the resumed run's processes."""
    whole = uninterrupted(saved_on)
    cut = tmp_path / "cut"
    shutil.copytree(whole, cut)
    for later in [cut / "checkpoint-6", cut / "final"]:
        shutil.rmtree(later)
    saved_state = json.loads((cut / "checkpoint-3" / "trainer_state" / "state.json").read_text())
    assert saved_state["distribution"] == f"fsdp2, {saved_on} shards"
    assert len(list((cut / "checkpoint-3" / "trainer_state" / "shards").glob("*.distcp"))) == saved_on
    resumed = train(rl_yaml, cut, resumed_on, "log.save_every=3", "log.keep_last=5", "resume_from=latest")
    assert f", fsdp2, {resumed_on} shards, generated by" in resumed.stdout

    before, after = (json.loads((d / "plan.json").read_text()) for d in (whole, cut))
    assert before["distribution"] == f"fsdp2, {saved_on} shards" and before["world_size"] == saved_on
    assert after["distribution"] == f"fsdp2, {resumed_on} shards" and after["world_size"] == resumed_on
    assert after["episodes_per_minibatch_per_process"] == before["episodes_per_minibatch"] // resumed_on
    assert {k: after[k] for k in PLAN_COUNTS} == {k: before[k] for k in PLAN_COUNTS}
    later_state = json.loads((cut / "checkpoint-6" / "trainer_state" / "state.json").read_text())
    assert later_state["distribution"] == f"fsdp2, {resumed_on} shards"

    assert completions(cut) == completions(whole)
    r1, r2 = read_jsonl(whole / "metrics.jsonl"), read_jsonl(cut / "metrics.jsonl")
    assert [(a["step"], a["lr"]) for a in r1] == [(b["step"], b["lr"]) for b in r2]
    for a, b in zip(r1, r2):
        for key in ("loss", "grad_norm", "reward_mean", "entropy"):
            assert a[key] == pytest.approx(b[key], abs=TOL), key
    assert max_diff(whole / "final" / "model.safetensors", cut / "final" / "model.safetensors") < TOL


# `tidyrl train` whose second process kills itself (kill -9) halfway through writing its optimizer shards of
# checkpoint-6 (after the first tensor of its `__1_0.distcp`), having left a note of the file it was writing.
KILL_MID_SHARDS = textwrap.dedent('''
    import os, signal, sys
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    import torch.distributed.checkpoint.filesystem as filesystem

    real_save, real_write_item, saving = dcp.save, filesystem._write_item, []

    def save(state, *args, checkpoint_id=None, **kwargs):
        saving[:] = [str(checkpoint_id)]
        return real_save(state, *args, checkpoint_id=checkpoint_id, **kwargs)

    def write_item(transforms, stream, *args, **kwargs):
        result = real_write_item(transforms, stream, *args, **kwargs)
        if os.environ["RANK"] == "1" and ".checkpoint-6.tmp" in saving[0]:
            stream.flush()
            with open(Path(saving[0]).parents[3] / "killed.txt", "w") as note:  # beside the output folder
                note.write(getattr(stream, "name", "?"))
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    dcp.save, filesystem._write_item = save, write_item
    from tidyrl.cli import main

    sys.exit(main(sys.argv[1:]))
''')


@pytest.mark.slow
def test_a_process_killed_while_writing_its_shards_loses_that_checkpoint_only(rl_yaml, tmp_path, uninterrupted):
    """kill -9 of one of 2 processes while it writes its shards of checkpoint-6's optimizer states: the launcher
    stops the other, nothing named checkpoint-6 appears (the shards go into the hidden .checkpoint-6.tmp/, renamed
    only once every process has written), checkpoint-3 stays whole, and `resume_from=latest` takes it and ends as
    the uninterrupted run, bit for bit."""
    out = tmp_path / "torn"
    script = tmp_path / "kill_mid_shards.py"
    script.write_text(KILL_MID_SHARDS)
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_YAML),
                "--num_processes", "2", "--main_process_port", str(free_port()), str(script)]
    killed = subprocess.run(launcher + ["train", str(rl_yaml), f"output_dir={out}", "log.save_every=3",
                                        "log.keep_last=5"], capture_output=True, text=True, timeout=600,
                            env=gloo_cpu_env())
    assert killed.returncode != 0
    written = (tmp_path / "killed.txt").read_text()  # died mid-write, in its own shard file
    assert ".checkpoint-6.tmp" in written and written.endswith("__1_0.distcp"), written
    assert [step for step, _ in complete_checkpoints(out)] == [3]
    assert not (out / "checkpoint-6").exists() and not (out / "final").exists()
    # at most the hidden folder is left (the other process removes it when its save fails first)
    assert {p.name for p in out.glob(".checkpoint-*")} <= {".checkpoint-6.tmp"}
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == list(range(1, 7))  # nothing before it lost
    shards = out / "checkpoint-3" / "trainer_state" / "shards"
    assert sorted(p.name for p in shards.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    load_trainer_state(out / "checkpoint-3")  # every file of it reads

    resumed = train(rl_yaml, out, 2, "log.save_every=3", "log.keep_last=5", "resume_from=latest")
    assert ", fsdp2, 2 shards, generated by" in resumed.stdout
    whole = uninterrupted(2)
    assert [[r[k] for k in EXACT if k in r] for r in read_jsonl(out / "metrics.jsonl")] == \
        [[r[k] for k in EXACT if k in r] for r in read_jsonl(whole / "metrics.jsonl")]
    assert completions(out) == completions(whole)
    assert identical(out / "final" / "model.safetensors", whole / "final" / "model.safetensors")
    assert [step for step, _ in complete_checkpoints(out)] == [3, 6] and not list(out.glob(".checkpoint-*"))


@pytest.mark.slow
def test_grpo_with_a_kl_reference_under_fsdp2_matches_one_process(rl_yaml, tmp_path):
    """The KL reference (no LoRA: a frozen copy of the starting model) is sharded like the policy, each of its
    forwards gathering a layer at a time; its log-probs, and with them the KL and the update, are the 1-process
    run's."""
    cfg = yaml.safe_load(rl_yaml.read_text())
    cfg["grpo"] = {"kl_coef": 0.05}
    one_rollout_sharded_matches_one_process(cfg, tmp_path, "KL reference: sharded like the policy, 2 shards", "kl")


def one_rollout_sharded_matches_one_process(cfg: dict, tmp_path, said: str, metric: str) -> None:
    """`cfg` for one rollout of one epoch, on 1 process and sharded over 2: the sharded run says `said`, and the two
    have the same completions and lr sequence, and their loss, `metric`, gradient norms and final weights agree."""
    cfg["train"].update(rollouts=1, epochs_per_rollout=1)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    one, sharded = tmp_path / "one", tmp_path / "fsdp"
    train(path, one, 1)
    done = train(path, sharded, 2)
    assert said in done.stdout
    assert completions(one) == completions(sharded)
    r1, r2 = read_jsonl(one / "metrics.jsonl"), read_jsonl(sharded / "metrics.jsonl")
    assert [(a["step"], a["lr"]) for a in r1] == [(b["step"], b["lr"]) for b in r2]
    for a, b in zip(r1, r2):
        for key in ("loss", metric, "grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=TOL), key
    assert max_diff(one / "final" / "model.safetensors", sharded / "final" / "model.safetensors") < TOL


@pytest.mark.slow
def test_distill_under_fsdp2_shards_its_teacher_and_matches_one_process(rl_yaml, tiny_model_dir, tmp_path):
    """On-policy distillation: the teacher (here another tiny model of the same tokenizer) is sharded like the
    policy and scores the same episodes in the same chunks; its log-probs, the reverse KL and the update are the
    1-process run's."""
    from tidyrl.models.tiny import save_tiny_model

    teacher = save_tiny_model(tmp_path / "teacher", seed=7, hidden_size=32, num_layers=2, num_heads=2)
    cfg = yaml.safe_load(rl_yaml.read_text())
    cfg.update(algorithm="distill", teacher={"model": str(teacher)})
    cfg.pop("grpo", None)
    one_rollout_sharded_matches_one_process(cfg, tmp_path, "teacher: sharded like the policy, 2 shards",
                                            "distill/reverse_kl")


@pytest.fixture(scope="module")
def sft_yaml(tmp_path_factory, tiny_model_dir):
    folder = tmp_path_factory.mktemp("fsdp-sft")
    data = write_jsonl(folder / "sft.jsonl", [{"prompt": f"{w}:", "completion": w[::-1]} for w in WORDS])
    cfg = {"algorithm": "sft", "model": str(tiny_model_dir), "seed": 3, "data": {"path": str(data)},
           "train": {"batch_size": 4, "micro_batch_size": 1, "max_steps": 4, "learning_rate": 1e-3,
                     "warmup_steps": 1, "max_grad_norm": 1.0},
           "log": {"progress_bar": False}}
    path = folder / "sft.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_sft_under_fsdp2_matches_one_process_with_and_without_syncing_each_micro_batch(sft_yaml, tmp_path):
    """B = 4, m = 1: 2 micro-batches per process and step. Without sync_each_microbatch the first one's gradients
    stay unsharded on each process until the second is done; with it, each is reduce-scattered at once. The same
    update either way."""
    one = tmp_path / "one"
    train(sft_yaml, one, 1)
    lazy, eager = tmp_path / "lazy", tmp_path / "eager"
    train(sft_yaml, lazy, 2)
    done = train(sft_yaml, eager, 2, "train.sync_each_microbatch=true")
    assert ", fsdp2, 2 shards" in done.stdout
    assert json.loads((eager / "plan.json").read_text())["gradient_accumulation_steps"] == 2
    r1 = read_jsonl(one / "metrics.jsonl")
    for other in (lazy, eager):
        rows = read_jsonl(other / "metrics.jsonl")
        assert [(a["step"], a["lr"], a["examples"]) for a in r1] == [(b["step"], b["lr"], b["examples"]) for b in rows]
        for a, b in zip(r1, rows):
            assert a["loss"] == pytest.approx(b["loss"], abs=TOL) and a["grad_norm"] == pytest.approx(b["grad_norm"], abs=TOL)
        assert max_diff(one / "final" / "model.safetensors", other / "final" / "model.safetensors") < TOL
    assert r1[-1]["loss"] < r1[0]["loss"]


@pytest.mark.slow
def test_ppo_with_a_lora_policy_and_a_full_critic_under_fsdp2_matches_one_process(rl_yaml, tmp_path, tiny_model_dir):
    """Both trained models sharded: the LoRA policy (its adapters are parameters of the decoder layers' shard
    groups, so they are sharded with them; the frozen base too) and the critic (a model of its own, sharded the same
    way, with its own optimizer); the KL reference is the policy with its adapter off, as on one process."""
    pytest.importorskip("peft")
    cfg = yaml.safe_load(rl_yaml.read_text())
    cfg.update(algorithm="ppo", critic={"model": str(tiny_model_dir), "learning_rate": 2e-3},
               ppo={"kl_coef": 0.05}, lora={"enabled": True, "r": 4, "alpha": 8})
    cfg["train"]["rollouts"] = 1
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    one, sharded = tmp_path / "one", tmp_path / "fsdp"
    train(path, one, 1)
    train(path, sharded, 2)
    assert completions(one) == completions(sharded)
    r1, r2 = read_jsonl(one / "metrics.jsonl"), read_jsonl(sharded / "metrics.jsonl")
    assert [(a["step"], a["lr"], a["critic_lr"]) for a in r1] == [(b["step"], b["lr"], b["critic_lr"]) for b in r2]
    for a, b in zip(r1, r2):
        for key in ("loss", "value_loss", "kl", "grad_norm"):
            assert a[key] == pytest.approx(b[key], abs=TOL), key
    for part in ("adapter_model.safetensors", "critic/model.safetensors"):
        assert max_diff(one / "final" / part, sharded / "final" / part) < TOL, part
    from safetensors.torch import load_file

    adapter = load_file(sharded / "final" / "adapter_model.safetensors")
    assert max(w.abs().max().item() for k, w in adapter.items() if "lora_B" in k) > 0  # the adapter trained


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["reinforce_pp", "rloo", "dpo", "reward"])
def test_other_stages_under_fsdp2_match_one_process(stage, rl_yaml, tmp_path, tiny_model_dir):
    from tidyrl.models.tiny import save_tiny_reward_model

    if stage in ("reinforce_pp", "rloo"):
        cfg = yaml.safe_load(rl_yaml.read_text())
        cfg.update(algorithm=stage, **{stage: {"kl_coef": 0.05}})  # a KL reference, sharded like the policy
        cfg["train"]["rollouts"] = 1
        part = "model.safetensors"
    else:
        pairs = write_jsonl(tmp_path / "pairs.jsonl", [{"prompt": f"{w}:", "chosen": w[::-1], "rejected": w}
                                                        for w in WORDS])
        model = tiny_model_dir if stage == "dpo" else save_tiny_reward_model(tmp_path / "rm", seed=4)
        cfg = {"algorithm": stage, "model": str(model), "seed": 2, "data": {"path": str(pairs)},
               "train": {"batch_size": 4, "micro_batch_size": 1, "max_steps": 3, "learning_rate": 1e-3},
               "log": {"progress_bar": False}}
        part = "model.safetensors"
    path = tmp_path / f"{stage}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    one, sharded = tmp_path / "one", tmp_path / "fsdp"
    train(path, one, 1)
    done = train(path, sharded, 2)
    assert ", fsdp2, 2 shards" in done.stdout
    r1, r2 = read_jsonl(one / "metrics.jsonl"), read_jsonl(sharded / "metrics.jsonl")
    assert [(a["step"], a["lr"]) for a in r1] == [(b["step"], b["lr"]) for b in r2]
    for a, b in zip(r1, r2):
        assert a["loss"] == pytest.approx(b["loss"], abs=TOL)
    assert max_diff(one / "final" / part, sharded / "final" / part) < TOL


def test_frozen_scorers_sharded_under_fsdp2_score_as_the_whole_model_on_uneven_shares(tiny_model_dir, tmp_path):
    """A reference and a reward model sharded as a run shards them (`shard_frozen`): each process holds half of
    their parameters, as DTensors; every forward all-gathers, so a process with fewer chunks to score (3 against 2
    of a DPO cache, 3 against 1 reward-model chunks, a reward call on no samples) joins the other's extra forwards
    instead of leaving it waiting. The scores are the unsharded models' within 1e-5."""
    from tidyrl.models.tiny import save_tiny_reward_model

    reward_dir = save_tiny_reward_model(tmp_path / "rm", seed=4)
    report = tmp_path / "report.json"
    child = Path(__file__).with_name("fsdp_frozen_child.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(child), str(tiny_model_dir), str(reward_dir), str(report)],
                          capture_output=True, text=True, timeout=300, env=gloo_cpu_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        r = json.loads(Path(f"{report}.{rank}").read_text())
        assert r["reference_dtensors"] and r["reward_dtensors"]
        assert 0.45 < r["reference_local_fraction"] < 0.55  # half of every parameter (rows split in two)
        assert r["logps_diff"] < TOL
        assert r["scores"] == r["expected"] == (6 if rank == 0 else 2)
        assert r["reward_diff"] < TOL

"""train.exact_gradients: micro-batch gradients summed on a fixed-point grid, as integers, so the sum does not
depend on the order or the split; the weights of 1 and 2 processes bit for bit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import free_port, gloo_cpu_env, grpo_config, read_jsonl, torchrun_train, write_jsonl

import tidyrl
from tidyrl.loops.run.exact_sums import (GRID_EXPONENT, ExactGradients, clip_exactly, exact_grad_norm,
                                     global_micro_batches)


class One:
    num_processes = 1


def _accumulate(grads) -> ExactGradients:
    """The gradients (one parameter's) added in the given order."""
    p = torch.nn.Parameter(torch.zeros(len(grads[0])))
    acc = ExactGradients([p])
    for g in grads:
        p.grad = g.clone()
        acc.add()
    return acc


def _total(acc: ExactGradients):
    acc.reduce(One())
    return acc.parameters[0].grad


def test_the_sum_is_the_same_in_any_order_and_within_the_grids_rounding():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(1000, generator=g) * 10.0 ** float(torch.randint(-6, 2, (1,), generator=g)) for _ in range(16)]
    forward, backward = _total(_accumulate(grads)), _total(_accumulate(grads[::-1]))
    assert torch.equal(forward, backward)
    # two processes' shares, each summed on the grid, then the integer all-reduce: the one-process integers
    shares = _accumulate(grads[:8]).sums[0] + _accumulate(grads[8:]).sums[0]
    assert torch.equal(shares, _accumulate(grads).sums[0])
    # float32 sums in two orders differ; the exact ones do not
    assert not torch.equal(sum(grads), sum(grads[::-1]))
    exact = torch.stack([x.double() for x in grads]).sum(0)
    # each term rounded to the nearest multiple of 2^-40: at most 16 half-units off, then one float32 rounding
    bound = 16 * 2.0 ** -(GRID_EXPONENT + 1) + exact.abs() * torch.finfo(torch.float32).eps
    assert ((forward.double() - exact).abs() <= bound).all()


def test_a_diverged_gradient_is_refused():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([0.0, 5000.0, 1.0])
    acc = ExactGradients([p])
    acc.add()
    with pytest.raises(FloatingPointError, match="a micro-batch gradient reached 5e\\+03"):
        acc.reduce(One())


def test_the_exact_norm_is_the_same_on_any_split_and_near_the_float64_norm():
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, generator=g) * 10.0 ** float(torch.randint(-5, 2, (1,), generator=g))
             for n in (7, 300, 1, 64)]
    whole = exact_grad_norm(grads)
    flat = torch.cat(grads)
    for cuts in ([flat], list(flat.split(5)), list(flat.flip(0).split(33))):  # other tensors, other orders
        assert exact_grad_norm(cuts) == whole
    reference = flat.double().norm().item()
    assert abs(whole - reference) <= reference * 2.0 ** -50  # each square rounded to 2^-52 of the largest
    assert exact_grad_norm([torch.tensor([3.0]), torch.tensor([[4.0]])]) == 5.0
    assert exact_grad_norm([torch.zeros(3)]) == 0.0
    assert exact_grad_norm([torch.tensor([1.0, float("nan")])]) != exact_grad_norm([torch.ones(1)])


def test_exact_clipping_scales_as_torch_clip_grad_norm_does():
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([4.0])]
    assert clip_exactly(grads, 1.0) == 5.0
    coefficient = torch.tensor(1.0 / (5.0 + 1e-6))
    assert torch.equal(grads[0], torch.tensor([3.0, 0.0]) * coefficient) and torch.equal(grads[1], torch.tensor([4.0]) * coefficient)
    small = [torch.tensor([0.3])]
    assert clip_exactly(small, 1.0) == small[0].item() == float(torch.tensor(0.3))  # below max_norm: unscaled


def test_micro_batches_are_formed_from_the_whole_mini_batch_then_shared_out():
    episodes = [3, 1, 4, 0, 5, 2, 7, 6]
    assert global_micro_batches(episodes, 2, 0, 1) == [[3, 1], [4, 0], [5, 2], [7, 6]]
    assert global_micro_batches(episodes, 2, 0, 2) == [[3, 1], [4, 0]]
    assert global_micro_batches(episodes, 2, 1, 2) == [[5, 2], [7, 6]]


@pytest.mark.extended  # (the FSDP2 case, in the default suite, covers the exact sums across processes too)
def test_reinforce_pp_on_two_processes_gives_the_one_process_weights_bit_for_bit(tiny_model_dir, prompt_file,
                                                                               tmp_path):
    """A dense reward, KL in the reward, two epochs of two mini-batches of two micro-batches per process: without
    exact sums 1 and 2 processes differ in the last bits (tests/test_multiprocess.py bounds it); with them the
    final weights and every logged gradient norm are identical (the scoring chunks of 2 episodes hold the same
    episodes on 1 and 2 processes; one thread per process in both)."""
    from safetensors.torch import load_file

    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path / "one", rollouts=2, algorithm="reinforce_pp",
                      reinforce_pp={"kl_coef": 0.05},
                      train={"epochs_per_rollout": 2, "micro_batch_size": 2, "exact_gradients": True,
                             "learning_rate": 1e-2})
    cfg["rewards"] = [{"function": "tidyrl.demo:anagram_reward"}]
    # the no-grad scoring (reference and old log-probs) in chunks that hold the same episodes on 1 and 2 processes
    cfg["rollout"].update({"forward_batch_size": 2, "generation_batch_size": 2})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun process has (conftest.gloo_cpu_env): a CPU kernel may split its
    try:                      # sums by thread, so the same kernels means the same threads per process
        tidyrl.train(cfg)
    finally:
        torch.set_num_threads(threads)
    torchrun_train({**cfg, "output_dir": str(tmp_path / "two")}, tmp_path, world=2)
    one, two = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("one", "two"))
    assert all(torch.equal(one[k], two[k]) for k in one)
    r1, r2 = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("one", "two"))
    assert [r["grad_norm"] for r in r1] == [r["grad_norm"] for r in r2]
    plan = json.loads((tmp_path / "two" / "plan.json").read_text())
    assert plan["world_size"] == 2 and plan["gradient_accumulation_steps"] == 1  # 8 / (2 mini-batches * 2 * 2)


def _one_and_two_processes(cfg: dict, tmp_path, fsdp: bool = False, world: int = 2) -> None:
    """`cfg` run in this process (one thread, as each torchrun process has) into tmp_path/one, and on `world`
    processes into tmp_path/two: under torchrun (DDP), or with `fsdp` as a user launches FSDP2 (accelerate launch
    with examples/accelerate/fsdp.yaml)."""
    if fsdp:
        skip_without_fsdp2()
    one_process(cfg, tmp_path / "one")
    if fsdp:
        fsdp_train({**cfg, "output_dir": str(tmp_path / "two")}, tmp_path, world)
    else:
        torchrun_train({**cfg, "output_dir": str(tmp_path / "two")}, tmp_path, world=world)


def one_process(cfg: dict, out: Path) -> None:
    """`cfg` run in this process into `out`, with one thread, as each torchrun process has: a CPU kernel may split
    its sums by thread, so the same kernels means the same threads per process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tidyrl.train({**cfg, "output_dir": str(out)})
    finally:
        torch.set_num_threads(threads)


def subprocess_train(config: dict, folder) -> None:
    """`tidyrl train` of `config` in a process of its own, with the environment of the multi-process runs (one
    OpenMP thread in every thread: torch.set_num_threads in this process sets the calling thread's only, and a run
    with rollout.lag computes on a thread of its own)."""
    import subprocess
    import sys

    import yaml

    path = Path(folder) / "one-process.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "tidyrl", "train", str(path)], env=gloo_cpu_env(),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def skip_without_fsdp2() -> None:
    """accelerate before 1.6 launches FSDP1 only, which tidyrl refuses (tests/test_fsdp.py)."""
    from test_fsdp import _accelerate_launches_fsdp2

    if not _accelerate_launches_fsdp2():
        pytest.skip("this accelerate has no fsdp_version: it launches FSDP1 only (1.6+ needed)")


def fsdp_train(config: dict, folder, world: int) -> None:
    """`tidyrl train` under FSDP2 on `world` gloo processes, launched as tests/test_fsdp.py launches it."""
    import subprocess
    import sys

    import yaml
    from test_fsdp import FSDP_YAML

    skip_without_fsdp2()
    path = Path(folder) / "fsdp.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_YAML),
                           "--num_processes", str(world), "--main_process_port", str(free_port()), "-m", "tidyrl",
                           "train", str(path)], env=gloo_cpu_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((Path(config["output_dir"]) / "plan.json").read_text())["distribution"] == \
        f"fsdp2, {world} shards"


def _same_weights_and_norms(tmp_path, *parts: str, norms=("grad_norm",)) -> list[dict]:
    """tmp_path/one and tmp_path/two: each of `parts` of final/ identical, and the logged `norms` of every step.
    Returns the one-process metrics rows."""
    from safetensors.torch import load_file

    for part in parts:
        one, two = (load_file(tmp_path / d / "final" / part) for d in ("one", "two"))
        assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one), part
    r1, r2 = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("one", "two"))
    assert len(r1) == len(r2)
    for key in norms:
        assert [r[key] for r in r1] == [r[key] for r in r2], key
    return r1


def _exact_rl_config(tiny_model_dir, prompt_file, tmp_path, algorithm: str, **sections) -> dict:
    """The REINFORCE++ test's conditions for another algorithm: 8 episodes a rollout, two epochs of two
    mini-batches, micro-batches of 2, scoring and generation in chunks of 2."""
    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path / "one", rollouts=2, algorithm=algorithm,
                      train={"epochs_per_rollout": 2, "micro_batch_size": 2, "exact_gradients": True,
                             "learning_rate": 1e-2}, **sections)
    cfg["rewards"] = [{"function": "tidyrl.demo:anagram_reward"}]
    cfg["rollout"].update({"forward_batch_size": 2, "generation_batch_size": 2})
    return cfg


@pytest.mark.slow
def test_ppo_on_two_processes_gives_the_one_process_policy_and_critic_bit_for_bit(tiny_model_dir, prompt_file,
                                                                                 tmp_path):
    """PPO: the critic (its own optimizer and schedule) sums its gradients on the same grid as the policy, so
    both final weights and both logged gradient norms are identical on 1 and 2 processes."""
    from safetensors.torch import load_file

    cfg = _exact_rl_config(tiny_model_dir, prompt_file, tmp_path, "ppo", ppo={"kl_coef": 0.05},
                           critic={"model": str(tiny_model_dir), "learning_rate": 2e-3})
    _one_and_two_processes(cfg, tmp_path)
    for part in ("model.safetensors", "critic/model.safetensors"):
        one, two = (load_file(tmp_path / d / "final" / part) for d in ("one", "two"))
        assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one), part
    r1, r2 = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("one", "two"))
    assert len(r1) == 8  # 2 rollouts x 2 epochs x 2 mini-batches
    for key in ("grad_norm", "critic_grad_norm", "value_loss"):
        assert [r[key] for r in r1] == [r[key] for r in r2], key
    assert r1[-1]["critic_grad_norm"] > 0


def test_reinforce_pp_under_fsdp2_gives_the_one_process_weights_bit_for_bit(tiny_model_dir, prompt_file, tmp_path):
    """Under FSDP2 each layer's gradient is reduce-scattered inside backward: with exact sums that reduce-scatter
    sums grid integers (loops/run/exact_sums.py, ShardedExactGradients), every micro-batch, into an int64 sum per
    shard, and the clipping norm is summed exactly from the shards. 1 process against 2 shards: the same final
    weights and gradient norms (clipped: max_grad_norm below the norms), the same metrics rows."""
    cfg = _exact_rl_config(tiny_model_dir, prompt_file, tmp_path, "reinforce_pp", reinforce_pp={"kl_coef": 0.05})
    cfg["train"]["max_grad_norm"] = 0.05
    _one_and_two_processes(cfg, tmp_path, fsdp=True)
    rows = _same_weights_and_norms(tmp_path, "model.safetensors")
    assert len(rows) == 8 and min(r["grad_norm"] for r in rows) > 0.05  # every step clipped


CLOCK = ("time_s", "time/generate_s", "time/reward_s", "time/score_s", "time/update_s", "tokens_per_s")


def _rows_without_clock(out: Path) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in CLOCK} for row in read_jsonl(out / "metrics.jsonl")]


def _sha256(path: Path) -> str:
    import hashlib

    from safetensors.torch import load_file

    state = load_file(path)
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode() + state[key].numpy().tobytes())
    return digest.hexdigest()


@pytest.mark.slow
def test_thirty_rollouts_on_1_2_and_4_processes_ddp_or_fsdp2_and_a_resume_on_another_count_agree_bit_for_bit(
        tiny_model_dir, prompt_file, tmp_path):
    """GRPO with a KL reference (sharded under FSDP2) and clipping, 30 rollouts (60 optimizer steps). Without exact
    sums, 1 process and 2 FSDP2 shards end with 99 % of the parameters different (by up to 8.8e-6, 1.2e-5 relative;
    measured). With them, 1 process, 2 and 4 FSDP2 shards and 4 DDP processes write the same final weights
    (sha256) and the same metrics rows, clock fields aside; the checkpoints at step 30 of the 1-process and the
    2-shard runs, each resumed on 4 shards, end the same too."""
    import shutil

    skip_without_fsdp2()
    cfg = grpo_config(tiny_model_dir, prompt_file, tmp_path / "one", rollouts=30, grpo={"kl_coef": 0.05},
                      train={"micro_batch_size": 1, "exact_gradients": True, "learning_rate": 1e-2,
                             "max_grad_norm": 0.05})
    cfg["rewards"] = [{"function": "tidyrl.demo:anagram_reward"}]
    cfg["rollout"].update({"forward_batch_size": 2, "generation_batch_size": 2})
    saving = {"log": {**cfg["log"], "save_every": 30}}
    one_process({**cfg, **saving}, tmp_path / "one")
    fsdp_train({**cfg, **saving, "output_dir": str(tmp_path / "fsdp2")}, tmp_path, 2)
    fsdp_train({**cfg, "output_dir": str(tmp_path / "fsdp4")}, tmp_path, 4)
    torchrun_train({**cfg, "output_dir": str(tmp_path / "ddp4")}, tmp_path, world=4)
    for saved, resumed in (("fsdp2", "fsdp2-on-4"), ("one", "one-on-4")):  # checkpoint-30 resumed on 4 shards
        cut = tmp_path / resumed
        shutil.copytree(tmp_path / saved, cut)
        shutil.rmtree(cut / "final")
        for later in cut.glob("checkpoint-*"):
            if later.name != "checkpoint-30":
                shutil.rmtree(later)
        fsdp_train({**cfg, **saving, "output_dir": str(cut), "resume_from": "latest"}, tmp_path, 4)
    runs = ["one", "fsdp2", "fsdp4", "ddp4", "fsdp2-on-4", "one-on-4"]
    digests = {run: _sha256(tmp_path / run / "final" / "model.safetensors") for run in runs}
    assert len(set(digests.values())) == 1, digests
    rows = {run: _rows_without_clock(tmp_path / run) for run in runs}
    assert len(rows["one"]) == 60 and rows["one"][-1]["kl"] > 0
    assert sum(r["grad_norm"] > 0.05 for r in rows["one"]) >= 50  # most steps clipped
    for run in runs[1:]:
        assert rows[run] == rows["one"], run


@pytest.mark.slow
def test_ppo_under_fsdp2_gives_the_one_process_policy_and_critic_bit_for_bit(tiny_model_dir, prompt_file, tmp_path):
    """PPO under FSDP2: the policy, its sharded KL reference and the critic (sharded, its own optimizer): both
    models' final weights, both gradient norms and every metrics row as on one process."""
    cfg = _exact_rl_config(tiny_model_dir, prompt_file, tmp_path, "ppo", ppo={"kl_coef": 0.05},
                           critic={"model": str(tiny_model_dir), "learning_rate": 2e-3})
    _one_and_two_processes(cfg, tmp_path, fsdp=True)
    rows = _same_weights_and_norms(tmp_path, "model.safetensors", "critic/model.safetensors",
                                   norms=("grad_norm", "critic_grad_norm"))
    assert rows[-1]["critic_grad_norm"] > 0
    assert _rows_without_clock(tmp_path / "one") == _rows_without_clock(tmp_path / "two")


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["grpo", "ppo", "reinforce_pp", "sft", "dpo", "reward"])
def test_every_stage_on_four_fsdp2_shards_gives_the_one_process_run_bit_for_bit(stage, tiny_model_dir, prompt_file,
                                                                                tmp_path):
    """Each stage with its policy (and reference, critic) sharded over 4 gloo processes, one micro-batch of 1 per
    process per step: the final weights and every metrics row (clock fields aside) as on one process."""
    if stage in ("sft", "dpo", "reward"):
        cfg = _offline(stage, tiny_model_dir, tmp_path / "one", write_jsonl(tmp_path / "data.jsonl", _rows(stage)))
        parts = ["model.safetensors"]
    else:
        extra = {"critic": {"model": str(tiny_model_dir), "learning_rate": 2e-3}} if stage == "ppo" else {}
        cfg = _exact_rl_config(tiny_model_dir, prompt_file, tmp_path, stage, **{stage: {"kl_coef": 0.05}}, **extra)
        cfg["train"]["micro_batch_size"] = 1  # 4 episodes a mini-batch: one per process
        cfg["rollout"]["forward_batch_size"] = 2  # 2 episodes of the rollout per process
        parts = ["model.safetensors"] + (["critic/model.safetensors"] if stage == "ppo" else [])
    _one_and_two_processes(cfg, tmp_path, fsdp=True, world=4)
    _same_weights_and_norms(tmp_path, *parts)
    assert _rows_without_clock(tmp_path / "one") == _rows_without_clock(tmp_path / "two")


@pytest.mark.slow
def test_two_nodes_of_one_process_give_the_one_process_weights_bit_for_bit(tiny_model_dir, prompt_file, tmp_path):
    """`torchrun --nnodes 2 --nproc_per_node 1` (two node ranks on this host, as tests/test_multiprocess.py runs
    them): GRPO with a KL reference, the same final weights and metrics rows as one process."""
    import yaml
    from test_multiprocess import launch_two_nodes

    cfg = _exact_rl_config(tiny_model_dir, prompt_file, tmp_path, "grpo", grpo={"kl_coef": 0.05})
    one_process(cfg, tmp_path / "one")
    path = tmp_path / "two-nodes.yaml"
    path.write_text(yaml.safe_dump(cfg))
    launch_two_nodes(path, tmp_path / "two")
    _same_weights_and_norms(tmp_path, "model.safetensors")
    assert _rows_without_clock(tmp_path / "one") == _rows_without_clock(tmp_path / "two")


@pytest.mark.slow
def test_a_lora_policy_on_two_processes_gives_the_one_process_adapter_bit_for_bit(tiny_model_dir, prompt_file,
                                                                                 tmp_path):
    """REINFORCE++ with a LoRA policy (the KL's reference the base model, the adapter switched off): only the
    adapter's parameters are on the grid, and its final weights are identical on 1 and 2 processes."""
    pytest.importorskip("peft")
    from safetensors.torch import load_file

    cfg = _exact_rl_config(tiny_model_dir, prompt_file, tmp_path, "reinforce_pp", reinforce_pp={"kl_coef": 0.05},
                           lora={"enabled": True, "r": 4, "alpha": 8})
    _one_and_two_processes(cfg, tmp_path)
    one, two = (load_file(tmp_path / d / "final" / "adapter_model.safetensors") for d in ("one", "two"))
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    assert max(w.abs().max().item() for k, w in one.items() if "lora_B" in k) > 0  # the adapter trained
    r1, r2 = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("one", "two"))
    assert [r["grad_norm"] for r in r1] == [r["grad_norm"] for r in r2]


WORDS = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon", "mango", "peach", "banana", "cherry"]


def _offline(stage: str, model_dir, out, data_file) -> dict:
    """A small run of an offline stage with exact sums: 12 examples (pairs), B = 4 in micro-batches of 1, so each
    of 2 processes runs 2 micro-batches a step; the examples' lengths differ, so train.group_by_length (on)
    reorders the batch before it is cut."""
    from test_dpo import dpo_config
    from test_kto import kto_config
    from test_reward_training import reward_config
    from test_sft import sft_config

    make, sections = {"sft": (sft_config, {}), "dpo": (dpo_config, {}), "reward": (reward_config, {}),
                      "orpo": (dpo_config, {"dpo": {"loss_type": "orpo"}}), "kto": (kto_config, {})}[stage]
    train = {"batch_size": 4, "micro_batch_size": 1, "dataset_epochs": 1.0, "learning_rate": 1e-2,
             "exact_gradients": True}
    return make(model_dir, data_file, out, train=train, **sections)


def _rows(stage: str) -> list[dict]:
    if stage == "sft":
        return [{"prompt": f"{w}:", "completion": w[::-1]} for w in WORDS]
    if stage == "kto":
        return [{"prompt": f"{w}:", "completion": w[::-1] if i % 3 else "zz" + w, "label": bool(i % 3)}
                for i, w in enumerate(WORDS)]
    return [{"prompt": f"{w}:", "chosen": w[::-1], "rejected": "zz" + w * (i % 3)} for i, w in enumerate(WORDS)]


@pytest.mark.parametrize("stage, fsdp", [("sft", False), pytest.param("dpo", False, marks=pytest.mark.slow),
                                         pytest.param("reward", False, marks=pytest.mark.slow),
                                         pytest.param("orpo", False, marks=pytest.mark.slow),
                                         pytest.param("kto", False, marks=pytest.mark.slow),
                                         pytest.param("sft", True, marks=pytest.mark.slow),
                                         pytest.param("dpo", True, marks=pytest.mark.slow),
                                         pytest.param("reward", True, marks=pytest.mark.slow)])
def test_an_offline_stage_on_two_processes_gives_the_one_process_weights_bit_for_bit(stage, fsdp, tiny_model_dir,
                                                                                     tmp_path):
    """sft, dpo (its reference log-probs cached in chunks of the same pairs on any W), the reward model, orpo (its
    SFT term a token mean over the global batch) and kto (its z0 from every position of the global batch): three
    steps of 2 micro-batches per process on 2 processes (DDP, or FSDP2 shards: dpo's reference sharded too), 4 on
    1, the same final weights, gradient norms and metrics rows (clock fields aside)."""
    data = write_jsonl(tmp_path / "data.jsonl", _rows(stage))
    cfg = _offline(stage, tiny_model_dir, tmp_path / "one", data)
    _one_and_two_processes(cfg, tmp_path, fsdp=fsdp)
    rows = _same_weights_and_norms(tmp_path, "model.safetensors")
    assert len(rows) == 3 and rows[-1]["loss"] != rows[0]["loss"]  # the weights moved
    assert _rows_without_clock(tmp_path / "one") == _rows_without_clock(tmp_path / "two")


def test_offline_micro_batches_are_cut_from_the_whole_batch_with_exact_gradients():
    from tidyrl.loops.offline.loop import micro_batches
    from tidyrl.plan import make_offline_plan

    length = {3: 5, 1: 2, 4: 9, 0: 1, 5: 7, 2: 3, 7: 4, 6: 8}.get
    batch = [3, 1, 4, 0, 5, 2, 7, 6]

    def parts(world, rank):
        plan = make_offline_plan(batch_size=8, micro_batch_size=2, max_steps=1, world_size=world)
        return micro_batches(batch, plan, rank, length, whole_batch_first=True)

    assert parts(1, 0) == [[0, 1], [2, 7], [3, 5], [6, 4]]  # by length, then cut
    assert parts(2, 0) + parts(2, 1) == parts(1, 0)
    plan = make_offline_plan(batch_size=8, micro_batch_size=2, max_steps=1, world_size=2)
    assert micro_batches(batch, plan, 1, length) == [[2, 7], [5, 6]]  # without: each process sorts its own share


def test_exact_gradients_is_accepted_under_every_sharding_tidyrl_runs():
    from tidyrl.config import load_config
    from tidyrl.loops.run.setup import check_sharding

    cfg = load_config({"algorithm": "sft", "model": "m", "data": {"path": "p"},
                       "train": {"max_steps": 1, "batch_size": 2, "exact_gradients": True}})
    for kind in ("none", "fsdp2"):
        check_sharding(kind, cfg)


def test_scoring_and_generation_chunks_that_would_hold_other_episodes_on_another_split_are_refused():
    from tidyrl.config import load_config
    from tidyrl.loops.rl.inputs import check_exact_chunks
    from tidyrl.plan import PlanError, plan_from_config

    def config(forward: int, generation: int):
        return load_config({"algorithm": "grpo", "model": "m", "data": {"path": "p"},
                            "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
                            "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 4,
                                        "forward_batch_size": forward, "generation_batch_size": generation},
                            "train": {"rollouts": 1, "micro_batch_size": 1, "exact_gradients": True}})

    cfg = config(2, 4)
    for world in (1, 2):  # 8 and 4 episodes a process: 2 and 4 divide both
        check_exact_chunks(cfg, plan_from_config(cfg, 10, world))
    with pytest.raises(PlanError, match="generation_batch_size=4 does not divide each process's 2 episodes"):
        check_exact_chunks(cfg, plan_from_config(cfg, 10, 4))
    cfg = config(3, 4)
    with pytest.raises(PlanError) as refused:
        check_exact_chunks(cfg, plan_from_config(cfg, 10, 1))
    assert refused.value.problems == [
        "train.exact_gradients: rollout.forward_batch_size=3 does not divide each process's 8 episodes (8 a rollout "
        "over 1 process(es)), so its chunks would hold other episodes on another number of processes and round "
        "otherwise; set it to a divisor of 8 (of R/W for every W you compare)"]
    cfg = config(2, 2)
    check_exact_chunks(cfg, plan_from_config(cfg, 10, 4))  # 2 episodes a process: 2 divides them

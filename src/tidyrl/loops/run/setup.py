"""Setting a run up and writing what it leaves: the accelerator, the output folder and its run header (config.yaml,
plan.json), the optimizer and LR schedule of what it trains, and saving a Hugging Face folder (loading is
`tidyrl.models.loading`). The steps themselves are `loops.run.steps`."""

from __future__ import annotations

import functools
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tidyrl.config import Config, save_config
from tidyrl.console import say
from tidyrl.models.devices import cuda_in_use
from tidyrl.models.loading import enable_gradient_checkpointing
from tidyrl.plan import Plan

RUN_FILES = ("config.yaml", "plan.json", "metrics.jsonl", "samples.jsonl", "best.json")
"""Files whose presence means a folder already holds a run."""


class RunDirError(RuntimeError):
    """The output directory cannot be used as asked."""


@dataclass
class TrainResult:
    """What `tidyrl.train` returns."""

    output_dir: Path
    """The run folder."""
    final_dir: Path
    """The trained model (Hugging Face format)."""
    plan: Plan
    """The batch plan the run followed."""
    metrics: dict = field(default_factory=dict)
    """The last metrics row."""
    first_reward_mean: Optional[float] = None
    """RL stages: mean reward of the first rollout."""
    last_reward_mean: Optional[float] = None
    """RL stages: mean reward of the last rollout."""
    is_main_process: bool = True
    """False in the other processes of a multi-process run (they print nothing)."""


class LaunchError(RuntimeError):
    """The processes were launched in a way the machine cannot run; the message says how to launch instead."""


def check_processes_fit_devices(local_processes: int, cuda_devices: int) -> None:
    """Each process of a CUDA run takes its own GPU (`cuda:LOCAL_RANK`): more processes on one machine than
    GPUs would fail inside the first CUDA call with "invalid device ordinal", after the launch. Refused here,
    before anything loads, with both numbers and the two ways out."""
    if local_processes > cuda_devices:
        raise LaunchError(
            f"{local_processes} processes were started on this machine, but it has {cuda_devices} CUDA "
            f"device{'s' if cuda_devices != 1 else ''}: each process needs a GPU of its own. Start at most "
            f"{cuda_devices} (`torchrun --nproc_per_node {cuda_devices}` or `accelerate launch --num_processes "
            f"{cuda_devices}`), or run all processes on CPU (gloo) with ACCELERATE_USE_CPU=1 or CUDA_VISIBLE_DEVICES=''."
        )


@functools.lru_cache(maxsize=None)  # registered once per process, however many runs it makes
def _destroy_process_group_at_exit() -> None:
    """Destroy the default process group when the interpreter exits, while it is still whole. Left alive, gloo's
    worker threads still hold tensors at interpreter finalization; freeing them then takes the GIL of a dying
    interpreter and a process that trained correctly dies with SIGABRT ("terminate called without an active
    exception": once in CI, torch 2.11, gloo; pytorch/pytorch#190489). Garbage is collected first: a DDP model in
    a reference cycle (a finished run's objects) would otherwise outlive its group, and its reducer, freed at
    finalization after the group, aborted a 2-process run the same way in CI (torch 2.11). Only local teardown: no
    collective."""
    import atexit
    import gc

    import torch.distributed as dist

    def destroy() -> None:
        if dist.is_available() and dist.is_initialized():
            gc.collect()
            dist.destroy_process_group()

    atexit.register(destroy)


def make_accelerator(cfg: Optional[Config] = None, *, watch: bool = False, **kwargs):
    """The one Accelerator of a run. Under torchrun / accelerate launch on a machine without CUDA,
    accelerate only forms a (gloo) process group when asked for CPU explicitly; without this, each
    process would silently train alone and all would write the same output_dir. On CUDA, more processes per
    machine than GPUs are refused first (`check_processes_fit_devices`).

    A launch that asks for FSDP2 (`models.sharding.launch_sharding`) is sharded by tidyrl (`prepare_for_training`),
    on CPU and GPU alike: accelerate is kept out of it (it forms the process group only; on a CPU it would train
    plain DDP and say nothing). Every process reads the weights and shards the whole model it read. With `cfg`, a
    sharding mode the launch asks for and tidyrl cannot run `cfg` under is refused here (`check_sharding`), before
    any weights load. With `watch` (a training run, which reports its exception in `tidyrl.train` and stops the
    watch there) and several processes, each process watches the others from here on (`loops.run.faults`: a fault
    on one ends them all, a hang after train.watchdog_s)."""
    import torch
    from accelerate import Accelerator

    from tidyrl.models.sharding import check_fsdp_settings, launch_sharding, sharding_kind

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    on_cpu = not cuda_in_use()
    if launched and not on_cpu:
        check_processes_fit_devices(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count())
    tidyrl_shards = launch_sharding() == "fsdp2"
    if tidyrl_shards:
        check_fsdp_settings()
        os.environ["ACCELERATE_USE_FSDP"] = "false"  # accelerate: the process group and devices, no FSDP of its own
    try:
        accelerator = Accelerator(cpu=launched and on_cpu, **kwargs)
    finally:
        if tidyrl_shards:
            os.environ["ACCELERATE_USE_FSDP"] = "true"  # the request stays readable (launch_sharding)
    if launched:
        _destroy_process_group_at_exit()
    if launched and accelerator.num_processes == 1:
        raise RuntimeError(
            f"launched with WORLD_SIZE={os.environ['WORLD_SIZE']} but accelerate formed no process group; "
            "check the launcher's environment (MASTER_ADDR, MASTER_PORT, RANK)."
        )
    if cfg is not None:
        from tidyrl.loops.run.faults import watch_faults

        if watch:  # a fault on one process ends them all (loops.run.faults)
            watch_faults(accelerator, cfg.train.watchdog_s)
        check_sharding(sharding_kind(accelerator), cfg)
        # the run's first words: what it computes differs from its config.yaml
        say(kernel_override_lines(cfg), main=accelerator.is_main_process)
    return accelerator


def kernel_overrides(cfg: Config) -> dict:
    """plan.json's `kernel_overrides`: per developer override set in the environment (`models.kernels.OVERRIDES`),
    {"kernels.<key>": {"variable": "TIDYRL_...=<value>", "value": what the run uses, "configured": config.yaml's}};
    empty where none is set."""
    from tidyrl.models.kernels import overrides

    return {f"kernels.{o.key}": {"variable": f"{o.variable}={o.raw}", "value": o.value,
                                 "configured": getattr(cfg.kernels, o.key)} for o in overrides()}


def kernel_override_lines(cfg: Config) -> list[str]:
    """One line per developer override in effect: what a run says at its start and in its summary."""
    from tidyrl.models.kernels import overrides, shown

    return [f"developer override: {o.describe()} (config.yaml: {shown(getattr(cfg.kernels, o.key))}); set "
            f"kernels.{o.key} in the config to make it the run's" for o in overrides()]


def distribution_of(accelerator) -> str:
    """'fsdp2, N shards', 'ddp, N processes' or 'one process': how this run's model is distributed (plan.json's
    `distribution`, the summary)."""
    from tidyrl.models.sharding import distribution, sharding_kind

    return distribution(sharding_kind(accelerator), accelerator.num_processes)


def check_sharding(kind: str, cfg) -> None:
    """Raise ShardingError before any weights load when the launch's sharding (`kind`, from
    `models.sharding.sharding_kind`) cannot run `cfg`: DeepSpeed and FSDP1 never (`models.sharding.check_supported`);
    under FSDP2 nothing the configured engine refuses on a sharded policy (`engines.fsdp_problem`)."""
    from tidyrl.engines import fsdp_problem
    from tidyrl.models.sharding import ShardingError, check_supported

    check_supported(kind)
    if kind != "fsdp2":
        return
    problem = fsdp_problem(cfg)
    if problem:
        raise ShardingError(problem)


def prepare_output_dir(out: Path, overwrite: bool, accelerator) -> None:
    """Lock the folder for this run (tidyrl.run_lock; `tidyrl.train` releases it), then refuse a folder that
    holds a run unless `overwrite`; with it, remove that run's files. Locked first: a running run's files are
    neither judged nor deleted here."""
    from tidyrl.run_lock import hold_output_dir

    hold_output_dir(out, accelerator)
    held = [name for name in RUN_FILES if (out / name).exists()]
    held += sorted(p.name for p in out.glob("checkpoint-*")) + [d for d in ("best", "final") if (out / d).exists()]
    if held and not overwrite:
        raise RunDirError(
            f"output_dir {out} already holds a run ({', '.join(held)}). Choose another `output_dir`, "
            "or set `overwrite=true` to replace it."
        )
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        for name in held:
            path = out / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    accelerator.wait_for_everyone()


def write_run_header(cfg: Config, plan: Plan, out: Path, accelerator, extra: Optional[dict] = None,
                     resumed: bool = False) -> None:
    """config.yaml (resolved) and plan.json (with several processes `distribution`, how the model is spread over
    them: `distribution_of`; and `extra`: choices the run made, e.g. PPO's critic), written once by the main
    process. A one-process run's plan says world_size 1. A resumed run (`resumed`) writes plan.json again for its
    own processes, since a checkpoint resumes on any number of them (the world size, the per-process counts,
    `distribution` and the memory plan are then this run's; the totals are the same), keeping the extensions
    recorded (`extended`); config.yaml stays the one the run started with. Developer overrides of the kernels set in
    the environment are recorded as `kernel_overrides` (`kernel_overrides`)."""
    if accelerator.is_main_process:
        path, kept = out / "plan.json", {}
        if resumed:
            previous = json.loads(path.read_text()) if path.exists() else {}
            kept = {"extended": previous["extended"]} if "extended" in previous else {}
        else:
            save_config(cfg, out / "config.yaml")
        spread = {"distribution": distribution_of(accelerator)} if accelerator.num_processes > 1 else {}
        overridden = kernel_overrides(cfg)
        header = {**plan.to_dict(), **spread, **(extra or {}),
                  **({"kernel_overrides": overridden} if overridden else {}), **kept}
        path.write_text(json.dumps(header, indent=2) + "\n")


def build_optimizer(model, train_cfg):
    """AdamW; weight decay on matrices only, not on biases and norm weights (as transformers.Trainer)."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": train_cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    kwargs = dict(lr=train_cfg.learning_rate, betas=(train_cfg.adam_beta1, train_cfg.adam_beta2),
                  eps=train_cfg.adam_epsilon)
    # The fused kernel (CPU and CUDA) runs one pass over all parameters instead of a loop of small ops per
    # parameter: the same update, faster (docs/benchmarks.md, "Figures behind the code's choices"). Where it cannot
    # run (a device or dtype it lacks), torch's default implementation.
    try:
        return torch.optim.AdamW(groups, fused=True, **kwargs)
    except (RuntimeError, ValueError):
        return torch.optim.AdamW(groups, **kwargs)


def build_scheduler(optimizer, name: str, plan: Plan):
    """`transformers.get_scheduler` over the plan's total optimizer steps.

    Deliberately NOT passed to `accelerator.prepare`: accelerate would step it once per process per step
    (LLaMA-Factory #424). The loops step it themselves, exactly once per optimizer step, in every process.
    """
    from transformers import get_scheduler

    return get_scheduler(name, optimizer, num_warmup_steps=plan.warmup_steps,
                         num_training_steps=plan.total_optimizer_steps)


def weights_device(accelerator):
    """Where a stage loads the weights of its models: this process's accelerator, straight from the file
    (`models.loading.placed`: no host copy first); None (the host) on a CPU, and under FSDP, whose `prepare` shards
    each weight from the whole model on the host."""
    from tidyrl.models.sharding import sharding_kind

    device = accelerator.device
    return None if device.type == "cpu" or sharding_kind(accelerator) != "none" else device


def prepare_for_training(accelerator, model, train_cfg, plan: Plan, lr_scheduler: Optional[str] = None):
    """Gradient checkpointing (when asked), AdamW, the model's distribution, and the LR schedule over the plan's
    total optimizer steps (`lr_scheduler`, default train_cfg.lr_scheduler). Returns (model, optimizer,
    scheduler); the loop steps the scheduler itself, once per optimizer step.

    Under FSDP2 the model is sharded here (`models.sharding.shard`: FSDP2 itself, not accelerate's wrapping) and
    the optimizer built over the shards, so each process holds 1/W of the parameters, gradients and AdamW state;
    otherwise accelerate wraps model and optimizer (DDP with several processes)."""
    from tidyrl.models.sharding import offload_params, reshard_after_forward, shard, sharding_kind

    if train_cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if sharding_kind(accelerator) == "fsdp2":
        model = shard(model, accelerator.device.type, reshard_after_forward(), offload_params())
        optimizer = build_optimizer(model, train_cfg)
    else:
        optimizer = build_optimizer(model, train_cfg)
        model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, build_scheduler(optimizer, lr_scheduler or train_cfg.lr_scheduler, plan)


def save_pretrained_atomic(accelerator, model, tokenizer, target: Path, extra_models: Optional[dict] = None,
                           merged: bool = False) -> Path:
    """Save a standard Hugging Face folder (safetensors, config, generation config, tokenizer), written
    beside the target and renamed into place, so a crash never leaves a folder that looks complete.
    `extra_models` (name -> model, e.g. PPO's critic) go into subfolders, each loadable on its own.
    A LoRA model saves its adapter (a peft folder); with `merged`, also `merged/`, the base weights with the
    adapter folded in (this merges the model in place: call it once training is over)."""
    from tidyrl.models.lora import save_merged, unwrap_peft
    from tidyrl.models.sharding import full_state_dict

    accelerator.wait_for_everyone()
    # Sharded (FSDP) weights are gathered in full first: a collective, so every process takes part.
    state = full_state_dict(accelerator, model)
    extra_states = {name: full_state_dict(accelerator, extra) for name, extra in (extra_models or {}).items()}
    model = accelerator.unwrap_model(model)
    if accelerator.is_main_process:
        tmp = target.with_name(f".{target.name}.tmp")
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            model.save_pretrained(tmp, safe_serialization=True, state_dict=state)
            tokenizer.save_pretrained(tmp)
            if merged and unwrap_peft(model) is not None:
                save_merged(model, tmp / "merged", tokenizer)
            for name, extra in (extra_models or {}).items():
                accelerator.unwrap_model(extra).save_pretrained(tmp / name, safe_serialization=True,
                                                                state_dict=extra_states[name])
                tokenizer.save_pretrained(tmp / name)
            if target.exists():
                shutil.rmtree(target)
            tmp.rename(target)
        except OSError as err:  # a full disk, a quota, permissions: say so, leave nothing half-written
            import errno

            from tidyrl.checkpoint import CheckpointError, last_good_checkpoint

            shutil.rmtree(tmp, ignore_errors=True)
            why = "the disk is full" if err.errno == errno.ENOSPC else f"{type(err).__name__}: {err}"
            raise CheckpointError(
                f"could not save {target} ({why}); nothing partial was left behind, and metrics.jsonl is kept; "
                f"{last_good_checkpoint(target.parent)}. Free space or fix the cause, then run again."
            ) from err
    accelerator.wait_for_everyone()
    return target

"""What every training loop shares: the accelerator, the output folder, loading, the optimizer and
LR schedule, and saving a Hugging Face folder. Each loop stays explicit; these are its parts."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tidyrl.config import Config, save_config
from tidyrl.plan import Plan

RUN_FILES = ("config.yaml", "plan.json", "metrics.jsonl", "samples.jsonl", "best.json")
"""Files whose presence means a folder already holds a run."""


class RunDirError(RuntimeError):
    """The output directory cannot be used as asked."""


class ModelLoadError(RuntimeError):
    """A model or tokenizer path does not load; the message names the config key."""


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


def make_accelerator(cfg: Optional[Config] = None, **kwargs):
    """The one Accelerator of a run. Under torchrun / accelerate launch on a machine without CUDA,
    accelerate only forms a (gloo) process group when asked for CPU explicitly; without this, each
    process would silently train alone and all would write the same output_dir. On CUDA, more processes per
    machine than GPUs are refused first (`check_processes_fit_devices`). With `cfg`, a sharding
    mode the launch asks for and tidyrl cannot run `cfg` under is refused here (tidyrl.sharding)."""
    import torch
    from accelerate import Accelerator

    from tidyrl.sharding import check_supported, sharding_kind

    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    on_cpu = not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    if launched and not on_cpu:
        check_processes_fit_devices(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count())
    accelerator = Accelerator(cpu=launched and on_cpu, **kwargs)
    if launched and accelerator.num_processes == 1:
        raise RuntimeError(
            f"launched with WORLD_SIZE={os.environ['WORLD_SIZE']} but accelerate formed no process group; "
            "check the launcher's environment (MASTER_ADDR, MASTER_PORT, RANK)."
        )
    if cfg is not None:
        check_supported(sharding_kind(accelerator), cfg)
    return accelerator


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


def write_run_header(cfg: Config, plan: Plan, out: Path, accelerator, extra: Optional[dict] = None) -> None:
    """config.yaml (resolved) and plan.json (with `extra`: choices the run made, e.g. PPO's critic), written
    once by the main process."""
    if accelerator.is_main_process:
        save_config(cfg, out / "config.yaml")
        (out / "plan.json").write_text(json.dumps({**plan.to_dict(), **(extra or {})}, indent=2) + "\n")


def torch_dtype(name: str):
    import torch

    return "auto" if name == "auto" else getattr(torch, name)


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
"""What a Hugging Face hub id looks like: `name` or `owner/name`."""


@functools.lru_cache(maxsize=None)
def hub_reachable() -> bool:
    """Whether the Hugging Face hub (HF_ENDPOINT) accepts a connection: asked once per process, 3 s at most.
    Offline (HF_HUB_OFFLINE) counts as unreachable. Without this, a missing id costs ~25 s of hub retries."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout=3).close()
    except OSError:
        return False
    return True


def check_model_source(path: str, key: str) -> None:
    """Fail at once, before any download or retry, when `path` names neither a folder nor a hub id this machine
    can read: a path that does not exist, a string that is no hub id, or an id that is not in the local hub
    cache while the hub cannot be reached (offline). A reachable hub answers for the rest itself (quickly)."""
    if os.path.exists(os.path.expanduser(path)):
        return
    where = f"no folder {path!r} (relative to {os.getcwd()})"
    if not _HUB_ID.fullmatch(path) or path.startswith("."):
        raise ModelLoadError(f"{key}={path!r}: no such folder or hub id ({where}, and it is not a hub id). "
                             "Check the spelling, or give the path of a Hugging Face model folder.")
    from huggingface_hub import constants, try_to_load_from_cache

    if any(isinstance(try_to_load_from_cache(path, name), str) for name in ("config.json", "tokenizer_config.json")):
        return  # in the local hub cache
    if not hub_reachable():
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"{constants.ENDPOINT} cannot be reached"
        raise ModelLoadError(
            f"{key}={path!r}: no such folder or hub id ({where}; as a hub id it is not in the local cache "
            f"{constants.HF_HUB_CACHE}, and {why}). Check the spelling, give the path of a model folder, or "
            "download the model on a machine with access to the hub first."
        )


def load_tokenizer(path: str, key: str = "tokenizer"):
    """`AutoTokenizer.from_pretrained(path)`, with an error that names the config key."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    check_model_source(path, key)
    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ModelLoadError(
            f"{key}={path!r}: no tokenizer loads from it ({type(err).__name__}: {str(err).splitlines()[0]}). "
            "Point `tokenizer` (or `model`, when tokenizer is null) at a folder with tokenizer files or a hub id."
        ) from None


def load_model_config(path: str, key: str = "model"):
    """The model's config (no weights): checks early that `model` names a local folder or a hub id. For a LoRA
    adapter folder (a LoRA run's final/ or checkpoint-N/), its base model's config."""
    from transformers import AutoConfig

    from tidyrl.lora import adapter_base, is_adapter_folder

    if is_adapter_folder(path):
        return load_model_config(adapter_base(path), key)
    check_model_source(path, key)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        where = "a local folder" if os.path.exists(path) else \
            f"not a folder (no such path relative to {os.getcwd()}) and not a hub id this machine can reach"
        raise ModelLoadError(
            f"{key}={path!r} cannot be loaded: it is {where}. Set `{key}` to a Hugging Face model folder "
            f"(with config.json) or a hub id. ({type(err).__name__}: {str(err).splitlines()[0]})"
        ) from None


def without_dropout(model_config):
    """Every `*dropout*` float of a model config set to 0: RL ratios, KL and reference log-probs compare
    forward passes, which must agree."""
    for name, value in vars(model_config).items():
        if "dropout" in name and isinstance(value, float):
            setattr(model_config, name, 0.0)
    return model_config


def load_causal_lm(path: str, dtype: str = "float32", dropout: bool = False):
    """`AutoModelForCausalLM.from_pretrained(path)`, dropout off unless asked for. A LoRA adapter folder loads
    as its base model with the adapter folded in (a plain model)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from tidyrl.lora import is_adapter_folder, merged_from_adapter

    if is_adapter_folder(path):
        return merged_from_adapter(path, lambda base: load_causal_lm(base, dtype, dropout))
    hf_logging.disable_progress_bar()
    model_config = AutoConfig.from_pretrained(path)
    if not dropout:
        without_dropout(model_config)
    return in_own_memory(AutoModelForCausalLM.from_pretrained(path, config=model_config, dtype=torch_dtype(dtype)))


def load_policy(cfg: Config, resume_path: Optional[Path] = None):
    """The model a stage trains: the policy in full, or with a LoRA adapter when `lora.enabled` (a fresh one,
    or the checkpoint's when resuming; the base weights then come from `model` as at the start)."""
    if not cfg.lora.enabled:
        return load_causal_lm(str(resume_path or cfg.model), cfg.model_dtype)
    from tidyrl.lora import apply_lora, load_adapter

    base = load_causal_lm(cfg.model, cfg.model_dtype)
    return load_adapter(base, resume_path, trainable=True) if resume_path else apply_lora(base, cfg.lora, cfg.model)


def load_critic(path: str, dtype: str = "float32"):
    """PPO's value model: `AutoModelForTokenClassification` with one label (a value per position), from a
    causal LM (new value head) or a reward model (its score head carries over). Dropout off, including the
    classifier dropout that transformers otherwise defaults to 0.1."""
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    config = without_dropout(AutoConfig.from_pretrained(path))
    config.classifier_dropout = 0.0
    config.num_labels = 1
    return in_own_memory(AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch_dtype(dtype)))


def in_own_memory(model):
    """`model` with every CPU parameter and buffer that `from_pretrained` left inside the memory-mapped
    safetensors file moved to memory of its own (torch's allocator aligns it to 64 bytes).

    Why: a tensor mapped from a file sits where the file's header puts it (8-byte aligned, seen at 48 mod 64),
    and on some CPUs a matmul's last bits depend on its operands' alignment (seen on an AMD EPYC with torch
    2.13's CPU kernels; not on an Intel Xeon). The same weights loaded from two files, the start model and a
    checkpoint, then round differently, and an exact resume is not exact (tests/test_ppo.py caught it). It also
    makes the run independent of the file once loaded. Tied weights stay tied (one Parameter, its data
    replaced in place)."""
    import itertools

    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.device.type == "cpu" and tensor.data_ptr() % 64:
            tensor.data = tensor.data.clone()
    return model


def activation_checkpointing_on(model) -> bool:
    """Whether `model` (a transformers model) recomputes activations in backward (gradient checkpointing)."""
    on = getattr(model, "is_activation_checkpointing", None)  # transformers 5's name
    return bool(on if on is not None else getattr(model, "is_gradient_checkpointing", False))


def enable_gradient_checkpointing(model) -> None:
    # Non-reentrant checkpoints (torch's recommendation, transformers 5's default): transformers 4 defaulted to
    # reentrant ones, whose recomputed segments have no grad path when the embeddings are frozen (LoRA) and
    # fail with "element 0 of tensors does not require grad". transformers 5 renamed the method.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


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
    # parameter: the same update, ~5x faster on CPU. Where it cannot run (a device or dtype it lacks), torch's
    # default implementation.
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


def prepare_for_training(accelerator, model, train_cfg, plan: Plan, lr_scheduler: Optional[str] = None):
    """Gradient checkpointing (when asked), AdamW, accelerate's wrapping of both, and the LR schedule over the
    plan's total optimizer steps (`lr_scheduler`, default train_cfg.lr_scheduler). Returns (model, optimizer,
    scheduler); the loop steps the scheduler itself, once per optimizer step."""
    if train_cfg.gradient_checkpointing:
        enable_gradient_checkpointing(model)
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
    from tidyrl.lora import save_merged, unwrap_peft
    from tidyrl.sharding import full_state_dict

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

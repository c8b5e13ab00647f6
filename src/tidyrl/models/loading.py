"""Loading models and tokenizers from a folder or hub id, with errors that name the config key, and the
few facts about a loaded model that training and generation both need (its dtype, gradient checkpointing). Every
model loaded here carries the run's choice of kernels (`kernels=`, the config's `kernels` section: `models.kernels`),
which its fast parts read from it."""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path
from typing import Optional



class ModelLoadError(RuntimeError):
    """A model or tokenizer path does not load; the message names the config key."""


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
    cache while the hub cannot be reached (offline), or a GGUF file (converted once instead: `models.gguf`
    says why). A reachable hub answers for the rest itself (quickly)."""
    if os.path.isfile(os.path.expanduser(path)) and str(path).lower().endswith(".gguf"):
        raise ModelLoadError(
            f"{key}={path!r} is a GGUF file; {key} takes a Hugging Face model folder or hub id. Convert the file "
            "once (pip install gguf): python -c \"from tidyrl.models.gguf import convert_gguf; "
            f"convert_gguf({str(path)!r}, 'models/converted')\", then set {key}=models/converted.")
    if os.path.exists(os.path.expanduser(path)):
        return
    where = f"no folder {path!r} in the current directory {os.getcwd()} or beside the config file"
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
    from tidyrl.models.lora import adapter_base, is_adapter_folder

    if is_adapter_folder(path):
        return load_model_config(adapter_base(path), key)
    check_model_source(path, key)  # before transformers is imported: a wrong path is answered at once
    from transformers import AutoConfig

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


OWN_LAYERS = {"use_kernels": False}
"""What every model tidyrl loads is loaded with: the model's own layers. transformers 5.25 swaps layers for the
Hugging Face hub's kernels (`kernels`, a dependency of it) by default, fetched at load time: another computation
than the one tidyrl's fast paths are proven equal to, a download at run time, and a re-kernelization at every
`train()`/`eval()` (which fails on the meta device). `kernels:` (tidyrl's own) chooses tidyrl's kernels."""


def load_causal_lm(path: str, dtype: str = "float32", dropout: bool = False, device=None, kernels=None):
    """`AutoModelForCausalLM.from_pretrained(path)`, dropout off unless asked for, placed on `device` (`placed`),
    carrying the choice `kernels` (`models.kernels.attach`; None: the defaults). A LoRA adapter folder loads as its
    base model with the adapter folded in (a plain model)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from tidyrl.models.kernels import attach
    from tidyrl.models.lora import is_adapter_folder, merged_from_adapter

    if is_adapter_folder(path):
        merged = merged_from_adapter(path, lambda base: load_causal_lm(base, dtype, dropout))
        return attach(placed(merged, device), kernels)
    hf_logging.disable_progress_bar()
    model_config = AutoConfig.from_pretrained(path)
    if not dropout:
        without_dropout(model_config)
    model = AutoModelForCausalLM.from_pretrained(path, config=model_config, dtype=torch_dtype(dtype), **OWN_LAYERS)
    return attach(placed(model, device), kernels)


def load_policy(model: str, dtype: str, lora=None, resume_path: Optional[Path] = None, device=None, kernels=None):
    """The model a stage trains: the policy in full, or with a LoRA adapter when `lora` (the options of
    `models.lora.apply_lora`) is given: a fresh one, or the checkpoint's when resuming (the base weights then
    come from `model` as at the start). The full policy is placed on `device` (`placed`); a LoRA one stays on
    the host until prepared, so that its adapter is initialised on the host, from the host's random generator, as
    in a CPU run. It carries the choice `kernels` (`load_causal_lm`), under the adapter too."""
    if lora is None:
        return load_causal_lm(str(resume_path or model), dtype, device=device, kernels=kernels)
    from tidyrl.models.lora import apply_lora, load_adapter

    base = load_causal_lm(model, dtype, kernels=kernels)
    return load_adapter(base, resume_path, trainable=True) if resume_path else apply_lora(base, lora, model)


def load_critic(path: str, dtype: str = "float32", device=None, kernels=None):
    """PPO's value model: `AutoModelForTokenClassification` with one label (a value per position), from a
    causal LM (new value head, initialised on the host) or a reward model (its score head carries over). Dropout off,
    including the classifier dropout that transformers otherwise defaults to 0.1. Placed on `device` (`placed`),
    carrying the choice `kernels` (`load_causal_lm`)."""
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    from tidyrl.models.kernels import attach

    hf_logging.disable_progress_bar()
    config = without_dropout(AutoConfig.from_pretrained(path))
    config.classifier_dropout = 0.0
    config.num_labels = 1
    model = AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=torch_dtype(dtype),
                                                            **OWN_LAYERS)
    return attach(placed(model, device), kernels)


def placed(model, device=None):
    """`model`, loaded on the host (by `from_pretrained`: its tensors still inside the file's memory mapping), where
    it will run. On the host (`device` None, or a name or torch.device of the CPU): `in_own_memory`. On an
    accelerator: moved there straight from the mapping, with no host copy of its own. Why: a host copy first would
    hold two of the model on the host at once (the mapped file's pages it reads and the copy), beside the models
    loaded before it: a policy and its reference would peak at three models' size (`python
    benchmarks/bench_loading.py --device cuda`, its `copy-then-move` way against `placed`; docs/benchmarks.md, "NVIDIA
    H100", has a run's peak with that copy). A tensor's address matters to a host matmul's
    rounding only, not on a device."""
    import torch

    return in_own_memory(model) if device is None or torch.device(device).type == "cpu" else model.to(device)


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

"""LoRA adapters through `peft` (Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models").

Each adapted linear layer computes W x + (alpha / r) B A x with W frozen and only A (r x in) and B (out x r)
trained (eq. 3 of the paper; B starts at zero, so the adapted model starts equal to the base one).

What this buys in tidyrl:
- the optimizer holds state for A and B only;
- the reference model of the KL penalty (RL) and of DPO is the *same* weights with the adapter disabled
  (`reference_of`): no second copy of the model is loaded or held;
- `final/` is a standard peft adapter folder (adapter_config.json, adapter_model.safetensors, the tokenizer)
  that `PeftModel.from_pretrained` loads, and that `AutoModelForCausalLM.from_pretrained` loads too when peft
  is installed; `lora.save_merged: true` also writes `final/merged/`, the base weights with the adapter
  folded in, a plain model folder for tools that know nothing of adapters.

peft is an optional dependency (`pip install tidyrl[lora]`), imported only when a run uses LoRA or loads an
adapter folder.
"""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

ADAPTER_CONFIG = "adapter_config.json"


def is_adapter_folder(path) -> bool:
    """True for a local peft adapter folder (e.g. a LoRA run's final/ or checkpoint-N/)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def adapter_folder_problem(path, key: str, what: str) -> Optional[str]:
    """The error message when `path` (config key `key`) is an adapter folder but `what` needs full weights
    (a critic, a reward model); None when it is not an adapter folder."""
    if not is_adapter_folder(path):
        return None
    return (f"{key}={path!r} is a LoRA adapter folder, but {what} starts from full weights. Point {key} at the "
            "merged model instead: the earlier run's final/merged/ (written with lora.save_merged: true).")


def adapter_base(path) -> str:
    """The base model an adapter folder was trained on (its adapter_config.json's base_model_name_or_path)."""
    base = json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{path}/{ADAPTER_CONFIG} names no base_model_name_or_path; cannot load the adapter")
    return base


class MissingPeftError(ImportError):
    """LoRA was asked for but peft is not installed."""


def _peft():
    try:
        import peft
    except ImportError:
        raise MissingPeftError(
            "LoRA needs peft: pip install 'tidyrl[lora]' (or pip install peft). It is used for `lora.enabled: "
            "true` and for loading adapter folders."
        ) from None
    return peft


def require_peft() -> None:
    """Fail before any expensive work when LoRA is asked for and peft is missing."""
    _peft()


def require_target_parameters() -> None:
    """Fail before any expensive work where lora.target_parameters is set and the installed peft has none."""
    import dataclasses

    peft = _peft()
    if "target_parameters" not in {f.name for f in dataclasses.fields(peft.LoraConfig)}:
        raise MissingPeftError(f"lora.target_parameters needs peft >= 0.17 (installed: {peft.__version__}): "
                               "pip install -U peft")


def apply_lora(model, lora_cfg, base_path: str, task: str = "causal_lm"):
    """Wrap `model` in a fresh, trainable LoRA adapter (peft.get_peft_model). `task` is causal_lm or
    sequence_classification (the reward model: its new score head is trained in full, as peft's
    modules_to_save). `base_path` is recorded in the adapter config, absolute when local, so the adapter
    loads from anywhere."""
    peft = _peft()
    extra = {}
    if getattr(lora_cfg, "target_parameters", None):
        require_target_parameters()
        extra["target_parameters"] = list(lora_cfg.target_parameters)
    config = peft.LoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=lora_cfg.target_modules or "all-linear",
        bias="none",
        task_type="SEQ_CLS" if task == "sequence_classification" else "CAUSAL_LM",
        **extra,
    )
    wrapped = peft.get_peft_model(model, config)
    wrapped.peft_config["default"].base_model_name_or_path = _portable(base_path)
    return wrapped


def load_adapter(model, adapter_dir, trainable: bool):
    """`model` (the base) with the adapter saved in `adapter_dir`; `trainable` for resuming a run."""
    peft = _peft()
    return peft.PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=trainable)


def _portable(path: str) -> str:
    return os.path.abspath(path) if os.path.exists(path) else path


def unwrap_peft(model):
    """The peft model under accelerate's wrappers, or None when the model carries no adapter."""
    try:
        from peft import PeftModel
    except ImportError:
        return None
    return model if isinstance(model, PeftModel) else None


@contextmanager
def reference_of(policy, ref_model=None):
    """The reference model to score with: `ref_model` when one was loaded, else the policy itself with its
    LoRA adapter disabled (the base weights, which are frozen: exactly the starting model)."""
    if ref_model is not None:
        yield ref_model
        return
    with policy.disable_adapter():
        yield policy


def save_merged(peft_model, target: Path, tokenizer) -> Path:
    """The base weights with the adapter folded in (W + (alpha / r) B A), saved as a plain model folder.
    Merges in place: call it last, once training is over."""
    merged = peft_model.merge_and_unload()
    merged.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    return target


def save_adapter_only(peft_model, folder) -> int:
    """Write the active adapter alone into `folder` (adapter_model.safetensors and adapter_config.json, as
    `PeftModel.from_pretrained` and vLLM's LoRA loading read them; never the embeddings); returns the bytes of its
    weights. What an engine that holds the base weights receives at each sync."""
    folder = Path(folder)
    peft_model.save_pretrained(str(folder), safe_serialization=True, save_embedding_layers=False)
    return (folder / "adapter_model.safetensors").stat().st_size


def merged_from_adapter(adapter_dir, load_base):
    """A plain model from an adapter folder: `load_base(base path)` loads the base, the adapter is folded in.
    Used when `model:` (or `tidyrl eval`) points at a LoRA run's final/ or checkpoint-N/."""
    base = load_base(adapter_base(adapter_dir))
    return load_adapter(base, adapter_dir, trainable=False).merge_and_unload()


def trainable_parameters(model) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trainable, sum(p.numel() for p in model.parameters())


def adapter_note(model) -> Optional[str]:
    """One line for the run's start: how much of the model LoRA trains."""
    if unwrap_peft(model) is None:
        return None
    trainable, total = trainable_parameters(model)
    return f"LoRA: training {trainable:,} of {total:,} parameters ({100 * trainable / total:.2f} %)"

"""Checkpoints that resume exactly (DESIGN §5).

A checkpoint is `output_dir/checkpoint-<step>/`: a standard Hugging Face model
folder (`from_pretrained` loads it as is) plus `trainer_state/`:

    state.json     counters (step, rollout), elapsed time, the config it was saved with
    optimizer.pt   the optimizer's state_dict          scheduler.pt  the LR scheduler's
    shards/        instead of optimizer.pt (and critic_optimizer.pt) in an FSDP2-sharded run's: the optimizer
                   states, each process's shards, written with torch.distributed.checkpoint (SHARDS_DIR)
    rng.pt         python, numpy and torch RNG states
    rollout.pt     the unfinished rollout, when the save fell inside one
    ahead.pt       the rollouts made ahead (rollout.lag), each process's share
    critic_optimizer.pt, critic_scheduler.pt   PPO: the value model's (its weights: critic/, a model folder)

Sampling, the prompt order and the mini-batch shuffles are keyed by (seed,
rollout, ...) rather than drawn from a running RNG, so these files are all the
state there is: a resumed run replays the remaining steps bit for bit.

Written atomically: everything goes into a hidden `.checkpoint-<step>.tmp/`
folder that is flushed to disk (fsync) and renamed into place only when
complete, so a crash, a power cut or a full disk mid-save leaves the earlier
checkpoints as they were and no folder that looks complete but is not. In a
sharded run every process writes its shards into that folder and the first
process renames it once all have.

Read as data only: the trainer state loads with `torch.load(weights_only=True)`
(tensors and plain Python values; unpickling anything else could run code), and
a damaged file is reported by name with the checkpoints to fall back on.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any, Optional

STATE_DIR = "trainer_state"

RESUMABLE_CHANGES = {
    "resume_from", "overwrite", "output_dir", "extend",
    "rollout.generation_batch_size", "rollout.forward_batch_size",
    "train.micro_batch_size", "train.gradient_checkpointing", "train.sync_each_microbatch",
    "train.group_by_length", "train.padding_free", "train.watchdog_s", "train.memory_budget", "train.memory_probe",
    "log.progress_bar", "log.save_every", "log.keep_last", "lora.save_merged",
    "environment.max_error_fraction",
    "server.urls", "server.timeout_s", "server.retries", "server.sync_dir", "server.sync_timeout_s",
}
"""Config keys that may differ on resume: memory knobs, saving cadence, the environment's failure threshold and
where the generation servers are (their replicas sample each request by its key) change speed, memory or when a
failing run stops, never the maths. Any other difference (sizes, learning rate, algorithm, data, rewards, ...) is refused."""


EXTENDABLE = {"train.rollouts", "train.dataset_epochs", "train.max_steps"}
"""The length of a run: with `extend: true` a resume may change it (longer only; loops.run.steps.continue_longer)."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or resumed from; the message says what to do."""


def complete_checkpoints(output_dir: Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint in `output_dir`, oldest first. In-progress
    `.checkpoint-*.tmp` folders are hidden and never count."""
    found = []
    for path in Path(output_dir).glob("checkpoint-*"):
        suffix = path.name.removeprefix("checkpoint-")
        if suffix.isdigit() and (path / STATE_DIR / "state.json").is_file():
            found.append((int(suffix), path))
    return sorted(found)


def find_checkpoint(output_dir: Path, resume_from: str) -> Path:
    """The checkpoint `resume_from` names: `latest` or a path."""
    if resume_from == "latest":
        found = complete_checkpoints(output_dir)
        if not found:
            raise CheckpointError(
                f"resume_from=latest, but {output_dir} holds no complete checkpoint-N folder. Set "
                "log.save_every > 0 to write checkpoints, or start afresh with resume_from=null."
            )
        return found[-1][1]
    path = Path(resume_from)
    if not (path / STATE_DIR / "state.json").is_file():
        raise CheckpointError(
            f"resume_from={resume_from}: not a complete tidyrl checkpoint (no {STATE_DIR}/state.json in it). "
            f"Use `latest` or one of: {', '.join(str(p) for _, p in complete_checkpoints(output_dir)) or 'none'}."
        )
    return path


def last_good_checkpoint(output_dir: Path) -> str:
    """Where a stopped run can resume from, in words: for error messages."""
    saved = complete_checkpoints(output_dir)
    if saved:
        return f"the last good checkpoint is {saved[-1][1]} (resume_from=latest)"
    return "no checkpoint was saved, so the run must start again (set log.save_every to keep some)"


def refused_changes(saved: dict, current: dict, prefix: str = "", allowed=frozenset()) -> list[str]:
    """The dotted keys whose values differ between two config dicts and are neither in RESUMABLE_CHANGES nor in
    `allowed`."""
    changes = []
    for key in sorted(set(saved) | set(current)):
        dotted = prefix + key
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += refused_changes(a, b, dotted + ".", allowed)
        elif a != b and dotted not in RESUMABLE_CHANGES and dotted not in allowed:
            changes.append(f"{dotted}: {a!r} -> {b!r}")
    return changes


def rng_state() -> dict:
    """Python, NumPy and torch RNG states, as plain values and tensors only (what a weights_only load reads)."""
    import numpy as np
    import torch

    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": random.getstate(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
            "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])


def save_checkpoint(output_dir: Path, step: int, *, model, tokenizer, optimizer, scheduler, state: dict,
                    rollout: Optional[dict], keep_last: int, critic: Optional[tuple] = None,
                    ahead: Optional[dict] = None) -> Path:
    """Write checkpoint-<step> atomically, then keep only the newest `keep_last` checkpoints. A failure leaves no
    checkpoint-<step> and removes the partial folder. `critic` = (model, optimizer, scheduler) of PPO's value
    model: saved as `critic/`, a model folder of its own.

    A model that is not sharded: call it on the main process only. An FSDP2-sharded one (`model` and the critic
    being FSDP modules): call it on every process (`_save_sharded`: each writes its shards of the optimizer
    states)."""
    if _is_sharded(model):
        return _save_sharded(output_dir, step, model=model, tokenizer=tokenizer, optimizer=optimizer,
                             scheduler=scheduler, state=state, rollout=rollout, keep_last=keep_last, critic=critic,
                             ahead=ahead)
    tmp = Path(output_dir) / f".checkpoint-{step}.tmp"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        _write_files(tmp, model=model, tokenizer=tokenizer, optimizer=optimizer, scheduler=scheduler, state=state,
                     rollout=rollout, critic=critic, ahead=ahead)
        return _publish(output_dir, step, tmp, keep_last)
    except OSError as err:
        raise _save_failed(output_dir, step, tmp, err) from err


def _write_files(tmp: Path, *, model, tokenizer, optimizer, scheduler, state: dict, rollout, critic, ahead,
                 model_state: Optional[dict] = None, critic_state: Optional[dict] = None) -> None:
    """Everything of a checkpoint into `tmp`, state.json last. `optimizer` None: the optimizer states are already
    there as shards (`_save_sharded`), and the weights come from the full state dicts `model_state`/`critic_state`."""
    import torch

    model.save_pretrained(tmp, safe_serialization=True, state_dict=model_state)
    tokenizer.save_pretrained(tmp)
    trainer = tmp / STATE_DIR
    trainer.mkdir(exist_ok=True)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), trainer / "optimizer.pt")
    torch.save(scheduler.state_dict(), trainer / "scheduler.pt")
    torch.save(rng_state(), trainer / "rng.pt")
    if rollout is not None:
        torch.save(rollout, trainer / "rollout.pt")
    if ahead:
        torch.save(ahead, trainer / "ahead.pt")
    if critic is not None:
        critic_model, critic_optimizer, critic_scheduler = critic
        critic_model.save_pretrained(tmp / "critic", safe_serialization=True, state_dict=critic_state)
        tokenizer.save_pretrained(tmp / "critic")
        if optimizer is not None:
            torch.save(critic_optimizer.state_dict(), trainer / "critic_optimizer.pt")
        torch.save(critic_scheduler.state_dict(), trainer / "critic_scheduler.pt")
    # state.json last: its presence is what marks the folder complete (with the rename).
    (trainer / "state.json").write_text(json.dumps(state, indent=2) + "\n")


def _publish(output_dir: Path, step: int, tmp: Path, keep_last: int) -> Path:
    """fsync `tmp`, rename it checkpoint-<step>, fsync the folder, drop the checkpoints beyond `keep_last`."""
    target = Path(output_dir) / f"checkpoint-{step}"
    _sync_to_disk(tmp)
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)
    with contextlib.suppress(OSError):  # the rename itself (some file systems cannot fsync a folder)
        _sync_to_disk(Path(output_dir), recursive=False)
    for _, old in complete_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def _save_failed(output_dir: Path, step: int, tmp: Path, err: BaseException) -> CheckpointError:
    """The partial folder removed, and the error that says so and what is intact."""
    shutil.rmtree(tmp, ignore_errors=True)
    kept = [p.name for _, p in complete_checkpoints(output_dir)]
    why = ("the disk is full" if getattr(err, "errno", None) == errno.ENOSPC
           else f"{type(err).__name__}: {_first_line(err)}")
    return CheckpointError(
        f"could not save checkpoint-{step} ({why}); nothing partial was left behind and the earlier "
        f"checkpoints are intact ({', '.join(kept) or 'none'}). Free space or fix the cause, then resume "
        "with resume_from=latest."
    )


SHARDS_DIR = "shards"
"""Under trainer_state/ of a sharded run's checkpoint: the optimizer states (`optimizer`, PPO's `critic_optimizer`)
as torch.distributed.checkpoint wrote them, each process its shards (`__<rank>_0.distcp`) and the first process the
index (`.metadata`). Keyed by parameter name, so that any number of processes reads them back (`restore_optimizer`)."""


def _is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _save_sharded(output_dir: Path, step: int, *, model, tokenizer, optimizer, scheduler, state: dict,
                  rollout: Optional[dict], keep_last: int, critic: Optional[tuple], ahead: Optional[dict]) -> Path:
    """checkpoint-<step> of an FSDP2-sharded run; every process calls it. The full weights are gathered to the
    first process (a collective) and written there as the model folder `from_pretrained` loads; the optimizer
    states are written by every process, its own shards, with torch.distributed.checkpoint into the same hidden
    folder (it needs one file system that every process sees); the first process then writes the rest and renames
    the folder into place, so the checkpoint is whole or absent, as an unsharded one. A failure in any process is
    raised in every process."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    is_main = dist.get_rank() == 0
    tmp = Path(output_dir) / f".checkpoint-{step}.tmp"
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on the first process only
    model_state = get_model_state_dict(model, options=full)
    parts = {"optimizer": (model, optimizer)}
    critic_state = None
    if critic is not None:
        critic_state = get_model_state_dict(critic[0], options=full)
        parts["critic_optimizer"] = (critic[0], critic[1])
    shards = {name: get_optimizer_state_dict(m, o) for name, (m, o) in parts.items()}

    def everywhere(error: Optional[BaseException]) -> None:
        """The first process's failure, raised in every process (a collective)."""
        text = [None if error is None else f"{type(error).__name__}: {_first_line(error)}"]
        dist.broadcast_object_list(text, src=0)
        if text[0] is not None:
            failure = error if error is not None else OSError(text[0])
            raise _save_failed(output_dir, step, tmp, failure) from error

    error = None
    if is_main:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            (tmp / STATE_DIR).mkdir(parents=True)
        except OSError as err:
            error = err
    everywhere(error)
    try:
        dcp.save(shards, checkpoint_id=tmp / STATE_DIR / SHARDS_DIR)  # fails in every process if it fails in one
    except Exception as err:  # DCP's CheckpointException carries each process's failure
        raise _save_failed(output_dir, step, tmp, err) from err
    error, target = None, Path(output_dir) / f"checkpoint-{step}"
    if is_main:
        try:
            _write_files(tmp, model=model, tokenizer=tokenizer, optimizer=None, scheduler=scheduler, state=state,
                         rollout=rollout, critic=critic, ahead=ahead, model_state=model_state,
                         critic_state=critic_state)
            _publish(output_dir, step, tmp, keep_last)
        except OSError as err:
            error = err
    everywhere(error)
    return target


def restore_optimizer(loaded: dict, name: str, model, optimizer) -> None:
    """Load the optimizer state `name` ('optimizer', 'critic_optimizer') of a checkpoint (`loaded`, from
    `load_trainer_state`) into `optimizer`, whatever the distribution of the run that saved it and of this one:
    saved sharded (DCP shards, keyed by parameter name), read by any number of processes, sharded or not; saved
    whole (optimizer.pt) into a sharded model, each process taking its shards of it; whole into whole as it is."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_optimizer_state_dict)

    if loaded.get("shards") is not None:
        import torch.distributed.checkpoint as dcp

        states = {name: get_optimizer_state_dict(model, optimizer)}  # the layout to read into (this run's)
        dcp.load(states, checkpoint_id=loaded["shards"])
        set_optimizer_state_dict(model, optimizer, states[name])
    elif _is_sharded(model):  # optimizer.pt: parameters by their index in the optimizer; named, then sharded
        names = {param: key for key, param in model.named_parameters()}
        order = [names[param] for group in optimizer.param_groups for param in group["params"]]
        whole = loaded[name]
        by_name = {"state": {order[i]: value for i, value in whole["state"].items()},
                   "param_groups": [{**group, "params": [order[i] for i in group["params"]]}
                                    for group in whole["param_groups"]]}
        set_optimizer_state_dict(model, optimizer, by_name, options=StateDictOptions(full_state_dict=True))
    else:
        optimizer.load_state_dict(loaded[name])


def _sync_to_disk(folder: Path, recursive: bool = True) -> None:
    """fsync every file under `folder` and the folders themselves. The rename that follows publishes the
    checkpoint; after a power cut it must not name files whose data never reached the disk (a kill alone
    loses nothing written: the kernel still holds it)."""
    paths = [*sorted(folder.rglob("*"), reverse=True), folder] if recursive else [folder]
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_trainer_state(path: Path) -> dict[str, Any]:
    """Everything but the weights: state.json, optimizer, scheduler, RNG and the unfinished rollout. Also opens
    the weight files' headers, so a damaged checkpoint is reported here, before any weights load."""
    trainer = Path(path) / STATE_DIR
    try:
        state = json.loads((trainer / "state.json").read_text())
    except (OSError, ValueError) as err:
        raise _damaged(trainer / "state.json", path, f"{type(err).__name__}: {err}") from None
    shards = trainer / SHARDS_DIR
    loaded = {"state": state, "rollout": None, "shards": None}
    if shards.exists():  # a sharded run's: the optimizer states are shards, read once the models are sharded
        if not (shards / ".metadata").is_file():
            raise _damaged(shards / ".metadata", path, "missing")
        loaded["shards"] = shards
    for name in ("optimizer", "scheduler", "rng", "rollout", "ahead", "critic_optimizer", "critic_scheduler"):
        required = name in ("scheduler", "rng") or (name == "optimizer" and loaded["shards"] is None)
        if required or (trainer / f"{name}.pt").exists():
            loaded[name] = _load_pt(trainer / f"{name}.pt", path)
    _check_weight_files(Path(path))
    return loaded


def _load_pt(file: Path, checkpoint: Path):
    """torch.load restricted to tensors and plain Python values (`weights_only=True`): unpickling anything else
    could run code, so a file that holds more is refused, never executed. tidyrl writes nothing else."""
    import pickle

    import torch

    try:
        return torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        text = str(err)
        if "GLOBAL" in text or "allowlist" in text:  # the restricted unpickler met something it does not build
            found = re.search(r"GLOBAL (\S+)", text)
            name = found.group(1) if found else "a Python object"
            raise CheckpointError(
                f"{file} holds more than tensors and plain values ({name}); tidyrl refuses to load it, since "
                "unpickling it could run arbitrary code; tidyrl's own checkpoints never hold such objects: this file "
                "was altered or comes from elsewhere. Resume from a checkpoint you trust "
                "(resume_from=path/to/checkpoint-N), or start afresh with resume_from=null."
            ) from None
        raise _damaged(file, checkpoint, f"{type(err).__name__}: {_first_line(err)}") from None
    except (OSError, RuntimeError, EOFError, ValueError) as err:  # truncated or not a torch file at all
        raise _damaged(file, checkpoint, f"{type(err).__name__}: {_first_line(err)}") from None


def _check_weight_files(checkpoint: Path) -> None:
    """Open the header of each safetensors file (cheap, no weights read): a truncated file fails here."""
    from safetensors import safe_open

    for file in sorted(checkpoint.rglob("*.safetensors")):
        try:
            with safe_open(file, framework="pt") as f:
                f.keys()
        except Exception as err:  # safetensors raises its own SafetensorError, or OSError
            raise _damaged(file, checkpoint, f"{type(err).__name__}: {_first_line(err)}") from None


def _damaged(file: Path, checkpoint: Path, why: str) -> CheckpointError:
    """The error for an unreadable file of `checkpoint`, naming the other checkpoints beside it."""
    checkpoint = Path(checkpoint)
    others = [p.name for _, p in complete_checkpoints(checkpoint.parent) if p.name != checkpoint.name]
    earlier = (f"resume from an earlier one instead (resume_from=path/to/{others[-1]}; complete ones here: "
               f"{', '.join(others)})" if others else "no other checkpoint is in that folder, so the run must start "
               "again (resume_from=null)")
    return CheckpointError(f"{file} is damaged or truncated ({why}); {checkpoint.name} cannot be resumed: {earlier}.")


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[0].strip() if lines else ""


def truncate_jsonl(path: Path, keep) -> None:
    """Keep only the rows for which keep(row) is true (rewritten atomically): the rows a resumed run is
    about to write again are dropped, so none is duplicated."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill mid-write
            continue
        if keep(row):
            kept.append(line)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)

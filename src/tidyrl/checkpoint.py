"""Checkpoints that resume exactly (DESIGN §5).

A checkpoint is `output_dir/checkpoint-<step>/`: a standard Hugging Face model
folder (`from_pretrained` loads it as is) plus `trainer_state/`:

    state.json     counters (step, rollout), elapsed time, the config it was saved with
    optimizer.pt   the optimizer's state_dict          scheduler.pt  the LR scheduler's
    rng.pt         python, numpy and torch RNG states
    rollout.pt     the unfinished rollout, when the save fell inside one
    critic_optimizer.pt, critic_scheduler.pt   PPO: the value model's (its weights: critic/, a model folder)

Sampling, the prompt order and the mini-batch shuffles are keyed by (seed,
rollout, ...) rather than drawn from a running RNG, so these files are all the
state there is: a resumed run replays the remaining steps bit for bit.

Written atomically: everything goes into a hidden `.checkpoint-<step>.tmp/`
folder that is renamed into place only when complete, so a crash or a full
disk mid-save leaves the earlier checkpoints as they were and no folder that
looks complete but is not.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Optional

STATE_DIR = "trainer_state"

RESUMABLE_CHANGES = {
    "resume_from", "overwrite", "output_dir",
    "rollout.generation_batch_size", "rollout.forward_batch_size",
    "train.micro_batch_size", "train.gradient_checkpointing", "train.sync_each_microbatch",
    "log.progress_bar", "log.save_every", "log.keep_last", "lora.save_merged",
}
"""Config keys that may differ on resume: memory knobs and saving cadence change speed and memory,
never the maths. Any other difference (sizes, learning rate, algorithm, data, rewards, ...) is refused."""


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


def refused_changes(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two config dicts and are not in RESUMABLE_CHANGES."""
    changes = []
    for key in sorted(set(saved) | set(current)):
        dotted = prefix + key
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += refused_changes(a, b, dotted + ".")
        elif a != b and dotted not in RESUMABLE_CHANGES:
            changes.append(f"{dotted}: {a!r} -> {b!r}")
    return changes


def rng_state() -> dict:
    import numpy as np
    import torch

    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


def save_checkpoint(output_dir: Path, step: int, *, model, tokenizer, optimizer, scheduler, state: dict,
                    rollout: Optional[dict], keep_last: int, critic: Optional[tuple] = None) -> Path:
    """Write checkpoint-<step> atomically (call on the main process only), then keep only the newest
    `keep_last` checkpoints. A failure leaves no checkpoint-<step> and removes the partial folder.
    `critic` = (model, optimizer, scheduler) of PPO's value model: saved as `critic/`, a model folder of its own."""
    import torch

    target = Path(output_dir) / f"checkpoint-{step}"
    tmp = Path(output_dir) / f".checkpoint-{step}.tmp"
    try:
        if tmp.exists():
            shutil.rmtree(tmp)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        trainer = tmp / STATE_DIR
        trainer.mkdir()
        torch.save(optimizer.state_dict(), trainer / "optimizer.pt")
        torch.save(scheduler.state_dict(), trainer / "scheduler.pt")
        torch.save(rng_state(), trainer / "rng.pt")
        if rollout is not None:
            torch.save(rollout, trainer / "rollout.pt")
        if critic is not None:
            critic_model, critic_optimizer, critic_scheduler = critic
            critic_model.save_pretrained(tmp / "critic", safe_serialization=True)
            tokenizer.save_pretrained(tmp / "critic")
            torch.save(critic_optimizer.state_dict(), trainer / "critic_optimizer.pt")
            torch.save(critic_scheduler.state_dict(), trainer / "critic_scheduler.pt")
        # state.json last: its presence is what marks the folder complete (with the rename).
        (trainer / "state.json").write_text(json.dumps(state, indent=2) + "\n")
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        kept = [p.name for _, p in complete_checkpoints(output_dir)]
        why = "the disk is full" if err.errno == errno.ENOSPC else f"{type(err).__name__}: {err}"
        raise CheckpointError(
            f"could not save checkpoint-{step} ({why}); nothing partial was left behind and the earlier "
            f"checkpoints are intact ({', '.join(kept) or 'none'}). Free space or fix the cause, then resume "
            "with resume_from=latest."
        ) from err
    for _, old in complete_checkpoints(output_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def load_trainer_state(path: Path) -> dict[str, Any]:
    """Everything but the weights: state.json, optimizer, scheduler, RNG and the unfinished rollout."""
    import torch

    trainer = Path(path) / STATE_DIR
    loaded = {
        "state": json.loads((trainer / "state.json").read_text()),
        "optimizer": torch.load(trainer / "optimizer.pt", weights_only=False),
        "scheduler": torch.load(trainer / "scheduler.pt", weights_only=False),
        "rng": torch.load(trainer / "rng.pt", weights_only=False),
        "rollout": None,
    }
    if (trainer / "rollout.pt").exists():
        loaded["rollout"] = torch.load(trainer / "rollout.pt", weights_only=False)
    for name in ("critic_optimizer", "critic_scheduler"):
        if (trainer / f"{name}.pt").exists():
            loaded[name] = torch.load(trainer / f"{name}.pt", weights_only=False)
    return loaded


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

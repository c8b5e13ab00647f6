"""`tidyrl demo`: the built-in end-to-end example, on CPU, in a couple of minutes.

It builds a character-level tokenizer and a tiny Llama locally (no downloads),
writes a prompt file and a YAML config, and trains with GRPO on a toy task:
answer a word with its own letters. The reward (`anagram_reward`: the letters
completion and word share, over the longer length) starts near chance, since
the model is random, and climbs as the policy learns to copy from its prompt.
"""

from __future__ import annotations

import json
import random
from collections import Counter
import string
from pathlib import Path

import yaml

WORDS = (
    "apple banana cherry grape lemon mango melon olive peach pear plum berry kiwi lime date fig guava "
    "papaya quince raisin tomato carrot potato onion garlic pepper radish turnip celery spinach kale"
).split()


def anagram_reward(prompts, completions, word, **_):
    """How much of the prompt's word the completion spells, in any order: the letters the two share
    (as multisets) over the longer of the two lengths. 1.0 for an exact anagram; repeating one
    common letter ("aaaa") earns little."""
    scores = []
    for text, w in zip(completions, word):
        text = text.strip()
        shared = sum((Counter(text) & Counter(w)).values())
        scores.append(shared / max(len(text), len(w)))
    return scores


def demo_config(folder: Path) -> dict:
    return {
        "algorithm": "grpo",
        "model": str(folder / "base-model"),
        "output_dir": str(folder / "run"),
        "seed": 0,
        "overwrite": True,
        "data": {"path": str(folder / "prompts.jsonl"), "prompt_column": "prompt"},
        "rewards": [{"function": "tidyrl.demo:anagram_reward", "weight": 1.0}],
        "rollout": {"prompts_per_rollout": 8, "samples_per_prompt": 8, "max_new_tokens": 10, "temperature": 1.0,
                    "generation_batch_size": 64, "forward_batch_size": 64},
        "train": {"rollouts": 200, "epochs_per_rollout": 1, "minibatches_per_epoch": 2, "micro_batch_size": 16,
                  "learning_rate": 6.0e-3, "lr_scheduler": "cosine", "warmup_steps": 4, "max_grad_norm": 1.0},
        "grpo": {"scale_rewards": "group", "loss_aggregation": "token_mean"},
        "log": {"log_every": 1, "samples_per_rollout": 2},
    }


def prepare_demo(folder: str | Path) -> Path:
    """Write the tiny model, the prompt set and demo.yaml into `folder`; return the YAML path."""
    from tidyrl.models.tiny import save_tiny_model

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_tiny_model(folder / "base-model", seed=0, hidden_size=64, num_layers=2, num_heads=4,
                    alphabet=string.ascii_lowercase + " :")
    rng = random.Random(0)
    with open(folder / "prompts.jsonl", "w") as f:
        for _ in range(256):
            word = rng.choice(WORDS)
            f.write(json.dumps({"prompt": f"{word}:", "word": word}) + "\n")
    path = folder / "demo.yaml"
    path.write_text(yaml.safe_dump(demo_config(folder), sort_keys=False))
    return path


def run_demo(folder: str | Path = "runs/demo", overrides: tuple[str, ...] = ()):
    """Prepare and run the demo; print the reward before and after and where the run was written."""
    from tidyrl.api import train

    config_path = prepare_demo(folder)
    print(f"tidyrl demo: the tiny model, prompts and config are in {Path(folder)}/ (config: {config_path.name})")
    result = train(config_path, overrides)
    # The run's own summary (above) has the reward at the start and the end and where everything is; the demo
    # adds only what a summary cannot show: a completion from the first rollout and one from the last.
    samples = [json.loads(line) for line in (result.output_dir / "samples.jsonl").read_text().splitlines()]
    first, last = samples[0], samples[-1]
    print(f"  examples: rollout {first['rollout']} {first['prompt']!r} -> {first['completion']!r}   |   "
          f"rollout {last['rollout']} {last['prompt']!r} -> {last['completion']!r}")
    return result

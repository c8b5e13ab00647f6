"""`tidyrl demo`: the built-in end-to-end example, on CPU, in a couple of minutes.

It builds a character-level tokenizer and a tiny Llama locally (no downloads),
writes a prompt file and a YAML config, and trains with GRPO on a toy task:
answer a word with letters taken from that word. The reward (the fraction of
completion characters that occur in the prompt's word) starts near chance and
climbs as the policy learns to copy from its prompt.
"""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import yaml

WORDS = (
    "apple banana cherry grape lemon mango melon olive peach pear plum berry kiwi lime date fig guava "
    "papaya quince raisin tomato carrot potato onion garlic pepper radish turnip celery spinach kale"
).split()


def letters_reward(prompts, completions, word, **_):
    """Fraction of completion characters that occur in the prompt's word (0 for an empty completion)."""
    scores = []
    for text, w in zip(completions, word):
        text = text.strip()
        scores.append(sum(ch in w for ch in text) / len(text) if text else 0.0)
    return scores


def demo_config(folder: Path) -> dict:
    return {
        "algorithm": "grpo",
        "model": str(folder / "base-model"),
        "output_dir": str(folder / "run"),
        "seed": 0,
        "overwrite": True,
        "data": {"path": str(folder / "prompts.jsonl"), "prompt_column": "prompt"},
        "rewards": [{"function": "tidyrl.demo:letters_reward", "weight": 1.0}],
        "rollout": {"prompts_per_rollout": 8, "samples_per_prompt": 8, "max_new_tokens": 8, "temperature": 1.0,
                    "generation_batch_size": 64, "forward_batch_size": 64},
        "train": {"rollouts": 40, "epochs_per_rollout": 1, "minibatches_per_epoch": 2, "micro_batch_size": 16,
                  "learning_rate": 3.0e-3, "lr_scheduler": "cosine", "warmup_steps": 4, "max_grad_norm": 1.0},
        "grpo": {"scale_rewards": "group", "loss_aggregation": "token_mean"},
        "log": {"log_every": 1, "samples_per_rollout": 2},
    }


def prepare_demo(folder: str | Path) -> Path:
    """Write the tiny model, the prompt set and demo.yaml into `folder`; return the YAML path."""
    from tidyrl.tiny import save_tiny_model

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
    from tidyrl.loops.rl import train

    config_path = prepare_demo(folder)
    print(f"tidyrl demo: tiny model, prompts and config written to {Path(folder)}/ ({config_path.name})")
    result = train(config_path, overrides)
    print(f"reward before training (first rollout): {result.first_reward_mean:.3f}")
    print(f"reward after training  (last rollout):  {result.last_reward_mean:.3f}")
    print(f"run written to {result.output_dir}/ (metrics.jsonl, samples.jsonl, plan.json, final/)")
    return result

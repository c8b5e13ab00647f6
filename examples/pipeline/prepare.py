"""Write what the pipeline example needs into WORK_DIR: a tiny model built locally and three small data files.

    python examples/pipeline/prepare.py [WORK_DIR]      (default: runs/pipeline)

The task: answer a word with the word reversed ("lemon" -> "nomel"). The prompt is the same chat message in
every stage, so SFT, the reward model and GRPO all see it rendered by the same chat template.

    base-model/         a random tiny Llama and its character tokenizer (tidyrl.models.tiny), never downloaded
    sft.jsonl           {"prompt": [{"role": "user", "content": "lemon"}], "completion": "nomel"}
    preferences.jsonl   {"prompt": [...], "chosen": "nomel", "rejected": "lemon"}   (4 wrong answers per word)
    prompts.jsonl       {"prompt": [...], "word": "lemon"}                         (the GRPO prompt set)
"""

from __future__ import annotations

import json
import random
import string
import sys
from pathlib import Path

WORDS = (
    "apple banana cherry grape lemon mango melon olive peach pear plum berry kiwi lime date fig guava "
    "papaya quince raisin tomato carrot potato onion garlic pepper radish turnip celery spinach kale"
).split()


def wrong_answers(word: str, rng: random.Random) -> list[str]:
    """Four answers worse than the reversal: the word as is, the reversal missing a letter, a shuffle of its
    letters, and random letters (so the reward model has seen gibberish, which GRPO's samples can be)."""
    backwards = word[::-1]
    dropped = backwards[:len(backwards) // 2] + backwards[len(backwards) // 2 + 1:]
    letters = list(word)
    while "".join(letters) in (word, backwards):
        rng.shuffle(letters)
    noise = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 8)))
    return [word, dropped, "".join(letters), noise]


def prepare(work: str | Path) -> Path:
    from tidyrl.models.tiny import save_tiny_model

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    save_tiny_model(work / "base-model", seed=0, hidden_size=64, num_layers=2, num_heads=4,
                    alphabet=string.ascii_lowercase + " :\n")
    rng = random.Random(0)

    def ask(word):
        return [{"role": "user", "content": word}]

    def write(name, rows):
        (work / name).write_text("".join(json.dumps(row) + "\n" for row in rows))

    write("sft.jsonl", [{"prompt": ask(w), "completion": w[::-1]} for w in WORDS])
    write("preferences.jsonl", [{"prompt": ask(w), "chosen": w[::-1], "rejected": bad}
                                for w in WORDS for bad in wrong_answers(w, rng)])
    write("prompts.jsonl", [{"prompt": ask(w), "word": w} for w in WORDS])
    return work


if __name__ == "__main__":
    print(f"pipeline: tiny model and data written to {prepare(sys.argv[1] if len(sys.argv) > 1 else 'runs/pipeline')}/")

"""The example's tiny model and data: `python prepare.py WORK_DIR` writes

    WORK_DIR/base-model/   a random tiny Llama with a character tokenizer (tidyrl.models.tiny)
    WORK_DIR/sft.jsonl     conversations that use the calculator: user "a+b", assistant "a+b", tool "= s", assistant "s"
    WORK_DIR/tasks.jsonl   RL prompts: {"prompt": [user "a+b"], "answer": "s"}
"""

import json
import random
import sys
from pathlib import Path

from tidyrl.models.tiny import save_tiny_model


def main(work: str) -> None:
    work = Path(work)
    save_tiny_model(work / "base-model", hidden_size=64, num_layers=2, seed=0)
    rng = random.Random(0)
    problems = [(a, b) for a in range(10) for b in range(10)]
    rng.shuffle(problems)
    with open(work / "sft.jsonl", "w") as f:
        for a, b in problems[:60]:
            f.write(json.dumps({"messages": [
                {"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": f"{a}+{b}"},
                {"role": "tool", "content": f"= {a + b}"}, {"role": "assistant", "content": f"{a + b}"}]}) + "\n")
    with open(work / "tasks.jsonl", "w") as f:
        for a, b in problems:
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"{a}+{b}"}], "answer": str(a + b)}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/multiturn")

"""The tool-use task on SmolLM2-135M-Instruct: `python tools_prepare.py WORK_DIR` writes (the model folder itself,
WORK_DIR/model, is prepare.py's)

    WORK_DIR/tools/sft.jsonl    400 conversations for SFT, {"messages": [system, user, assistant, ...]}: half call
                                the tool (the call, the tool's result, then the answer), half answer at once
    WORK_DIR/tools/train.jsonl  300 GRPO prompts, {"prompt": [system, user], "answer": "3901"}
    WORK_DIR/tools/eval.jsonl   200 held-out prompts, the same columns

The problems: products of two two-digit numbers (10-99), each unordered pair used once across the three files, so
no held-out product (in either order) is trained on. The questions are phrased four ways in sft.jsonl and
train.jsonl ("What is 47 * 83?", "Compute 47 * 83.", "47 * 83 = ?", "What is 47 times 83?"), the held-out ones
the first way. Every conversation starts with tools_env.SYSTEM, which describes the tool and the call format.

SFT teaches the call format and copying the tool's result into the answer, and leaves the choice open: half its
conversations answer without the tool (the true product, which a 135M model cannot work out for a new pair), so
after SFT the model calls in some of its first turns and not in others, and GRPO has something to decide.
"""

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools_env import SYSTEM, Multiply  # noqa: E402

PHRASINGS = ("What is {a} * {b}?", "Compute {a} * {b}.", "{a} * {b} = ?", "What is {a} times {b}?")
COUNTS = {"eval": 200, "sft": 400, "train": 300}
CALL_SHARE = 0.5
"""The share of SFT conversations that call the tool; the others answer at once."""


def pairs(seed: int = 0) -> dict[str, list[tuple[int, int]]]:
    """Disjoint sets of unordered two-digit pairs, each in a random order: {"eval": [...], "sft": ..., "train": ...}."""
    rng = random.Random(seed)
    unordered = [(a, b) for a in range(10, 100) for b in range(a, 100)]
    rng.shuffle(unordered)
    out, start = {}, 0
    for name, n in COUNTS.items():
        out[name] = [(a, b) if rng.random() < 0.5 else (b, a) for a, b in unordered[start:start + n]]
        start += n
    return out


def prompt(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def call_text(a: int, b: int) -> str:
    """The model's tool call for a * b, as the system message shows it."""
    return "<tool_call>\n" + json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}}) + "\n</tool_call>"


def answer_text(a: int, b: int) -> str:
    return f"{a} * {b} = {a * b}."


def conversation(a: int, b: int, question: str, call: bool) -> list[dict]:
    """An SFT conversation: with `call`, the call, the tool message the environment answers it with (built by the
    environment itself, so SFT shows the very text GRPO will append) and the answer; else the answer at once."""
    messages = prompt(question)
    if call:
        turn = call_text(a, b)
        reply = Multiply({"answer": str(a * b)}, seed=0).step(turn, messages + [{"role": "assistant", "content": turn}])
        messages += [{"role": "assistant", "content": turn}, reply.message]
    return messages + [{"role": "assistant", "content": answer_text(a, b)}]


def main(work: str, seed: int = 0) -> dict[str, int]:
    folder = Path(work) / "tools"
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed + 1)
    split = pairs(seed)
    with open(folder / "eval.jsonl", "w") as f:
        for a, b in split["eval"]:
            f.write(json.dumps({"prompt": prompt(PHRASINGS[0].format(a=a, b=b)), "answer": str(a * b)}) + "\n")
    with open(folder / "train.jsonl", "w") as f:
        for a, b in split["train"]:
            question = rng.choice(PHRASINGS).format(a=a, b=b)
            f.write(json.dumps({"prompt": prompt(question), "answer": str(a * b)}) + "\n")
    calling = set(rng.sample(range(COUNTS["sft"]), round(CALL_SHARE * COUNTS["sft"])))
    with open(folder / "sft.jsonl", "w") as f:
        for i, (a, b) in enumerate(split["sft"]):
            question = rng.choice(PHRASINGS).format(a=a, b=b)
            f.write(json.dumps({"messages": conversation(a, b, question, i in calling)}) + "\n")
    counts = {name: len(rows) for name, rows in split.items()}
    print(f"{folder}: sft.jsonl {counts['sft']} conversations ({len(calling)} call the tool), "
          f"train.jsonl {counts['train']} prompts, eval.jsonl {counts['eval']} held-out prompts")
    return counts


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/smollm2")

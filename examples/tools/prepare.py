"""The example's tiny model and data: `python prepare.py WORK_DIR` writes

    WORK_DIR/base-model/   a random tiny Llama with a byte-level BPE and a tool-calling chat template
                           (tidyrl.models.tiny, as `tidyrl tiny --tokenizer bytes`)
    WORK_DIR/sft.jsonl     conversations with the tools: half call the tool and copy its result into the answer,
                           half answer at once with a guess (the answer to another question of its kind)
    WORK_DIR/tasks.jsonl   RL prompts about other countries and products: {"prompt": [system, user], "answer"}

SFT teaches the format (JSON tool calls, copying a result) and leaves the choice open: after it the model calls
a tool in about half its first turns. On the RL prompts only a call can find the answer, which GRPO learns.
"""

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tools_env import CAPITALS, SYSTEM, capital, multiply  # noqa: E402

from tidyrl.models.tiny import save_tiny_model  # noqa: E402


def questions(countries, pairs):
    for country in countries:
        yield f'What is the capital of "{country}"?', "capital", {"country": country}, capital(country)
    for a, b in pairs:
        yield f"What is {a} times {b}?", "multiply", {"a": a, "b": b}, multiply(a, b)


def main(work: str, sft_rows: int = 3000) -> None:
    work = Path(work)
    save_tiny_model(work / "base-model", tokenizer="bytes", hidden_size=64, num_layers=2, num_heads=2, seed=0)
    rng = random.Random(0)
    countries = sorted(CAPITALS)
    rng.shuffle(countries)
    pairs = [(a, b) for a in range(32, 100) for b in range(32, 100)]  # products of 4 digits
    rng.shuffle(pairs)
    sft_items = list(questions(countries[:200], pairs[:1000]))
    rl_items = list(questions(countries[200:], pairs[1000:1040]))  # never seen in SFT
    with open(work / "sft.jsonl", "w") as f:
        for _ in range(sft_rows):
            question, name, arguments, result = rng.choice(sft_items)
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            if rng.random() < 0.5:  # call the tool, then copy its result
                call = json.dumps({"name": name, "arguments": arguments})
                messages += [
                    {"role": "assistant", "content": "<tool_call>\n" + call + "\n</tool_call>"},
                    {"role": "tool", "content": json.dumps({"name": name, "result": result})},
                    {"role": "assistant", "content": str(result)}]
            else:  # a guess: the answer to another question of the same kind (rarely right)
                guess = rng.choice([item for item in sft_items if item[1] == name])[3]
                messages.append({"role": "assistant", "content": str(guess)})
            f.write(json.dumps({"messages": messages}) + "\n")
    with open(work / "tasks.jsonl", "w") as f:
        for question, _, _, result in rl_items:
            prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
            f.write(json.dumps({"prompt": prompt, "answer": str(result)}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/tools")

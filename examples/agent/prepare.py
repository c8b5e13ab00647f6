"""The example's tiny model and data: `python prepare.py WORK_DIR` writes

    WORK_DIR/base-model/   a random tiny Llama with the byte-level BPE of `tidyrl tiny --tokenizer bytes` and its
                           Qwen2.5-style chat template, whose tool section is one line (`COMPACT_TOOLS`)
    WORK_DIR/sft.jsonl     conversations with the agent's tool (its schema in a `tools` column, as the agent's
                           calls send it): half call multiply and copy its result, half answer at once with a guess
    WORK_DIR/tasks.jsonl   RL prompts with products SFT never showed: {"prompt": question, "answer": product}

SFT teaches the format and leaves the choice open; on the RL prompts only a call finds the product, which GRPO
through the agent learns.
"""

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from calculator_agent import TOOLS  # noqa: E402

from tidyrl.models.tiny import TOOLS_CHAT_TEMPLATE, save_tiny_model  # noqa: E402

# The template's tools as one system line, "Tools: multiply(a, b).", instead of Qwen2.5's ~150 tokens of
# instructions and JSON schemas: a 2-layer model 64 wide does not learn to copy numbers across that much context in
# a CPU minute (examples/tools/README.md). The agent still sends OpenAI tool schemas; the model's template renders
# them its own way, as every model's does.
_SECTION = TOOLS_CHAT_TEMPLATE[:TOOLS_CHAT_TEMPLATE.index("{%- else %}{%- if messages[0]['role'] == 'system' %}")]
COMPACT_TOOLS = TOOLS_CHAT_TEMPLATE.replace(_SECTION, (
    "{%- if tools %}{{- '<|im_start|>system\\nTools: ' }}{%- for tool in tools %}"
    "{{- tool.function.name + '(' + (tool.function.parameters.properties | list | join(', ')) + ')' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- endif %}{%- endfor %}{{- '.<|im_end|>\\n' }}"))


def main(work: str, sft_rows: int = 3000, tasks: int = 64) -> None:
    work = Path(work)
    save_tiny_model(work / "base-model", tokenizer="bytes", chat_template=COMPACT_TOOLS, hidden_size=64, num_layers=2,
                    num_heads=2, seed=0)
    rng = random.Random(0)
    pairs = [(a, b) for a in range(32, 100) for b in range(32, 100)]  # products of 4 digits
    rng.shuffle(pairs)
    sft_pairs, rl_pairs = pairs[:1000], pairs[1000:1000 + tasks]
    with open(work / "sft.jsonl", "w") as f:
        for _ in range(sft_rows):
            a, b = rng.choice(sft_pairs)
            messages = [{"role": "user", "content": f"What is {a} times {b}?"}]
            if rng.random() < 0.5:  # call the tool, then copy its result
                call = json.dumps({"name": "multiply", "arguments": {"a": a, "b": b}})
                messages += [
                    {"role": "assistant", "content": "<tool_call>\n" + call + "\n</tool_call>"},
                    {"role": "tool", "content": json.dumps({"name": "multiply", "result": a * b})},
                    {"role": "assistant", "content": str(a * b)}]
            else:  # a guess: another question's product (rarely right)
                c, d = rng.choice(sft_pairs)
                messages.append({"role": "assistant", "content": str(c * d)})
            f.write(json.dumps({"messages": messages, "tools": json.dumps(TOOLS)}) + "\n")
    with open(work / "tasks.jsonl", "w") as f:
        for a, b in rl_pairs:
            f.write(json.dumps({"prompt": f"What is {a} times {b}?", "answer": str(a * b)}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "runs/agent")

"""Tool use on SmolLM2-135M-Instruct: a `multiply(a, b)` tool offered by a `ToolEnvironment` (docs/environments.md),
for products of two two-digit numbers, which the 135M model cannot work out in its head.

The model's chat template (plain ChatML) has no tool section: it ignores a `tools` argument, and tidyrl refuses an
environment whose schemas such a template would drop (`check_template_renders_tools`). So `tool_schemas()` returns
None and the system message (`SYSTEM`) describes the tool and the call format in plain text. A call is the
Hermes/Qwen convention `parse_tool_calls` reads:

    <tool_call>
    {"name": "multiply", "arguments": {"a": 47, "b": 83}}
    </tool_call>

its result comes back as a `tool` message, which the template renders as `<|im_start|>tool\\n{...}<|im_end|>`. A turn
with no call is the answer: reward 1 when its last number is the product, else 0.
"""

import re

from tidyrl.environments import ToolEnvironment


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first number
        b: the second number
    """
    return int(a) * int(b)


SYSTEM = ('You can call a tool: multiply(a, b) returns a times b. To call it, write only '
          '<tool_call>\n{"name": "multiply", "arguments": {"a": ..., "b": ...}}\n</tool_call> '
          'and its result comes back in a tool message.')
"""The system message of every conversation (SFT) and prompt (GRPO, eval): the tool in one line, and the call
format."""

NUMBER = re.compile(r"-?\d+")


def last_number(text: str):
    """The last integer the text writes (thousands separators dropped), or None."""
    numbers = NUMBER.findall(text.replace(",", ""))
    return int(numbers[-1]) if numbers else None


class Multiply(ToolEnvironment):
    tools = (multiply,)

    @classmethod
    def tool_schemas(cls):
        # SmolLM2's template renders no `tools`: the tool is described in the system message (SYSTEM) instead.
        return None

    def reward(self, messages):  # the finished conversation: its last message is the model's answer
        return float(last_number(messages[-1]["content"]) == int(self.row["answer"]))


def summary(folder) -> dict:
    """One evaluation (`tidyrl eval ... --output-dir FOLDER`, with this environment): accuracy and the share of
    episodes that call the tool, each (mean, half-width of its 95 % interval), from eval_samples.jsonl: an episode
    calls it when it took more than one turn (`turns`; where a file has none, when its trajectory, decoded without
    special tokens, holds `<tool_call>`); `results`: the share whose call came back with a result (not an error)."""
    import json
    import math
    from pathlib import Path

    with open(Path(folder) / "eval_samples.jsonl") as f:
        samples = [json.loads(line) for line in f]

    def interval(xs):
        n, mean = len(xs), sum(xs) / len(xs)
        var = sum((x - mean) ** 2 for x in xs) / (n - 1)
        return mean, 1.96 * math.sqrt(var / n)

    return {"n": len(samples), "accuracy": interval([s["reward"] for s in samples]),
            "calls": interval([float(s["turns"] > 1 if "turns" in s else "<tool_call>" in s["completion"])
                               for s in samples]),
            "results": interval([float('"result":' in s["completion"]) for s in samples])}


if __name__ == "__main__":  # python tools_env.py EVAL_DIR...: accuracy and tool-call share of each evaluation
    import sys

    for folder in sys.argv[1:]:
        s = summary(folder)
        print(f"{folder}: accuracy {s['accuracy'][0]:.3f} ± {s['accuracy'][1]:.3f}, calls the tool "
              f"{s['calls'][0]:.3f} ± {s['calls'][1]:.3f}, gets a result {s['results'][0]:.3f} (95 %, n = {s['n']})")

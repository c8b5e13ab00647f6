"""A calculator the model can call, as a multi-turn environment (docs/environments.md).

The model may answer a sum at once, or first write the expression (e.g. `3+4`): the environment then answers
with a tool message `= 7`, and the model's next turn is its answer. The episode's reward is 1 for a correct
final answer, else 0. The example's model is tiny and character-level, so the protocol is plain text rather
than JSON tool calls (ToolEnvironment does those for real models).
"""

import re

from tidyrl.environments import EnvReply

EXPRESSION = re.compile(r"^\s*(\d+)\s*([+*-])\s*(\d+)\s*$")


class Calculator:
    def __init__(self, row, seed):
        self.answer = str(row["answer"])

    def step(self, turn, messages):
        match = EXPRESSION.match(turn)
        if match and len(messages) <= 2:  # the first turn is a call: compute it
            a, op, b = int(match.group(1)), match.group(2), int(match.group(3))
            value = a + b if op == "+" else a - b if op == "-" else a * b
            return EnvReply(message={"role": "tool", "content": f"= {value}"}, reward=0.0)
        return EnvReply(reward=1.0 if turn.strip() == self.answer else 0.0, done=True)

"""Tool environments: Python functions offered to the model as tools (`<tool_call>` turns), and the parser of
those turns."""

from __future__ import annotations

import json
import re
from typing import Callable, Sequence

from tidyrl.environments.base import EnvReply


_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def parse_tool_calls(turn: str) -> list[dict]:
    """The tool calls of a model turn in the Hermes/Qwen convention the common chat templates use:
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, each a dict with name and arguments. A block
    that is not such JSON, and a `<tool_call>` never closed, are returned as {"error": ...} so the environment
    answers them (a turn that opened a call is not the model's final answer)."""
    calls = []
    for body in _TOOL_CALL.findall(turn):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append({"error": f"the tool call is not JSON ({err.msg})"})
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append({"error": "a tool call needs a \"name\""})
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        calls.append({"name": call["name"], "arguments": arguments if isinstance(arguments, dict) else {}})
    if turn.count("<tool_call>") > turn.count("</tool_call>"):  # opened, never closed (often cut by max_turn_tokens)
        calls.append({"error": "a <tool_call> is not closed with </tool_call>; write the whole call: "
                               "<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>"})
    return calls


class ToolEnvironment:
    """Tools from Python functions. Subclass it and set `tools` (functions with type hints and a docstring);
    override `reward(self, messages)` to score the finished conversation, and `close(self)` to release what the
    episode's tools held. Each model turn: every tool call in
    it runs, and the results come back in one `tool` message; a turn with no tool call ends the episode (the
    model answered) and `reward` scores it. Unknown tools and malformed calls are answered with an error
    message, so the model can recover."""

    tools: Sequence[Callable] = ()
    no_call: str = "answer"
    """A turn with no tool call: "answer" (it is the model's answer: `reward` scores it, the episode ends) or
    "remind" (the model is told to call a tool and the episode goes on)."""

    def __init__(self, row: dict, seed: int):
        self.row, self.seed = row, seed
        self.by_name = {fn.__name__: fn for fn in self.tools}

    @classmethod
    def tool_schemas(cls) -> list[dict]:
        """The JSON schemas the chat template renders (transformers.utils.get_json_schema of each tool)."""
        from transformers.utils import get_json_schema

        return [get_json_schema(fn) for fn in cls.tools]

    def reward(self, messages: list[dict]) -> float:
        return 0.0

    def close(self) -> None:
        """Called once when the episode ends (done, out of turns or tokens, or failed), in an environment worker:
        override it to release what `__init__` opened for the tools (a file, a connection, a session). What it
        raises is recorded, never raised into the run."""

    def step(self, turn: str, messages: list[dict]) -> EnvReply:
        calls = parse_tool_calls(turn)
        if not calls and self.no_call == "remind":
            return EnvReply(message={"role": "user", "content": "Call one of the tools: "
                                     + ", ".join(sorted(self.by_name)) + "."})
        if not calls:
            return EnvReply(reward=float(self.reward(messages)), done=True)
        results = []
        for call in calls:
            if "error" in call:
                results.append({"error": call["error"]})
            elif call["name"] not in self.by_name:
                results.append({"error": f"unknown tool {call['name']!r}; tools: {sorted(self.by_name)}"})
            else:
                try:
                    results.append({"name": call["name"], "result": self.by_name[call["name"]](**call["arguments"])})
                except Exception as err:
                    results.append({"name": call["name"], "error": f"{type(err).__name__}: {err}"})
        return EnvReply(message={"role": "tool", "content": json.dumps(results if len(results) > 1 else results[0],
                                                                        default=str)})


# ------------------------------------------------------------------------------------------- OpenEnv

"""Multi-turn environments: what the model talks to between its turns.

An environment is a class; tidyrl makes one per episode and calls it once per model turn:

    class Guess:
        def __init__(self, row: dict, seed: int):     # the prompt's data row; a seed keyed like the sampling
            self.target = int(row["target"])
        def step(self, turn: str, messages: list[dict]) -> EnvReply:
            # turn: the model's last turn (decoded); messages: the conversation so far, that turn included
            guess = ...
            if guess == self.target:
                return EnvReply(reward=1.0, done=True)
            return EnvReply(message={"role": "user", "content": "higher"}, reward=0.0)

named in the YAML as `environment: {class: my_envs.py:Guess, max_turns: 4}`. The episode's reward is the sum
of its replies' rewards (`reward/env`), added to the configured reward functions'. An environment that raises
or runs past `environment.timeout_s` ends its episode with `environment.error_reward` and a recorded error;
the run goes on.

`ToolEnvironment` turns Python functions (type hints and a docstring each) into tools: the prompt is rendered
with the chat template's `tools`, a model turn holding `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
calls the function, and the result comes back as a `tool` message.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence


class EnvironmentError_(RuntimeError):
    """An environment misbehaved (raised, timed out, or answered with something that is not an EnvReply)."""


@dataclass
class EnvReply:
    """An environment's answer to one model turn."""

    message: Optional[dict] = None
    """The next message ({"role": "user" or "tool", "content": str}), rendered with the chat template and
    appended to the conversation as tokens that carry no loss; None when the episode ends without one."""
    reward: Optional[float] = None
    """Reward for this turn; the episode's reward is the sum (None counts as 0)."""
    done: bool = False
    """True ends the episode (so does reaching environment.max_turns or the token budget)."""


def check_reply(reply: Any, name: str) -> EnvReply:
    """`reply` if it is a well-formed EnvReply, else an EnvironmentError_ naming the environment and the fault."""
    if not isinstance(reply, EnvReply):
        raise EnvironmentError_(f"environment {name}.step returned {type(reply).__name__}, not an EnvReply "
                                "(tidyrl.environments.EnvReply(message=..., reward=..., done=...))")
    if reply.message is not None:
        m = reply.message
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise EnvironmentError_(f"environment {name}.step returned message={m!r}; a message is "
                                    '{"role": "user" or "tool", "content": "..."}')
    if reply.reward is not None and (isinstance(reply.reward, bool) or not isinstance(reply.reward, (int, float))):
        raise EnvironmentError_(f"environment {name}.step returned reward={reply.reward!r}; a reward is a number")
    if reply.message is None and not reply.done:
        raise EnvironmentError_(f"environment {name}.step returned no message and done=False; give the model a "
                                "message to answer, or end the episode")
    return reply


class EnvironmentPool:
    """Runs environment calls in worker threads with a per-call timeout: a call that raises or runs too long is
    reported as an error string, never as an exception of the run. (A thread stuck in a call cannot be killed;
    it is left behind and the episode ends.)"""

    def __init__(self, timeout_s: float, workers: int = 8):
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tidyrl-env")

    def call(self, fns: Sequence[Callable[[], Any]]) -> list[tuple[Any, Optional[str]]]:
        """Run the calls concurrently; (result, None) or (None, error text) for each, in order."""
        futures = [self._pool.submit(fn) for fn in fns]
        results = []
        for future in futures:
            try:
                results.append((future.result(timeout=self.timeout_s), None))
            except FutureTimeout:
                results.append((None, f"timed out after {self.timeout_s} s"))
            except Exception as err:  # the environment's own error, recorded for the episode
                results.append((None, f"{type(err).__name__}: {err}"))
        return results

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------------------------- tools

_TOOL_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)


def parse_tool_calls(turn: str) -> list[dict]:
    """The tool calls of a model turn in the Hermes/Qwen convention the common chat templates use:
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, each a dict with name and arguments. A block
    that is not such JSON is returned as {"error": ...} so the environment can answer it."""
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
    return calls


class ToolEnvironment:
    """Tools from Python functions. Subclass it and set `tools` (functions with type hints and a docstring);
    override `reward(row, messages)` to score the finished conversation. Each model turn: every tool call in
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


class OpenEnvEnvironment:
    """An OpenEnv environment (openenv-core's `reset()` / `step(action)`) as a tidyrl environment.

    OpenEnv environments take typed actions and answer with observations; a subclass says how a model turn
    becomes an action and an observation becomes the next message:

        from my_openenv_envs import EchoEnvironment, EchoAction

        class Echo(OpenEnvEnvironment):
            def make_env(self, row, seed):
                return EchoEnvironment()              # in process; or an EnvClient of a running server
            def to_action(self, turn):
                return EchoAction(message=turn)
            def to_message(self, observation):
                return observation.echoed_message

    `step` accepts both forms OpenEnv returns: a client's `StepResult(observation, reward, done)`, or a server
    environment's observation carrying `reward` and `done` itself. The observation of `reset()` is kept as
    `self.first_observation` (the prompt comes from the data row, as for every tidyrl environment). Nothing of
    openenv-core is imported here: it is needed only by the environment classes a subclass builds.
    """

    role = "user"
    """The role of the messages built from observations (`tool` when the environment is a tool)."""

    def __init__(self, row: dict, seed: int):
        self.row, self.seed = row, seed
        self.env = self.make_env(row, seed)
        self.first_observation = _observation_of(self.env.reset())

    def make_env(self, row: dict, seed: int):
        raise NotImplementedError("an OpenEnvEnvironment subclass builds its OpenEnv environment in make_env(row, seed)")

    def to_action(self, turn: str):
        raise NotImplementedError("an OpenEnvEnvironment subclass turns a model turn into an action in to_action(turn)")

    def to_message(self, observation) -> str:
        return str(observation)

    def step(self, turn: str, messages: list[dict]) -> EnvReply:
        result = self.env.step(self.to_action(turn))
        observation = _observation_of(result)
        reward = getattr(result, "reward", None) if hasattr(result, "observation") else getattr(observation, "reward", None)
        done = bool(getattr(result, "done", False) if hasattr(result, "observation") else getattr(observation, "done", False))
        if done:
            return EnvReply(reward=reward, done=True)
        return EnvReply(message={"role": self.role, "content": self.to_message(observation)}, reward=reward)

    def close(self) -> None:
        closer = getattr(self.env, "close", None)
        if callable(closer):
            closer()


def _observation_of(result):
    """The observation of an OpenEnv step or reset result (a client's StepResult holds it; a server's is it)."""
    return result.observation if hasattr(result, "observation") else result

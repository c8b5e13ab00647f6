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

from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence


class EnvironmentError_(RuntimeError):
    """An environment misbehaved (raised, timed out, or answered with something that is not an EnvReply)."""


class EnvironmentFailure(RuntimeError):
    """Too many of a rollout's episodes ended on an environment error (environment.max_error_fraction): the run
    stopped, since it would learn from nothing."""


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
        self.timeout_s, self.workers = timeout_s, workers
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tidyrl-env")
        self._kept: dict[str, Any] = {}

    def submit(self, fn: Callable[[], Any]):
        """Run `fn` in a worker; its `concurrent.futures.Future` (the caller bounds its time)."""
        return self._pool.submit(fn)

    def kept(self, name: str, make: Callable[[], Any]):
        """What the episodes share for the pool's life (e.g. an agent's endpoint): made by `make()` the first time
        `name` is asked for, closed (its `close()`) with the pool."""
        if name not in self._kept:
            self._kept[name] = make()
        return self._kept[name]

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
        for resource in self._kept.values():
            resource.close()
        self._kept.clear()
        self._pool.shutdown(wait=False, cancel_futures=True)


# --------------------------------------------------------------------------------------------- tools

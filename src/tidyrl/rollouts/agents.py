"""Agent episodes: an agent function written against the `openai` client, run unchanged, its calls answered by the
engine through the OpenAI-compatible endpoint (`rollouts.endpoint`), every episode assembled from the tokens the
engine sampled.

    def solve(base_url, row, seed):                      # environment.agent: my_agent.py:solve
        client = openai.OpenAI(base_url=base_url, api_key="-")
        ... client.chat.completions.create(model="policy", messages=..., tools=...) ...
        return reward                                     # a number, a dict of reward terms, or None

Each episode of a round gets a base_url of its own; the agents run in the environment workers, and their calls
are gathered into the engine's generate calls on the rollout's thread (where the engine lives): a batch goes
when every agent that can run (as many as the workers, of those not done) is waiting on a call, or no new
call came for `QUIET_S`, or `MAX_WAIT_S` after its first call came. Call c of
episode e samples with the key (seed, rollout, "e.c"), as a multi-turn environment's turn t does, so the samples
do not depend on how calls were batched or how fast the agents are, and a resumed run makes the same ones.

Exact tokens. An episode is a record of segments; a segment is a prompt (the first call's messages, rendered by
the chat template and tokenised once) and everything after it as tokens: each call's answer is the sampled tokens
verbatim, decoded for the agent (its tool calls parsed from the model's own `<tool_call>` format), and a later
call whose messages begin with the segment's (the agent sent back what it was answered) adds only the new
messages' tokens: the text the template adds after the sampled turn, less the stop token the model sampled
itself, plus the next generation prompt (`new_message_ids`); nothing sampled is re-tokenised. A call whose
messages do not begin so (the agent dropped, summarised or reordered its history; changed its tools; or the
template re-renders earlier turns) starts a new segment. The episode's row is its first segment; the tokens of
later segments are counted (`segments`) and not trained.

The agent's own time between its calls is bounded by environment.timeout_s (waiting for an answer does not count):
past it, or when it raises or returns something else than a reward, its episode ends with environment.error_reward
and the error (a traceback) recorded; the run goes on, under environment.max_error_fraction's rule. Its calls
past environment.max_turns, or past the episode's token budget (rollout.max_new_tokens), are refused (HTTP 400):
the episode is truncated, as a multi-turn episode that ran out of turns or tokens.
"""

from __future__ import annotations

import json
import queue
import re
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

from tidyrl.data.prompts import render_chat, tools_problem
from tidyrl.environments.tools import parse_tool_calls
from tidyrl.rewards.functions import keyword_parameters
from tidyrl.rollouts.endpoint import ApiError, Endpoint
from tidyrl.rollouts.episodes import Conversation, EpisodeSettings

QUIET_S, MAX_WAIT_S = 0.02, 0.5
"""A batch of calls goes to the engine once no new call came for QUIET_S, or MAX_WAIT_S after its first call came,
if not all the agents that can run are waiting before (speed only: the samples are keyed per call)."""
POLL_S = 0.01
AGENT_ARGUMENTS = ("base_url", "api_key", "model", "prompt", "row", "seed")
"""What an agent function may take (by name): its episode's base_url, the API key (the episode's key, for clients
that send one), the model name the endpoint serves, the prompt row's prompt, the whole row, and a seed keyed like
the sampling."""
MODEL_NAME = "policy"
_SENTINEL = "\x00tidyrl-turn\x00"
_TOOL_BLOCK = re.compile(r"\s*<tool_call>.*?</tool_call>\s*", re.DOTALL)


class AgentError(RuntimeError):
    """An agent function that cannot be called as one (checked before the run)."""


def check_agent(fn: Callable, spec) -> "Agent":
    """Before any weights load: `fn` is callable and every argument it needs (no default) is one it is offered;
    the `Agent` that calls it."""
    if not callable(fn):
        raise AgentError(f"environment.agent = {spec!r} is not a function")
    accepts, required = keyword_parameters(fn)
    missing = sorted(required - set(AGENT_ARGUMENTS))
    if missing:
        raise AgentError(f"environment.agent = {spec!r} requires argument(s) {missing}; an agent is called with "
                         f"some of {list(AGENT_ARGUMENTS)} (by name)")
    return Agent(fn, str(getattr(fn, "__name__", spec) if callable(spec) else spec), accepts)


# ------------------------------------------------------------------------------------------------ messages

def template_message(message: Any) -> dict:
    """An OpenAI chat message (a dict as the client sends it) as tidyrl compares and renders it: its text content
    (text parts joined; None is ""), its tool calls with their arguments parsed from JSON (call ids dropped: they
    are the endpoint's own), a tool message's tool_call_id and a name where given."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ApiError(400, f"a message must be an object with a role, got {message!r}")
    content = message.get("content")
    if isinstance(content, list):
        if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
            raise ApiError(400, "only text content parts are served")
        content = "".join(p.get("text", "") for p in content)
    if content is not None and not isinstance(content, str):
        raise ApiError(400, f"a message's content must be text, got {type(content).__name__}")
    out = {"role": message["role"], "content": content or ""}
    calls = []
    for call in message.get("tool_calls") or ():
        function = (call or {}).get("function") or {}
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        calls.append({"type": "function", "function": {"name": function.get("name"), "arguments": arguments}})
    if calls:
        out["tool_calls"] = calls
    for key in ("tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    return out


def new_message_ids(tokenizer, messages: list[dict], new: list[dict], stop_text: str, tools) -> Optional[list[int]]:
    """The tokens `new` messages add after the conversation `messages`, which ends with a sampled assistant turn
    whose last token decodes to `stop_text` ("" when it did not stop on a stop token): the chat template's text
    after that turn's content (e.g. "<|im_end|>\\n"), less `stop_text` when it begins it, then `new` and the next
    generation prompt, tokenised alone without special tokens. None where the template does not render
    `messages` as the beginning of the longer conversation (it rewrites earlier turns)."""
    before = render_chat(tokenizer, messages, add_generation_prompt=False, tools=tools)
    after = render_chat(tokenizer, messages + new, add_generation_prompt=True, tools=tools)
    if not after.startswith(before):
        return None
    marked = render_chat(tokenizer, messages[:-1] + [{"role": "assistant", "content": _SENTINEL}],
                         add_generation_prompt=False, tools=tools)
    tail = marked[marked.rfind(_SENTINEL) + len(_SENTINEL):]  # what the template writes after a turn's content
    if not before.endswith(tail):
        tail = ""
    if stop_text and tail.startswith(stop_text):
        tail = tail[len(stop_text):]
    return tokenizer(tail + after[len(before):], add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------------------ episodes

@dataclass
class Segment:
    """A prompt and the tokens after it, as sampled and appended."""

    prompt_ids: list[int]
    tools: Optional[list]
    messages: list[dict]
    """The conversation the tokens hold (template form), ending with the last answer."""
    conversation: Conversation = field(default_factory=Conversation)
    stop_text: str = ""


@dataclass
class _Call:
    episode: "AgentEpisode"
    request: dict
    arrived: float
    answer: Any = None
    done: threading.Event = field(default_factory=threading.Event)


class AgentEpisode:
    """One episode's record and its calls' door: `call` runs on the endpoint's request thread and waits until the
    round's loop answered it."""

    def __init__(self, index: int, key: str, calls: "queue.Queue[_Call]"):
        self.index, self.key, self._calls = index, key, calls
        self.segments: list[Segment] = []
        self.answered = 0
        self.refused: Optional[str] = None
        self.ended = False
        self.started: Optional[float] = None
        self.last_active = 0.0
        self.waiting = False
        self.lock = threading.Lock()

    def call(self, request: dict) -> dict:
        if self.ended:
            raise ApiError(410, f"episode {self.key} has ended")
        if not isinstance(request.get("messages"), list) or not request["messages"]:
            raise ApiError(400, "messages must be a non-empty list")
        if request.get("n") not in (None, 1):
            raise ApiError(400, "n must be 1 (tidyrl samples a group as several episodes: rollout.samples_per_prompt)")
        call = _Call(self, request, time.monotonic())
        with self.lock:
            self.waiting = True
        self._calls.put(call)
        call.done.wait()
        with self.lock:
            self.waiting, self.last_active = False, time.monotonic()
        if isinstance(call.answer, ApiError):
            raise call.answer
        return call.answer


class AgentRound:
    """One round's agent episodes through `engine` (see the module docstring)."""

    def __init__(self, engine, tokenizer, settings: EpisodeSettings, endpoint: Endpoint, timeout_s: float,
                 workers: int):
        self.engine, self.tokenizer, self.settings = engine, tokenizer, settings
        self.endpoint, self.timeout_s, self.workers = endpoint, timeout_s, workers
        self.budget = settings.sampling.max_new_tokens
        self.calls: "queue.Queue[_Call]" = queue.Queue()
        self._tools_seen: dict[str, Optional[str]] = {}

    def run(self, agent: "Agent", rows: Sequence[dict], prompts: Sequence[Any], seeds: Sequence[int],
            sample_key: Callable[[int, int], int], pool) -> list[Conversation]:
        """The episodes of `rows` (each with its prompt and agent seed): the agents run in `pool`, their calls are
        answered here, and each episode's conversation (its first segment) is returned."""
        episodes = [AgentEpisode(i, uuid.uuid4().hex[:16], self.calls) for i in range(len(rows))]
        outcomes: list[Any] = [None] * len(rows)
        futures = []
        for ep, row, prompt, seed in zip(episodes, rows, prompts, seeds):
            self.endpoint.open(ep.key, ep)
            values = dict(base_url=self.endpoint.base_url(ep.key), api_key=ep.key, model=MODEL_NAME, prompt=prompt,
                          row=dict(row), seed=seed)
            futures.append(pool.submit(self._agent_call(agent, ep, values)))
        try:
            self._serve(episodes, futures, sample_key, outcomes)
        finally:
            for ep in episodes:
                ep.ended = True
                self.endpoint.shut(ep.key)
            while True:  # calls of agents left behind: refused
                try:
                    late = self.calls.get_nowait()
                except queue.Empty:
                    break
                late.answer = ApiError(410, f"episode {late.episode.key} has ended")
                late.done.set()
        return [self._conversation(ep, outcome) for ep, outcome in zip(episodes, outcomes)]

    @staticmethod
    def _agent_call(agent: "Agent", ep: AgentEpisode, values: dict):
        def run():
            with ep.lock:
                ep.started = ep.last_active = time.monotonic()
            return agent.call(values)
        return run

    def _serve(self, episodes, futures, sample_key, outcomes) -> None:
        pending: list[_Call] = []
        over = [False] * len(episodes)
        start = time.monotonic()  # (calls that came while the agents were being started wait from here)
        starved_since = None
        while True:
            for i, future in enumerate(futures):
                if not over[i] and future.done():
                    over[i] = True
                    err = future.exception()
                    outcomes[i] = ("returned", future.result()) if err is None else \
                        ("error", f"raised {type(err).__name__}: {err}\n"
                                  + "".join(traceback.format_exception(err)).strip())
            now = time.monotonic()
            for i, ep in enumerate(episodes):  # an agent that neither calls nor returns within timeout_s
                with ep.lock:
                    stuck = ep.started is not None and not ep.waiting and now - ep.last_active > self.timeout_s
                if not over[i] and stuck:
                    over[i] = True
                    outcomes[i] = ("error", f"the agent made no call and did not return for {self.timeout_s} s "
                                            "(environment.timeout_s); its thread is left behind")
                    ep.ended = True
                    self.endpoint.shut(ep.key)
            # agents that cannot start: every worker is held by an agent that hung (left behind) and none runs
            unstarted = [i for i, ep in enumerate(episodes) if not over[i] and ep.started is None]
            if unstarted and not pending and not any(not over[i] and ep.started is not None
                                                     for i, ep in enumerate(episodes)):
                starved_since = starved_since or now
                if now - starved_since > self.timeout_s:
                    for i in unstarted:
                        over[i] = True
                        outcomes[i] = ("error", f"the agent found no free environment worker for {self.timeout_s} s "
                                                "(environment.timeout_s): the workers are held by agents that hung")
                        episodes[i].ended = True
                        self.endpoint.shut(episodes[i].key)
            else:
                starved_since = None
            try:
                pending.append(self.calls.get(timeout=POLL_S))
                while True:
                    pending.append(self.calls.get_nowait())
            except queue.Empty:
                pass
            for call in [c for c in pending if over[c.episode.index]]:  # (its episode ended meanwhile)
                call.answer = ApiError(410, f"episode {call.episode.key} has ended")
                call.done.set()
            pending = [c for c in pending if not over[c.episode.index]]
            if not pending:
                if all(over):
                    return
                continue
            # the agents that can call now: as many as the pool runs at once, of those not over
            able = min(self.workers, len(episodes) - sum(over))
            quiet = now - max(pending[-1].arrived, start) >= QUIET_S
            if len(pending) >= able or quiet or now - max(pending[0].arrived, start) >= MAX_WAIT_S:
                batch, seen = [], set()
                for call in pending:  # an episode's calls one at a time, in the order they came
                    if call.episode.index not in seen:
                        seen.add(call.episode.index)
                        batch.append(call)
                self._answer(batch, sample_key)
                pending = [c for c in pending if c not in batch]

    def _answer(self, calls: list[_Call], sample_key) -> None:
        """The calls' answers: each call's context as tokens, generated in one engine call per token limit."""
        by_limit: dict[int, list] = {}
        for call in calls:
            try:
                context, limit = self._context(call)
            except ApiError as err:
                call.answer = err
                call.done.set()
                continue
            by_limit.setdefault(limit, []).append((call, context))
        for limit, group in sorted(by_limit.items()):
            keys = [sample_key(call.episode.index, call.episode.answered) for call, _ in group]  # (one call each)
            sampling = replace(self.settings.sampling, max_new_tokens=limit, record_routes=False)
            try:
                ids, mask, truncated, logprobs, *_ = self.engine.generate([c for _, c in group], keys, sampling)
            except BaseException:
                for call, _ in group:
                    call.answer = ApiError(503, "the engine failed; the run stops", "server_error")
                    call.done.set()
                raise
            for row, (call, context) in enumerate(group):
                n = int(mask[row].sum())
                call.answer = self._record(call, context, ids[row, :n].tolist(), logprobs[row, :n].tolist(),
                                           bool(truncated[row]))
                call.done.set()

    def _context(self, call: _Call) -> tuple[list[int], int]:
        """The call's whole context as tokens (its segment's, continued or new) and its token limit; the segment
        to be continued is the episode's last. Raises ApiError for a call refused."""
        ep, request = call.episode, call.request
        if ep.answered >= self.settings.max_turns:
            ep.refused = f"the episode made its {self.settings.max_turns} calls (environment.max_turns)"
            raise ApiError(400, ep.refused)
        messages = [template_message(m) for m in request["messages"]]
        tools = request.get("tools") or None
        if request.get("tool_choice") == "none":
            tools = None
        if tools is not None:
            self._check_tools(tools)
        seg = ep.segments[-1] if ep.segments else None
        extra = None
        if seg is not None and seg.tools == tools and len(messages) > len(seg.messages) \
                and messages[:len(seg.messages)] == seg.messages:
            extra = new_message_ids(self.tokenizer, seg.messages, messages[len(seg.messages):], seg.stop_text, tools)
        if extra is None:  # a new segment: the conversation as sent, rendered and tokenised once
            text = render_chat(self.tokenizer, messages, add_generation_prompt=True, tools=tools)
            seg = Segment(self.tokenizer(text, add_special_tokens=False)["input_ids"], tools, messages)
            ep.segments.append(seg)
            extra = []
        c = seg.conversation
        room = self.budget - len(c.ids) - len(extra)
        if room < 1:
            ep.refused = f"the episode's token budget (rollout.max_new_tokens = {self.budget}) is spent"
            raise ApiError(400, ep.refused)
        c.ids += extra
        c.action += [0] * len(extra)
        c.logprobs += [0.0] * len(extra)
        seg.messages = messages
        limit = min(room, self.settings.max_turn_tokens or room, _requested_limit(request) or room)
        return seg.prompt_ids + c.ids, limit

    def _check_tools(self, tools: list) -> None:
        """A request's tools must reach the model: refused (400) where the chat template cannot render them or has
        no tool section (`data.prompts.tools_problem`); checked once a round for each distinct list."""
        key = json.dumps(tools, sort_keys=True)
        if key not in self._tools_seen:
            self._tools_seen[key] = tools_problem(self.tokenizer, tools)
        if self._tools_seen[key] is not None:
            raise ApiError(400, f"{self._tools_seen[key]}; describe the tools in a message instead")

    def _record(self, call: _Call, context: list[int], turn: list[int], logprobs: list[float], truncated: bool
                ) -> dict:
        """The sampled turn into the episode's record, and the chat completion that answers the call."""
        ep, seg = call.episode, call.episode.segments[-1]
        c = seg.conversation
        c.ids += turn
        c.action += [1] * len(turn)
        c.logprobs += logprobs
        c.turns += 1
        stopped = bool(turn) and not truncated and turn[-1] in self.settings.sampling.eos_ids
        seg.stop_text = self.tokenizer.decode(turn[-1:], skip_special_tokens=False) if stopped else ""
        text = self.tokenizer.decode(turn, skip_special_tokens=True)
        content, tool_calls = text, []
        if seg.tools:
            parsed = [p for p in parse_tool_calls(text) if "error" not in p]
            if parsed:
                content = _TOOL_BLOCK.sub("\n", text).strip() or None
                tool_calls = [{"id": f"call_{ep.key}_{ep.answered}_{j}", "type": "function",
                               "function": {"name": p["name"], "arguments": json.dumps(p["arguments"])}}
                              for j, p in enumerate(parsed)]
        message = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        seg.messages = seg.messages + [template_message(message)]
        if truncated and len(c.ids) >= self.budget:
            c.truncated = True
        finish = "tool_calls" if tool_calls else ("length" if truncated else "stop")
        completion = {"id": f"chatcmpl-{ep.key}-{ep.answered}", "object": "chat.completion",
                      "created": int(time.time()), "model": call.request.get("model") or MODEL_NAME,
                      "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
                      "usage": {"prompt_tokens": len(context), "completion_tokens": len(turn),
                                "total_tokens": len(context) + len(turn)}}
        ep.answered += 1
        return completion

    def _conversation(self, ep: AgentEpisode, outcome) -> Conversation:
        """The episode's row: its first segment, with the agent's outcome (its reward, or its error)."""
        seg = ep.segments[0] if ep.segments else None
        c = seg.conversation if seg is not None else Conversation()
        c.prompt_ids = seg.prompt_ids if seg is not None else None
        c.messages = list(seg.messages) if seg is not None else []
        c.turns = ep.answered
        c.segments = max(len(ep.segments), 1)
        c.done = c.closed = True
        kind, value = outcome or ("error", "the agent never ran")
        if kind == "returned" and seg is None:
            kind, value = "error", "the agent returned without calling the model"
        if kind == "returned":
            try:
                c.reward = agent_reward(value)
            except AgentError as err:
                kind, value = "error", str(err)
        if kind == "error":
            if ep.refused is not None and seg is not None:  # it raised on a refused call: out of turns or tokens
                c.truncated, c.reward = True, self.settings.error_reward
            else:
                c.error, c.reward = f"agent: {value}", self.settings.error_reward
        if ep.refused is not None:
            c.truncated = True
        return c


def agent_reward(value) -> float:
    """An agent's return value as its episode's reward: a number, the sum of a dict of numbers, or None (0: the
    reward functions score the conversation)."""
    if value is None:
        return 0.0
    if isinstance(value, dict):
        bad = {k: v for k, v in value.items() if isinstance(v, bool) or not isinstance(v, (int, float))}
        if bad:
            raise AgentError(f"the agent returned reward terms that are not numbers: {bad!r}")
        return float(sum(value.values()))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AgentError(f"the agent returned {value!r}; return a number, a dict of reward terms, or None")
    return float(value)


def _requested_limit(request: dict) -> Optional[int]:
    for key in ("max_completion_tokens", "max_tokens"):
        value = request.get(key)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ApiError(400, f"{key} must be a positive integer, got {value!r}")
            return value
    return None




@dataclass(frozen=True)
class Agent:
    """environment.agent, imported and checked (`check_agent`): what a producer runs its episodes with
    (`run_agent_episodes`)."""

    fn: Callable
    spec: str
    accepts: Optional[frozenset] = None
    """The AGENT_ARGUMENTS it takes by name; None: all of them (**kwargs, or no signature to read)."""

    def call(self, values: dict):
        return self.fn(**{k: v for k, v in values.items() if self.accepts is None or k in self.accepts})

    @property
    def __name__(self) -> str:
        return self.spec


def run_agent_episodes(agent: Agent, engine, tokenizer, settings: EpisodeSettings, rows: Sequence[dict],
                       prompts: Sequence[Any], seeds: Sequence[int], sample_key: Callable[[int, int], int], pool
                       ) -> list[Conversation]:
    """A round of agent episodes (see the module docstring) in the workers of `pool` (an EnvironmentPool: its
    timeout bounds an agent's time between calls), on the endpoint it keeps for the run."""
    endpoint = pool.kept("endpoint", lambda: Endpoint(MODEL_NAME))
    round_ = AgentRound(engine, tokenizer, settings, endpoint, pool.timeout_s, pool.workers)
    return round_.run(agent, rows, prompts, seeds, sample_key, pool)


__all__ = ["AGENT_ARGUMENTS", "Agent", "AgentError", "AgentRound", "agent_reward", "check_agent", "new_message_ids",
           "run_agent_episodes", "template_message"]

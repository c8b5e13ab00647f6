"""Episodes: a prompt, then model turns through an engine and environment turns, token in, token out.

A single-turn prompt is an episode of one model turn (no environment): the same loop, which then ends.

    for turn t = 0 .. max_turns - 1, over the episodes still running:
        generate the model's turn from (prompt + everything so far), as tokens (keys: seed, rollout, episode, t)
        the environment answers the decoded turn (in worker threads, with a timeout)
        its message is rendered by the chat template and only the NEW text is tokenised and appended
    until the environment says done, the turns run out, or the trajectory reaches rollout.max_new_tokens

The trajectory is the exact token sequence the model saw and produced: the model's tokens are never decoded
and re-encoded, and each environment message is encoded once, as the text the chat template adds after the
model's turn (`environment_message_ids`). `action` marks the model's tokens: only they carry the loss, the KL
and the entropy; the environment's are context.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import torch

from tidyrl.data.prompts import render_chat
from tidyrl.engines.base import SamplingSettings
from tidyrl.environments.base import EnvironmentError_, EnvironmentPool, check_reply
from tidyrl.rollouts.record import Rollout


@dataclass
class Conversation:
    """One episode's completion: every token after the prompt, model and environment."""

    ids: list[int] = field(default_factory=list)
    action: list[int] = field(default_factory=list)
    """1 for a token the model sampled, 0 for one the environment's message added."""
    logprobs: list[float] = field(default_factory=list)
    """The sampling pass's log-prob of each model token (0 for environment tokens)."""
    messages: list[dict] = field(default_factory=list)
    reward: float = 0.0
    turns: int = 0
    truncated: bool = False
    """The trajectory reached the token budget (rollout.max_new_tokens) before the episode ended (a single turn:
    the engine stopped it at max_new_tokens without EOS)."""
    error: Optional[str] = None
    done: bool = False
    closed: bool = False
    """Its environment's `close()` ran (or it has none): the episode's end was handled."""
    close_error: Optional[str] = None
    """What `close()` raised, recorded (never raised into the run)."""
    prompt_routes: Optional[torch.Tensor] = None
    """With SamplingSettings.record_routes, a mixture of experts' routes of the prompt's tokens (prompt, MoE layers,
    k) from the first turn's prefill."""
    routes: list[torch.Tensor] = field(default_factory=list)
    """... and of `ids` as far as recorded, in pieces: each model turn's tokens from its decode steps, each
    environment message's from the next turn's prefill (none where no turn followed it)."""
    prompt_ids: Optional[list[int]] = None
    """An agent's episode: its prompt as the agent's first call rendered it (`rollouts.agents`); None: the data
    row's prompt."""
    segments: int = 1
    """An agent's episode: its segments (1 + the calls whose history did not continue the record)."""


def environment_message_ids(tokenizer, messages: list[dict], turn_text: str, generated_text: str, message: dict,
                            tools=None) -> list[int]:
    """The tokens an environment message adds after the model's turn: the chat template's text for
    `messages` (ending with the model's turn, `turn_text`) plus `message` plus the next generation prompt,
    minus the text already there, less what the model itself generated after its content (`generated_text`,
    e.g. its end-of-turn token). Encoded alone, without special tokens: nothing before it is re-tokenised."""
    before = render_chat(tokenizer, messages, add_generation_prompt=False, tools=tools)
    after = render_chat(tokenizer, messages + [message], add_generation_prompt=True, tools=tools)
    if not after.startswith(before):
        raise EnvironmentError_(
            "the chat template does not render a conversation as the prefix of the longer one (it rewrites earlier "
            "turns, e.g. drops reasoning), so an environment message cannot be appended as tokens; use a template "
            "that renders prefixes consistently")
    end = before.rfind(turn_text) + len(turn_text) if turn_text else len(before)
    tail = before[end:]  # what the template writes after the turn's content (e.g. "<|im_end|>\n")
    own = generated_text[len(turn_text):] if generated_text.startswith(turn_text) else ""
    rest = tail[len(own):] if own and tail.startswith(own) else tail
    return tokenizer(rest + after[len(before):], add_special_tokens=False)["input_ids"]


@dataclass(frozen=True)
class EpisodeSettings:
    """What shapes every episode of a call (the rollout.* and environment.* keys)."""

    sampling: SamplingSettings
    """The engine's settings; its max_new_tokens is the episode's budget (model and environment tokens)."""
    max_turns: int = 1
    max_turn_tokens: Optional[int] = None
    """The most tokens of one model turn (None: the budget)."""
    error_reward: float = 0.0
    """The reward of an episode whose environment failed."""
    tools: Optional[list] = None
    """The environment's tool schemas, rendered by the chat template."""


def run_episodes(engine, tokenizer, prompt_ids: Sequence[Sequence[int]], settings: EpisodeSettings, *,
                 sample_key: Callable[[int, int], int], environments: Optional[Sequence[Any]] = None,
                 messages: Optional[Sequence[list[dict]]] = None, pool: Optional[EnvironmentPool] = None,
                 env_names: Sequence[str] = ()) -> list[Conversation]:
    """The episodes of `prompt_ids` through `engine` (see the module docstring). `sample_key(i, t)` seeds episode
    i's turn t. With `environments` (one each, already built; an error text where one failed to build, see
    `Conversation.error`), `messages` are the prompts as chat messages and `pool` calls the environments; without,
    every episode is one model turn."""
    conversations = [Conversation(messages=list(m)) for m in messages] if messages is not None else \
        [Conversation() for _ in prompt_ids]
    for i, env in enumerate(environments or ()):
        if isinstance(env, str):  # the constructor failed: the episode ends before any turn
            conversations[i].error, conversations[i].done = env, True
            conversations[i].reward = settings.error_reward
    budget = settings.sampling.max_new_tokens
    for t in range(settings.max_turns if environments is not None else 1):
        active = [i for i, c in enumerate(conversations) if not c.done]
        if not active:
            break
        turn_tokens = min(settings.max_turn_tokens or budget, min(budget - len(conversations[i].ids) for i in active))
        ids, mask, truncated, logprobs, *routes = engine.generate(
            [list(prompt_ids[i]) + conversations[i].ids for i in active], [sample_key(i, t) for i in active],
            replace(settings.sampling, max_new_tokens=max(turn_tokens, 1)))
        replies = []
        for row, i in enumerate(active):
            c = conversations[i]
            n = int(mask[row].sum())
            if routes and routes[0] is not None:
                _record_routes(c, len(prompt_ids[i]), routes[0][row], routes[1][row, :n])
            turn = ids[row, :n].tolist()
            c.ids += turn
            c.action += [1] * n
            c.logprobs += logprobs[row, :n].tolist()
            c.turns += 1
            if environments is None:  # a single turn: the episode ends with it
                c.done, c.truncated = True, bool(truncated[row])
                continue
            text = tokenizer.decode(turn, skip_special_tokens=True)
            c.messages.append({"role": "assistant", "content": text})
            replies.append((i, text, tokenizer.decode(turn, skip_special_tokens=False)))
        if environments is not None:
            _environment_turn(conversations, replies, environments, settings, pool, env_names, tokenizer,
                              last=(t == settings.max_turns - 1))
        for i in active:
            c = conversations[i]
            if not c.done and len(c.ids) >= budget:
                c.truncated, c.done = True, True
        if environments is not None:
            close_ended(conversations, environments, pool)
    if environments is not None:  # episodes still open when the turns ran out
        for c in conversations:
            c.done = True
        close_ended(conversations, environments, pool)
    return conversations


def _record_routes(c: Conversation, prompt: int, input_routes: torch.Tensor, turn_routes: torch.Tensor) -> None:
    """A turn's routes into the conversation: its input's (right-aligned: the prompt, then `c.ids`) for the
    prompt on the first turn, and for every earlier token still without one (the environment's since the last
    turn, and the last turn's last token, which its own decode never fed back); then the turn's own."""
    width = prompt + len(c.ids)
    given = input_routes[input_routes.shape[0] - width:]
    if c.prompt_routes is None:
        c.prompt_routes = given[:prompt]
    earlier = torch.cat(c.routes) if c.routes else given[prompt:prompt]
    earlier = torch.cat([earlier, given[prompt + len(earlier):]])  # (the environment's new tokens)
    none = (earlier < 0).all(-1, keepdim=True)
    c.routes = [torch.where(none, given[prompt:], earlier), turn_routes]


def close_ended(conversations: Sequence[Conversation], environments: Sequence[Any], pool: EnvironmentPool) -> None:
    """An episode's end: the environment of every episode that has ended (done, out of turns or tokens, failed)
    and is not closed yet gets its `close()` called, once, in the pool's workers (with its timeout), so that what
    it holds (an OpenEnv session, a connection, a file) is released as soon as the episode is over. What `close()`
    raises is recorded in `Conversation.close_error`, never raised into the run. Environments without `close`,
    and those whose constructor failed, have nothing to close."""
    ending = [i for i, c in enumerate(conversations) if c.done and not c.closed]
    calls = []
    for i in ending:
        conversations[i].closed = True
        closer = getattr(environments[i], "close", None)
        if not isinstance(environments[i], str) and callable(closer):
            calls.append((i, closer))
    for (i, _), (_, error) in zip(calls, pool.call([closer for _, closer in calls])):
        conversations[i].close_error = error


def _environment_turn(conversations, replies, environments, settings: EpisodeSettings, pool, env_names, tokenizer,
                      last: bool) -> None:
    """The environments answer the model's turns `replies` [(episode, text, text with special tokens)]: their
    rewards are added, their messages appended as tokens, and the episodes they end are marked done."""
    budget = settings.sampling.max_new_tokens
    results = pool.call([lambda i=i, text=text: environments[i].step(text, list(conversations[i].messages))
                         for i, text, _ in replies])
    for (i, text, generated), (reply, error) in zip(replies, results):
        c = conversations[i]
        if error is None:
            try:
                reply = check_reply(reply, env_names[i])
            except EnvironmentError_ as err:
                error = str(err)
        if error is not None:
            c.error, c.done, c.reward = error, True, settings.error_reward
            continue
        c.reward += float(reply.reward or 0.0)
        if reply.done or last or reply.message is None:
            c.done = True
            continue
        try:
            extra = environment_message_ids(tokenizer, c.messages, text, generated, reply.message, settings.tools)
        except EnvironmentError_ as err:
            c.error, c.done, c.reward = str(err), True, settings.error_reward
            continue
        c.messages.append(dict(reply.message))
        room = budget - len(c.ids)
        c.ids += extra[:room]
        c.action += [0] * min(len(extra), room)
        c.logprobs += [0.0] * min(len(extra), room)
        if len(extra) >= room:  # no room left for another model turn
            c.truncated, c.done = True, True


def as_episodes(conversations: Sequence[Conversation], budget: int, pad_id: int, multi_turn: bool,
                agent: bool = False) -> Rollout:
    """The conversations as a rollout's episode fields (`Rollout`, its prompts not yet set), each padded to the
    budget; with an environment (or an agent) its reward is `rewards["env"]`; an agent's, its segments too."""
    B, T = len(conversations), budget
    # each row's values at its first positions, one copy per tensor (a row at a time: 7 ms for 128 x 256, this 3)
    written = torch.arange(T) < torch.tensor([len(c.ids) for c in conversations], dtype=torch.long)[:, None]
    mask = written.float()
    ids = _rows_into(written, [c.ids for c in conversations], torch.full((B, T), pad_id, dtype=torch.long))
    logprobs = _rows_into(written, [c.logprobs for c in conversations], torch.zeros((B, T)))
    truncated = torch.tensor([c.truncated for c in conversations], dtype=torch.bool)
    episodes = Rollout(completion_ids=ids, completion_mask=mask, truncated=truncated, sampled_logprobs=logprobs)
    if any(c.prompt_routes is not None for c in conversations):
        episodes = replace(episodes, **_routes(conversations, T))
    if not multi_turn:
        return episodes
    if agent:
        episodes = replace(episodes, segments=torch.tensor([float(c.segments) for c in conversations]))
    return replace(episodes, action_mask=_rows_into(written, [c.action for c in conversations], torch.zeros((B, T))),
                   rewards={"env": torch.tensor([c.reward for c in conversations])},
                   turns=torch.tensor([float(c.turns) for c in conversations]),
                   env_errors=torch.tensor([float(c.error is not None) for c in conversations]),
                   error_texts=[c.error for c in conversations], close_errors=[c.close_error for c in conversations])


def _routes(conversations: Sequence[Conversation], budget: int) -> dict:
    """The conversations' routes as the rollout's fields: prompt_routes left-padded to the longest prompt (as the
    prompts are), completion_routes over the budget; -1 where none was recorded."""
    shape = next(c.prompt_routes for c in conversations if c.prompt_routes is not None).shape[1:]
    widest = max(len(c.prompt_routes) for c in conversations if c.prompt_routes is not None)
    prompt = torch.full((len(conversations), widest, *shape), -1, dtype=torch.int16)
    completion = torch.full((len(conversations), budget, *shape), -1, dtype=torch.int16)
    for b, c in enumerate(conversations):
        if c.prompt_routes is not None:
            prompt[b, widest - len(c.prompt_routes):] = c.prompt_routes
        if c.routes:
            routes = torch.cat(c.routes)[:budget]
            completion[b, :len(routes)] = routes
    return {"prompt_routes": prompt, "completion_routes": completion}


def _rows_into(written: torch.Tensor, rows: Sequence[Sequence], out: torch.Tensor) -> torch.Tensor:
    """`out` (B, T) with row b's values at its positions where `written` (B, T) is true, which are its first
    len(rows[b]) positions (a boolean mask fills in row-major order)."""
    out[written] = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=out.dtype)
    return out


def build_environments(env_cls, rows: Sequence[dict], seeds: Sequence[int], pool: EnvironmentPool) -> list:
    """One environment per episode, built in the pool (a constructor may hang or raise too): the instance, or
    the error text for that episode."""
    built = pool.call([lambda row=row, seed=seed: env_cls(row, seed) for row, seed in zip(rows, seeds)])
    return [env if error is None else f"environment constructor: {error}" for env, error in built]


__all__ = ["Conversation", "EpisodeSettings", "as_episodes", "build_environments",
           "environment_message_ids", "run_episodes"]

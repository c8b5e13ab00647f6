"""Multi-turn rollouts: model turns and environment turns, token in, token out.

    for turn t = 0 .. environment.max_turns - 1, over the episodes still running:
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

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from tidyrl.environments import EnvironmentError_, EnvironmentPool, EnvReply, check_reply


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
    """The trajectory reached the token budget (rollout.max_new_tokens) before the episode ended."""
    error: Optional[str] = None
    done: bool = False


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, tools=None) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **({"tools": tools} if tools else {}))


def environment_message_ids(tokenizer, messages: list[dict], turn_text: str, generated_text: str, message: dict,
                            tools=None) -> list[int]:
    """The tokens an environment message adds after the model's turn: the chat template's text for
    `messages` (ending with the model's turn, `turn_text`) plus `message` plus the next generation prompt,
    minus the text already there, less what the model itself generated after its content (`generated_text`,
    e.g. its end-of-turn token). Encoded alone, without special tokens: nothing before it is re-tokenised."""
    before = _render(tokenizer, messages, False, tools)
    after = _render(tokenizer, messages + [message], True, tools)
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


def run_conversations(policy, tokenizer, prompt_ids: Sequence[list[int]], prompt_messages: Sequence[list[dict]],
                      environments: Sequence[Any], *, sample_key: Callable[[int, int], int], budget: int,
                      max_turns: int, max_turn_tokens: int, pool: EnvironmentPool, generate_kwargs: dict,
                      env_names: Sequence[str], tools=None, error_reward: float = 0.0) -> list[Conversation]:
    """The multi-turn episodes of `prompt_ids` (one environment each, already built; None = it failed to build,
    see `Conversation.error`). `sample_key(i, t)` seeds episode i's turn t. See the module docstring."""
    from tidyrl.models.generation import generate

    conversations = [Conversation(messages=list(m)) for m in prompt_messages]
    for i, env in enumerate(environments):
        if isinstance(env, str):  # the constructor failed: the episode ends before any turn
            conversations[i].error, conversations[i].done, conversations[i].reward = env, True, error_reward
    for t in range(max_turns):
        active = [i for i, c in enumerate(conversations) if not c.done]
        if not active:
            break
        turn_tokens = min(max_turn_tokens, min(budget - len(conversations[i].ids) for i in active))
        ids, mask, _, logprobs = generate(
            policy, [list(prompt_ids[i]) + conversations[i].ids for i in active],
            sample_keys=[sample_key(i, t) for i in active], max_new_tokens=max(turn_tokens, 1),
            return_logprobs=True, **generate_kwargs)
        replies = []
        for row, i in enumerate(active):
            c = conversations[i]
            n = int(mask[row].sum())
            turn = ids[row, :n].tolist()
            c.ids += turn
            c.action += [1] * n
            c.logprobs += logprobs[row, :n].tolist()
            c.turns += 1
            text = tokenizer.decode(turn, skip_special_tokens=True)
            c.messages.append({"role": "assistant", "content": text})
            replies.append((i, text, tokenizer.decode(turn, skip_special_tokens=False)))
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
                c.error, c.done, c.reward = error, True, error_reward
                continue
            c.reward += float(reply.reward or 0.0)
            if reply.done or t == max_turns - 1 or reply.message is None:
                c.done = True
                continue
            try:
                extra = environment_message_ids(tokenizer, c.messages, text, generated, reply.message, tools)
            except EnvironmentError_ as err:
                c.error, c.done, c.reward = str(err), True, error_reward
                continue
            c.messages.append(dict(reply.message))
            room = budget - len(c.ids)
            c.ids += extra[:room]
            c.action += [0] * min(len(extra), room)
            c.logprobs += [0.0] * min(len(extra), room)
            if len(extra) >= room:  # no room left for another model turn
                c.truncated, c.done = True, True
        for i in active:
            c = conversations[i]
            if not c.done and len(c.ids) >= budget:
                c.truncated, c.done = True, True
    return conversations


def build_environments(env_cls, rows: Sequence[dict], seeds: Sequence[int], pool: EnvironmentPool) -> list:
    """One environment per episode, built in the pool (a constructor may hang or raise too): the instance, or
    the error text for that episode."""
    built = pool.call([lambda row=row, seed=seed: env_cls(row, seed) for row, seed in zip(rows, seeds)])
    return [env if error is None else f"environment constructor: {error}" for env, error in built]


__all__ = ["Conversation", "EnvReply", "build_environments", "environment_message_ids", "run_conversations"]

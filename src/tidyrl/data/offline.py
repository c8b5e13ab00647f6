"""Data of the offline stages: load, check and tokenise SFT examples and preference pairs.

Formats (docs/stages.md), one row per example; column names are config keys:

    sft      {"prompt": ..., "completion": ...}   or   {"messages": [...]}
    reward   {"prompt": ..., "chosen": ..., "rejected": ...}     (+ a margin column, optional)
    dpo      {"prompt": ..., "chosen": ..., "rejected": ...}

A prompt is a string or a list of chat messages; a completion (chosen,
rejected) is a string or a list of messages that continue the prompt's
conversation. The text is built exactly as the RL stages build it
(tidyrl.data): a string prompt is used as is and tokenised with the
tokenizer's special tokens; a message-list prompt goes through the chat
template with `add_generation_prompt=True` and is tokenised without special
tokens (the template writes BOS). A string completion is tokenised on its own
and appended to the prompt's tokens, as generated tokens are in a rollout, so
SFT and DPO train on the very token sequences GRPO will sample and score.

Every row is checked before any model is loaded; problems raise
`tidyrl.data.DataError` naming the config key, the 0-based row and the fix.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

from tidyrl.data.errors import DataError
from tidyrl.data.prompts import _prompt_problem, _short, load_table, render_chat


@dataclass
class TokenizedSequence:
    """One tokenised sequence of an offline stage."""

    input_ids: list[int]
    target_mask: list[int]
    """1 where the token is a training target (SFT: the loss; DPO: the sequence log-prob); the first token
    of an example is never a target (nothing predicts it)."""
    position_ids: Optional[list[int]] = None
    """Packed SFT rows only: positions restart at 0 at each example, which is how the model knows where the
    examples start (transformers then masks attention block by block)."""


@dataclass
class TokenizedPair:
    """One preference pair: chosen and rejected continuations of the same prompt."""

    chosen: TokenizedSequence
    rejected: TokenizedSequence
    margin: float = 0.0
    """reward: the Bradley–Terry margin of this pair (reward.margin_column), 0 without one."""


# ---------------------------------------------------------------------------
# Loading and checking


def load_sft_examples(cfg, tokenizer, eos_ids: list[int]) -> tuple[list[TokenizedSequence], list[str]]:
    """The SFT examples of `cfg.data`, tokenised, one per row (pack_examples packs them); plus notes to print
    (truncations). Uses `messages` when the data has no completion column."""
    d = cfg.data
    table = load_table(d.path, d.split)
    columns = table.column_names
    if d.completion_column in columns:
        _require(columns, d.prompt_column, "data.prompt_column", d.path, "the prompt the completion follows")
        prompts, completions = table[d.prompt_column], table[d.completion_column]
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            _check_prompt(prompt, i, "data.prompt_column", d.prompt_column, d.path)
            _check_completion(prompt, completion, i, "data.completion_column", d.completion_column, d.path)
        pieces = [_completion_segments(p, c, tokenizer) for p, c in zip(prompts, completions)]
    elif d.messages_column in columns:
        conversations = table[d.messages_column]
        for i, messages in enumerate(conversations):
            _check_conversation(messages, i, d.messages_column, d.path)
        tools = [_tools(t, i, d.tools_column, d.path) for i, t in enumerate(table[d.tools_column])] \
            if d.tools_column in columns else [None] * len(conversations)
        pieces = [_conversation_segments(_clean(m), 0, tokenizer, i, tools[i]) for i, m in enumerate(conversations)]
    else:
        raise DataError(
            f"data.path = {d.path!r} has neither a completion column (data.completion_column = "
            f"{d.completion_column!r}) nor a conversation column (data.messages_column = {d.messages_column!r}); "
            f"the columns present are {columns}. sft needs prompt + completion, or messages: rename the columns "
            "or set data.prompt_column / data.completion_column / data.messages_column to them."
        )
    eos = _eos_to_append(tokenizer, eos_ids)
    examples, notes, cut = [], [], 0
    for i, (segments, special) in enumerate(pieces):
        seq = _encode(segments, special, tokenizer, eos, eos_ids, train_all=not cfg.sft.completion_only_loss)
        seq, was_cut = _truncate(seq, d.max_length, i, d.path)
        cut += was_cut
        examples.append(seq)
    if cut:
        notes.append(f"{cut} of {len(examples)} examples are longer than data.max_length={d.max_length} tokens "
                     "and were cut at the end")
    return examples, notes


def pack_examples(examples: list[TokenizedSequence], max_length: int) -> tuple[list[TokenizedSequence], str]:
    """sft.packing: the examples packed into rows (pack_sequences), and the note that says so."""
    packed = pack_sequences(examples, max_length)
    return packed, (f"packed {len(examples)} examples into {len(packed)} rows of up to {max_length} tokens "
                    "(train.batch_size counts rows)")



def load_preference_pairs(cfg, tokenizer, eos_ids: list[int], *, whole_text: bool,
                          margin_column: Optional[str] = None) -> tuple[list[TokenizedPair], list[str]]:
    """The preference pairs of `cfg.data`, tokenised; plus notes to print.

    `whole_text=True` (reward model): each sequence is the whole text tokenised at once, as a reward model
    reads a decoded completion (`reward_model_input_ids`), cut from the left to data.max_length; no EOS is
    appended. False (DPO): prompt and completion tokenised apart and EOS appended, as in a rollout, with the
    completion tokens as targets, cut at the end. `margin_column` (the reward model's reward.margin_column):
    the column of each pair's margin, checked to be a finite number; None reads no margin (0 for every pair).
    """
    d = cfg.data
    table = load_table(d.path, d.split)
    columns = table.column_names
    for key, column, what in (("data.prompt_column", d.prompt_column, "the prompt both completions follow"),
                              ("data.chosen_column", d.chosen_column, "the preferred completion"),
                              ("data.rejected_column", d.rejected_column, "the dispreferred completion")):
        _require(columns, column, key, d.path, what)
    if margin_column is not None:
        _require(columns, margin_column, "reward.margin_column", d.path, "the margin of each pair")
    prompts, chosen, rejected = table[d.prompt_column], table[d.chosen_column], table[d.rejected_column]
    margins = table[margin_column] if margin_column is not None else [0.0] * len(prompts)
    for i in range(len(prompts)):
        _check_prompt(prompts[i], i, "data.prompt_column", d.prompt_column, d.path)
        _check_completion(prompts[i], chosen[i], i, "data.chosen_column", d.chosen_column, d.path)
        _check_completion(prompts[i], rejected[i], i, "data.rejected_column", d.rejected_column, d.path)
        m = margins[i]
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not math.isfinite(m):
            raise DataError(f"data.path = {d.path!r}, row {i} (0-based): the margin (reward.margin_column = "
                            f"{margin_column!r}) holds {_short(m)}; it must be a finite number.")

    eos = None if whole_text else _eos_to_append(tokenizer, eos_ids)
    pairs, cut = [], 0
    for i in range(len(prompts)):
        sides = []
        for completion in (chosen[i], rejected[i]):
            if whole_text:
                # Cut from the left, as the RL stages cut a reward model's input: the completion's end is scored.
                ids = reward_model_input_ids(prompts[i], completion, tokenizer)
                was_cut = d.max_length is not None and len(ids) > d.max_length
                ids = ids[-d.max_length:] if was_cut else ids
                seq = TokenizedSequence(ids, [1] * len(ids))
            else:
                segments, special = _completion_segments(prompts[i], completion, tokenizer)
                seq = _encode(segments, special, tokenizer, eos, eos_ids, train_all=False)
                seq, was_cut = _truncate(seq, d.max_length, i, d.path)
            cut += was_cut
            sides.append(seq)
        if whole_text and sides[0].input_ids == sides[1].input_ids:
            raise DataError(f"data.path = {d.path!r}, row {i} (0-based): chosen and rejected are the same tokens"
                            f"{' after cutting to data.max_length' if d.max_length else ''}, so no reward can "
                            "prefer one; fix the row or raise data.max_length.")
        pairs.append(TokenizedPair(sides[0], sides[1], float(margins[i])))
    notes = []
    if cut:
        notes.append(f"{cut} of {2 * len(pairs)} chosen/rejected sequences are longer than data.max_length="
                     f"{d.max_length} tokens and were cut at the {'start' if whole_text else 'end'}")
    return pairs, notes


@dataclass
class KTOExample:
    """One unpaired KTO example: prompt + completion, and whether the completion is desirable."""

    sequence: TokenizedSequence
    desirable: bool

    @property
    def prompt_length(self) -> int:
        """Tokens before the completion (the completion's tokens are the targets, contiguous at the end)."""
        return self.sequence.target_mask.index(1)


def load_kto_examples(cfg, tokenizer, eos_ids: list[int]) -> tuple[list[KTOExample], list[str]]:
    """The unpaired examples of `cfg.data` for KTO (TRL's columns: prompt, completion, label), tokenised as DPO's
    sides are (prompt and completion apart, EOS appended, the completion the targets); plus notes. A label that is
    not a boolean, or a file with only one kind of label, is an error naming the row or the counts."""
    d = cfg.data
    table = load_table(d.path, d.split)
    columns = table.column_names
    for key, column, what in (("data.prompt_column", d.prompt_column, "the prompt"),
                              ("data.completion_column", d.completion_column, "the completion"),
                              ("data.label_column", d.label_column, "true: desirable, false: undesirable")):
        _require(columns, column, key, d.path, what)
    prompts, completions, labels = table[d.prompt_column], table[d.completion_column], table[d.label_column]
    for i in range(len(prompts)):
        _check_prompt(prompts[i], i, "data.prompt_column", d.prompt_column, d.path)
        _check_completion(prompts[i], completions[i], i, "data.completion_column", d.completion_column, d.path)
        if not isinstance(labels[i], bool):
            raise DataError(f"data.path = {d.path!r}, row {i} (0-based): the label (data.label_column = "
                            f"{d.label_column!r}) holds {_short(labels[i])}; it must be true (a desirable completion) "
                            "or false (an undesirable one).")
    desirable = sum(labels)
    if desirable in (0, len(labels)):
        raise DataError(f"data.path = {d.path!r}: KTO needs both desirable and undesirable examples, but all "
                        f"{len(labels)} rows have {d.label_column}={str(bool(desirable)).lower()}. Add examples of the "
                        "other kind, or use sft (only desirable ones) instead.")
    eos = _eos_to_append(tokenizer, eos_ids)
    examples, cut = [], 0
    for i in range(len(prompts)):
        segments, special = _completion_segments(prompts[i], completions[i], tokenizer)
        seq = _encode(segments, special, tokenizer, eos, eos_ids, train_all=False)
        seq, was_cut = _truncate(seq, d.max_length, i, d.path)
        cut += was_cut
        examples.append(KTOExample(seq, bool(labels[i])))
    notes = [f"{desirable} desirable and {len(labels) - desirable} undesirable examples"]
    if cut:
        notes.append(f"{cut} of {len(examples)} examples are longer than data.max_length={d.max_length} tokens and "
                     "were cut at the end")
    return examples, notes


def mismatched_sequence(prompt_of: KTOExample, completion_of: KTOExample, max_length: Optional[int]
                        ) -> TokenizedSequence:
    """KTO's mismatched pair (x_i, y_j): the prompt tokens of one example followed by the completion tokens of
    another, the completion the targets; cut at the end to max_length (the prompt is whole: it fit before)."""
    p, c = prompt_of.sequence, completion_of.sequence
    ids = p.input_ids[: prompt_of.prompt_length] + c.input_ids[completion_of.prompt_length:]
    mask = [0] * prompt_of.prompt_length + c.target_mask[completion_of.prompt_length:]
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return TokenizedSequence(ids, mask)


def kto_key(example: KTOExample) -> tuple:
    return tuple(example.sequence.input_ids), example.desirable


def check_distinct_pairs(pairs: list[TokenizedPair], path: str, max_length: Optional[int]) -> None:
    """Refuse pairs whose chosen and rejected are the same tokens, naming every such row.

    Such a pair gives every preference loss zero gradient (h = 0 for any policy; ORPO keeps only its SFT term)
    and is almost surely a data bug, so it is an error rather than a silent drop.
    """
    same = [i for i, p in enumerate(pairs) if p.chosen.input_ids == p.rejected.input_ids]
    if same:
        shown = ", ".join(map(str, same[:20])) + (f", ... ({len(same)} in all)" if len(same) > 20 else "")
        raise DataError(f"data.path = {path!r}: {len(same)} of {len(pairs)} rows have chosen and rejected the same "
                        f"tokens{' after cutting to data.max_length' if max_length else ''}, so no loss can prefer "
                        f"one: rows {shown} (0-based). Fix or remove them"
                        f"{' or raise data.max_length' if max_length else ''}.")


def held_out_rows(num_rows: int, fraction: float, seed: int) -> list[int]:
    """The rows data.eval_fraction holds out of `num_rows`: round(fraction * N) of them (at least one), drawn
    with `seed` (the same rows on every process and every run), in increasing order."""
    import torch

    n = max(1, round(fraction * num_rows))
    if n >= num_rows:
        raise DataError(f"data.eval_fraction = {fraction} holds out {n} of the {num_rows} rows, leaving none to "
                        "train on; lower it or give a held-out file as data.eval_path")
    order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(order[:n])


def split_train_eval(cfg, items: list, load_eval, key) -> tuple[list, list, list[str]]:
    """(train items, eval items, notes). The eval items come from data.eval_path (`load_eval(cfg)` with that path)
    or are data.eval_fraction of `items` (held_out_rows); none without either. An eval item whose `key(item)`
    (its tokens) is also a training item is counted in a note: eval metrics on it measure memory, not
    generalisation."""
    import dataclasses

    d = cfg.data
    if d.eval_path:
        eval_items = load_eval(dataclasses.replace(cfg, data=dataclasses.replace(d, path=d.eval_path)))
        train_items = items
    elif d.eval_fraction > 0:
        rows = set(held_out_rows(len(items), d.eval_fraction, cfg.seed))
        eval_items = [x for i, x in enumerate(items) if i in rows]
        train_items = [x for i, x in enumerate(items) if i not in rows]
    else:
        return items, [], []
    source = f"data.eval_path = {d.eval_path!r}" if d.eval_path else f"data.eval_fraction = {d.eval_fraction}"
    every = cfg.log.eval_every
    notes = [f"eval: {len(eval_items)} held-out examples ({source}), scored "
             + (f"every {every} optimizer step{'s' if every != 1 else ''}" if every else "after the last optimizer step")]
    seen = {key(x) for x in train_items}
    shared = sum(key(x) in seen for x in eval_items)
    if shared:
        notes.append(f"warning: {shared} of {len(eval_items)} eval examples also appear in the training data (the "
                     f"same tokens); their eval metrics measure memory, not generalisation. Remove them from "
                     f"{d.eval_path or d.path}.")
    return train_items, eval_items, notes


def sequence_key(seq: TokenizedSequence) -> tuple:
    return tuple(seq.input_ids)


def pair_key(pair: TokenizedPair) -> tuple:
    return tuple(pair.chosen.input_ids), tuple(pair.rejected.input_ids)


def load_stage_items(cfg, tokenizer, *, packing: bool) -> tuple[list, list]:
    """(training items, held-out items) of an offline stage, tokenised as its loop tokenises them, for `tidyrl
    plan`: sft's examples (packed into rows where `packing`: tidyrl.config.packs_rows), reward's and dpo's pairs,
    kto's examples. Their count is the plan's N; their lengths set the memory plan's longest sequence."""
    eos_ids = completion_eos_ids(cfg.model, tokenizer)
    if cfg.algorithm == "sft":
        load, key = (lambda c: load_sft_examples(c, tokenizer, eos_ids)[0]), sequence_key
    elif cfg.algorithm in ("reward", "dpo"):
        margin = cfg.reward.margin_column if cfg.algorithm == "reward" else None
        load, key = (lambda c: load_preference_pairs(c, tokenizer, eos_ids, whole_text=cfg.algorithm == "reward",
                                                     margin_column=margin)[0]), pair_key
    else:
        load, key = (lambda c: load_kto_examples(c, tokenizer, eos_ids)[0]), kto_key
    train, held_out, _ = split_train_eval(cfg, load(cfg), load, key)
    if packing:  # after the split, as the loop packs: a row never mixes train and held-out examples
        train = pack_sequences(train, cfg.data.max_length)
    return train, held_out


def completion_eos_ids(model_path: str, tokenizer) -> list[int]:
    """Every EOS id of the tokenizer and of the model's generation config (read without the weights): the ids
    that end a completion in a rollout (tidyrl.models.sequences.eos_token_ids)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if os.path.isfile(os.path.join(str(model_path), "generation_config.json")):
        from transformers import GenerationConfig

        gen_eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        if gen_eos is not None:
            ids.update([gen_eos] if isinstance(gen_eos, int) else gen_eos)
    return sorted(ids)


def _require(columns: list[str], column: str, key: str, path: str, what: str) -> None:
    if column not in columns:
        raise DataError(f"{key} = {column!r} ({what}) is not a column of data.path = {path!r}; the columns present "
                        f"are {columns}. Rename the column or set {key} to one of them.")


def _check_prompt(prompt: Any, row: int, key: str, column: str, path: str) -> None:
    problem = _prompt_problem(prompt)
    if problem is not None:
        raise DataError(f"data.path = {path!r}, row {row} (0-based): the prompt ({key} = {column!r}) holds "
                        f"{_short(prompt)}, which {problem}. A prompt is a non-empty string or a non-empty list "
                        'of chat messages like [{"role": "user", "content": "..."}].')


def _check_completion(prompt: Any, completion: Any, row: int, key: str, column: str, path: str) -> None:
    where = f"data.path = {path!r}, row {row} (0-based): {key} = {column!r} holds {_short(completion)}"
    if isinstance(completion, str):
        if not completion:
            raise DataError(f"{where}, an empty string; a completion needs some text.")
        return
    problem = _prompt_problem(completion)
    if problem is not None:
        raise DataError(f"{where}, which {problem}. A completion is a string, or a list of messages that "
                        "continues the prompt's conversation.")
    if isinstance(prompt, str):
        raise DataError(f"{where}: chat messages after a string prompt cannot be rendered together. Use a "
                        "message-list prompt with message completions, or string completions.")
    if not any(m["role"] == "assistant" for m in completion):
        raise DataError(f"{where}, with no assistant message: there is nothing to train on. A message completion "
                        'holds the assistant turn, e.g. [{"role": "assistant", "content": "..."}].')


def _check_conversation(messages: Any, row: int, column: str, path: str) -> None:
    problem = _prompt_problem(messages) if not isinstance(messages, str) else "is a string, not a list of messages"
    where = f"data.path = {path!r}, row {row} (0-based): the conversation (data.messages_column = {column!r})"
    if problem is not None:
        raise DataError(f"{where} holds {_short(messages)}, which {problem}. A conversation is a non-empty list "
                        'of chat messages like [{"role": "user", ...}, {"role": "assistant", ...}].')
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where} has no assistant message: there is nothing to train on. Add the assistant's "
                        "reply, or drop the row.")


# ---------------------------------------------------------------------------
# Rendering: text pieces, each marked trainable or not


def _clean(messages: list[dict]) -> list[dict]:
    """Drop keys whose value is None (Arrow fills keys only some messages have), as tidyrl.data.render_prompt."""
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def _tools(value: Any, row: int, column: str, path: str) -> Optional[list]:
    """A row's tool schemas: a list of dicts, or a JSON string of one (Arrow unifies the schemas of a column into
    one struct type, filling the keys a schema lacks with None: those are dropped again)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise DataError(f"data.path = {path!r}, row {row} (0-based): the tools (data.tools_column = {column!r}) "
                            f"are a string but not JSON ({err.msg}); write the list of tool schemas") from None
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise DataError(f"data.path = {path!r}, row {row} (0-based): the tools (data.tools_column = {column!r}) hold "
                        f"{_short(value)}; write a list of JSON schemas (ToolEnvironment.tool_schemas()) or that "
                        "list as a JSON string")
    return [_without_none(t) for t in value] or None


def _without_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_none(v) for v in value]
    return value


def _render(messages: list[dict], tokenizer, add_generation_prompt: bool, tools: Optional[list] = None) -> str:
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError("the data holds chat messages, but the tokenizer has no chat_template to render them. "
                        "Use string prompts and completions, or a tokenizer (model / tokenizer) with a chat template.")
    return render_chat(tokenizer, messages, add_generation_prompt=add_generation_prompt, tools=tools)


def _completion_segments(prompt, completion, tokenizer) -> tuple[list[tuple[str, bool]], bool]:
    """(segments, add_special_tokens) of a prompt and its completion: the prompt as the RL stages render it
    (tidyrl.data.render_prompt), then the completion (trainable)."""
    from tidyrl.data.prompts import render_prompt

    if isinstance(completion, str):
        return [(render_prompt(prompt, tokenizer), False), (completion, True)], isinstance(prompt, str)
    prompt = _clean(prompt)
    return _conversation_segments(prompt + _clean(completion), len(prompt), tokenizer, None)


def _conversation_segments(messages: list[dict], first: int, tokenizer, row: Optional[int],
                           tools: Optional[list] = None) -> tuple[list[tuple[str, bool]], bool]:
    """Split the rendered conversation into (text, trainable) pieces: each assistant message at index >= `first`
    is trainable: the text its turn adds after the generation prompt, i.e.
    render(messages[:i+1]) minus render(messages[:i], add_generation_prompt=True). Messages after the last
    assistant message carry no loss and are left out."""
    segments, done = [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < first:
            continue
        before = _render(messages[:i], tokenizer, add_generation_prompt=True, tools=tools)
        through = _render(messages[: i + 1], tokenizer, add_generation_prompt=False, tools=tools)
        if not (before.startswith(done) and through.startswith(before)):
            where = "" if row is None else f"row {row} (0-based): "
            raise DataError(
                f"{where}the tokenizer's chat template does not render this conversation prefix-consistently "
                f"(the text up to message {i} changes when later messages are added), so its assistant tokens "
                "cannot be located. Use prompt/completion columns with string completions instead."
            )
        segments += [(before[len(done):], False), (through[len(before):], True)]
        done = through
    return segments, False


def reward_model_input_ids(prompt, completion, tokenizer) -> list[int]:
    """The token ids a reward model reads for (prompt, completion), exactly as the RL stages score a completion
    with it (tidyrl.rewards.reward_models.RewardModel.encode, before its left cut): the whole text tokenised at once,
    with the tokenizer's special tokens only for a string prompt (a chat template writes its own).

        string prompt:    prompt + completion
        message prompt:   apply_chat_template(prompt + [{"role": "assistant", "content": completion}])
                          apply_chat_template(prompt + completion)     (a message-list completion)

    No EOS is appended to plain text: a reward model scores decoded text, and decoding drops EOS."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt + completion, add_special_tokens=True)["input_ids"])
    turns = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else _clean(completion)
    text = _render(_clean(prompt) + turns, tokenizer, add_generation_prompt=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------------
# Tokenising


def _eos_to_append(tokenizer, eos_ids: list[int]) -> tuple[int, int]:
    """(the end appended to a completion of a string prompt, the end appended to one of a chat prompt): the EOS, and
    after a chat prompt the token the chat template ends an assistant turn with where it is one of `eos_ids`
    (Gemma's <end_of_turn>, not its <eos>: a turn ends as the template ends it), else the EOS."""
    if tokenizer.eos_token_id is not None:
        eos = tokenizer.eos_token_id
    elif eos_ids:
        eos = eos_ids[0]
    else:
        raise DataError("the tokenizer and the model's generation config define no EOS token, so completions cannot "
                        "be taught to end. Set the tokenizer's eos_token or `eos_token_id` in generation_config.json.")
    return eos, _turn_end(tokenizer, eos_ids) or eos


def _turn_end(tokenizer, eos_ids: list[int]) -> Optional[int]:
    """The first of `eos_ids` among the tokens the chat template writes after an assistant message's text, or None
    (no template, or it ends a turn with none of them)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    probe = "tidyrl-probe"
    try:
        text = _render([{"role": "user", "content": "?"}, {"role": "assistant", "content": probe}], tokenizer,
                       add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - a template that renders no such conversation: the EOS
        return None
    after = text[text.rfind(probe) + len(probe):] if probe in text else ""
    return next((t for t in tokenizer(after, add_special_tokens=False)["input_ids"] if t in eos_ids), None)


def _encode(segments: list[tuple[str, bool]], add_special_tokens: bool, tokenizer, eos: int, eos_ids: list[int],
            *, train_all: bool) -> TokenizedSequence:
    """Tokenise each piece on its own (as a rollout appends generated tokens to the prompt's) and mark targets.

    EOS: a completion must end the way a generated one does, or the policy never learns to stop. If the
    trainable tokens hold no EOS id (a chat template's end-of-turn token usually is one), the end is appended:
    `eos` is `_eos_to_append`'s pair, the EOS after a string prompt, the template's turn end after a chat one.
    """
    ids, mask, completion_ids = [], [], []
    for k, (text, trainable) in enumerate(segments):
        piece = tokenizer(text, add_special_tokens=add_special_tokens and k == 0)["input_ids"]
        ids += piece
        mask += [1 if (trainable or train_all) else 0] * len(piece)
        completion_ids += piece if trainable else []
    end = eos[0] if add_special_tokens else eos[1]
    if not any(t in eos_ids or t in eos for t in completion_ids):
        ids.append(end)
        mask.append(1)
    mask[0] = 0  # the first token is predicted by nothing
    return TokenizedSequence(ids, mask)


def _truncate(seq: TokenizedSequence, max_length: Optional[int], row: int, path: str
              ) -> tuple[TokenizedSequence, bool]:
    """Cut at the end to `max_length` tokens; the prompt must leave room for at least one target token."""
    if max_length is None or len(seq.input_ids) <= max_length:
        return seq, False
    cut = TokenizedSequence(seq.input_ids[:max_length], seq.target_mask[:max_length])
    if not any(cut.target_mask) and any(seq.target_mask):
        raise DataError(f"data.path = {path!r}, row {row} (0-based): the prompt alone fills data.max_length="
                        f"{max_length} tokens, so no completion token is left to train on; raise data.max_length or "
                        "shorten the prompt.")
    return cut, True


def pack_sequences(sequences: list[TokenizedSequence], max_length: int) -> list[TokenizedSequence]:
    """Pack whole sequences, in order, into rows of at most `max_length` tokens (next fit: start a new row when
    the next sequence does not fit). Positions restart at 0 at each sequence, so each attends only to itself."""
    rows: list[TokenizedSequence] = []
    current = TokenizedSequence([], [], [])
    for seq in sequences:
        if current.input_ids and len(current.input_ids) + len(seq.input_ids) > max_length:
            rows.append(current)
            current = TokenizedSequence([], [], [])
        current.input_ids += seq.input_ids
        current.target_mask += seq.target_mask
        current.position_ids += list(range(len(seq.input_ids)))
    if current.input_ids:
        rows.append(current)
    return rows

"""Prompt data: load the prompt set, render chat messages, and order prompts.

The prompt set is a table with one prompt per row (`data.prompt_column`) and
any number of other columns (reference answers, test cases, ...). The other
columns are handed to the reward functions next to each completion.

A prompt is either a plain string, used as is, or a list of chat messages
(`{"role": ..., "content": ...}`) rendered with the policy tokenizer's chat
template (DESIGN §3, step 1).

`PromptStream` is the prompt order of DESIGN §2: each dataset epoch is a fresh
shuffle by `seed`, epochs follow each other, and rollout i takes the stream
positions [i*P, (i+1)*P), so no prompt is skipped at an epoch boundary.

`datasets` and numpy are imported inside the functions: `import tidyrl.data` stays light.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Optional, TYPE_CHECKING, Any

from tidyrl.data.errors import DataError

if TYPE_CHECKING:  # pragma: no cover
    import datasets

FILE_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
"""File extension -> `datasets` builder used to read it."""


# ---------------------------------------------------------------------------
# Loading


def load_rl_prompts(cfg) -> "datasets.Dataset":
    """The prompt set of an RL config: data.path read (load_prompt_dataset), or data.reasoning_gym's generated
    problems (tidyrl.data.reasoning_gym)."""
    d = cfg.data
    if d.reasoning_gym is not None:
        from tidyrl.data.reasoning_gym import reasoning_gym_dataset

        return reasoning_gym_dataset(d.reasoning_gym, d.reasoning_gym_size, cfg.seed, d.reasoning_gym_options,
                                     d.prompt_column)
    return load_prompt_dataset(d.path, d.prompt_column, d.split)


def load_prompt_dataset(path: str, prompt_column: str = "prompt", split: str = "train") -> "datasets.Dataset":
    """Load the prompt set from a local file or a saved `datasets` folder, and check it.

    `path` is a .jsonl / .json / .parquet / .csv file, or a folder written by
    `Dataset.save_to_disk` or `DatasetDict.save_to_disk` (then `split` picks
    the split). Nothing is downloaded. Files are read into memory through a
    temporary cache folder, so the user's Hugging Face cache is left untouched.

    Every row is checked: the prompt must be a non-empty string or a non-empty
    list of `{"role", "content"}` messages. Problems raise `DataError`.
    """
    if _is_jsonl_file(path):
        # Checked on the lines themselves, before `datasets` reads them: the error names the line (and on
        # datasets 3, a column mixing types would fail inside Arrow before any row could be named).
        for index, (line, row) in enumerate(read_jsonl_rows(path)):
            if prompt_column in row:
                _raise_on_bad_prompt(os.path.expanduser(str(path)), f"line {line} (row {index}, 0-based)",
                                     row[prompt_column], prompt_column)
    dataset = load_table(path, split)
    path = os.path.expanduser(str(path))
    if prompt_column not in dataset.column_names:
        raise DataError(
            f"data.prompt_column = {prompt_column!r} is not a column of data.path = {path!r}; "
            f"the columns present are {dataset.column_names}. Set data.prompt_column to one of them."
        )
    for index, prompt in enumerate(dataset[prompt_column]):
        _raise_on_bad_prompt(path, f"row {index} (0-based)", prompt, prompt_column)
    return dataset


def _raise_on_bad_prompt(path: str, place: str, prompt: Any, prompt_column: str) -> None:
    problem = _prompt_problem(prompt)
    if problem is not None:
        raise DataError(
            f"data.path = {path!r}, {place}: the prompt column "
            f"(data.prompt_column = {prompt_column!r}) holds {_short(prompt)}, which {problem}. "
            'Each prompt must be a non-empty string, or a non-empty list of chat messages like '
            '[{"role": "user", "content": "..."}].'
        )


def _is_jsonl_file(path) -> bool:
    path = os.path.expanduser(str(path or ""))
    return os.path.isfile(path) and os.path.splitext(path)[1].lower() == ".jsonl"


def read_jsonl_rows(path: str) -> list[tuple[int, dict]]:
    """(line number, object) of each non-blank line of a JSON Lines file. A line that is not UTF-8 text, not
    JSON, or JSON but not an object raises `DataError` naming the file and the line (1-based)."""
    path = os.path.expanduser(str(path))
    rows = []
    with open(path, "rb") as file:
        for number, raw in enumerate(file, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"data.path = {path!r}, line {number}: byte {raw[err.start]:#04x} at column {err.start + 1} "
                    "is not UTF-8 text; save the file as UTF-8 (JSON Lines files are UTF-8)."
                ) from None
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as err:
                raise DataError(
                    f"data.path = {path!r}, line {number}: not valid JSON ({err.msg} at column {err.colno}): "
                    f"{_short(text.strip())}. Each line of a .jsonl file must be one JSON object."
                ) from None
            if not isinstance(row, dict):
                raise DataError(
                    f"data.path = {path!r}, line {number}: a JSON {type(row).__name__}, not an object: "
                    f"{_short(text.strip())}. Each line of a .jsonl file must be one JSON object, e.g. "
                    '{"prompt": "..."}.'
                )
            rows.append((number, row))
    return rows


def _mixed_column(rows: list[tuple[int, dict]]) -> str | None:
    """The first column whose values have two JSON types on two lines (null aside; ints and floats are one
    type), said with both line numbers: what `datasets` cannot turn into one Arrow column."""
    def kind(value):
        return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__

    first: dict[str, tuple[str, int]] = {}
    for number, row in rows:
        for column, value in row.items():
            if value is None:
                continue
            seen = first.setdefault(column, (kind(value), number))
            if seen[0] != kind(value):
                return (f"column {column!r} holds a {kind(value)} on line {number} but a {seen[0]} on line "
                        f"{seen[1]}; a column must hold one type on every line (null for a missing value)")
    return None


def load_table(path: str, split: str = "train") -> "datasets.Dataset":
    """Read `data.path` (a .jsonl / .json / .parquet / .csv file or a saved `datasets` folder) into memory,
    checking only that it exists, parses and holds rows; the caller checks the columns. Nothing is downloaded,
    and the user's Hugging Face cache is left untouched. Problems raise `DataError`."""
    import datasets

    if not path:
        raise DataError("data.path is not set: point it at a .jsonl, .json, .parquet or .csv file, or a saved datasets folder.")
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        where = "" if os.path.isabs(path) else (f" (a relative path is looked up in the current directory "
                                                  f"{os.getcwd()!r}, then beside the config file)")
        raise DataError(f"data.path = {path!r} does not exist{where}; fix the path or use an absolute one.")

    was_enabled = datasets.utils.logging.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        if os.path.isdir(path):
            dataset = _load_saved_folder(path, split)
        else:
            dataset = _load_file(path)
    finally:
        if was_enabled:
            datasets.enable_progress_bars()
    if len(dataset) == 0:
        raise DataError(_EMPTY.format(path=path))
    return dataset


def _load_file(path: str) -> "datasets.Dataset":
    import datasets

    extension = os.path.splitext(path)[1].lower()
    if extension not in FILE_FORMATS:
        raise DataError(
            f"data.path = {path!r} has an unsupported extension {extension or '(none)'!r}; "
            f"supported: {', '.join(FILE_FORMATS)}, or a folder written by Dataset.save_to_disk."
        )
    # keep_in_memory + a throw-away cache_dir: the Arrow cache the builder writes
    # goes to a temporary folder that is deleted at once, not to ~/.cache.
    rows = read_jsonl_rows(path) if extension == ".jsonl" else None  # names a bad line before datasets reads it
    if rows == []:
        raise DataError(_EMPTY.format(path=path))
    with tempfile.TemporaryDirectory(prefix="tidyrl-data-", ignore_cleanup_errors=True) as cache_dir:
        try:
            return datasets.load_dataset(
                FILE_FORMATS[extension],
                data_files=os.path.abspath(path),
                split="train",
                cache_dir=cache_dir,
                keep_in_memory=True,
            )
        except Exception as error:  # the builders raise many types; name the file and the cause
            if _file_has_no_rows(path, extension):  # datasets cannot build an empty split
                raise DataError(_EMPTY.format(path=path)) from error
            mixed = _mixed_column(rows) if rows else None
            if mixed:
                raise DataError(f"data.path = {path!r} could not be read as jsonl: {mixed}.") from error
            raise DataError(
                f"data.path = {path!r} could not be read as {extension[1:]}: {type(error).__name__}: {error}. "
                "Check that the file is valid (one JSON object per line for .jsonl)."
            ) from error


_EMPTY = "data.path = {path!r} holds no rows: the prompt set is empty; add prompts to it."


def _file_has_no_rows(path: str, extension: str) -> bool:
    """Whether a file that `datasets` failed to read simply holds no rows."""
    try:
        if extension == ".parquet":
            import pyarrow.parquet

            return pyarrow.parquet.read_metadata(path).num_rows == 0
        with open(path, encoding="utf-8") as file:
            lines = [line for line in file.read().splitlines() if line.strip()]
    except Exception:
        return False
    if extension == ".csv":
        return len(lines) <= 1  # at most a header
    if extension == ".json":
        return "".join(lines).replace(" ", "") in ("", "[]")
    return not lines


def _load_saved_folder(path: str, split: str) -> "datasets.Dataset":
    import datasets

    try:
        loaded = datasets.load_from_disk(path, keep_in_memory=True)
    except Exception as error:
        if any(os.path.exists(os.path.join(path, name)) for name in ("state.json", "dataset_dict.json")):
            raise DataError(
                f"data.path = {path!r} is a saved datasets folder that could not be loaded "
                f"({type(error).__name__}: {error}); an empty dataset cannot be loaded either. "
                "Check the folder, or save the prompts again with Dataset.save_to_disk."
            ) from error
        raise DataError(
            f"data.path = {path!r} is a folder but not one written by Dataset.save_to_disk or "
            f"DatasetDict.save_to_disk ({type(error).__name__}: {error}). Point data.path at such a folder, "
            "or at a .jsonl, .json, .parquet or .csv file."
        ) from error
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(
                f"data.path = {path!r} is a saved DatasetDict without a split {split!r}; "
                f"available splits: {list(loaded)}. Set data.split to one of them."
            )
        return loaded[split]
    return loaded


def _prompt_problem(prompt: Any) -> str | None:
    """None when `prompt` is a valid prompt, else why it is not."""
    if isinstance(prompt, str):
        if not prompt:
            return "is an empty string"
        return None if prompt.strip() else "holds only whitespace"
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            return "is an empty message list"
        for i, message in enumerate(prompt):
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                return f"has message {i} that is not a dict with 'role' and 'content' keys"
            if not isinstance(message["role"], str):
                return f"has message {i} whose 'role' is not a string"
            if not isinstance(message["content"], (str, list)):
                return f"has message {i} whose 'content' is neither a string nor a list of content parts"
        return None
    return f"is a {type(prompt).__name__}, neither a string nor a list of chat messages"


def other_columns(dataset, prompt_column: str) -> list[str]:
    """Every column except the prompt column: these are passed to the reward functions."""
    return [name for name in dataset.column_names if name != prompt_column]


# ---------------------------------------------------------------------------
# Rendering and tokenizing


def render_prompt(prompt: str | list[dict], tokenizer, tools: Optional[list] = None) -> str:
    """The text the policy sees: a string as is, chat messages through the chat template.

    Message keys whose value is None are dropped first: Arrow fills keys that
    only some messages have (`name`, `tool_calls`, ...) with None, and chat
    templates test such keys with `is defined`.
    """
    if isinstance(prompt, str):
        return prompt
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(
            "the prompt column (data.prompt_column) holds chat messages, but the tokenizer has no chat_template "
            "to render them. Use plain-string prompts, or a tokenizer (model / tokenizer) that has a chat template."
        )
    messages = [{key: value for key, value in message.items() if value is not None} for message in prompt]
    return render_chat(tokenizer, messages, add_generation_prompt=True, tools=tools)


def render_chat(tokenizer, messages: list[dict], *, add_generation_prompt: bool, tools: Optional[list] = None) -> str:
    """`messages` through the tokenizer's chat template, as text. `tools`: the JSON schemas of tool functions (a
    tool environment's, or an SFT row's), rendered by the template's own tool section."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **({"tools": tools} if tools else {}))


def tools_problem(tokenizer, tools: list) -> Optional[str]:
    """Why the tokenizer's chat template would not show `tools` (JSON schemas) to the model, or None: it has no
    template, fails on them, or renders a conversation the same with and without them (no tool section)."""
    if getattr(tokenizer, "chat_template", None) is None:
        return "the tokenizer has no chat template to render them"
    probe = [{"role": "user", "content": "hi"}]
    try:
        with_tools = render_chat(tokenizer, probe, add_generation_prompt=True, tools=tools)
    except Exception as err:  # the template failed on the schemas
        return f"the chat template cannot render them ({type(err).__name__}: {err})"
    if with_tools == render_chat(tokenizer, probe, add_generation_prompt=True):
        return "the model's chat template ignores `tools` (no tool section): the model would never see them"
    return None


def encode_prompts(prompts: list, tokenizer, tools: Optional[list] = None) -> list[list[int]]:
    """Token ids of each prompt.

    Plain strings are tokenized with the tokenizer's special tokens (e.g. BOS).
    Chat messages are rendered, then tokenized without special tokens: the chat
    template writes BOS itself, and adding it again would double it.
    """
    encoded = []
    for index, prompt in enumerate(prompts):
        text = render_prompt(prompt, tokenizer, tools)
        ids = tokenizer(text, add_special_tokens=isinstance(prompt, str))["input_ids"]
        if len(ids) == 0:
            raise DataError(
                f"prompt {index} ({_short(prompt)}) encodes to zero tokens; "
                "remove it from the prompt set (data.path) or give it some text."
            )
        encoded.append(list(ids))
    return encoded


OVERLONG_PROMPTS = ("error", "truncate", "skip")


def fit_prompts(encoded: list[list[int]], max_length: int, policy: str) -> tuple[list[int], list[list[int]], str]:
    """Apply `data.overlong_prompts` to prompts longer than `max_length` tokens.

    Returns (indices of the prompts kept, their ids, a one-line report or ""). `error` raises
    DataError with the count and the longest; `truncate` keeps each long prompt's last `max_length`
    tokens (the end holds the question and the chat template's generation prompt); `skip` drops them.
    """
    long = [i for i, ids in enumerate(encoded) if len(ids) > max_length]
    if not long:
        return list(range(len(encoded))), encoded, ""
    longest = max(long, key=lambda i: len(encoded[i]))
    counted = f"{len(long)} of {len(encoded)} prompts are longer than {max_length} tokens"
    if policy == "error":
        raise DataError(
            f"{counted} (data.max_prompt_length, by default the model's context minus rollout.max_new_tokens); "
            f"the longest is row {longest} with {len(encoded[longest])} tokens. Set data.overlong_prompts to "
            "truncate (keep each prompt's end) or skip, shorten the prompts, or lower rollout.max_new_tokens."
        )
    if policy == "truncate":
        return list(range(len(encoded))), [ids[-max_length:] for ids in encoded], \
            f"{counted}: truncated to their last {max_length} tokens (data.overlong_prompts=truncate)"
    if policy == "skip":
        kept = [i for i, ids in enumerate(encoded) if len(ids) <= max_length]
        if not kept:
            raise DataError(f"{counted}: every prompt would be skipped (data.overlong_prompts=skip); "
                            "raise data.max_prompt_length or lower rollout.max_new_tokens.")
        return kept, [encoded[i] for i in kept], f"{counted}: skipped them (data.overlong_prompts=skip)"
    raise DataError(f"data.overlong_prompts={policy!r}: use one of {', '.join(OVERLONG_PROMPTS)}")


# ---------------------------------------------------------------------------
# Prompt order


class PromptStream:
    """DESIGN §2: prompts form one stream: each dataset epoch is a fresh shuffle
    (by seed), epochs follow each other, and rollout i takes stream positions
    [i*P, (i+1)*P).

    Stream position s is prompt `epoch_order(s // N)[s % N]`. The order depends
    only on (seed, epoch), never on a global RNG, so resuming or running on
    another number of processes draws the same prompts.
    """

    def __init__(self, num_prompts: int, seed: int):
        if num_prompts < 1:
            raise ValueError(f"PromptStream needs at least one prompt, got num_prompts={num_prompts}")
        if seed < 0:
            raise ValueError(f"seed must be a non-negative integer to order the prompts, got {seed}")
        self.num_prompts = int(num_prompts)
        self.seed = int(seed)
        self._orders: dict[int, list[int]] = {}  # a few recent epochs; a rollout spans at most a few

    def epoch_order(self, epoch: int) -> list[int]:
        """The permutation of range(N) used in dataset epoch `epoch` (0-based)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch not in self._orders:
            if len(self._orders) >= 4:
                self._orders.pop(next(iter(self._orders)))
            import numpy as np

            rng = np.random.default_rng([self.seed, epoch])
            self._orders[epoch] = rng.permutation(self.num_prompts).tolist()
        return list(self._orders[epoch])

    def rollout_indices(self, rollout: int, prompts_per_rollout: int) -> list[int]:
        """Prompt indices of rollout `rollout` (0-based): stream positions [rollout*P, (rollout+1)*P)."""
        if rollout < 0 or prompts_per_rollout < 1:
            raise ValueError(f"need rollout >= 0 and prompts_per_rollout >= 1, got {rollout} and {prompts_per_rollout}")
        start = rollout * prompts_per_rollout
        indices = []
        for position in range(start, start + prompts_per_rollout):
            epoch, offset = divmod(position, self.num_prompts)
            indices.append(self._order(epoch)[offset])
        return indices

    def _order(self, epoch: int) -> list[int]:
        self.epoch_order(epoch)  # fills the cache
        return self._orders[epoch]


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."

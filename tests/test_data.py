"""Prompt data: loading from every format, validation errors, chat rendering, prompt order."""

from __future__ import annotations

import json

import datasets
import pytest
from tokenizers import Tokenizer, models, processors
from transformers import PreTrainedTokenizerFast

from tidyrl.data import (
    DataError,
    PromptStream,
    encode_prompts,
    load_prompt_dataset,
    other_columns,
    render_prompt,
)

ROWS = [
    {"prompt": "What is 2+2?", "answer": "4"},
    {"prompt": "Name a colour.", "answer": "red"},
    {"prompt": "Say hi.", "answer": "hi"},
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def char_tokenizer(chat_template: str | None = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    """A tiny local character tokenizer that prepends BOS (id 0) like Llama's."""
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    for char in "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?+<>|\n:'\"":
        vocab.setdefault(char, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))  # no merges: one token per char
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer.chat_template = chat_template
    return tokenizer


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


# ---------------------------------------------------------------------------
# Loading every format


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv", "saved_dataset", "saved_dict"])
def test_load_each_format(tmp_path, fmt):
    dataset = datasets.Dataset.from_list(ROWS)
    if fmt == "jsonl":
        path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    elif fmt == "json":
        path = tmp_path / "p.json"
        path.write_text(json.dumps(ROWS))
    elif fmt == "parquet":
        path = tmp_path / "p.parquet"
        dataset.to_parquet(str(path))
    elif fmt == "csv":
        path = tmp_path / "p.csv"
        dataset.to_csv(str(path), index=False)
    elif fmt == "saved_dataset":
        path = tmp_path / "saved"
        dataset.save_to_disk(str(path))
    else:
        path = tmp_path / "saved_dict"
        datasets.DatasetDict({"train": dataset, "test": dataset.select([0])}).save_to_disk(str(path))

    loaded = load_prompt_dataset(str(path))
    assert loaded["prompt"] == [row["prompt"] for row in ROWS]
    assert loaded["answer"] == [row["answer"] for row in ROWS]
    assert other_columns(loaded, "prompt") == ["answer"]


def test_saved_dataset_dict_split(tmp_path):
    dataset = datasets.Dataset.from_list(ROWS)
    path = str(tmp_path / "dd")
    datasets.DatasetDict({"train": dataset, "test": dataset.select([2])}).save_to_disk(path)
    assert load_prompt_dataset(path, split="test")["prompt"] == ["Say hi."]
    with pytest.raises(DataError) as info:
        load_prompt_dataset(path, split="validation")
    message = str(info.value)
    assert "without a split 'validation'" in message
    assert "available splits: ['train', 'test']" in message
    assert "data.split" in message


def test_chat_prompts_load_and_custom_column(tmp_path):
    rows = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], "id": 1},
        {"messages": [{"role": "user", "content": "Bye"}], "id": 2},
    ]
    loaded = load_prompt_dataset(write_jsonl(tmp_path / "chat.jsonl", rows), prompt_column="messages")
    assert loaded["messages"][1] == [{"role": "user", "content": "Bye"}]
    assert other_columns(loaded, "messages") == ["id"]


def test_loading_does_not_use_the_hf_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hf_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    data = tmp_path / "data"
    data.mkdir()
    load_prompt_dataset(write_jsonl(data / "p.jsonl", ROWS))
    assert not cache.exists() or not any(cache.iterdir())
    assert sorted(p.name for p in data.iterdir()) == ["p.jsonl"]


# ---------------------------------------------------------------------------
# Loading errors


def test_missing_path(tmp_path):
    with pytest.raises(DataError) as info:
        load_prompt_dataset(str(tmp_path / "nope.jsonl"))
    assert "data.path" in str(info.value)
    assert "nope.jsonl' does not exist" in str(info.value)


def test_empty_path():
    with pytest.raises(DataError, match="data.path is not set"):
        load_prompt_dataset("")


def test_unsupported_extension(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text("hello\n")
    with pytest.raises(DataError) as info:
        load_prompt_dataset(str(path))
    message = str(info.value)
    assert "unsupported extension '.txt'" in message
    assert ".jsonl, .json, .parquet, .csv" in message


@pytest.mark.parametrize(
    "name, text", [("p.jsonl", ""), ("p.jsonl", "\n\n"), ("p.json", "[]"), ("p.csv", "prompt,answer\n"), ("p.parquet", None)]
)
def test_empty_dataset(tmp_path, name, text):
    path = tmp_path / name
    if text is None:
        datasets.Dataset.from_dict({"prompt": ["x"]}).select([]).to_parquet(str(path))
    else:
        path.write_text(text)
    with pytest.raises(DataError) as info:
        load_prompt_dataset(str(path))
    assert "holds no rows: the prompt set is empty" in str(info.value)


def test_broken_saved_folder(tmp_path):
    path = tmp_path / "saved"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(path))
    for arrow in path.glob("*.arrow"):
        arrow.unlink()
    with pytest.raises(DataError, match="is a saved datasets folder that could not be loaded"):
        load_prompt_dataset(str(path))


def test_folder_that_is_not_a_saved_dataset(tmp_path):
    (tmp_path / "x.txt").write_text("x")
    with pytest.raises(DataError, match="is a folder but not one written by Dataset.save_to_disk"):
        load_prompt_dataset(str(tmp_path))


@pytest.mark.parametrize("content, message", [
    (b'{"prompt": "a"}\n\n{not json\n', "line 3: not valid JSON (Expecting property name enclosed in double quotes "
                                          "at column 2): '{not json'. Each line of a .jsonl file must be one JSON object"),
    (b'{"prompt": "a"}\n{"prompt": "b"', "line 2: not valid JSON (Expecting ',' delimiter at column 15)"),  # cut short
    (b'{"prompt": "a"}\n["b"]\n', "line 2: a JSON list, not an object: '[\"b\"]'"),
    (b'{"prompt": "caf\xe9"}\n', "line 1: byte 0xe9 at column 16 is not UTF-8 text; save the file as UTF-8"),
    (b"\n  \n", "holds no rows"),
])
def test_a_bad_jsonl_file_is_named_with_its_line(tmp_path, content, message):
    """Bad data fails before any model loads, naming the file and the line (1-based): corrupt or cut-short
    lines, a line that is not an object, bytes that are not UTF-8, an empty file, a column of mixed types.
    The SFT and preference loaders read files through the same code (tests/test_sft.py, test_dpo.py)."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError) as info:
        load_prompt_dataset(str(path))
    assert f"data.path = {str(path)!r}" in str(info.value)
    assert message in str(info.value)


def test_a_column_of_mixed_types_loads_as_written_or_is_named_with_its_lines(tmp_path):
    """Newer datasets (5.2 here) keep a column whose lines hold several JSON types as they are (a Json feature);
    datasets 3 cannot build such a column: then the error names the column and both lines."""
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "answer": 1}, {"prompt": "b", "answer": "two"}])
    try:
        dataset = load_prompt_dataset(str(path))
    except DataError as err:
        assert "could not be read as jsonl: column 'answer' holds a str on line 2 but a number on line 1; a " \
               "column must hold one type on every line (null for a missing value)" in str(err)
    else:
        assert dataset["answer"] == [1, "two"]


def test_missing_prompt_column_lists_columns(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError) as info:
        load_prompt_dataset(path)
    message = str(info.value)
    assert "data.prompt_column = 'prompt' is not a column" in message
    assert "the columns present are ['question', 'answer']" in message


@pytest.mark.parametrize(
    "bad, why",
    [
        ("", "is an empty string"),
        ("  \n", "holds only whitespace"),
        ([{"role": "user", "content": 3}], "has message 0 whose 'content' is neither a string nor a list"),
        ([], "is an empty message list"),
        ([{"role": "user"}], "has message 0 that is not a dict with 'role' and 'content' keys"),
        (["hello"], "has message 0 that is not a dict with 'role' and 'content' keys"),
    ],
)
def test_invalid_prompt_names_the_row(tmp_path, bad, why):
    rows = [{"prompt": "fine"}, {"prompt": "also fine"}, {"prompt": bad}]
    with pytest.raises(DataError) as info:
        load_prompt_dataset(write_jsonl(tmp_path / "p.jsonl", rows))
    message = str(info.value)
    assert "p.jsonl', line 3 (row 2, 0-based)" in message
    assert "data.prompt_column = 'prompt'" in message
    assert why in message
    assert "must be a non-empty string, or a non-empty list of chat messages" in message


def test_invalid_prompt_type_names_the_row(tmp_path):
    path = tmp_path / "p.parquet"
    datasets.Dataset.from_dict({"prompt": [1, 2]}).to_parquet(str(path))
    with pytest.raises(DataError) as info:
        load_prompt_dataset(str(path))
    assert "row 0 (0-based)" in str(info.value)
    assert "is a int, neither a string nor a list of chat messages" in str(info.value)


def test_csv_empty_cell_is_invalid(tmp_path):
    path = tmp_path / "p.csv"
    path.write_text("prompt,answer\nhello,1\n,2\n")
    with pytest.raises(DataError, match=r"row 1 \(0-based\)"):
        load_prompt_dataset(str(path))


# ---------------------------------------------------------------------------
# Rendering and encoding


def test_render_string_as_is():
    assert render_prompt("Hello there", char_tokenizer()) == "Hello there"


def test_render_chat_messages_exactly():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert render_prompt(messages, char_tokenizer()) == "<s><|system|>Be brief.\n<|user|>Hi\n<|assistant|>"


def test_render_drops_none_keys_filled_by_arrow():
    template = "{% for m in messages %}{{ m.role }}{% if m.name is defined %}({{ m.name }}){% endif %}:{{ m.content }};{% endfor %}"
    tokenizer = char_tokenizer(template)
    messages = [{"role": "user", "content": "a", "name": None}, {"role": "user", "content": "b", "name": "x"}]
    assert render_prompt(messages, tokenizer) == "user:a;user(x):b;"


def test_render_chat_without_template():
    with pytest.raises(DataError) as info:
        render_prompt([{"role": "user", "content": "Hi"}], char_tokenizer(chat_template=None))
    message = str(info.value)
    assert "holds chat messages, but the tokenizer has no chat_template" in message
    assert "Use plain-string prompts, or a tokenizer" in message


def test_encode_strings_add_bos_and_chat_does_not_double_it():
    tokenizer = char_tokenizer()
    bos = tokenizer.bos_token_id
    string_ids, chat_ids = encode_prompts(["Hi", [{"role": "user", "content": "Hi"}]], tokenizer)
    assert string_ids == [bos] + tokenizer.convert_tokens_to_ids(["H", "i"])
    assert chat_ids[0] == bos
    assert chat_ids.count(bos) == 1
    assert "".join(tokenizer.convert_ids_to_tokens(chat_ids[1:])) == "<|user|>Hi\n<|assistant|>"


def test_encode_zero_tokens_is_an_error():
    tokenizer = char_tokenizer(chat_template="{% for m in messages %}{% endfor %}")  # renders to ""
    with pytest.raises(DataError) as info:
        encode_prompts(["fine", [{"role": "user", "content": "x"}]], tokenizer)
    assert "prompt 1" in str(info.value)
    assert "encodes to zero tokens" in str(info.value)


# ---------------------------------------------------------------------------
# PromptStream


def test_first_epoch_is_a_permutation_and_epochs_differ():
    stream = PromptStream(num_prompts=10, seed=3)
    first, second = stream.epoch_order(0), stream.epoch_order(1)
    assert sorted(first) == list(range(10))
    assert sorted(second) == list(range(10))
    assert first != second
    assert first != list(range(10))


def test_rollouts_cover_the_stream_across_epoch_boundaries():
    n, p = 7, 3
    stream = PromptStream(num_prompts=n, seed=0)
    flat = stream.epoch_order(0) + stream.epoch_order(1) + stream.epoch_order(2)
    for rollout in range(6):  # rollout 2 takes positions 6, 7, 8: the end of epoch 0 and the start of epoch 1
        assert stream.rollout_indices(rollout, p) == flat[rollout * p : (rollout + 1) * p]
    assert stream.rollout_indices(2, p) == [flat[6], flat[7], flat[8]]
    assert stream.rollout_indices(2, p)[0] == stream.epoch_order(0)[6]
    assert stream.rollout_indices(2, p)[1:] == stream.epoch_order(1)[:2]


def test_rollout_larger_than_the_dataset():
    stream = PromptStream(num_prompts=2, seed=1)
    assert stream.rollout_indices(0, 5) == stream.epoch_order(0) + stream.epoch_order(1) + stream.epoch_order(2)[:1]


def test_deterministic_across_instances_and_global_rng():
    import random

    import numpy as np

    a = PromptStream(num_prompts=50, seed=7)
    random.seed(123)
    np.random.seed(123)
    b = PromptStream(num_prompts=50, seed=7)
    np.random.seed(999)
    assert [a.rollout_indices(r, 16) for r in range(10)] == [b.rollout_indices(r, 16) for r in range(10)]
    # Asking in another order (as after a resume) gives the same answer.
    c = PromptStream(num_prompts=50, seed=7)
    assert c.rollout_indices(9, 16) == a.rollout_indices(9, 16)
    assert PromptStream(num_prompts=50, seed=8).epoch_order(0) != a.epoch_order(0)


def test_epoch_order_is_a_copy():
    stream = PromptStream(num_prompts=4, seed=0)
    order = stream.epoch_order(0)
    expected = list(order)
    order.clear()
    assert stream.epoch_order(0) == expected
    assert stream.rollout_indices(0, 4) == expected


def test_prompt_stream_rejects_bad_arguments():
    with pytest.raises(ValueError, match="at least one prompt"):
        PromptStream(num_prompts=0, seed=0)
    with pytest.raises(ValueError, match="non-negative"):
        PromptStream(num_prompts=3, seed=-1)


GEMMA_LIKE_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>"
                       "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
                       "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def test_a_chat_completion_ends_as_the_template_ends_a_turn_and_a_plain_one_with_eos():
    """A completion that holds no end token gets one: after a chat prompt the token the chat template ends an
    assistant turn with, where generation stops on it too (Gemma's <end_of_turn>, not its <eos>); after a string
    prompt, and where the template's turn end is no stop token, the EOS."""
    from tidyrl.data.offline import _completion_segments, _encode, _eos_to_append
    from tidyrl.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer(chat_template=GEMMA_LIKE_TEMPLATE)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    eos = tokenizer.eos_token_id
    ends = _eos_to_append(tokenizer, [eos, turn])
    assert ends == (eos, turn)
    chat = _encode(*_completion_segments([{"role": "user", "content": "ab"}], "cd", tokenizer), tokenizer, ends,
                   [eos, turn], train_all=False)
    assert chat.input_ids[-1] == turn and chat.input_ids[-3:-1] == tokenizer("cd", add_special_tokens=False)[
        "input_ids"]
    plain = _encode(*_completion_segments("ab", "cd", tokenizer), tokenizer, ends, [eos, turn], train_all=False)
    assert plain.input_ids[-1] == eos
    assert _eos_to_append(tokenizer, [eos]) == (eos, eos)  # <end_of_turn> does not stop generation: the EOS

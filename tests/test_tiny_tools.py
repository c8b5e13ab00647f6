"""The tiny model that can write tool calls (`tidyrl tiny --tokenizer bytes`): a byte-level BPE covering every
byte, a Qwen2.5-style chat template that renders tools, `<tool_call>` JSON and tool results, read back by
`parse_tool_calls` and appended token in, token out."""

from __future__ import annotations

import json
import string

import pytest

from tidyrl.environments import ToolEnvironment, parse_tool_calls
from tidyrl.models.tiny import IM_END, build_bytes_tokenizer


def capital(country: str) -> str:
    """The capital of a country.

    Args:
        country: the country's name
    """
    return {"Borduria": "Szohod"}[country]


class Capitals(ToolEnvironment):
    tools = (capital,)


@pytest.fixture(scope="module")
def tok():
    return build_bytes_tokenizer()


def test_the_byte_tokenizer_round_trips_printable_ascii_and_json_and_is_the_same_each_time(tok):
    samples = [string.printable, json.dumps({"name": "add", "arguments": {"a": 12, "b": -3.5}, "x": [None, True]}),
               '{"_Key_": "A~B|C`D^E", "path": "C:\\\\dir"}', "caf\u00e9 \u2603"]  # non-ASCII: bytes too
    for text in samples:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
    assert tok.unk_token is None and tok.bos_token is None  # bytes cover everything; no BOS (as Qwen2.5)
    assert tok.eos_token == IM_END and tok.pad_token_id != tok.eos_token_id
    assert 256 < len(tok) < 600  # the bytes, a few hundred merges, the special and tool tokens
    assert len(tok("0123456789", add_special_tokens=False)["input_ids"]) == 10  # digits one by one (as Qwen2)
    assert build_bytes_tokenizer().get_vocab() == tok.get_vocab()  # the merges are learned deterministically


def test_the_template_renders_tools_calls_and_results_as_qwen25_does(tok):
    tools = Capitals.tool_schemas()
    messages = [{"role": "user", "content": "The capital of Borduria?"}]
    prompt = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in prompt
    assert prompt.endswith("<|im_start|>user\nThe capital of Borduria?<|im_end|>\n<|im_start|>assistant\n")
    without = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    default_system = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    assert without == default_system + prompt.split("<|im_end|>\n", 1)[1]
    # An assistant message with `tool_calls` (the transformers format) renders as Qwen2.5 writes it ...
    call = {"name": "capital", "arguments": {"country": "Borduria"}}
    tool_calls = [{"type": "function", "function": call}]
    structured = messages + [{"role": "assistant", "content": "", "tool_calls": tool_calls}]
    rendered = tok.apply_chat_template(structured, tools=tools, tokenize=False)
    written = "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"
    assert rendered == prompt + written + "<|im_end|>\n"
    # ... which is the text a model writes as its turn: decoded without special tokens, parse_tool_calls reads it.
    ids = tok(written, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # as sampled: EOS ends it
    turn = tok.decode(ids, skip_special_tokens=True)
    assert turn == written and parse_tool_calls(turn) == [call]
    reply = Capitals({}, seed=0).step(turn, messages + [{"role": "assistant", "content": turn}])
    assert reply.message == {"role": "tool", "content": json.dumps({"name": "capital", "result": "Szohod"})}
    # The tool's result is a user turn of <tool_response>, and the environment's tokens are exactly the text the
    # template adds after the model's turn (token in, token out).
    from tidyrl.rollouts.episodes import environment_message_ids

    history = messages + [{"role": "assistant", "content": turn}]
    extra = environment_message_ids(tok, history, turn, tok.decode(ids, skip_special_tokens=False), reply.message,
                                    tools)
    assert tok.decode(extra, skip_special_tokens=False) == (
        "\n<|im_start|>user\n<tool_response>\n" + reply.message["content"] + "\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    whole = tok.apply_chat_template(history + [reply.message], tools=tools, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert tok.decode(prompt_ids + ids + extra, skip_special_tokens=False) == whole


def test_tidyrl_tiny_bytes_writes_a_model_that_can_write_tool_calls(tmp_path, capsys):
    from transformers import AutoConfig, AutoTokenizer

    from tidyrl.cli import main

    assert main(["tiny", str(tmp_path / "m"), "--tokenizer", "bytes", "--hidden-size", "32"]) == 0
    assert "byte-level BPE" in capsys.readouterr().out
    config, tok = AutoConfig.from_pretrained(tmp_path / "m"), AutoTokenizer.from_pretrained(tmp_path / "m")
    assert config.max_position_embeddings == 512 and config.vocab_size == len(tok)
    assert config.eos_token_id == tok.eos_token_id and config.pad_token_id == tok.pad_token_id
    turn = '<tool_call>\n{"name": "capital", "arguments": {"country": "Borduria"}}\n</tool_call>'
    assert tok.decode(tok(turn)["input_ids"], skip_special_tokens=True) == turn  # as saved and loaded
    assert main(["tiny", str(tmp_path / "c"), "--tokenizer", "bytes", "--context", "1024"]) == 0
    assert AutoConfig.from_pretrained(tmp_path / "c").max_position_embeddings == 1024
    assert main(["tiny", str(tmp_path / "rm"), "--reward-model", "--tokenizer", "bytes"]) == 2
    assert "drop --reward-model" in capsys.readouterr().err


def test_sft_renders_a_conversations_tools_as_the_rl_stages_render_an_environments(tmp_path):
    """The `tools` column (data.tools_column) of SFT conversations goes to the chat template's `tools`, as GRPO
    renders a ToolEnvironment's schemas: a list of schemas, or that list as a JSON string (Arrow unifies the
    schemas of a column, filling missing keys with None: dropped again)."""
    from transformers import AutoTokenizer

    from tidyrl.config import load_config
    from tidyrl.data.offline import load_sft_examples
    from tidyrl.models.tiny import save_tiny_model

    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first number
            b: the second number
        """
        return a * b

    class Both(ToolEnvironment):
        tools = (multiply, capital)

    model = save_tiny_model(tmp_path / "m", tokenizer="bytes", hidden_size=16, num_layers=1, num_heads=2)
    tok = AutoTokenizer.from_pretrained(model)
    schemas = Both.tool_schemas()
    call = '<tool_call>\n{"name": "capital", "arguments": {"country": "Borduria"}}\n</tool_call>'
    messages = [{"role": "user", "content": "The capital of Borduria?"}, {"role": "assistant", "content": call},
                {"role": "tool", "content": '{"name": "capital", "result": "Szohod"}'},
                {"role": "assistant", "content": "Szohod"}]
    for tools in (json.dumps(schemas), schemas):
        data = tmp_path / "sft.jsonl"
        data.write_text(json.dumps({"messages": messages, "tools": tools}) + "\n")
        cfg = load_config({"algorithm": "sft", "model": str(model), "data": {"path": str(data)},
                           "train": {"max_steps": 1, "batch_size": 1}})
        (seq,), _ = load_sft_examples(cfg, tok, [tok.eos_token_id])
        text = tok.decode(seq.input_ids, skip_special_tokens=False)
        assert text == tok.apply_chat_template(messages, tools=schemas, tokenize=False)
        trained = tok.decode([t for t, m in zip(seq.input_ids, seq.target_mask) if m], skip_special_tokens=False)
        assert trained == call + "<|im_end|>\n" + "Szohod<|im_end|>\n"  # the assistant turns only

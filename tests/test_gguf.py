"""tidyrl.models.gguf on a tiny GGUF file written here (tests/tiny_gguf.py; no download), and the refusal of a
`.gguf` path as `model:`. The same conversion of the real SmolLM2 file: tests/test_smollm2.py."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("gguf", reason="reading GGUF files needs the gguf package (pip install 'tidyrl[gguf]')")

from tiny_gguf import SYSTEM, write_tiny_gguf  # noqa: E402


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory):
    from tidyrl.models.gguf import convert_gguf

    return convert_gguf(tiny_gguf, tmp_path_factory.mktemp("converted") / "model")


def test_converted_folder_computes_what_the_gguf_model_computes(tiny_gguf, converted):
    from transformers import AutoModelForCausalLM

    from_gguf = AutoModelForCausalLM.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    from_folder = AutoModelForCausalLM.from_pretrained(converted)
    ids = torch.tensor([[1, 40, 41, 42, 2, 50]])
    assert torch.equal(from_gguf(ids).logits, from_folder(ids).logits)
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())
    # tied embeddings stay tied: one tensor in the file, the output layer is the embedding
    assert from_folder.config.tie_word_embeddings
    assert from_folder.lm_head.weight.data_ptr() == from_folder.model.embed_tokens.weight.data_ptr()
    from safetensors import safe_open

    with safe_open(str(converted / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())


def test_converted_tokenizer_keeps_template_specials_and_gets_a_real_context(tiny_gguf, converted):
    from transformers import AutoTokenizer, GenerationConfig

    from_gguf = AutoTokenizer.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    tok = AutoTokenizer.from_pretrained(converted)
    text = "the cat <|im_end|> 12 + 7"
    assert tok(text)["input_ids"] == from_gguf(text)["input_ids"]
    messages = [{"role": "user", "content": "hi"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == from_gguf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>")  # the template's default system prompt
    assert (tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (2, 2, 1)
    assert from_gguf.model_max_length > 1e29  # transformers' "no limit" for a GGUF
    assert tok.model_max_length == 128  # the model's context, as a hub folder carries it
    assert GenerationConfig.from_pretrained(converted).eos_token_id == 2


def test_special_tokens_are_the_files_own(tiny_gguf):
    """Read from the file's metadata, not from transformers' reading of it (4.56 takes SmolLM2's eos for
    <|im_start|> and finds no pad token); the conversion writes these."""
    from tidyrl.models.gguf import special_token_ids

    assert special_token_ids(tiny_gguf) == {"bos": 1, "eos": 2, "pad": 2, "unk": 0}


def test_a_gguf_file_as_model_is_refused_with_the_conversion(tiny_gguf):
    from tidyrl.models.loading import ModelLoadError, load_tokenizer

    with pytest.raises(ModelLoadError, match=r"model='.*tiny\.gguf' is a GGUF file.*convert_gguf"):
        load_tokenizer(str(tiny_gguf), "model")


def test_missing_file_is_named(tmp_path):
    from tidyrl.models.gguf import convert_gguf

    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "out")


def test_an_end_of_turn_token_the_vocabulary_has_ends_generation_too():
    """A GGUF names no end-of-turn token; Gemma's <end_of_turn> (not its eos) is one of END_OF_TURN_TOKENS, so the
    converted generation config ends on it as well; an eos that is itself the end of turn (SmolLM2's <|im_end|>)
    adds nothing, and neither does the word spelt in plain text."""
    from tidyrl.models.gguf import end_of_turn_ids
    from tidyrl.models.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer(chat_template=None)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<end_of_turn>", "<|im_end|>"]})
    turn, im_end = tokenizer.convert_tokens_to_ids(["<end_of_turn>", "<|im_end|>"])
    assert end_of_turn_ids(tokenizer, tokenizer.eos_token_id) == [turn, im_end]
    assert end_of_turn_ids(tokenizer, im_end) == [turn]
    assert end_of_turn_ids(build_char_tokenizer(chat_template=None), 0) == []

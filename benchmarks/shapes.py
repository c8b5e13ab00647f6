"""The model shape of the benchmarks that build a Qwen2 model from their command line (count_saved_bytes.py,
bench_recompute.py, bench_loading.py): its options, each script with its own defaults, and the config they give."""

from __future__ import annotations

import argparse


def add_shape_arguments(parser: argparse.ArgumentParser, *, hidden: int, intermediate: int, layers: int, heads: int,
                        vocab: int) -> None:
    """--hidden, --intermediate, --layers, --heads and --vocab, with these defaults."""
    parser.add_argument("--hidden", type=int, default=hidden)
    parser.add_argument("--intermediate", type=int, default=intermediate)
    parser.add_argument("--layers", type=int, default=layers)
    parser.add_argument("--heads", type=int, default=heads)
    parser.add_argument("--vocab", type=int, default=vocab)


def qwen2_config(args: argparse.Namespace, **overrides):
    """The `Qwen2Config` of the options `add_shape_arguments` adds (and --kv-heads where a script has it, else 2),
    its embeddings tied, 1024 positions; `overrides` change any field."""
    from transformers import Qwen2Config

    fields = dict(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                  num_hidden_layers=args.layers, num_attention_heads=args.heads,
                  num_key_value_heads=getattr(args, "kv_heads", 2), max_position_embeddings=1024,
                  tie_word_embeddings=True)
    return Qwen2Config(**{**fields, **overrides})

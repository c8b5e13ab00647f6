"""What the decode loop and the training forward both need of a token sequence and of a Hugging Face model: the end
and padding ids, each sequence's sampling key, left padding, and the model's calling conventions (the cache's
keyword and returned field, its forward's parameters, whether its cache is one plain layer per decoder layer).
Decoding itself is `models.generation`; the training forward is `models.forward`."""

from __future__ import annotations

import functools
import hashlib
import inspect
from typing import Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from tidyrl.models.sharding import base_of


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every EOS id of the generation config and the tokenizer (models often list several)."""
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for source in (gen_eos, tokenizer.eos_token_id):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else list(source))
    if not ids:
        raise ValueError(
            "The model's generation config and the tokenizer define no EOS token: completions could never end. "
            "Set `eos_token_id` in the model's generation_config.json or the tokenizer's eos_token."
        )
    return sorted(ids)


def pad_token_id(tokenizer, eos_ids: Sequence[int]) -> int:
    """Padding filler. Padded positions are masked out everywhere, so EOS serves when there is no pad token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(eos_ids[0])


def sample_seed(seed: int, rollout: int, sample_index: int) -> int:
    """A 63-bit generator seed for one sequence, keyed by (seed, rollout, global sample index)."""
    digest = hashlib.blake2b(f"tidyrl:{seed}:{rollout}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and mask, padded on the left so that every sequence ends at the last column."""
    width = max((len(s) for s in seqs), default=0)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s):] = torch.as_tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


def absent_id(seqs: Sequence[Sequence[int]]) -> int:
    """The smallest token id none of `seqs` holds: a padding filler that a classifier's pooling ("the last token
    that is not padding") never mistakes for a sequence's own last token, whatever its pad/EOS ids."""
    present = {t for s in seqs for t in s}
    return next(i for i in range(len(present) + 1) if i not in present)


def cache_argument(model) -> str:
    """The keyword under which `model`'s forward takes its key/value cache: `cache` where the forward names it so
    (transformers 5.24 does, and warns that `past_key_values` is a deprecated alias to be removed in 5.40), else
    `past_key_values` (transformers 4). Read from the forward's signature (`forward_parameters`), not from a
    version number; a forward that names neither (**kwargs) gets the name of the installed transformers' model
    outputs."""
    parameters = forward_parameters(model)
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def forward_parameters(model) -> frozenset[str]:
    """The parameter names of the forward of the model under `model`'s peft and DDP wrappers (whose own forwards
    pass keywords on). inspect.signature follows functools.wraps, so transformers' decorators are seen through."""
    while True:
        inner = base_of(model)  # under peft
        if inner is model and isinstance(getattr(model, "module", None), torch.nn.Module):  # under DDP
            inner = model.module
        if inner is model:
            return _forward_parameters_of(type(model))
        model = inner


@functools.cache
def _forward_parameters_of(cls: type) -> frozenset[str]:
    try:
        return frozenset(inspect.signature(getattr(cls, "forward", cls.__call__)).parameters)
    except (TypeError, ValueError):
        return frozenset()


def returned_cache(output):
    """The key/value cache a forward returned: `output.cache` where the output class has that field
    (transformers 5.24, where reading `past_key_values` logs a deprecation), else `output.past_key_values`."""
    return output.cache if "cache" in getattr(output, "__dataclass_fields__", ()) else output.past_key_values


def plain_kv_cache(model) -> bool:
    """True when the model's cache is one plain growing key/value layer per decoder layer (Llama, Qwen,
    Mistral without sliding windows, ...): then prompts can be shared and keys buffered. Sliding-window,
    linear-attention and other special caches keep the model's own cache and one prefill per row."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    try:
        cache = DynamicCache(config=config)
    except Exception:  # a config the cache cannot read: use the model's own
        return False
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def model_device(model) -> torch.device:
    """The device of a model, also when it is wrapped (DDP has no `.device`)."""
    return next(model.parameters()).device

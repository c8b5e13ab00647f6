"""Fewer activations kept for the backward pass of the model's own forward: each RMSNorm and each MLP's
act(gate) * up recomputed in the backward pass from their inputs, instead of keeping their intermediates.

Why: in bf16, LlamaRMSNorm (and Qwen2's, Mistral's) keeps a float32 copy of its input (twice the bf16 size) and its
bf16 normalised output for the backward pass, and the MLP keeps silu(gate) beside gate, up and their product. On
Qwen2.5-0.5B's update micro-batch (16 x 257 positions) that is ~15 MB per norm and 40 MB per MLP: ~1.7 GB of the
update's peak, which on CUDA is the run's peak (docs/benchmarks.md, issue 26). Kept instead: the norm's bf16 input,
and the MLP's gate and up, as the product's inputs. Recomputing is a few elementwise kernels per layer in the
backward pass; the matmuls are not recomputed.

The same ops run again on the same inputs (non-reentrant checkpoints, `torch.utils.checkpoint`), so the log-probs
and gradients are the model's bit for bit (tests/test_recompute.py). Used by `models.forward` around the one-pass
forward of a plain Llama/Qwen2/Qwen3/Mistral model (alone, under peft or inside DDP; a LoRA-adapted projection is
called as the MLP calls it) with gradients on, on RECOMPUTE_DEVICES, and not where the model already checkpoints
whole layers or FSDP shards it. `TIDYRL_RECOMPUTE=0` turns it off.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

# Where the update's peak is GPU memory; on CPU the lean pass (models.llama_forward) keeps its own, fewer, tensors.
RECOMPUTE_DEVICES = ("cuda",)


@contextlib.contextmanager
def cheap_parts_recomputed(model) -> Iterator[None]:
    """Inside the block, `model`'s RMSNorms and MLP products are recomputed in the backward pass (see the module's
    docstring) where that applies, else nothing changes. The modules' own forwards are back as the block ends (the
    backward pass recomputes from the closures the checkpoints keep)."""
    modules = _cheap_parts(model) if torch.is_grad_enabled() else []
    for module in modules:
        own = type(module).forward.__get__(module)
        module.forward = functools.partial(_mlp if _is_mlp(module) else _checkpointed, own, module)
    try:
        yield
    finally:
        for module in modules:
            del module.forward


def _cheap_parts(model) -> list[nn.Module]:
    from tidyrl.models.chunked_head import PLAIN_CAUSAL_LMS
    from tidyrl.models.llama_decode import _wrapped, base_of
    from tidyrl.models.loading import activation_checkpointing_on
    from tidyrl.models.sharding import ddp_inner, is_sharded

    model = base_of(ddp_inner(model))  # (its modules run inside DDP's and peft's forwards)
    if os.environ.get("TIDYRL_RECOMPUTE", "1") == "0" or type(model).__name__ not in PLAIN_CAUSAL_LMS:
        return []
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    device = next(model.parameters()).device
    if layers is None or device.type not in RECOMPUTE_DEVICES or activation_checkpointing_on(model) or \
            is_sharded(model):
        return []
    parts = [inner.norm] if _is_norm(getattr(inner, "norm", None)) else []
    for layer in layers:
        parts += [m for m in (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
                  if _is_norm(m)]
        if _is_mlp(getattr(layer, "mlp", None)):
            parts.append(layer.mlp)
    return [m for m in parts if not _wrapped(m)]  # (hooks around a forward: left as they are)


def _is_norm(module) -> bool:
    return module is not None and type(module).__name__.endswith("RMSNorm") and not list(module.children())


def _is_mlp(module) -> bool:
    # down(act(gate(x)) * up(x)): Llama's MLP and its copies (chunked_head.PLAIN_CAUSAL_LMS)
    return module is not None and type(module).__name__.endswith("MLP") and \
        {name for name, _ in module.named_children()} == {"gate_proj", "up_proj", "down_proj", "act_fn"}


def _checkpointed(own, module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The norm's own forward, its intermediates recomputed in the backward pass."""
    return checkpoint(own, hidden_states, use_reentrant=False, preserve_rng_state=False)  # (no randomness inside)


def _mlp(own, mlp, x: torch.Tensor) -> torch.Tensor:
    """down(act(gate(x)) * up(x)), as the MLP's forward, with act(gate) * up recomputed in the backward pass: its
    inputs gate and up kept, not act(gate)."""
    return mlp.down_proj(checkpoint(_act_times, mlp.act_fn, mlp.gate_proj(x), mlp.up_proj(x), use_reentrant=False,
                                    preserve_rng_state=False))


def _act_times(act: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return act(gate) * up

"""Fewer activations kept for the backward pass of the model's own forward: each RMSNorm and each MLP's
act(gate) * up recomputed in the backward pass from their inputs, instead of keeping their intermediates.

Why: in bf16, LlamaRMSNorm (and Qwen2's, Mistral's) keeps a float32 copy of its input (twice the bf16 size) and its
bf16 normalised output for the backward pass, and the MLP keeps silu(gate) beside gate, up and their product: a
large share of the update's peak, which on CUDA is the run's peak (`python benchmarks/count_saved_bytes.py` counts
it; docs/benchmarks.md has the counts). Kept instead:
the norm's bf16 input, and the MLP's gate and up, as the product's inputs. Recomputing is a few elementwise kernels
per layer in the backward pass; the matmuls are not recomputed.

Each part is one autograd function (`NormRecomputed`, `SiluTimesRecomputed`) whose backward pass recomputes the few
elementwise values it needs and runs the very ops autograd would have run on the model's own graph, in the same
order, so the log-probs and gradients are the model's bit for bit (tests/test_recompute.py). Not
`torch.utils.checkpoint`: its bookkeeping (a hook per saved tensor, a second graph per recompute) costs several
times the functions' host time per part (`python benchmarks/bench_recompute.py` runs both around the same parts;
docs/benchmarks.md). Another activation than SiLU, or a norm in float32 or whose weight has another dtype than its
input, still takes a checkpoint.

Used by `models.forward` around the one-pass forward of a model of a declared family with Llama's pre-norms (alone,
under peft or inside DDP; a LoRA-adapted projection is called as the MLP calls it) with gradients on, on
RECOMPUTE_DEVICES, and not where the model already checkpoints whole layers or FSDP shards it.

Off unless `kernels.recompute: true` (`models.kernels`): measured on a GPU (docs/benchmarks.md: `tidyrl-recompute`
beside `tidyrl`), it lowers the update's peak but slows the update by more than its kernels and host time explain,
and without it the update's peak is already under TRL's. It is the lever to pull when the update runs out of memory
and whole-layer gradient checkpointing (train.gradient_checkpointing) would cost more."""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

# Where the update's peak is GPU memory; on CPU the lean pass (models.lean_forward) keeps its own, fewer, tensors.
RECOMPUTE_DEVICES = ("cuda",)


@contextlib.contextmanager
def cheap_parts_recomputed(model) -> Iterator[None]:
    """Inside the block, `model`'s RMSNorms and MLP products are recomputed in the backward pass (see the module's
    docstring) where that applies, else nothing changes. The modules' own forwards are back as the block ends (the
    backward pass recomputes from the closures the checkpoints keep)."""
    modules = _cheap_parts(model) if torch.is_grad_enabled() else []
    for module in modules:
        own = type(module).forward.__get__(module)
        module.forward = functools.partial(_mlp if _is_mlp(module) else _norm, own, module)
    try:
        yield
    finally:
        for module in modules:
            del module.forward


def _cheap_parts(model) -> list[nn.Module]:
    from tidyrl.models.families import family_of, on_fast_path
    from tidyrl.models.kernels import kernels_of
    from tidyrl.models.lean_layer import wrapped as _wrapped
    from tidyrl.models.loading import activation_checkpointing_on
    from tidyrl.models.sharding import base_of, ddp_inner, is_sharded

    model = base_of(ddp_inner(model))  # (its modules run inside DDP's and peft's forwards)
    name = type(model).__name__
    family = family_of(model.config, name) if kernels_of(model).recompute else None  # (off by default)
    # (the recomputed norm is Llama's RMSNorm, before attention and before the MLP)
    if family is None or not family.llama_norms() or \
            family.fused_projections or not on_fast_path(model.config, name):
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
    # down(act(gate(x)) * up(x)): the gated MLP of the declared families (models.families)
    return module is not None and type(module).__name__.endswith("MLP") and \
        {name for name, _ in module.named_children()} == {"gate_proj", "up_proj", "down_proj", "act_fn"}


# The norms whose forward is LlamaRMSNorm's, read in transformers 4.5x-5.x: weight * (x32 * rsqrt(mean(x32^2) + eps))
# cast back to x's dtype, x32 = x in float32. Another norm keeps a checkpoint of its own forward, and so does a
# float32 input: there the cast is no op, the input itself feeds two ops of the norm, and the order in which autograd
# adds their gradients to the residual stream's is not one a single function could keep.
HALF_DTYPES = (torch.bfloat16, torch.float16)
SILU_ACTIVATIONS = ("SiLU", "SiLUActivation")  # (torch's and transformers': F.silu)
LLAMA_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm")


def _norm(own, module, hidden_states: torch.Tensor) -> torch.Tensor:
    """The norm's forward, its intermediates recomputed in the backward pass: NormRecomputed where it applies, else a
    checkpoint of the norm's own forward."""
    weight = getattr(module, "weight", None)
    if type(module).__name__ in LLAMA_NORMS and hidden_states.dtype in HALF_DTYPES and \
            isinstance(weight, torch.Tensor) and weight.dtype == hidden_states.dtype:
        return NormRecomputed.apply(hidden_states, weight, module.variance_epsilon)
    return checkpoint(own, hidden_states, use_reentrant=False, preserve_rng_state=False)  # (no randomness inside)


def _mlp(own, mlp, x: torch.Tensor) -> torch.Tensor:
    """down(act(gate(x)) * up(x)), as the MLP's forward, with act(gate) * up recomputed in the backward pass: its
    inputs gate and up kept, not act(gate)."""
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    if type(mlp.act_fn).__name__ in SILU_ACTIVATIONS:
        return mlp.down_proj(SiluTimesRecomputed.apply(gate, up))
    return mlp.down_proj(checkpoint(_act_times, mlp.act_fn, gate, up, use_reentrant=False, preserve_rng_state=False))


def _act_times(act: nn.Module, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return act(gate) * up


def _normalised(x32: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """LlamaRMSNorm's float32 steps: x32 * rsqrt(mean(x32^2) + eps) and the rsqrt (Zhang & Sennrich 2019, eq. 4)."""
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return x32 * rstd, rstd


class NormRecomputed(torch.autograd.Function):
    """LlamaRMSNorm's forward, keeping only its input and weight; the backward pass recomputes the float32 copy, the
    rsqrt and the normalised output, then runs autograd's own derivative formulas (torch's derivatives.yaml) for
    each op of the forward, last to first, in their order of operations, so every gradient is autograd's bit for bit."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return weight * _normalised(x.to(torch.float32), eps)[0].to(x.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        x32 = x.to(torch.float32)
        normalised, rstd = _normalised(x32, ctx.eps)
        grad_weight = None
        if ctx.needs_input_grad[1]:  # mul: grad * other, summed to the weight's shape as the engine does (sum_to)
            grad_weight = (grad * normalised.to(x.dtype)).sum_to_size(weight.shape)
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_n = (grad * weight).to(torch.float32)  # mul, then the cast's backward
            grad_rstd = (grad_n * x32).sum_to_size(rstd.shape)  # mul (broadcast rstd)
            grad_mean = -0.5 * grad_rstd * rstd.pow(3)  # rsqrt: -0.5 * grad * result^3; (+ eps: the identity)
            grad_square = grad_mean.expand(x32.shape) / x32.shape[-1]  # mean over the last dimension
            grad_x32 = grad_n * rstd + grad_square * (2.0 * x32.pow(1.0))  # mul, + pow(2): grad * (2 * x^1)
            grad_x = grad_x32.to(x.dtype)  # the cast to float32's backward
        return grad_x, grad_weight, None


class SiluTimesRecomputed(torch.autograd.Function):
    """silu(gate) * up, keeping gate and up; the backward pass recomputes silu(gate) and runs autograd's formulas:
    mul's (grad * other) and silu's (aten.silu_backward), so the gradients are autograd's bit for bit."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up

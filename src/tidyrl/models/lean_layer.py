"""One decoder layer of every declared family (`models.families`), as plain tensor ops: the layer function that
the lean prefill and decode step (`models.lean_decode`) and the lean scoring/update pass (`models.lean_forward`)
share. Each caller brings its own attention (a decoding step's one query against the cache, a prefill's causal
prompts, the update's prompts and completions in one pass) and its own projections and norm/activation kernels
(`Ops`: plain ops for decoding, autograd functions that keep fewer tensors for training); the layer around the
attention is this module's, read from the family's declaration.

The maths, per decoder layer (Touvron et al. 2023, "LLaMA"; transformers' modeling files are the references each
family is checked against in tests/test_families.py), with the family's optional parts in brackets:

    h = [norm_attention_in](x)
    q, k, v = q_proj(h), k_proj(h), v_proj(h)            (or one qkv_proj: Phi-3)
    q, k = [q_norm](q), [k_norm](k)                      (per head: Qwen3, Gemma 3; whole projection: OLMo 2)
    q, k = rope(q), rope(k)
    x = x + [norm_attention_out](o_proj(attention(q, k, v)))
    h = [norm_mlp_in](x)
    x = x + [norm_mlp_out](down_proj(act(gate_proj(h)) * up_proj(h)))   (or one gate_up_proj: Phi-3; or the
                                                                        model's own mixture-of-experts block)

- RMSNorm (Zhang & Sennrich 2019): x / sqrt(mean(x^2) + eps) in float32, then the family's weight form
  (`families.Family.norm`): Llama's w * (cast back first), OLMo 2's w in float32 then cast, Gemma's (1 + w) in
  float32 then cast.
- RoPE (Su et al. 2021, "RoFormer" eq. 34): x * cos + rotate_half(x) * sin in the half-split layout; cos and sin
  from the model's own rotary module (every rope scaling it supports), per layer type where it keeps one per type.
- Grouped-query attention (Ainslie et al. 2023), softmax in float32, with each layer's sliding window where it has
  one (`families.windows`): the callers' masks.
- MLP: a gated linear unit (Shazeer 2020) with the model's own activation module (SiLU, Gemma's tanh GELU).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from tidyrl.models import families
from tidyrl.models.families import Family
from tidyrl.models.sharding import is_sharded


class Norm(NamedTuple):
    """An RMSNorm's weight and epsilon, and the family's form of it (`families.Family.norm`)."""
    weight: torch.Tensor
    eps: float
    form: str


def norm_of(module: nn.Module, form: str) -> Norm:
    eps = getattr(module, "variance_epsilon", None)
    return Norm(module.weight, float(module.eps if eps is None else eps), form)


def rms_norm(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    """The family's RMSNorm of x over its last dimension, with the model's own casts (see the module docstring).
    For float32 input, torch's rms_norm is the same ops in the same order, in one call."""
    weight, eps = norm.weight, norm.eps
    if norm.form == families.CAST_THEN_WEIGHT:
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return F.rms_norm(x, weight.shape, weight, eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(x.dtype)
    weight32 = weight.float() if norm.form == families.WEIGHT_THEN_CAST else 1.0 + weight.float()
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight32, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * weight32).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    # RoFormer eq. 34 in the half-split layout: x * cos + (-x2, x1) * sin. (-x2, x1) * sin is
    # roll(x) * (-sin1, sin2), the same products up to an exact sign flip, in one op fewer.
    # `sin_signed` is `signed_sin(sin)`. Factors in float32 for a bf16 x (OLMo 2's rotary module keeps them so):
    # computed in float32, then cast back, as its apply_rotary_pos_emb does.
    out = torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """(-sin1, sin2) for the two halves of the head dimension: the factor `rope` multiplies roll(x) by."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = may attend) as an additive one of the same shape: 0 where True, -inf where False."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def gated(act: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up, op by op."""
    return act(gate) * up


class Ops(NamedTuple):
    """The kernels a caller computes the layer with: its RMSNorm and its act(gate) * up."""
    norm: Callable[[torch.Tensor, Norm], torch.Tensor]
    gated: Callable[[Callable, torch.Tensor, torch.Tensor], torch.Tensor]


PLAIN_OPS = Ops(rms_norm, gated)

Projection = Callable[[torch.Tensor], torch.Tensor]


class Layer(NamedTuple):
    """What one decoder layer's pass reads, looked up once. A projection is one callable (several linears side by
    side, their outputs concatenated: q|k|v, gate|up) or a tuple of callables, one per linear."""
    attention_in: Optional[Norm]
    attention_out: Optional[Norm]
    mlp_in: Optional[Norm]
    mlp_out: Optional[Norm]
    q_norm: Optional[Norm]
    k_norm: Optional[Norm]
    qk_norm: Optional[str]  # families.Family.qk_norm
    qkv: Union[Projection, tuple[Projection, ...]]
    o: Projection
    gate_up: Union[Projection, tuple[Projection, ...], None]  # None: `down` is the model's own MLP module (MoE)
    down: Projection
    act: Callable[[torch.Tensor], torch.Tensor]  # F.silu for SiLU modules (their forward, minus the module call)
    window: Optional[int]  # the sliding window (positions attended, the query's own included), or None
    rope: str  # the layer's type: which rope factors it reads


def layers_of(model, family: Family, qkv: Callable, gate_up: Callable, single: Callable) -> list[Layer]:
    """The decoder layers of `model` (a supported model: `refusal` is None) as `Layer`s. `qkv(*linears)` and
    `gate_up(*linears)` make the projections of linears that read the same input (one callable or a tuple);
    `single(linear)` the others'."""
    config = model.config
    windows = families.windows(config, family)
    types = families.layer_types(config)
    out = []
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp

        def norm(place: str) -> Optional[Norm]:
            return norm_of(getattr(layer, family.norms[place]), family.norm) if place in family.norms else None

        if family.fused_projections:
            q_k_v, gate_and_up, act = single(attn.qkv_proj), single(mlp.gate_up_proj), mlp.activation_fn
        else:
            q_k_v = qkv(attn.q_proj, attn.k_proj, attn.v_proj)
            if is_own_block(mlp, family):  # a mixture of experts: the model's own module, called as its layer calls it
                gate_and_up, act = None, None
            else:
                gate_and_up, act = gate_up(mlp.gate_proj, mlp.up_proj), mlp.act_fn
        out.append(Layer(
            norm("attention_in"), norm("attention_out"), norm("mlp_in"), norm("mlp_out"),
            norm_of(attn.q_norm, family.norm) if family.qk_norm else None,
            norm_of(attn.k_norm, family.norm) if family.qk_norm else None, family.qk_norm,
            q_k_v, single(attn.o_proj), gate_and_up, _own_block(mlp) if gate_and_up is None else single(mlp.down_proj),
            F.silu if is_silu(act) else act, windows[i], types[i] if family.rope_by_layer_type else families.FULL))
    return out


def attention_inputs(layer: Layer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
                     head_dim: int, ops: Ops = PLAIN_OPS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries (rows, H, D) and keys (rows, Hkv, D) after their norms and rope, and values (rows, Hkv, D), of the
    layer's input x (rows, hidden). `cos`, `sin`: (rows, 1, D), `sin` signed (`signed_sin`)."""
    H, Hkv, D = heads, kv_heads, head_dim
    h = ops.norm(x, layer.attention_in) if layer.attention_in is not None else x
    # torch.split rather than slicing throughout: the backward of a split is one concatenation, that of each slice
    # a zero-filled tensor of the whole input.
    if callable(layer.qkv):  # q|k|v side by side in one product
        qkv = layer.qkv(h)
        if layer.qk_norm is None:  # the query and key heads in one rope
            qk, v = qkv.view(-1, H + 2 * Hkv, D).split([H + Hkv, Hkv], 1)
            q, k = rope(qk, cos, sin).split([H, Hkv], 1)
            return q, k, v
        q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], -1)
    else:
        q_proj, k_proj, v_proj = layer.qkv
        q, k, v = q_proj(h), k_proj(h), v_proj(h)
    if layer.qk_norm == "projection":  # over all heads together (OLMo 2)
        q, k = ops.norm(q, layer.q_norm), ops.norm(k, layer.k_norm)
    q, k, v = q.view(-1, H, D), k.view(-1, Hkv, D), v.view(-1, Hkv, D)
    if layer.qk_norm == "head":  # over each head's dimension (Qwen3, Gemma 3)
        q, k = ops.norm(q, layer.q_norm), ops.norm(k, layer.k_norm)
    return rope(q, cos, sin), rope(k, cos, sin), v


def after_attention(layer: Layer, x: torch.Tensor, o: torch.Tensor, ops: Ops = PLAIN_OPS) -> torch.Tensor:
    """The layer's output from its input x (rows, hidden) and the attention output o (rows, H*D): the output
    projection and its norm, the residual, the MLP and its norms, the residual."""
    a = layer.o(o)
    if layer.attention_out is not None:
        a = ops.norm(a, layer.attention_out)
    x = x + a
    h = ops.norm(x, layer.mlp_in) if layer.mlp_in is not None else x
    if layer.gate_up is None:  # the model's own MLP module
        return x + layer.down(h)
    if callable(layer.gate_up):
        gate, up = layer.gate_up(h).chunk(2, dim=-1)
    else:
        gate_proj, up_proj = layer.gate_up
        gate, up = gate_proj(h), up_proj(h)
    m = layer.down(ops.gated(layer.act, gate, up))
    if layer.mlp_out is not None:
        m = ops.norm(m, layer.mlp_out)
    return x + m


def is_own_block(mlp: nn.Module, family: Family) -> bool:
    """A mixture-of-experts MLP of a family that has one (`Family.moe`): the module the fast path calls as it is."""
    return family.moe and type(mlp).__name__.endswith("SparseMoeBlock")


def _own_block(mlp: nn.Module) -> Projection:
    """The model's own MLP module on rows (rows, hidden), called as its decoder layer calls it, on (1, rows, hidden)
    (a block that also returns its router's logits, as in transformers 4.x, gives them as a tuple's second item)."""

    def call(h: torch.Tensor) -> torch.Tensor:
        out = mlp(h[None])
        return (out[0] if isinstance(out, tuple) else out)[0]

    return call


def rope_factors(rotary: nn.Module, x: torch.Tensor, positions: torch.Tensor, layer_type: str,
                 by_layer_type: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's own rotary module's cos and sin (B, T, D) for `positions` (B, T), for one layer type where the
    module keeps one rope per type (`families.Family.rope_by_layer_type`)."""
    return rotary(x, positions, layer_type) if by_layer_type else rotary(x, positions)


def is_silu(act_fn: nn.Module) -> bool:
    """True for torch's and transformers' SiLU modules, whose forward is F.silu."""
    return isinstance(act_fn, nn.SiLU) or type(act_fn).__name__ == "SiLUActivation"


def family_of_model(model) -> Optional[Family]:
    """The declared family of a transformers model, by its class."""
    return families.family_of(model.config, type(model).__name__)


# The forward hook that transformers' and peft's `enable_input_require_grads` put on the input embeddings
# (`make_inputs_require_grads` / `make_inputs_require_grad`), installed with gradient checkpointing: it only
# marks the embeddings' output as requiring grad, so that reentrant checkpoints of frozen embeddings still reach
# the trainable weights. A no-grad pass skips nothing by not calling it; refusing it sent every generation of
# a gradient-checkpointed model through the model's slower forward (2x on the tiny model).
_GRAD_ONLY_HOOK = "make_inputs_require_grad"


def wrapped(module: nn.Module) -> bool:
    """Something runs around this module's forward that a pass calling no forward would skip: an instance-level
    forward (accelerate's autocast for mixed precision, its offloading hooks) or registered forward hooks (but
    the input-require-grad hook of gradient checkpointing, see _GRAD_ONLY_HOOK)."""
    hooks = [h for h in module._forward_hooks.values() if not getattr(h, "__name__", "").startswith(_GRAD_ONLY_HOOK)]
    return "forward" in vars(module) or bool(hooks) or bool(module._forward_pre_hooks)


def refusal(model, computable: Callable[[nn.Module], bool]) -> Optional[str]:
    """Why the lean passes do not compute `model` (a transformers causal LM) exactly, or None where they do: its
    config (`families.fast_path_refusal`), then its modules, checked one by one against the family's declaration.
    `computable(linear)`: whether a projection module is one the caller computes (nn.Linear, or LoRA's)."""
    name = type(model).__name__
    if getattr(model, "config", None) is None:
        return f"{name} is not a transformers model"
    reason = families.fast_path_refusal(model.config, name)
    if reason is not None:
        return reason
    family = families.family_of(model.config, name)
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"the attention implementation is {impl!r}"
    inner = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(model, "lm_head", None), nn.Linear):
        return "its output layer is not a linear layer"
    embed = getattr(inner, "embed_tokens", None)
    if not (type(embed) is nn.Embedding or
            (family.embedding_scale and isinstance(embed, nn.Embedding) and hasattr(embed, "embed_scale"))):
        return f"its embedding is a {type(embed).__name__}"
    if is_sharded(model):  # FSDP shards the parameters in place (and whole ones are gathered only for a while)
        return "its parameters are sharded"
    # (a mixture-of-experts block is called as the module it is, with whatever runs around it: routing replay's
    # forward, a hook; so are the modules inside it)
    own_blocks = tuple(f"{name}." for name, module in model.named_modules() if is_own_block(module, family))
    for module_name, module in model.named_modules():
        if wrapped(module) and not f"{module_name}.".startswith(own_blocks):
            return f"{module_name or 'the model'} has a hook or its own forward"
    for i, layer in enumerate(inner.layers):
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(getattr(attn, "scaling", None), float):  # (older transformers' OLMoE computes its own)
            return f"layer {i}'s attention keeps no `scaling`"
        own_block = is_own_block(mlp, family)
        for part, want in ((layer, family.layer_children()), (attn, family.attention_children()),
                           *(() if own_block else ((mlp, family.mlp_children()),))):
            got = {child for child, _ in part.named_children()}
            if got != want:
                return f"layer {i}'s {type(part).__name__} has {sorted(got ^ want)}, not the {family.name} layout"
        linears = [m for m in (*attn.children(), *(() if own_block else mlp.children()))
                   if not _is_norm(m) and not _is_activation(m)]
        if not all(computable(m) for m in linears):
            return f"layer {i} has a projection that is not a plain linear layer"
        norms = [getattr(layer, child) for child in family.norms.values()]
        norms += [attn.q_norm, attn.k_norm] if family.qk_norm else []
        if not all(_is_norm(n) for n in norms):
            return f"layer {i} has a norm that is not an RMSNorm"
        for child in family.extra_layer_children:
            if not isinstance(getattr(layer, child), nn.Dropout):
                return f"layer {i}'s {child} is not a dropout"
    if not _is_norm(inner.norm):
        return "its final norm is not an RMSNorm"
    return None


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith("RMSNorm") and not list(module.children())


def _is_activation(module: nn.Module) -> bool:
    return not isinstance(module, nn.Linear) and not list(module.parameters()) and not _is_norm(module) and \
        not hasattr(module, "base_layer")

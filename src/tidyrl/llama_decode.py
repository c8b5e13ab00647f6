"""A lean one-token decoding step for Llama-layout models (Llama, Qwen2, Mistral without sliding windows).

Why: in the overhead-bound regime (a small model, a few dozen rows) a Hugging Face decoding step is
mostly the fixed cost of its module calls, mask and position bookkeeping, output dataclasses and
kwargs plumbing, not arithmetic (docs/benchmarks.md). This step does the same maths with plain tensor ops,
on the model's own parameters, or for small models on a transposed, concatenated copy of them made for one
generation (`COPY_MAX_BYTES`; a step object is built per generation, so nothing is ever out of date).

The maths, per decoder layer, for one new token per row (Touvron et al. 2023, "LLaMA"; the HF
`modeling_llama.py` is the reference it is checked against in tests/test_llama_decode.py):

    h   = x + o_proj(attention(rope(q_proj(rms(x))), rope(k_proj(rms(x))), v_proj(rms(x))))
    out = h + down_proj(act(gate_proj(rms(h))) * up_proj(rms(h)))

- RMSNorm (Zhang & Sennrich 2019): rms(x) = w * (x / sqrt(mean(x^2) + eps)), computed in float32 and cast
  back before the weight, as HF does.
- RoPE (Su et al. 2021, "RoFormer" eq. 34): x * cos + rotate_half(x) * sin, with rotate_half(x) =
  (-x2, x1) for the two halves of the head dimension, the half-split layout HF uses. cos and sin come from
  the model's own rotary module, so every rope scaling it supports (linear, llama3, yarn, dynamic...) is
  the model's.
- Grouped-query attention (Ainslie et al. 2023): query head h reads key/value head h // n_rep. For one query
  token this is attention of the n_rep query heads of a group against their shared keys, so the queries are
  viewed as (B, Hkv, n_rep, D) and no key/value head is ever repeated (as HF's SDPA path does for a
  one-token step). softmax(q k^T * head_dim^-1/2 + bias) v (Vaswani et al. 2017, eq. 1), the bias -inf at
  padding, the softmax in float32 as in HF's eager attention.
- MLP: SwiGLU (Shazeer 2020), down(act(gate(h)) * up(h)) with the model's own activation module.

Anything that does not match this layout exactly (extra modules such as q/k norms, wrapped projections as
with LoRA adapters, sharded parameters, other attention kernels) is refused by `supports`, and the caller
keeps the model's own forward.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tidyrl.sharding import is_sharded

# Architectures whose decoder layer is exactly Llama's (checked module by module in `supports` as well).
_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
_LAYER_CHILDREN = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def supports(model) -> bool:
    """True when `model` is a plain Llama-layout causal LM that `LlamaDecodeStep` computes exactly."""
    if type(model).__name__ not in _ARCHITECTURES:
        return False
    config = model.config
    if getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    inner = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(model, "lm_head", None), nn.Linear):
        return False
    if type(getattr(inner, "embed_tokens", None)) is not nn.Embedding:
        return False
    if is_sharded(model):  # FSDP shards the parameters in place (and whole ones are gathered only for a while)
        return False
    if any(_wrapped(m) for m in model.modules()):
        return False
    for layer in inner.layers:
        if {name for name, _ in layer.named_children()} != _LAYER_CHILDREN:
            return False
        attn, mlp = layer.self_attn, layer.mlp
        if {name for name, _ in attn.named_children()} != set(_ATTN_LINEARS):  # e.g. Qwen3's q_norm/k_norm
            return False
        if {name for name, _ in mlp.named_children()} != set(_MLP_LINEARS) | {"act_fn"}:
            return False
        if any(type(getattr(attn, n)) is not nn.Linear for n in _ATTN_LINEARS):  # LoRA wraps them
            return False
        if any(type(getattr(mlp, n)) is not nn.Linear for n in _MLP_LINEARS):
            return False
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not type(norm).__name__.endswith("RMSNorm") or list(norm.children()):
                return False
    return type(inner.norm).__name__.endswith("RMSNorm")


def _wrapped(module: nn.Module) -> bool:
    """Something runs around this module's forward that a pass calling no forward would skip: an instance-level
    forward (accelerate's autocast for mixed precision, its offloading hooks) or registered forward hooks."""
    return "forward" in vars(module) or bool(module._forward_hooks) or bool(module._forward_pre_hooks)


# Below this many bytes of weights, `LlamaDecodeStep` works on a copy of them made for one generation:
# transposed to (in, out), the layout in which a (rows, in) x (in, out) product is ~30 % faster on CPU than
# nn.Linear's x W^T, and with q/k/v and gate/up concatenated (5 matmuls per layer become 2). That regime is
# overhead-bound: a step costs far more in per-op dispatch than in arithmetic, and the copy is small. Above
# it the matmuls dominate, and the copy would only cost memory.
COPY_MAX_BYTES = 32 * 2**20
# Rope types whose frequencies depend on the positions seen (transformers' `dynamic_rope_update`): their
# cos/sin are asked of the model's rotary module at every step, as its own forward does.
_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")


def rms_norm(x: torch.Tensor, norm: nn.Module) -> torch.Tensor:
    # w * x / sqrt(mean(x^2) + eps), in float32, cast back before the weight (as LlamaRMSNorm). For float32
    # input torch's rms_norm is those same ops in that order, in one call.
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, norm.weight.shape, norm.weight, norm.variance_epsilon)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    # RoFormer eq. 34 in the half-split layout: x * cos + (-x2, x1) * sin. (-x2, x1) * sin is
    # roll(x) * (-sin1, sin2), the same products up to an exact sign flip, in one op fewer.
    # `sin_signed` is `signed_sin(sin)`.
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), sin_signed)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """(-sin1, sin2) for the two halves of the head dimension: the factor `rope` multiplies roll(x) by."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


class LlamaDecodeStep:
    """logits = step(tokens_B, bias_B11L, positions_B1, cache_layers): one new token per row, through every
    layer, its keys and values written into the cache layers (objects with `update(k, v)` that return all keys
    and values so far, such as rollout._BufferedLayer). `bias_B11L` is the additive attention mask: 0 where a
    row may attend, -inf at its padding (see `attention_bias`).

    Made for one generation (`max_positions`: the largest position id it will see, plus one) with the weights
    as they are: small models' weights are copied here (see COPY_MAX_BYTES), so build a new one after an
    optimizer step."""

    def __init__(self, model, max_positions: int):
        self.model = model
        inner = model.model
        config = model.config
        self.layers = list(inner.layers)
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.n_kv = config.num_key_value_heads
        self.n_rep = config.num_attention_heads // config.num_key_value_heads
        self.scale = attn.scaling
        rotary = inner.rotary_emb
        self.rope_table = None
        if getattr(rotary, "rope_type", "default") not in _POSITION_DEPENDENT_ROPE:
            # The rotary module's cos/sin for every position (elementwise in the position: the same values it
            # returns for each position alone), looked up per step.
            positions = torch.arange(max_positions, device=inner.embed_tokens.weight.device)[None]
            cos, sin = rotary(inner.embed_tokens.weight[:1], positions)  # (1, P, D) each, in the model's dtype
            self.rope_table = (cos[0], signed_sin(sin[0]))
        self.copies = None
        if linear_weight_bytes(model) <= COPY_MAX_BYTES:
            with torch.no_grad():
                self.copies = [(_t(l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj), _t(l.self_attn.o_proj),
                                _t(l.mlp.gate_proj, l.mlp.up_proj), _t(l.mlp.down_proj)) for l in self.layers]
                self.head = _t(model.lm_head)

    def __call__(self, tokens_B: torch.Tensor, bias_B11L: torch.Tensor, positions_B1: torch.Tensor,
                 cache_layers) -> torch.Tensor:
        inner = self.model.model
        B, D, Hkv, R = tokens_B.shape[0], self.head_dim, self.n_kv, self.n_rep
        H = Hkv * R
        x = F.embedding(tokens_B, inner.embed_tokens.weight)  # (B, hidden)
        if self.rope_table is not None:
            cos, sin = (F.embedding(positions_B1[:, 0], t).view(B, 1, D) for t in self.rope_table)
        else:
            cos, sin = inner.rotary_emb(x, positions_B1)  # (B, 1, D): the model's own call, as in its forward
            cos, sin = cos.view(B, 1, D), signed_sin(sin).view(B, 1, D)
        for i, (layer, kv) in enumerate(zip(self.layers, cache_layers)):
            attn, mlp = layer.self_attn, layer.mlp
            h = rms_norm(x, layer.input_layernorm)
            if self.copies is not None:
                qkv_w, o_w, gate_up_w, down_w = self.copies[i]
                qkv = _mm(h, qkv_w).view(B, H + 2 * Hkv, D)
                qk = rope(qkv[:, : H + Hkv], cos, sin)  # one rope for the query and key heads together
                q, k, v = qk[:, :H], qk[:, H:], qkv[:, H + Hkv:]
            else:
                q = rope(F.linear(h, attn.q_proj.weight, attn.q_proj.bias).view(B, H, D), cos, sin)
                k = rope(F.linear(h, attn.k_proj.weight, attn.k_proj.bias).view(B, Hkv, D), cos, sin)
                v = F.linear(h, attn.v_proj.weight, attn.v_proj.bias).view(B, Hkv, D)
            keys, values = kv.update(k.view(B, Hkv, 1, D), v.view(B, Hkv, 1, D))  # (B, Hkv, L, D)
            # Grouped-query attention for one query token: the R query heads of group g (heads g*R .. g*R+R-1,
            # HF's repeat_kv order) attend to key/value head g, as an (R, D) x (D, L) product per group.
            # softmax(q k^T * scale + bias) v, with the softmax in float32 as in the models' eager attention.
            scores = torch.matmul(q.view(B, Hkv, R, D), keys.transpose(-1, -2))  # (B, Hkv, R, L)
            probs = torch.softmax(torch.add(bias_B11L, scores, alpha=self.scale).float(), dim=-1).to(values.dtype)
            o = torch.matmul(probs, values).view(B, H * D)  # (B, H*D)
            if self.copies is not None:
                x = x + _mm(o, o_w)
                gate, up = _mm(rms_norm(x, layer.post_attention_layernorm), gate_up_w).chunk(2, dim=-1)
                x = x + _mm(mlp.act_fn(gate) * up, down_w)
            else:
                x = x + F.linear(o, attn.o_proj.weight, attn.o_proj.bias)
                h = rms_norm(x, layer.post_attention_layernorm)
                gate = F.linear(h, mlp.gate_proj.weight, mlp.gate_proj.bias)
                up = F.linear(h, mlp.up_proj.weight, mlp.up_proj.bias)
                x = x + F.linear(mlp.act_fn(gate) * up, mlp.down_proj.weight, mlp.down_proj.bias)
        x = rms_norm(x, inner.norm)
        if self.copies is not None:
            return _mm(x, self.head)
        return F.linear(x, self.model.lm_head.weight, self.model.lm_head.bias)  # (B, V)


def attention_bias(mask_BL: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form (B, 1, 1, L) of a 0/1 key mask: 0 where attended, -inf where masked."""
    return additive_mask(mask_BL != 0, dtype)[:, None, None, :]


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True = may attend) as an additive one of the same shape: 0 where True, -inf where False."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def concatenated(*linears: nn.Linear) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The weights of linears that read the same input as one (sum of outs, in) matrix, and their concatenated
    bias (zeros for a linear without one; None when none has one): F.linear with them computes all of them
    side by side. Differentiable: autograd splits the gradients back to each linear."""
    if len(linears) == 1:
        return linears[0].weight, linears[0].bias
    weight = torch.cat([m.weight for m in linears])
    if all(m.bias is None for m in linears):
        return weight, None
    return weight, torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])


def linear_weight_bytes(model) -> int:
    """Bytes of all nn.Linear weights of `model` (what decides whether small-model copies/fusions pay off)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))


def _t(*linears: nn.Linear) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """A copy of `concatenated(*linears)` with the weight transposed to (in, sum of outs): x @ w + b computes
    all of them side by side."""
    weight, bias = concatenated(*linears)
    return weight.t().contiguous(), bias


def _mm(x: torch.Tensor, weight_bias: tuple[torch.Tensor, Optional[torch.Tensor]]) -> torch.Tensor:
    weight, bias = weight_bias
    return x @ weight if bias is None else torch.addmm(bias, x, weight)


def decode_step_for(model, max_positions: int) -> Optional[LlamaDecodeStep]:
    """The lean step for `model` (see `LlamaDecodeStep`), or None when it is not a layout this module computes
    exactly."""
    return LlamaDecodeStep(model, max_positions) if supports(model) else None

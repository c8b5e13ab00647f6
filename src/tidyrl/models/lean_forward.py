"""A lean forward pass for scoring and training completions of every declared model family (`models.families`;
the layouts of `models.lean_decode.supports`, sliding windows included).

Why: scoring and the policy-gradient updates run the model on a rollout's rows, k samples per prompt. The
Hugging Face forward would run every prompt k times; tidyrl's generic path (`models.forward._shared_prompt_logits`)
runs the distinct prompts once and the completions on their keys and values, in two forward passes, each
with its module calls, mask building and output objects, recorded op by op by autograd. For a small model
that bookkeeping costs as much as the arithmetic (docs/benchmarks.md). Here both go through the layers in
one pass: the distinct prompts' tokens and the completions' tokens are the rows of one (N, hidden) matrix,
so every projection is one matmul (q/k/v concatenated for small models), and only attention splits
them: the prompts attend causally within themselves, each completion to its prompt's keys and
values (indexed per row, so backward sums the k copies' gradients into the shared prompt) and causally to
itself.

The layer is `models.lean_layer`'s, the one the decoding step runs (norms, q/k norms, rope, the MLP, each
family's declaration), with autograd functions that keep fewer tensors for backward (`TRAINING_OPS`). The
attention masks are the one-pass forward's over [prompt, completion] with the row's attention mask (and, in a
layer with a sliding window, keys whose index is at most the query's minus the window masked, as transformers'
masks do), so every score that is read equals the HF forward's to float rounding (tests/test_lean_forward.py and
tests/test_families.py check logits and gradients). Queries that nothing reads differ: a prompt's left-padding
positions attend to themselves only (HF would leave them with no key at all).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tidyrl.models import families
from tidyrl.models.devices import to_device
from tidyrl.models.lean_decode import COPY_MAX_BYTES, concatenated, linear_weight_bytes, supports
from tidyrl.models.lean_layer import (Norm, Ops, additive_mask, after_attention, attention_inputs, family_of_model,
                                      is_silu, layers_of, norm_of, rms_norm, rope_factors, signed_sin)
from tidyrl.models.loading import activation_checkpointing_on


def can_run(model) -> bool:
    """True when `completion_logits` computes what `model`'s own forward would, and its gradients reach
    the parameters as they would through the model: a plain (not DDP-wrapped: DDP syncs gradients only for
    passes through its own forward) model of a declared family, without gradient checkpointing (whose memory
    saving the user asked for) and without dropout in training (this pass applies none)."""
    if isinstance(model, DistributedDataParallel) or not supports(model) or activation_checkpointing_on(model):
        return False
    return not (model.training and families.dropout_refusal(model.config, family_of_model(model)))


def completion_logits(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, completion_ids: torch.Tensor,
                      completion_mask: torch.Tensor) -> torch.Tensor:
    """Logits (B, Tc, V) that predict each completion token (position t predicts completion token t) for
    left-padded prompts (B, Lp) and right-padded completions (B, Tc), as `model`'s forward over the rows
    [prompt, completion] with attention mask [prompt_mask, completion_mask] would give them. Gradients flow
    to `model`'s parameters when called with grad enabled. See `can_run` for the models it takes."""
    inner = model.model
    family = family_of_model(model)
    device = inner.embed_tokens.weight.device
    B, Lp = prompt_ids.shape
    Tc = completion_ids.shape[1]
    Tq = Tc - 1  # completion tokens read as inputs: the last one predicts nothing that is scored
    unique, inverse = distinct_prompts(prompt_ids, prompt_mask)
    U = unique.shape[0]
    # (torch.unique on host tensors: on a GPU it would wait for the device to learn the output's size.)
    u_ids, u_mask = to_device(unique[:, :Lp], device), to_device(unique[:, Lp:], device).bool()
    inverse = to_device(inverse, device)
    c_mask = to_device(completion_mask, device) > 0
    # Position ids as the one-pass forward derives them from the row's mask: cumsum - 1, padding at 0.
    u_pos = (u_mask.long().cumsum(-1) - 1).clamp(min=0)  # (U, Lp)
    c_pos = u_pos[:, -1:].index_select(0, inverse) + c_mask[:, :Tq].long().cumsum(-1)  # (B, Tq)
    tokens = torch.cat([u_ids.reshape(-1), to_device(completion_ids[:, :Tq], device).reshape(-1)])  # (N,)
    positions = torch.cat([u_pos.reshape(-1), c_pos.reshape(-1)])
    NP = U * Lp  # the prompt rows come first, then the completion rows

    attn0 = inner.layers[0].self_attn
    D, H, Hkv = attn0.head_dim, model.config.num_attention_heads, model.config.num_key_value_heads
    fused = linear_weight_bytes(model) <= COPY_MAX_BYTES
    # small models: q/k/v in one (N, hidden) x (hidden, (H + 2 Hkv) D) product instead of three. gate and up
    # always as two products: as halves of one, each is a strided view, and the element-wise SwiGLU on views costs
    # more (forward + backward) than the second matmul call saves.
    layers = layers_of(model, family, qkv=_side_by_side if fused else _each, gate_up=_each, single=_single)
    masks = {window: _masks(u_mask, c_mask, inverse, Lp, Tq, window, H)
             for window in {layer.window for layer in layers}}
    x = inner.embed_tokens(tokens)  # (N, hidden); the module's own call keeps its padding_idx (no gradient there)
    ropes = {}  # per layer type, from the model's own rotary module: every rope scaling it has
    for layer_type in {layer.rope for layer in layers}:
        cos, sin = rope_factors(inner.rotary_emb, x, positions[None], layer_type, family.rope_by_layer_type)
        ropes[layer_type] = cos[0, :, None, :], signed_sin(sin[0])[:, None, :]  # (N, 1, D)
    rows = [NP, B * Tq]
    for layer in layers:
        cos, sin = ropes[layer.rope]
        mask_p, mask_c = masks[layer.window]
        q, k, v = attention_inputs(layer, x, cos, sin, H, Hkv, D, TRAINING_OPS)
        # (rows, heads, L, D) per part; the completions' keys/values follow their prompt's.
        (q_p, q_c), (k_p, k_c), (v_p, v_c) = (t.split(rows) for t in (q, k, v))
        q_p, k_p, v_p = (t.view(U, Lp, -1, D).transpose(1, 2) for t in (q_p, k_p, v_p))
        q_c, k_c, v_c = (t.view(B, Tq, -1, D).transpose(1, 2) for t in (q_c, k_c, v_c))
        k_c = torch.cat([k_p.index_select(0, inverse), k_c], dim=2)
        v_c = torch.cat([v_p.index_select(0, inverse), v_c], dim=2)
        o_p = _attention(q_p, k_p, v_p, mask_p, attn0.scaling)
        o_c = _attention(q_c, k_c, v_c, mask_c, attn0.scaling)
        o = torch.cat([o_p.transpose(1, 2).reshape(NP, H * D), o_c.transpose(1, 2).reshape(B * Tq, H * D)])
        x = after_attention(layer, x, o, TRAINING_OPS)
    # Only the rows that predict completion tokens go through the head: each prompt's last position (left
    # padding puts it at Lp - 1), then the completion rows. They are put in the logits' order before the head
    # (a copy of hidden-size rows): arranging the logits afterwards would copy the pass's largest tensor.
    x_p, x_c = x.split(rows)
    last = x_p.view(U, Lp, -1).split([Lp - 1, 1], dim=1)[1][:, 0]
    h = torch.cat([last.index_select(0, inverse)[:, None], x_c.view(B, Tq, -1)], dim=1)  # (B, Tc, hidden)
    return _linear(_trained_norm(h, norm_of(inner.norm, family.norm)), model.lm_head)  # (B, Tc, V)


def distinct_prompts(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct prompts (a prompt is its ids and its padding) as rows [ids, mask] (U, 2 Lp), sorted, and each
    row's among them (B,): row b's prompt is unique[inverse[b]]. The one order of the passes that run each prompt
    once (and of what maps their tokens back to rows: `models.forward`)."""
    return torch.unique(torch.cat([prompt_ids, prompt_mask], dim=1), dim=0, return_inverse=True)


def _masks(u_mask: torch.Tensor, c_mask: torch.Tensor, inverse: torch.Tensor, Lp: int, Tq: int,
           window: Optional[int], heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The attention masks (True = may attend) of the prompt queries (U, 1, Lp, Lp) and the completion queries
    (B, 1, Tq, Lp + Tq), the one-pass forward's for every query that is read, in the form `_attention` takes
    (`_attention_mask`). Prompt queries: causal over real keys; a padding query attends to itself only (its
    output is never read, and it needs a key to stay finite). Completion queries: every real key of their
    prompt, then causal over real completion keys. With a sliding `window`, only keys whose index (in the row
    [prompt, completion]) is above the query's minus the window, and a completion's padding query its own key
    (as a prompt's)."""
    device = u_mask.device
    B = inverse.shape[0]
    causal_p = torch.ones(Lp, Lp, dtype=torch.bool, device=device).tril()
    causal_c = torch.ones(Tq, Tq, dtype=torch.bool, device=device).tril()
    prompt_keys = u_mask.index_select(0, inverse)[:, None, :].expand(B, Tq, Lp)
    if window is not None:  # query index - key index < window
        causal_p = causal_p & ~causal_p.tril(-window)
        causal_c = causal_c & ~causal_c.tril(-window)
        # completion query t sits at index Lp + t, prompt key j at j: Lp + t - j < window
        q_index = torch.arange(Lp, Lp + Tq, device=device)[:, None]
        prompt_keys = prompt_keys & (q_index - torch.arange(Lp, device=device)[None, :] < window)
    mask_p = (causal_p & u_mask[:, None, :]) | torch.eye(Lp, dtype=torch.bool, device=device)  # (U, Lp, Lp)
    own_c = causal_c & c_mask[:, None, :Tq]
    if window is not None:  # a padding query past the window would have no key: it attends to itself (not read)
        own_c = own_c | torch.eye(Tq, dtype=torch.bool, device=device)
    mask_c = torch.cat([prompt_keys, own_c], dim=-1)  # (B, Tq, Lp + Tq)
    return _attention_mask(mask_p[:, None], heads), _attention_mask(mask_c[:, None], heads)


# Attention whose probabilities (rows x heads x queries x keys, float32) fit in this many bytes is computed as
# matmul-softmax-matmul on CPU, above it with torch's fused scaled_dot_product_attention (which never holds them
# all). At the sizes of a short RL completion the fused CPU kernel costs more than the arithmetic (docs/benchmarks.md,
# "Figures behind the code's choices"). On other devices (CUDA) attention is always the fused kernel:
# one launch forward and one backward instead of five each, and no float32 probabilities kept for backward.
MATH_ATTENTION_MAX_BYTES = 32 * 2**20
MATH_ATTENTION_DEVICES = ("cpu",)
# Devices whose fused attention reads grouped key/value heads with a mask (`enable_gqa`). CUDA's fused kernels
# (flash, memory-efficient, cuDNN) take grouped heads only without a mask: with one, SDPA silently falls back to
# its unfused "math" kernel, in float32 for bf16 inputs (transformers' `use_gqa_in_sdpa` makes the same call).
# Elsewhere the key/value heads are repeated to one per query head first (HF's `repeat_kv`), as the model's own
# SDPA attention does.
GROUPED_SDPA_DEVICES = ("cpu",)


def _attention_mask(mask: torch.Tensor, heads: int) -> torch.Tensor:
    """The mask (B, 1, T, L) as `_attention` takes it: its additive form (0 / -inf, float32) for matmul attention
    (on CPU, where the probabilities fit in MATH_ATTENTION_MAX_BYTES), else as is (True = may attend: SDPA)."""
    B, _, T, L = mask.shape
    if mask.device.type not in MATH_ATTENTION_DEVICES or B * heads * T * L * 4 > MATH_ATTENTION_MAX_BYTES:
        return mask
    return additive_mask(mask, torch.float32)


def _attention(q, k, v, mask, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale + mask) v (Vaswani et al. 2017, eq. 1) for q (B, H, T, D) and keys/values
    (B, Hkv, L, D): query head h reads key/value head h // (H / Hkv) (grouped-query attention, Ainslie et
    al. 2023; HF's repeat_kv order). `mask` (B, 1, T, L) from `_attention_mask`: boolean (True = may attend)
    for torch's SDPA, or additive (0 / -inf) for matmul attention, which never copies a key/value head."""
    B, H, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    R = H // Hkv
    if mask.dtype == torch.bool:
        if R > 1 and q.device.type not in GROUPED_SDPA_DEVICES:  # one key/value head per query head (see above)
            k, v = (t[:, :, None].expand(B, Hkv, R, L, D).reshape(B, H, L, D) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != H)
    # The R query heads of group g are consecutive (g*R .. g*R + R - 1): as (B, Hkv, R*T, D) they are R*T
    # query rows against the group's L keys. The softmax in float32, as in the models' eager attention.
    scores = torch.matmul(q.reshape(B, Hkv, R * T, D), k.transpose(-1, -2)).view(B, Hkv, R, T, L)
    probs = torch.softmax(torch.add(mask[:, :, None], scores, alpha=scale).float(), dim=-1).to(v.dtype)
    return torch.matmul(probs.view(B, Hkv, R * T, L), v).view(B, H, T, D)


class _RMSNorm(torch.autograd.Function):
    """w * x / sqrt(mean(x^2) + eps) for float32 x (Zhang & Sennrich 2019, eq. 4), with its backward written
    out: d x = rstd * (g_hat - x_hat * mean(g_hat * x_hat)), g_hat = g * w; d w = sum(g * x_hat). One graph
    node instead of six, and only x_hat and rstd kept."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        x_hat = x * rstd
        ctx.save_for_backward(x_hat, rstd, weight)
        return x_hat * weight

    @staticmethod
    def backward(ctx, grad):
        x_hat, rstd, weight = ctx.saved_tensors
        grad_weight = (grad * x_hat).reshape(-1, x_hat.shape[-1]).sum(0) if ctx.needs_input_grad[1] else None
        g_hat = grad * weight
        grad_x = rstd * (g_hat - x_hat * (g_hat * x_hat).mean(-1, keepdim=True))
        return grad_x, grad_weight, None


def _trained_norm(x: torch.Tensor, norm: Norm) -> torch.Tensor:
    """`lean_layer.rms_norm` with autograd: for float32, `_RMSNorm` (the family's weight form as its weight:
    w, or Gemma's 1 + w), else op by op with the model's casts."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        weight = 1.0 + norm.weight if norm.form == families.ONE_PLUS_WEIGHT else norm.weight
        return _RMSNorm.apply(x, weight, norm.eps)
    return rms_norm(x, norm)


class _SiluGate(torch.autograd.Function):
    """silu(gate) * up (SwiGLU, Shazeer 2020), keeping only gate and up for backward (autograd op by op would
    also keep silu(gate): one more (tokens, intermediate) tensor per layer)."""

    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate)  # (grad * up) * silu'(gate), one kernel
        return grad_gate, grad * F.silu(gate)


def _gated(act, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if act is F.silu or is_silu(act):
        return _SiluGate.apply(gate, up)
    return act(gate) * up


TRAINING_OPS = Ops(_trained_norm, _gated)


def _linear(x: torch.Tensor, *linears: nn.Linear) -> torch.Tensor:
    """x through linears that read the same input, side by side (their outputs concatenated), as one product
    (`lean_decode.concatenated`: the weights are concatenated for this call, autograd splits their gradients)."""
    return F.linear(x, *concatenated(*linears))


def _side_by_side(*linears: nn.Linear):
    return lambda x: _linear(x, *linears)


def _each(*linears: nn.Linear):
    return tuple(_single(m) for m in linears)


def _single(linear: nn.Linear):
    return lambda x: _linear(x, linear)


def logits_if_lean(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> Optional[torch.Tensor]:
    """`completion_logits` when `can_run(model)` and the completions are at least 2 tokens wide (one is the
    model's ordinary one-position forward), else None."""
    if completion_ids.shape[1] < 2 or not can_run(model):
        return None
    return completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask)

"""A lean prefill and one-token decoding step for every declared model family (`models.families`: Llama, Qwen2,
Qwen3, Mistral, Gemma 3, OLMo 2, Phi-3; sliding windows included).

Why: in the overhead-bound regime (a small model, a few dozen rows) a Hugging Face decoding step is
mostly the fixed cost of its module calls, mask and position bookkeeping, output dataclasses and
kwargs plumbing, not arithmetic (docs/benchmarking.md, "Where the time goes on a CPU"). This step does the same
maths with plain tensor ops, on the model's own parameters, or for small models on a transposed, concatenated copy
of them (`COPY_MAX_BYTES`; rewritten in place before every generation, so never out of date).

The layer is `models.lean_layer`'s (the one layer function the training pass shares); this module adds what a
decoding step does around it:
- Grouped-query attention (Ainslie et al. 2023) for one query token: attention of the n_rep query heads of a
  group against their shared keys, the queries viewed as (B, Hkv, n_rep, D), so that no key/value head is ever
  repeated (as HF's SDPA path does for a one-token step). softmax(q k^T * scale + bias) v (Vaswani et al. 2017,
  eq. 1), the bias -inf at padding and, in a layer with a sliding window, at keys the window has passed (key index
  <= query index - window, transformers' mask), the softmax in float32 as in HF's eager attention. The cache keeps
  every position (a window masks, never drops, a key).
- Embeddings (times sqrt(hidden) where the family scales them), the final norm and the output layer.
tests/test_lean_decode.py and tests/test_families.py check it against the models' own forward.

Anything that does not match a family's declaration exactly (an undeclared config attribute, an extra module,
wrapped projections, sharded parameters, other attention kernels) is refused by `supports`, which says why
(`refusal`), and the caller keeps the model's own forward. LoRA adapters (peft) are computed for generation
(`supports(..., lora=True)`): a projection is W x + b + s B A x with the one active adapter, as peft's forward
computes it (Hu et al. 2021, eq. 3).
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from tidyrl.models import fused_decode
from tidyrl.models.kernels import kernels_of
from tidyrl.models.sharding import base_of
from tidyrl.models.lean_layer import (additive_mask, after_attention, attention_inputs, family_of_model,
                                      norm_of, rms_norm, rope_factors, signed_sin)
from tidyrl.models import lean_layer


def supports(model, lora: bool = False) -> bool:
    """True when `model` is a causal LM of a declared family that `DecodeStep` computes exactly (`refusal` is
    None). With `lora`, also a peft model over one, its projections adapted by LoRA (see `_lora_parts`)."""
    return refusal(model, lora) is None


def refusal(model, lora: bool = False) -> Optional[str]:
    """Why `DecodeStep` does not compute `model` (see `lean_layer.refusal`), or None where it does."""
    model = base_of(model) if lora else model
    return lean_layer.refusal(model, lambda module: _computable(module, lora))


def _computable(module: nn.Module, lora: bool) -> bool:
    return type(module) is nn.Linear or (lora and _lora_parts(module) is not None)


def _lora_parts(module: nn.Module) -> Optional[tuple[nn.Linear, nn.Linear, nn.Linear, float]]:
    """(base linear, A, B, scaling) of a peft LoRA linear layer that computes base(x) + B(A(x)) * scaling: one
    active adapter, not merged, not disabled, no DoRA or other variant, no bias on B, no dropout in effect, a
    plain base linear. None for any other module (its forward is then the model's own)."""
    base, lora_a, lora_b = (getattr(module, n, None) for n in ("base_layer", "lora_A", "lora_B"))
    if type(base) is not nn.Linear or not isinstance(lora_a, nn.ModuleDict) or not isinstance(lora_b, nn.ModuleDict):
        return None
    active = list(getattr(module, "active_adapters", ()))
    if len(active) != 1 or active[0] not in lora_a or getattr(module, "merged", True) or \
            getattr(module, "disable_adapters", True):
        return None
    name = active[0]
    a, b = lora_a[name], lora_b[name]
    if type(a) is not nn.Linear or type(b) is not nn.Linear or b.bias is not None or a.bias is not None:
        return None
    if getattr(module, "use_dora", {}).get(name) or getattr(module, "lora_variant", {}).get(name) is not None:
        return None
    dropout = module.lora_dropout[name]
    if dropout.training and getattr(dropout, "p", 0.0) > 0:
        return None
    return base, a, b, float(module.scaling[name])


def _lora_state(model) -> tuple:
    """What a step built for `model` depends on beyond its parameters: each LoRA layer's adapter and scaling."""
    return tuple((parts[1].weight.data_ptr(), parts[3]) for parts in map(_lora_parts, model.modules())
                 if parts is not None)


# Below this many bytes of weights, `DecodeStep` works on a copy of them, kept up to date in place:
# transposed to (in, out), the layout in which a (rows, in) x (in, out) product is ~30 % faster on CPU than
# nn.Linear's x W^T, and with q/k/v and gate/up concatenated (5 matmuls per layer become 2). That regime is
# overhead-bound: a step costs far more in per-op dispatch than in arithmetic, and the copy is small. Above
# it the matmuls dominate, and the copy would only cost memory.
COPY_MAX_BYTES = 32 * 2**20
# The most bytes of weights `DecodeStep.side_by_side` copies for a generation (q/k/v and gate/up side by side):
# Qwen2.5-0.5B's are 468 MB, 1.5B's 1.7 GB. Above it (larger models) the matmuls are bound by reading the weights,
# not by their launches, and the copy would only cost memory.
SIDE_BY_SIDE_MAX_BYTES = 1 << 30
# Rope types whose frequencies depend on the positions seen (transformers' `dynamic_rope_update`): their
# cos/sin are asked of the model's rotary module at every step, as its own forward does.
_POSITION_DEPENDENT_ROPE = ("dynamic", "longrope")


class DecodeStep:
    """logits = step(tokens_B, bias_B11L, positions_B1, cache_layers): one new token per row, through every
    layer, its keys and values written into the cache layers (objects with `update(k, v)` that return all keys
    and values so far, such as rollout._BufferedLayer). `bias_B11L` is the additive attention mask: 0 where a
    row may attend, -inf at its padding (see `attention_bias`); the new token's query sits at the last of its L
    positions, or at cache position `at` (a device tensor, `StaticDecode`) where given.

    Holds the model's parameters (not the model) and, for small models (see COPY_MAX_BYTES), transposed
    copies of them: `decode_step_for` keeps one step per model and calls `refresh` before each generation,
    which rewrites them in place (cheaper than building a step: no allocation, one strided copy per weight)."""

    def __init__(self, model, max_positions: int):
        model = base_of(model)
        inner = model.model
        config = model.config
        self.family = family_of_model(model)
        attn = inner.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.n_kv = config.num_key_value_heads
        self.n_rep = config.num_attention_heads // config.num_key_value_heads
        self.scale = attn.scaling
        self.embed = inner.embed_tokens.weight
        # Gemma's scaled embedding: its output times sqrt(hidden), the factor in the weight's dtype (its forward)
        self.embed_scale = inner.embed_tokens.embed_scale if self.family.embedding_scale else None
        self.norm = norm_of(inner.norm, self.family.norm)
        self.rotary = inner.rotary_emb  # a submodule: holding it does not keep the model alive
        self.rope_tables, self.max_positions = None, 0
        self.params = list(model.parameters())
        self.pointers = [p.data_ptr() for p in self.params]
        self.lora_state = _lora_state(model)
        # (LoRA adapters are merged into float32 copies only: in bf16 the rounding of W + s B A would swallow
        # most of a small adapter's update.)
        self.copied = linear_weight_bytes(model) <= COPY_MAX_BYTES and (
            not self.lora_state or all(p.dtype == torch.float32 for p in self.params))
        copies: list[_Copy] = []

        def side_by_side(*linears):  # linears that read the same input
            if not self.copied:
                return tuple(_Projection(m) for m in linears)
            copies.append(_Copy(*linears))
            return copies[-1]

        def single(linear):
            if not self.copied:
                return _Projection(linear)
            copies.append(_Copy(linear))
            return copies[-1]

        self.layers = lean_layer.layers_of(model, self.family, side_by_side, side_by_side, single)
        self.head = single(model.lm_head)
        self.copies = copies if self.copied else None
        self.rope_types = sorted({layer.rope for layer in self.layers})
        self.windows = sorted({layer.window for layer in self.layers if layer.window is not None})
        # Fixed-shape steps in bf16/fp16 on CUDA: a few fused kernels per layer (tidyrl.models.fused_decode), for
        # the layouts its kernels compute (Llama's norm before attention and before the MLP, no q/k norms, no
        # window, one rope), where every norm weight is in the activations' dtype (as LlamaRMSNorm's product then is).
        family = self.family
        self.kernels = kernels_of(model)  # (the choice it was built with: `matches` checks it is still the model's)
        self.attend = self.kernels.decode_attention == "kernel"
        self.fused = fused_decode.wanted(self.embed.device, self.embed.dtype, self.head_dim,
                                         self.kernels.fused_decode) and \
            family.llama_norms() and family.qk_norm is None and not family.moe \
            and not family.fused_projections and not self.windows and len(self.rope_types) == 1 and all(
                n.weight.dtype == self.embed.dtype
                for n in (self.norm, *(n for l in self.layers for n in (l.attention_in, l.mlp_in))))
        self.extend(max_positions)

    def side_by_side(self) -> Optional[list[tuple[tuple, tuple]]]:
        """For the fused step on the model's own weights (not `copied`): per layer ((W, b) of q/k/v, (W, b) of
        gate/up), each linear's weight and bias concatenated (`concatenated`), so that one matmul computes what
        two or three did; for a generation (`StaticDecode`), then freed. On a GPU at these row counts a matmul
        costs its launch more than its FLOPs: 168 matmuls per token become 96 on Qwen2.5-0.5B. None where it does
        not apply (unfused, copied, LoRA layers), or where the copy would exceed SIDE_BY_SIDE_MAX_BYTES."""
        if not self.fused or self.copied or any(p.lora is not None for l in self.layers for p in (*l.qkv, *l.gate_up)):
            return None
        size = sum(p.weight.numel() * p.weight.element_size() for l in self.layers for p in (*l.qkv, *l.gate_up))
        if size > SIDE_BY_SIDE_MAX_BYTES:
            return None
        with torch.no_grad():
            return [(concatenated(*l.qkv), concatenated(*l.gate_up)) for l in self.layers]

    def matches(self, model) -> bool:
        """True while `model` still has the parameters this step was built on: the same tensors in the same
        storage (not replaced, not moved to another device or dtype), and the same choice of kernels."""
        model = base_of(model)
        params = list(model.parameters())
        return kernels_of(model) == self.kernels and len(params) == len(self.params) and all(
            a is b and a.data_ptr() == ptr for a, b, ptr in zip(params, self.params, self.pointers)) and \
            _lora_state(model) == self.lora_state

    def refresh(self, max_positions: int) -> "DecodeStep":
        """Rewrite the copies from the parameters as they are now, in place, and extend the rope tables up to
        `max_positions`. Always: parameters change without a trace that could be checked cheaply (torch's fused
        AdamW updates them in place without bumping their version counters)."""
        if self.copies is not None:
            with torch.no_grad():
                for copy in self.copies:
                    copy.refresh()
        self.extend(max_positions)
        return self

    def extend(self, max_positions: int) -> None:
        """Tabulate the rotary module's cos/sin up to `max_positions` (not for position-dependent rope types)."""
        position_dependent = any(_rope_type(self.rotary, t) in _POSITION_DEPENDENT_ROPE for t in self.rope_types)
        if position_dependent or max_positions <= self.max_positions:
            return
        # The rotary module's cos/sin for every position (elementwise in the position: the same values it
        # returns for each position alone), looked up per step.
        tables = {}
        with torch.no_grad():
            positions = torch.arange(max_positions, device=self.embed.device)[None]
            for t in self.rope_types:  # (1, P, D) each, in the model's dtype
                cos, sin = rope_factors(self.rotary, self.embed[:1], positions, t, self.family.rope_by_layer_type)
                tables[t] = (cos[0], signed_sin(sin[0]))
        self.rope_tables, self.max_positions = tables, max_positions

    def __call__(self, tokens_B: torch.Tensor, bias_B11L: torch.Tensor, positions_B1: torch.Tensor,
                 cache_layers, at: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.fused and isinstance(cache_layers[0], _StaticLayer):
            return self._fused_step(tokens_B, bias_B11L, positions_B1, cache_layers)
        B, D, Hkv, R = tokens_B.shape[0], self.head_dim, self.n_kv, self.n_rep
        H, L = Hkv * R, bias_B11L.shape[-1]
        x = self._embed(tokens_B)  # (B, hidden)
        ropes = self._rope_factors(x, positions_B1)
        # The mask once per step (and per window) in the (B * Hkv, R, L) layout of the attention products below,
        # so that one baddbmm per layer computes q k^T * scale + bias.
        biases = {None: bias_B11L}
        for window in self.windows:  # keys at index <= query index - window are out of the window
            query = L - 1 if at is None else at
            passed = torch.arange(L, device=bias_B11L.device) <= query - window
            biases[window] = bias_B11L.masked_fill(passed, float("-inf"))
        biases = {w: b.expand(B, Hkv, R, L).reshape(B * Hkv, R, L) for w, b in biases.items()}
        for layer, kv in zip(self.layers, cache_layers):
            cos, sin = ropes[layer.rope]
            q, k, v = attention_inputs(layer, x, cos, sin, H, Hkv, D)
            keys, values = kv.update(k.view(B, Hkv, 1, D), v.view(B, Hkv, 1, D))  # (B, Hkv, L, D)
            # Grouped-query attention for one query token: the R query heads of group g (heads g*R .. g*R+R-1,
            # HF's repeat_kv order) attend to key/value head g, as an (R, D) x (D, L) product per group, all
            # groups of all rows as one batch (the cache buffers' rows and heads merge into one dimension
            # without a copy). softmax(q k^T * scale + bias) v, the softmax in float32 as in the models' eager
            # attention.
            scores = torch.baddbmm(biases[layer.window], q.reshape(B * Hkv, R, D),
                                   keys.reshape(B * Hkv, L, D).transpose(1, 2), alpha=self.scale)
            probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
            x = after_attention(layer, x, torch.bmm(probs, values.reshape(B * Hkv, L, D)).view(B, -1))
        return self._logits(x)  # (B, V)

    def _fused_step(self, tokens_B: torch.Tensor, bias_B11L: torch.Tensor, positions_B1: torch.Tensor,
                    cache_layers: list["_StaticLayer"]) -> torch.Tensor:
        """The general step's maths in fewer kernels (tidyrl.models.fused_decode) for fixed-shape cache layers:
        each residual add fused with the RMSNorm after it, rope with the cache writes and the attention (the
        layouts of `self.fused`: Llama's pre-norms, no q/k norms, no window, one rope)."""
        B, D, Hkv, R = tokens_B.shape[0], self.head_dim, self.n_kv, self.n_rep
        H, C = Hkv * R, bias_B11L.shape[-1]
        x = self._embed(tokens_B)  # (B, hidden)
        (cos, sin), = self._rope_factors(x, positions_B1).values()
        # The attention: one kernel with rope and the cache writes, over the positions written so far; or (where
        # kernels.decode_attention: sdpa) SDPA over the whole capacity, each group's R heads as its R queries.
        attend = self.attend
        bias_rows = bias_B11L.view(B, C)
        bias = None if attend else bias_B11L.expand(B, Hkv, R, C).reshape(B * Hkv, 1, R, C)
        delta = None  # the MLP output of the layer before, added to x with the next norm
        for layer, kv in zip(self.layers, cache_layers):
            x, h = fused_decode.add_rms_norm(x, delta, layer.attention_in.weight, layer.attention_in.eps)
            if self.copied or kv.qkv is not None:
                qkv = layer.qkv(h) if self.copied else F.linear(h, *kv.qkv)
                q, k, v = qkv[:, : H * D], qkv[:, H * D: (H + Hkv) * D], qkv[:, (H + Hkv) * D:]
            else:
                q, k, v = (proj(h) for proj in layer.qkv)
            if attend:  # over the positions written so far only
                o = fused_decode.rope_cache_attend(q, k, v, cos, sin, kv.keys, kv.values, kv.at, bias_rows,
                                                   self.scale)
            else:
                q = fused_decode.rope_and_cache(q, k, v, cos, sin, kv.keys, kv.values, kv.at)
                o = fused_decode.attention(q.view(B * Hkv, 1, R, D), kv.keys.view(B * Hkv, 1, C, D),
                                           kv.values.view(B * Hkv, 1, C, D), bias, self.scale).reshape(B, H * D)
            x, h = fused_decode.add_rms_norm(x, layer.o(o), layer.mlp_in.weight, layer.mlp_in.eps)
            if self.copied or kv.gate_up is not None:
                gate_up = layer.gate_up(h) if self.copied else F.linear(h, *kv.gate_up)
                if layer.act is F.silu:  # act(gate) * up in one kernel
                    hidden = fused_decode.silu_and_mul(gate_up)
                else:
                    gate, up = gate_up.chunk(2, dim=-1)
                    hidden = layer.act(gate) * up
            else:
                gate, up = layer.gate_up
                hidden = layer.act(gate(h)) * up(h)
            delta = layer.down(hidden)
        _, x = fused_decode.add_rms_norm(x, delta, self.norm.weight, self.norm.eps)
        return self.head(x)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache_layers) -> torch.Tensor:
        """The logits (U, V) after the last position of left-padded prompts `ids` (U, Lp), with their 0/1 `mask`
        and position ids, their keys and values written into the (empty) cache layers: what the model's forward
        over the prompts computes, where it is read. A padding position attends to itself only: its output is
        never read (later queries mask its key), and one key keeps it finite."""
        U, Lp = ids.shape
        D, Hkv, R = self.head_dim, self.n_kv, self.n_rep
        x = self._embed(ids.reshape(-1))  # (U*Lp, hidden)
        ropes = self._rope_factors(x, positions)
        eye = torch.eye(Lp, dtype=torch.bool, device=ids.device)
        causal = torch.ones_like(eye).tril()  # (Lp queries, Lp keys); (a bool cumsum would make an int64 copy)
        biases = {}
        for window in (None, *self.windows):
            allowed = causal if window is None else causal & ~causal.tril(-window)  # query - key < window
            allowed = (allowed & (mask[:, None, :] != 0)) | eye  # (U, Lp, Lp)
            biases[window] = additive_mask(allowed, x.dtype)[:, None, None]  # (U, 1, 1, Lp, Lp)
        for layer, kv in zip(self.layers, cache_layers):
            cos, sin = ropes[layer.rope]
            q, k, v = attention_inputs(layer, x, cos, sin, Hkv * R, Hkv, D)
            keys, values = kv.update(k.view(U, Lp, Hkv, D).transpose(1, 2), v.view(U, Lp, Hkv, D).transpose(1, 2))
            # As in __call__, with Lp queries per row: the R heads of a group and their Lp queries are R*Lp rows.
            q = q.view(U, Lp, Hkv, R, D).permute(0, 2, 3, 1, 4).reshape(U, Hkv, R * Lp, D)
            scores = torch.matmul(q, keys.transpose(-1, -2)).view(U, Hkv, R, Lp, Lp)
            probs = torch.softmax(torch.add(biases[layer.window], scores, alpha=self.scale).float(),
                                  dim=-1).to(values.dtype)
            o = torch.matmul(probs.view(U, Hkv, R * Lp, Lp), values).view(U, Hkv, R, Lp, D)
            x = after_attention(layer, x, o.permute(0, 3, 1, 2, 4).reshape(U * Lp, -1))
        return self._logits(x.view(U, Lp, -1)[:, -1])

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = F.embedding(tokens, self.embed)
        return x if self.embed_scale is None else x * self.embed_scale.to(x.dtype)

    def _rope_factors(self, x: torch.Tensor, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Per layer type, cos and signed sin (rows, 1, D) for `positions` (B, T), rows = B*T."""
        n, D = positions.numel(), self.head_dim
        if self.rope_tables is not None:
            flat = positions.reshape(-1)
            return {t: tuple(F.embedding(flat, f).view(n, 1, D) for f in table)
                    for t, table in self.rope_tables.items()}
        out = {}
        for t in self.rope_types:  # the model's own call, as in its forward
            cos, sin = rope_factors(self.rotary, x, positions, t, self.family.rope_by_layer_type)  # (B, T, D)
            out[t] = (cos.reshape(n, 1, D), signed_sin(sin).reshape(n, 1, D))
        return out

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(rms_norm(x, self.norm))


def _rope_type(rotary, layer_type: str) -> str:
    """The rope type of a rotary module (of one layer type, where it keeps one per type: Gemma 3)."""
    rope_type = getattr(rotary, "rope_type", "default")
    return rope_type.get(layer_type, "default") if isinstance(rope_type, dict) else rope_type


class StaticDecode:
    """`DecodeStep` with every shape fixed for a whole generation: B rows (finished rows keep decoding
    padding instead of leaving the batch), the key/value cache at its full capacity C, attention over all C
    positions with the ones not written yet masked (-inf) (the fused step's kernel reads only the positions up to
    the device-side write position: `fused_decode.rope_cache_attend`), and every index it advances (the write
    position, the rows' positions) a device tensor. Calling it decodes `tokens` and advances them in place, with
    no host value in between: a whole token (this step and the draw after it, see `generation`) is one unit a CUDA
    graph can capture once and replay for every token (`Replayed`). Eagerly (CPU, tests) it is the same computation:
    masked positions hold zeros and get probability 0, so a step's logits are the growing-cache step's up to
    summation order (tests/test_lean_decode.py: the same tokens).

    `cache_layers` are the prefilled `_BufferedLayer`s (capacity C, `filled` positions written), `bias` the
    (B, 1, 1, C) additive mask of the prompts' padding; both are taken over and written in place. Before the
    first call, set `tokens` and `positions` (B, 1) to the first token to decode and its positions."""

    def __init__(self, step: DecodeStep, cache_layers, bias: torch.Tensor, filled: int):
        self.step, self.bias = step, bias
        self.bias[..., filled:] = float("-inf")  # nothing after the prompts is written yet
        device, B = bias.device, bias.shape[0]
        self.at = torch.full((1,), filled, dtype=torch.long, device=device)  # where the next key/value goes
        self.layers = [_StaticLayer(layer, filled, self.at) for layer in cache_layers]
        # For this generation only (freed with it, never held while training): the fused step's q/k/v and gate/up
        # weights side by side, 7 matmuls per layer becoming 4 (`DecodeStep.side_by_side`).
        for static, weights in zip(self.layers, step.side_by_side() or ()):
            static.qkv, static.gate_up = weights
        self.tokens = torch.zeros(B, dtype=torch.long, device=device)
        self.positions = torch.zeros((B, 1), dtype=torch.long, device=device)

    def __call__(self) -> torch.Tensor:
        """The logits (B, V) after `tokens` at `positions`, their keys and values written at cache position `at`,
        which every row may attend from now on; then `at` and `positions` move on by one."""
        self.bias.index_fill_(-1, self.at, 0.0)
        logits = self.step(self.tokens, self.bias, self.positions, self.layers, at=self.at)
        self.at.add_(1)
        self.positions.add_(1)
        return logits


class Replayed:
    """`fn()` (no arguments: it reads and writes device tensors in place) as a CUDA graph: the first call runs it
    once for real on a side stream (a warm-up, whose effects are that call's) and then captures it, which
    records its kernels without running them; each later call replays them all in one launch, instead of
    launching each of a decoding step's ~1 000 kernels from Python. Its return value is the captured output,
    overwritten by the next call. With `use_graph` False (CPU, and rope types a graph cannot replay) `fn` is
    simply called; so it is, with a warning, after a capture that failed."""

    def __init__(self, fn: Callable[[], object], use_graph: bool):
        self.fn, self.use_graph = fn, use_graph
        self.graph, self.output = None, None

    def __call__(self):
        if not self.use_graph:
            return self.fn()
        if self.graph is not None:
            self.graph.replay()
            return self.output
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            first = self.fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: with rollout.lag the engine generates on a background thread while the learner trains
            # on its own; in the default "global" mode the learner's allocations during the capture would be refused.
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.output = self.fn()
        except RuntimeError as err:  # an op the capture refuses: the same unit, launched kernel by kernel
            warnings.warn(f"tidyrl: decoding runs without a CUDA graph (slower), its capture failed: {err}. "
                          "Please report it with the model's type.", RuntimeWarning, stacklevel=2)
            self.graph, self.output, self.use_graph = None, None, False
        return first  # (a capture records without running: the warm-up's effects are this call's, either way)


class _StaticLayer:
    """A decoder layer's key/value buffers at full capacity: `update` writes one position (the shared device
    index `at`) in place and returns all C positions (unwritten ones zero: masked, and 0 x 0 adds nothing)."""

    def __init__(self, buffered, filled: int, at: torch.Tensor):
        self.keys, self.values, self.at = buffered._k, buffered._v, at
        self.qkv = self.gate_up = None  # (weight, bias) of the layer's projections side by side (see StaticDecode)
        self.keys[:, :, filled:].zero_()
        self.values[:, :, filled:].zero_()

    def update(self, keys: torch.Tensor, values: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.at, keys)
        self.values.index_copy_(2, self.at, values)
        return self.keys, self.values


class _Projection:
    """One linear layer on the model's own parameters, as a call: F.linear(x, W, b), plus s B (A x) for a LoRA
    layer (peft's order and casts: x in the adapter's dtype, the sum back in the layer's result dtype)."""

    def __init__(self, module: nn.Module):
        parts = _lora_parts(module)
        base = module if parts is None else parts[0]
        self.weight, self.bias = base.weight, base.bias
        self.out_features = base.out_features
        self.lora = None if parts is None else (parts[1].weight, parts[2].weight, parts[3])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        if self.lora is None:
            return y
        a, b, scaling = self.lora
        return (y + F.linear(F.linear(x.to(a.dtype), a), b) * scaling).to(y.dtype)


def _effective_weight(module: nn.Module) -> torch.Tensor:
    """The weight a linear layer computes with: for LoRA, W + s B A (merged, for a float32 copy)."""
    parts = _lora_parts(module)
    if parts is None:
        return module.weight
    base, a, b, scaling = parts
    return torch.addmm(base.weight, b.weight, a.weight, alpha=scaling)


class _Copy:
    """Linears that read the same input, as one transposed (in, sum of outs) weight and a concatenated bias:
    `copy(x)` is x @ w (+ b), all of them side by side. `refresh()` rewrites the copy from the linears'
    current weights, in place."""

    def __init__(self, *linears: nn.Linear):
        self.linears = linears
        first = linears[0].weight
        self.weight = first.new_empty((first.shape[1], sum(m.out_features for m in linears)))
        self.refresh()

    def refresh(self) -> None:
        with torch.no_grad():
            start = 0
            for m in self.linears:  # written transposed, straight into place: one copy per weight
                self.weight[:, start: start + m.out_features].copy_(_effective_weight(m).t())
                start += m.out_features
            self.bias = _concatenated_bias(self.linears)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight if self.bias is None else torch.addmm(self.bias, x, self.weight)


def attention_bias(mask_BL: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive form (B, 1, 1, L) of a 0/1 key mask: 0 where attended, -inf where masked."""
    return additive_mask(mask_BL != 0, dtype)[:, None, None, :]


def concatenated(*linears: nn.Linear) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """The weights of linears that read the same input as one (sum of outs, in) matrix, and their concatenated
    bias (zeros for a linear without one; None when none has one): F.linear with them computes all of them
    side by side. Differentiable: autograd splits the gradients back to each linear."""
    if len(linears) == 1:
        return linears[0].weight, linears[0].bias
    return torch.cat([m.weight for m in linears]), _concatenated_bias(linears)


def _concatenated_bias(linears) -> Optional[torch.Tensor]:
    """The linears' biases side by side (zeros for a linear without one), or None when none has one."""
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])


def linear_weight_bytes(model) -> int:
    """Bytes of all nn.Linear weights of `model` (what decides whether small-model copies/fusions pay off)."""
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))


# One step per model, for as long as the model lives (a step holds its parameters, never the model itself).
_STEPS: "weakref.WeakKeyDictionary[nn.Module, DecodeStep]" = weakref.WeakKeyDictionary()


def decode_step_for(model, max_positions: int) -> Optional[DecodeStep]:
    """The lean step for `model` (see `DecodeStep`), up to date with its weights, or None when it is not a
    layout this module computes exactly. The step is kept between generations, its copies rewritten in place."""
    if not supports(model, lora=True):
        _STEPS.pop(base_of(model), None)
        return None
    model = base_of(model)
    step = _STEPS.get(model)
    if step is None or not step.matches(model):
        step = _STEPS[model] = DecodeStep(model, max_positions)
        return step
    return step.refresh(max_positions)


@contextlib.contextmanager
def kept_as_is(model):
    """Around generations that must leave no trace on later ones (the worst-case probe, `loops.rl.probe`): the
    step kept for `model` and its rope tables are put back as they were (the tables are tabulated up to the
    longest sequence seen so far, and one tabulated up to another length need not round each position alike)."""
    model = base_of(model)
    step = _STEPS.get(model)
    tables = None if step is None else (step.rope_tables, step.max_positions)
    try:
        yield
    finally:
        if step is None:
            _STEPS.pop(model, None)
        else:
            _STEPS[model] = step
            step.rope_tables, step.max_positions = tables

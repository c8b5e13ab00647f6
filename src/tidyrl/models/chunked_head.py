"""Completion log-probs from the last hidden states, the output layer applied in chunks: the (tokens, vocabulary)
logits are never whole, in the forward pass or the backward one.

Why: with a 151 936-token vocabulary the logits of an update micro-batch (16 x 257 positions, bf16) are 1.25 GB,
kept for the backward pass, and their gradient another 1.25 GB beside them when it starts: 2.5 GB of the update's
peak, the largest tensors of the pass. Here only the hidden states (tokens x hidden, ~600x smaller) and each
position's logsumexp are kept, and each side of the pass holds one chunk of logits at a time (the update's peak with
and without: docs/benchmarks.md):
- forward: per chunk of positions, logits = h W^T (then / temperature, in the logits' dtype, as the one-pass
  forward's `logits / temperature`), and their log-softmax statistics in float32 (`fused_logprobs`' kernel on
  CUDA, `ops`' row-by-row maths elsewhere): logsumexp, log p(id), entropy;
- backward: per slice of the vocabulary, the slice's logits again, d/dl = g (onehot(id) - exp(l - logsumexp)) / T
  (logsumexp's and gather's backward, then the division's), then dW[slice] = (d/dl)^T h, one product over every
  position, as the whole product would give it, and dh += (d/dl) W[slice], summed across slices in float32 and
  rounded once.
The cost: the output layer's product once more in the backward pass (~3 % of a 0.5B update micro-batch).
The arithmetic is the one-pass forward's; the results differ from it by the rounding of the products only (a
slice's product may take another kernel than the whole one), well inside one bf16 unit (tests/test_chunked_head.py).

Used by `models.forward.completion_logprobs` where the one-pass layout runs (`HEAD_DEVICES`) on a model whose
causal-LM forward is exactly lm_head(base model's last hidden states) (`head_of`), alone, under a peft adapter whose
output layer is the base model's (LoRA on the projections, the output layer frozen) or inside DDP: the model's own
forward runs, through peft's and DDP's where they wrap it (DDP's reducer must see each forward), with the output
layer passing its input through (`passed_through`). Not for FSDP (the output layer's weight is sharded).
`kernels.chunked_head: false` turns it off (`models.kernels`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tidyrl.models import fused_logprobs
from tidyrl.models.ops import low_precision_grad, low_precision_stats

# Device types whose one-pass forward applies the output layer in chunks (the memory of the logits is the peak's
# largest part there, and the recomputed product is cheap against it); elsewhere the model's own forward gives the
# whole logits (and CPU runs the lean pass, `models.forward.LAYOUTS`).
HEAD_DEVICES = ("cuda",)
# The largest chunk of logits either side of the pass holds at once (bytes); a chunk is at least one position, and
# a vocabulary slice at least `fused_logprobs.BLOCK` entries.
CHUNK_BYTES = 256 * 2**20


def head_of(model) -> Optional[nn.Linear]:
    """The output layer of `model` where `completion_logprobs` may apply it itself in chunks: a causal LM of a
    declared family on the fast path (`families.on_fast_path`: its forward is `lm_head(model(...).last_hidden_state[:,
    keep])` and nothing more, no logit scaling or soft-capping), alone, under peft or inside DDP (not sharded by FSDP,
    no accelerate hooks), in bf16/fp16 on a
    device of HEAD_DEVICES, its `lm_head` a plain linear layer without bias (under peft: neither adapted nor a
    trained copy, `modules_to_save`), its choice of kernels (`kernels_of`) with `chunked_head` on; else None."""
    from tidyrl.models.families import on_fast_path
    from tidyrl.models.kernels import kernels_of
    from tidyrl.models.lean_layer import wrapped as _wrapped
    from tidyrl.models.sharding import base_of, ddp_inner, is_sharded

    peft_or_model = ddp_inner(model)
    inner = base_of(peft_or_model)
    if not kernels_of(inner).chunked_head or not on_fast_path(
            inner.config, type(inner).__name__):
        return None
    head, base = getattr(inner, "lm_head", None), getattr(inner, "model", None)
    if type(head) is not nn.Linear or head.bias is not None or base is None:
        return None
    if head.weight.device.type not in HEAD_DEVICES or head.weight.dtype not in (torch.bfloat16, torch.float16):
        return None
    if any(_wrapped(m) for m in (model, peft_or_model, inner, head)) or is_sharded(inner):  # (accelerate's autocast)
        return None
    return head


@contextlib.contextmanager
def passed_through(head: nn.Linear) -> Iterator[None]:
    """Inside the block, `head`'s forward returns its input: the causal LM's forward (through any wrapper around it,
    such as DDP's, whose reducer must see the forward) gives its last hidden states as its "logits", for
    `head_logprobs` to apply the output layer in chunks."""
    head.forward = _unchanged
    try:
        yield
    finally:
        del head.forward


def _unchanged(x: Tensor) -> Tensor:
    return x


def head_logprobs(hidden_BTH: Tensor, weight_VH: Tensor, ids_BT: Tensor, temperature: float,
                  with_entropy: bool = False, fused: Optional[bool] = None) -> tuple[Tensor, Optional[Tensor]]:
    """(log-probs, entropy or None), float32 (B, T), of tokens `ids_BT` under logits = hidden W^T / temperature,
    the logits made a chunk at a time (see the module's docstring). Gradients reach `hidden_BTH` and `weight_VH`;
    the entropy has none. `fused`: whether `fused_logprobs`' kernels may serve each chunk (`kernels.fused_logprobs`;
    None: the defaults)."""
    B, T, H = hidden_BTH.shape
    out = _ChunkedHead.apply(hidden_BTH.reshape(B * T, H), weight_VH, ids_BT.reshape(-1).long(),
                             float(temperature), with_entropy, fused)
    logprobs, entropy = out if with_entropy else (out, None)
    return logprobs.view(B, T), entropy.view(B, T) if with_entropy else None


def _rows_per_chunk(vocabulary: int, itemsize: int) -> int:
    return max(1, CHUNK_BYTES // (vocabulary * itemsize))


def _slice_width(positions: int, itemsize: int) -> int:
    # a power-of-two number of the kernels' blocks within CHUNK_BYTES (at least one): each width is a compiled
    # kernel (the vocabulary is a constant of the gradient kernel), and micro-batches of nearby sizes share one
    block = fused_logprobs.BLOCK
    blocks = max(1, CHUNK_BYTES // (max(positions, 1) * itemsize) // block)
    return block << (blocks.bit_length() - 1)


class _ChunkedHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_NH: Tensor, weight_VH: Tensor, ids_N: Tensor, temperature: float, with_entropy: bool,
                fused: Optional[bool]):
        N, V = hidden_NH.shape[0], weight_VH.shape[0]
        lse = torch.empty(N, dtype=torch.float32, device=hidden_NH.device)
        logprobs = torch.empty_like(lse)
        entropy = torch.empty_like(lse) if with_entropy else None
        step = _rows_per_chunk(V, weight_VH.element_size())
        for start in range(0, N, step):
            end = min(start + step, N)
            logits = F.linear(hidden_NH[start:end], weight_VH)
            if temperature != 1.0:
                logits.div_(temperature)
            stats = low_precision_stats(logits[None], ids_N[None, start:end], with_entropy, fused)
            lse[start:end], logprobs[start:end] = stats[2][0], stats[3][0]
            if with_entropy:
                entropy[start:end] = stats[4][0]
            del logits, stats  # (before the next chunk's: one chunk alive at a time)
        ctx.temperature, ctx.fused = temperature, fused
        ctx.save_for_backward(hidden_NH, weight_VH, ids_N, lse)
        if with_entropy:
            ctx.mark_non_differentiable(entropy)
            return logprobs, entropy
        return logprobs

    @staticmethod
    def backward(ctx, grad_N: Tensor, *_):
        hidden_NH, weight_VH, ids_N, lse = ctx.saved_tensors
        N, V = hidden_NH.shape[0], weight_VH.shape[0]
        grad = grad_N.float().contiguous()
        grad_hidden = torch.zeros(hidden_NH.shape, dtype=torch.float32, device=hidden_NH.device)
        grad_weight = torch.empty_like(weight_VH) if ctx.needs_input_grad[1] else None
        width = _slice_width(N, weight_VH.element_size())
        for start in range(0, V, width):
            end = min(start + width, V)
            part = weight_VH[start:end]
            logits = F.linear(hidden_NH, part)
            if ctx.temperature != 1.0:
                logits.div_(ctx.temperature)
            # d/dl of this slice (its ids shifted to it), written over its logits; then the division's backward,
            # as autograd's (/ T)
            d = low_precision_grad(logits[None], (ids_N - start)[None], lse[None], grad[None], out=logits[None],
                                   fused=ctx.fused)[0]
            if ctx.temperature != 1.0:
                d.div_(ctx.temperature)
            if grad_weight is not None:
                torch.mm(d.t(), hidden_NH, out=grad_weight[start:end])
            grad_hidden += _mm_float32(d, part)
            del logits, d  # (before the next slice's: one slice alive at a time)
        return grad_hidden.to(hidden_NH.dtype), grad_weight, None, None, None, None


def _mm_float32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b summed and returned in float32 (low-precision inputs): CUDA's GEMM with a float32 output; elsewhere
    the float32 product (the same sums, without the cast of a low-precision output). Where a GEMM refuses the
    float32 output (an older GPU or library), its low-precision output, upcast: one rounding more per slice."""
    global _NO_FLOAT32_OUTPUT
    if a.is_cuda and not _NO_FLOAT32_OUTPUT:
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError, NotImplementedError):
            _NO_FLOAT32_OUTPUT = True
    if a.is_cuda:
        return torch.mm(a, b).float()
    return torch.mm(a.float(), b.float())


_NO_FLOAT32_OUTPUT = False  # set where CUDA's GEMM refused a float32 output once (`_mm_float32`)

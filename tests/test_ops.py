"""tidyrl.models.ops against the direct (memory-hungry) torch formulas."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import interpreted_triton, recorded_outputs, rerun_interpreted

from tidyrl.models.ops import entropy_from_logits, gather_logprobs

# Bit-equality between code paths, which may hold on some CPU kernels only: CI reruns these tests under
# other kernels (pytest -m kernels; tests/conftest.py).
pytestmark = pytest.mark.kernels


def _random(B=3, T=5, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = 3.0 * torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    return logits, ids


def test_gather_logprobs_matches_log_softmax():
    logits, ids = _random()
    expected = torch.log_softmax(logits, dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    actual = gather_logprobs(logits, ids)
    assert actual.shape == (3, 5) and actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected)


def test_gather_logprobs_gradient_matches_log_softmax():
    logits, ids = _random()
    a = logits.clone().requires_grad_(True)
    b = logits.clone().requires_grad_(True)
    gather_logprobs(a, ids).sum().backward()
    torch.log_softmax(b, dim=-1).gather(-1, ids.unsqueeze(-1)).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


def test_gather_logprobs_bf16_is_computed_in_float32():
    logits, ids = _random(V=50)
    logits_bf16 = logits.bfloat16()
    # Reference: the same bf16 values, upcast, then log_softmax in float32.
    expected = torch.log_softmax(logits_bf16.float(), dim=-1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    actual = gather_logprobs(logits_bf16, ids)
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected)
    # ...and it still backpropagates into the bf16 logits.
    leaf = logits_bf16.clone().requires_grad_(True)
    gather_logprobs(leaf, ids).sum().backward()
    assert leaf.grad is not None and leaf.grad.dtype == torch.bfloat16


def test_entropy_matches_definition():
    logits, _ = _random()
    logp = torch.log_softmax(logits, dim=-1)
    expected = -(logp.exp() * logp).sum(-1)
    actual = entropy_from_logits(logits)
    assert actual.shape == (3, 5) and actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected)
    logp16 = torch.log_softmax(logits.bfloat16().float(), dim=-1)
    torch.testing.assert_close(entropy_from_logits(logits.bfloat16()), -(logp16.exp() * logp16).sum(-1))


def test_entropy_uniform_and_deterministic():
    # Uniform over V = 7 -> H = log 7 = 1.94591.
    torch.testing.assert_close(entropy_from_logits(torch.zeros(2, 3, 7)), torch.full((2, 3), math.log(7)))
    # All mass on one token (others -inf, as after top-k masking) -> H = 0, not NaN.
    logits = torch.full((1, 1, 4), float("-inf"))
    logits[..., 2] = 1.0
    torch.testing.assert_close(entropy_from_logits(logits), torch.zeros(1, 1))


def _autograd_rows(logits_BTV, ids_BT):
    """The formulation autograd differentiates on its own: each row upcast, l[id] - logsumexp(l), stacked."""
    rows = []
    for i in range(logits_BTV.shape[0]):
        row = logits_BTV[i].float()
        rows.append(row.gather(-1, ids_BT[i].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(row, dim=-1))
    return torch.stack(rows)


def test_low_precision_logprobs_and_gradient_are_autograds_bit_for_bit():
    from tidyrl.models.ops import gather_logprobs_and_entropy

    logits, ids = _random(B=4, T=6, V=37)
    weights = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))  # a loss's per-token weights
    weights[0, 3:] = 0  # masked tokens: zero gradient
    for dtype in (torch.bfloat16, torch.float16):
        mine, ref = logits.to(dtype).requires_grad_(True), logits.to(dtype).requires_grad_(True)
        logprobs, entropy = gather_logprobs_and_entropy(mine, ids)
        (logprobs * weights).sum().backward()
        want = _autograd_rows(ref, ids)
        (want * weights).sum().backward()
        assert logprobs.dtype == torch.float32 and torch.equal(logprobs, want)
        assert mine.grad.dtype == dtype and torch.equal(mine.grad, ref.grad)
        assert not entropy.requires_grad and torch.equal(entropy, entropy_from_logits(logits.to(dtype)))
        assert torch.equal(gather_logprobs(logits.to(dtype), ids), want.detach())


def test_low_precision_logprobs_keep_no_float32_vocabulary_tensor_for_backward():
    """autograd's logsumexp keeps its float32 input (twice the bf16 logits); indexing row i has a backward that
    builds a zero tensor of the whole batch's shape per row (B^2 T V of memory traffic)."""
    B, T, V = 5, 3, 29
    logits, ids = _random(B=B, T=T, V=V)
    leaf = logits.bfloat16().requires_grad_(True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((t.dtype, t.shape)) or t, lambda t: t):
        logprobs = gather_logprobs(leaf, ids)
    assert not [s for s in saved if s[1][-1:] == (V,) and s[0] == torch.float32]
    assert (torch.bfloat16, (B, T, V)) in saved  # the logits themselves, upcast again row by row

    with recorded_outputs(lambda func, out: out.shape == (B, T, V) and func != torch.ops.aten.detach.default
                          ) as full_size:
        logprobs.sum().backward()
    assert leaf.grad.shape == (B, T, V) and len(full_size) == 1, full_size  # one gradient tensor, not one per row


def test_fused_logprobs_entropy_and_gradient_are_the_float32_maths_of_the_row_by_row_path(monkeypatch):
    """One pass over the vocabulary with running sums (online softmax) gives the row-by-row float32 results up to
    float32 rounding: log-probs, entropies (with -inf logits in a row, and a whole first block masked), and the
    gradient, cast to the logits' dtype, within one unit in its last place; on a (B, T) view with strides."""
    import warnings

    fused = interpreted_triton(monkeypatch, "fused_logprobs")
    if fused is None:  # Triton already imported here, compiling: the same test in a process of its own
        return rerun_interpreted(f"{__file__}::test_fused_logprobs_entropy_and_gradient_are_the_float32_maths_of_the_row_by_row_path")
    monkeypatch.setattr(fused, "BLOCK", 16)  # several blocks per row at this test's vocabulary
    from tidyrl.models.ops import gather_logprobs_and_entropy

    monkeypatch.setattr(fused, "wanted", lambda logits, on=None: True)  # (CPU tensors: the interpreter runs them)
    try:
        logits, ids = _random(B=3, T=6, V=53, seed=3)
        weights = torch.randn(3, 5, generator=torch.Generator().manual_seed(4))
        weights[1, 2:] = 0
        for dtype in (torch.bfloat16, torch.float16):
            low = logits.to(dtype)
            low[0, 1, :20] = float("-inf")  # a masked vocabulary, the first block all -inf
            low[2, 3, 7] = float("-inf")
            view = low[:, :-1]  # the one-pass forward's logits drop a column: not contiguous in (B, T)
            mine, ref = view.detach().requires_grad_(True), view.detach().requires_grad_(True)
            with warnings.catch_warnings():  # the interpreter evaluates both sides of tl.where
                warnings.simplefilter("ignore", RuntimeWarning)
                logprobs, entropy = gather_logprobs_and_entropy(mine, ids[:, :-1], True)
                (logprobs * weights).sum().backward()
                only, none = gather_logprobs_and_entropy(view, ids[:, :-1], False)
            want = _autograd_rows(ref, ids[:, :-1])
            (want * weights).sum().backward()
            assert logprobs.dtype == entropy.dtype == torch.float32 and none is None
            torch.testing.assert_close(logprobs, want, atol=2e-6, rtol=0)
            torch.testing.assert_close(only, want.detach(), atol=2e-6, rtol=0)
            torch.testing.assert_close(entropy, entropy_from_logits(view), atol=1e-5, rtol=0)  # (lse - sum p l)
            assert torch.isfinite(entropy).all() and not entropy.requires_grad
            assert mine.grad.dtype == dtype and mine.grad.shape == view.shape
            ulp = torch.finfo(dtype).eps * ref.grad.float().abs().clamp(min=torch.finfo(dtype).tiny)
            assert ((mine.grad.float() - ref.grad.float()).abs() <= ulp).all()
            assert torch.equal(mine.grad[1, 2:], torch.zeros_like(mine.grad[1, 2:]))  # zero weight, zero gradient
            assert mine.grad[0, 1, :20].eq(0).all()  # where p = 0
    finally:
        fused._kernels.cache_clear()


def test_the_fused_kernels_serve_only_low_precision_cuda_logits(monkeypatch):
    from tidyrl.models import fused_logprobs

    cpu = torch.zeros(2, 3, 5, dtype=torch.bfloat16)
    assert not fused_logprobs.wanted(cpu) and not fused_logprobs.wanted(cpu.float())
    monkeypatch.setattr(fused_logprobs, "_kernels", lambda: object())
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert fused_logprobs.wanted(cpu) and not fused_logprobs.wanted(cpu.float())
    assert not fused_logprobs.wanted(cpu[0])  # (only [B, T, V])
    assert not fused_logprobs.wanted(cpu, on=False)  # kernels.fused_logprobs: false
    monkeypatch.setenv("TIDYRL_FUSED_LOGPROBS", "0")  # a developer override: where no choice is given (`defaults`)
    assert not fused_logprobs.wanted(cpu) and fused_logprobs.wanted(cpu, on=True)

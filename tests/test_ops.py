"""tidyrl.ops against the direct (memory-hungry) torch formulas."""

from __future__ import annotations

import math

import torch

from tidyrl.ops import entropy_from_logits, gather_logprobs


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

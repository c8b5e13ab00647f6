"""Norms and MLP products recomputed in the backward pass of the model's own forward (tidyrl.models.recompute):
the same log-probs and gradients bit for bit, fewer bytes kept for backward."""

from __future__ import annotations

import pytest
import torch

from conftest import completion_batch, llama, mistral, qwen2, with_random_norms_and_biases
from tidyrl.models import forward, recompute
from tidyrl.models.kernels import Kernels, attach

# Bit-equality between code paths, which may hold on some CPU kernels only: CI reruns these tests under
# other kernels (pytest -m kernels; tests/conftest.py).
pytestmark = pytest.mark.kernels


def _run(model, batch, weights):
    """Log-probs, entropies and every parameter's gradient of one update-like pass; and the bytes kept for backward."""
    model.zero_grad()
    kept = []

    def pack(t):
        kept.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp, ent = forward.completion_logprobs(model, *batch, 0.8, with_entropy=True)
    (lp * weights).sum().backward()
    return lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}, sum(kept)


@pytest.mark.parametrize("build", [llama, qwen2, mistral], ids=["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_recomputed_norms_and_mlp_products_change_no_number_and_keep_fewer_bytes(monkeypatch, build, dtype):
    monkeypatch.setitem(forward.LAYOUTS, "cpu", ("onepass",))  # the model's own forward (CPU runs the lean pass)
    model = with_random_norms_and_biases(build()).to(dtype).train()
    batch, weights = completion_batch(3)
    plain = _run(model, batch, weights)
    monkeypatch.setattr(recompute, "RECOMPUTE_DEVICES", ("cpu",))
    assert recompute._cheap_parts(model) == []  # off by default
    attach(model, Kernels(recompute=True))  # kernels.recompute: true
    parts = recompute._cheap_parts(model)
    assert len(parts) == 2 * 2 + 1 + 2  # two layers: two norms and an MLP each, and the final norm
    checkpoints = []
    real_checkpoint = recompute.checkpoint
    monkeypatch.setattr(recompute, "checkpoint", lambda *a, **k: checkpoints.append(1) or real_checkpoint(*a, **k))
    lean = _run(model, batch, weights)
    # bf16: the autograd functions, no checkpoint; float32: the norms take checkpoints (see recompute.HALF_DTYPES)
    assert len(checkpoints) == (0 if dtype == torch.bfloat16 else 2 * 2 + 1)
    assert torch.equal(lean[0], plain[0]) and torch.equal(lean[1], plain[1])
    for name, grad in plain[2].items():
        assert torch.equal(lean[2][name], grad), name
    assert lean[3] < plain[3]
    assert not any("forward" in vars(m) for m in model.modules())  # the modules' own forwards are back


def test_nothing_is_recomputed_without_gradients_or_where_it_does_not_apply(monkeypatch):
    from tidyrl.models.loading import enable_gradient_checkpointing

    model = attach(llama().to(torch.bfloat16), Kernels(recompute=True))
    assert recompute._cheap_parts(model) == []  # CPU is not among RECOMPUTE_DEVICES
    monkeypatch.setattr(recompute, "RECOMPUTE_DEVICES", ("cpu",))
    assert len(recompute._cheap_parts(model)) == 7
    with torch.no_grad(), recompute.cheap_parts_recomputed(model):
        assert not any("forward" in vars(m) for m in model.modules())  # (scoring keeps nothing for backward)
    with recompute.cheap_parts_recomputed(model):
        assert sum("forward" in vars(m) for m in model.modules()) == 7
    model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert len(recompute._cheap_parts(model)) == 6  # a hooked module keeps its own forward
    enable_gradient_checkpointing(model)
    assert recompute._cheap_parts(model) == []  # whole layers recomputed already
    assert recompute._cheap_parts(attach(llama().to(torch.bfloat16), Kernels(recompute=False))) == []
    monkeypatch.setenv("TIDYRL_RECOMPUTE", "1")  # a developer override: a model tidyrl did not load takes it
    assert len(recompute._cheap_parts(llama().to(torch.bfloat16))) == 7


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_norm_and_silu_product_functions_give_autograds_gradients_bit_for_bit(dtype):
    """NormRecomputed and SiluTimesRecomputed against autograd on the model's own ops, their inputs also used
    elsewhere (a residual stream, gate and up read twice), random values including large ones: the same outputs and
    gradients bit for bit, and only the inputs kept for backward (on CUDA: tests/test_cuda.py)."""
    functions_match_autograd(dtype, "cpu")


def functions_match_autograd(dtype, device: str) -> None:
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = Qwen2RMSNorm(48, eps=1e-6).to(device, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=g))
    x0 = (torch.randn(3, 5, 48, generator=g) * torch.tensor([0.01, 1.0, 30.0]).view(3, 1, 1)).to(device, dtype)
    gate0 = (torch.randn(3, 5, 64, generator=g) * 4).to(device, dtype)
    up0 = torch.randn(3, 5, 64, generator=g).to(device, dtype)
    grad_out = torch.randn(3, 5, 48, generator=g).to(device, dtype)
    grad_act = torch.randn(3, 5, 64, generator=g).to(device, dtype)

    def run(norm_of, silu_times):
        norm.weight.grad = None
        x, gate, up = (t.clone().requires_grad_() for t in (x0, gate0, up0))
        y = norm_of(x) + x * 0.5  # (the residual stream reads x too)
        z = silu_times(gate, up) + gate * up
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t.untyped_storage().nbytes()) or t,
                                                      lambda t: t):
            y2, z2 = norm_of(y), silu_times(z, up)
        ((y2.float() * grad_out.float()).sum() + (z2.float() * grad_act.float()).sum()).backward()
        return y2.detach(), z2.detach(), x.grad, gate.grad, up.grad, norm.weight.grad, sum(kept)

    plain = run(norm, lambda gate, up: torch.nn.functional.silu(gate) * up)
    lean = run(lambda x: recompute.NormRecomputed.apply(x, norm.weight, norm.variance_epsilon),
               recompute.SiluTimesRecomputed.apply)
    for a, b in zip(lean[:6], plain[:6]):
        assert a.dtype == b.dtype and torch.equal(a, b)
    inputs = sum(t.untyped_storage().nbytes() for t in (x0, norm.weight, gate0, up0))
    assert lean[6] == inputs < plain[6]  # the inputs (norm: x and weight; product: gate and up), nothing else

"""Norms and MLP products recomputed in the backward pass of the model's own forward (tidyrl.models.recompute):
the same log-probs and gradients bit for bit, fewer bytes kept for backward."""

from __future__ import annotations

import pytest
import torch

from conftest import completion_batch, llama, mistral, qwen2, with_random_norms_and_biases
from tidyrl.models import forward, recompute


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
    parts = recompute._cheap_parts(model)
    assert len(parts) == 2 * 2 + 1 + 2  # two layers: two norms and an MLP each, and the final norm
    lean = _run(model, batch, weights)
    assert torch.equal(lean[0], plain[0]) and torch.equal(lean[1], plain[1])
    for name, grad in plain[2].items():
        assert torch.equal(lean[2][name], grad), name
    assert lean[3] < plain[3]
    assert not any("forward" in vars(m) for m in model.modules())  # the modules' own forwards are back


def test_nothing_is_recomputed_without_gradients_or_where_it_does_not_apply(monkeypatch):
    from tidyrl.models.loading import enable_gradient_checkpointing

    model = llama().to(torch.bfloat16)
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
    monkeypatch.setenv("TIDYRL_RECOMPUTE", "0")
    assert recompute._cheap_parts(llama().to(torch.bfloat16)) == []

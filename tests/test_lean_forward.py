"""The lean scoring/training pass computes the logits and gradients of the Hugging Face forward, for every
Llama layout it takes, and the generic path is kept for everything else."""

from __future__ import annotations

import pytest
import torch
from conftest import LLAMA_LAYOUTS, VOCAB, llama, own_completion_logits, recorded_outputs

from tidyrl.models import lean_forward
from tidyrl.models.lean_forward import can_run, completion_logits, logits_if_lean
from tidyrl.models.loading import enable_gradient_checkpointing
from tidyrl.models.forward import completion_logprobs
from tidyrl.models.sequences import left_pad
from tidyrl.rollouts import Rollout

# Bit-equality between code paths, which may hold on some CPU kernels only: CI reruns these tests under
# other kernels (pytest -m kernels; tests/conftest.py).
pytestmark = pytest.mark.kernels

K = 3  # samples per prompt


def _batch(distinct_prompts: bool = False) -> Rollout:
    """Prompts of 2, 7 and 4 tokens (left-padded), K samples each, completions of 9 tokens with EOS (then
    padding) at different places in some rows."""
    prompts = [[5, 6], [7, 8, 9, 10, 11, 12, 13], [14, 15, 16, 17]]
    rows = [p + [i] if distinct_prompts else p for p in prompts for i in range(K)]
    ids, mask = left_pad(rows, 0)
    g = torch.Generator().manual_seed(1)
    completions = torch.randint(4, VOCAB, (len(rows), 9), generator=g)
    completions[0, 2] = completions[5, 0] = 0  # the pad id sampled as a token: its embedding gets no gradient
    cmask = torch.ones(len(rows), 9)
    for row, eos_at in ((1, 3), (4, 0), (6, 8), (8, 5)):
        completions[row, eos_at] = 2
        completions[row, eos_at + 1:] = 0
        cmask[row, eos_at + 1:] = 0
    return Rollout(ids, mask, completions, cmask, torch.zeros(len(rows), dtype=torch.bool))


def _reference_logits(model, batch: Rollout) -> torch.Tensor:
    """The model's own forward over [prompt, completion] with the rows' mask and positions: what is scored."""
    return own_completion_logits(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                 batch.completion_mask)  # (B, Tc, V): position t predicts token t


def _grads(model, logits: torch.Tensor, weights: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (logits * weights).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("attention", ["matmul", "sdpa", "sdpa-repeated-kv"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-qkv", "separate-qkv"])
@pytest.mark.parametrize("name", sorted(LLAMA_LAYOUTS))
def test_logits_and_gradients_equal_the_model_forward(name, fused, attention, monkeypatch):
    """Shared prompts of different lengths, completions ending at different places: every logit that is read
    (up to and including each row's EOS) equals the HF forward's, and so does every parameter's gradient of a
    weighted sum of them, in training mode."""
    monkeypatch.setattr(lean_forward, "COPY_MAX_BYTES", 2**40 if fused else 0)
    monkeypatch.setattr(lean_forward, "MATH_ATTENTION_MAX_BYTES", 2**40 if attention == "matmul" else 0)
    if attention == "sdpa-repeated-kv":  # CUDA's way: grouped key/value heads repeated before a masked SDPA
        monkeypatch.setattr(lean_forward, "GROUPED_SDPA_DEVICES", ())
    model = LLAMA_LAYOUTS[name]().train()
    assert can_run(model)
    batch = _batch()
    read = batch.completion_mask[..., None]  # (B, Tc, 1)
    want = _reference_logits(model, batch)
    got = completion_logits(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    assert got.shape == want.shape == (3 * K, 9, VOCAB)
    torch.testing.assert_close(got * read, want * read, atol=2e-5, rtol=1e-5)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(2)) * read
    theirs, ours = _grads(model, want, weights), _grads(model, got, weights)
    assert theirs.keys() == ours.keys()
    # The tolerance is the reference's own noise: MKL's float32 products depend on their operands' memory
    # alignment, which differs from process to process, and in the dynamic-rope layout that ~1e-7 noise of the
    # HF forward reaches its gradients as up to 1.3e-4 of the largest (3 processes in 25); the other layouts
    # stay near 1e-6. A wrong mask, position or weight is off by orders of magnitude more.
    for key in theirs:
        scale = theirs[key].abs().max().item()
        assert scale > 0, key  # every parameter is reached, the embedding and the head included
        torch.testing.assert_close(ours[key], theirs[key], atol=5e-4 * scale, rtol=1e-4, msg=key)


def test_distinct_prompts_and_two_token_completions():
    """Nothing shared (every prompt distinct) and the narrowest width the pass takes (Tc = 2): the same logits."""
    model = llama().train()
    batch = _batch(distinct_prompts=True)
    for width in (9, 2):
        part = Rollout(batch.prompt_ids, batch.prompt_mask, batch.completion_ids[:, :width],
                       batch.completion_mask[:, :width], batch.truncated)
        read = part.completion_mask[..., None]
        got = completion_logits(model, part.prompt_ids, part.prompt_mask, part.completion_ids, part.completion_mask)
        torch.testing.assert_close(got * read, _reference_logits(model, part) * read, atol=2e-5, rtol=1e-5)


def test_the_logits_are_written_once():
    """The logits (B x Tc x vocabulary) are the pass's largest tensor: the head writes them in their final order,
    nothing copies them (arranging them after the head doubled the peak for a moment and cost a full copy)."""
    V = 4096  # far wider than the hidden size (64), so that only vocabulary-wide tensors reach the bound
    model = llama(vocab_size=V).train()
    batch = _batch()
    B, Tc = batch.completion_ids.shape
    with recorded_outputs(lambda func, out: out.numel() >= B * (Tc - 1) * V) as logits_sized:
        got = completion_logits(model, *batch.sequences)
    assert got.shape == (B, Tc, V) and len({storage for _, _, storage in logits_sized}) == 1
    read = batch.completion_mask[..., None]
    torch.testing.assert_close(got * read, _reference_logits(model, batch) * read, atol=2e-5, rtol=1e-5)


def test_completion_logprobs_takes_the_lean_pass_and_agrees_with_the_generic_one(monkeypatch):
    """`completion_logprobs` (scoring and training) goes through the lean pass for a Llama layout, and gives
    what the generic two-pass path gives, log-probs and entropy."""
    model = llama().train()
    batch = _batch()
    calls = []
    real = lean_forward.completion_logits
    monkeypatch.setattr(lean_forward, "completion_logits", lambda *a: calls.append(1) or real(*a))
    lean_lp, lean_ent = completion_logprobs(model, *batch.sequences, temperature=0.7, with_entropy=True)
    assert calls == [1]
    generic_lp, generic_ent = completion_logprobs(model, *batch.sequences, temperature=0.7, with_entropy=True,
                                                  fast_path=False)
    assert calls == [1]
    m = batch.completion_mask
    torch.testing.assert_close(lean_lp * m, generic_lp * m, atol=1e-5, rtol=0)
    torch.testing.assert_close(lean_ent * m, generic_ent * m, atol=1e-5, rtol=0)


@pytest.mark.parametrize("order", [("shared",), ("onepass",), ("onepass", "lean"), ("shared", "lean", "onepass")])
def test_the_device_s_layouts_decide_the_pass_in_order_and_all_agree(order, monkeypatch):
    """`forward.LAYOUTS[device type]` lists the layouts tried, in order: the first that applies runs (the one-pass
    forward always applies: the fallback); each gives the same log-probs and entropies to rounding; another device
    type's entry changes nothing here, and `fast_path=False` removes only the lean pass."""
    from tidyrl.models import forward

    model = llama().train()
    batch = _batch()
    calls = []
    for name, fn in (("lean", "logits_if_lean"), ("shared", "_shared_prompt_logits")):
        real = getattr(forward, fn)
        monkeypatch.setattr(forward, fn, lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    want_lp, want_ent = completion_logprobs(model, *batch.sequences, temperature=0.7, with_entropy=True)
    assert calls == ["lean"] and forward.layouts_for("cpu") == forward.DEFAULT_LAYOUTS
    monkeypatch.setitem(forward.LAYOUTS, "cuda", ("onepass",))
    calls.clear()
    completion_logprobs(model, *batch.sequences, temperature=0.7)
    assert calls == ["lean"]  # CUDA's entry is CUDA's
    monkeypatch.setitem(forward.LAYOUTS, "cpu", order)
    calls.clear()
    lp, ent = completion_logprobs(model, *batch.sequences, temperature=0.7, with_entropy=True)
    assert calls == ([] if order[0] == "onepass" else [order[0]])  # here every layout applies: the first runs
    m = batch.completion_mask
    torch.testing.assert_close(lp * m, want_lp * m, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent * m, want_ent * m, atol=1e-5, rtol=0)
    calls.clear()
    completion_logprobs(model, *batch.sequences, temperature=0.7, fast_path=False)
    assert "lean" not in calls


def test_models_it_cannot_run_keep_the_generic_path():
    batch = _batch()
    args = (batch.prompt_ids, batch.prompt_mask, batch.completion_ids, batch.completion_mask)
    model = llama().train()
    assert can_run(model) and logits_if_lean(model, *args) is not None
    assert logits_if_lean(model, *(a[:, :1] if i >= 2 else a for i, a in enumerate(args))) is None  # Tc = 1
    enable_gradient_checkpointing(model)  # the user asked for recomputation: the model's forward does it
    assert not can_run(model)
    dropout = llama(attention_dropout=0.1)
    assert not can_run(dropout.train()) and can_run(dropout.eval())  # this pass applies no dropout
    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma2 = Gemma2ForCausalLM(Gemma2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=16))
    assert not can_run(gemma2)  # no family declaration: not a layout this pass computes
    assert logits_if_lean(gemma2, *args) is None


def test_a_forward_with_something_around_it_keeps_the_generic_path():
    """accelerate's mixed precision wraps the model's forward in autocast, and hooks run around a module's
    forward: a pass that calls no forward would skip them, so such models are not taken."""
    assert can_run(llama())
    autocast = llama()  # what accelerate's prepare does for mixed precision (without its process-wide state)
    autocast.forward = torch.autocast("cpu", dtype=torch.bfloat16)(autocast.forward)
    assert not can_run(autocast)
    hooked = llama()
    hooked.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert not can_run(hooked)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2", "mistral"])
def test_bfloat16_pass_is_as_accurate_as_the_model_forward(name):
    """In bfloat16 both the model's forward and the lean pass round; measured against the float32 forward of
    the same weights, the lean pass's logits and gradients are as close as the model's own bfloat16 ones
    (within 2x of its error; measured 0.8-1.2x)."""
    import copy

    model = LLAMA_LAYOUTS[name]().to(torch.bfloat16).train()
    truth_model = copy.deepcopy(model).float()
    batch = _batch()
    read = batch.completion_mask[..., None]
    truth_logits = _reference_logits(truth_model, batch)
    weights = torch.randn(truth_logits.shape, generator=torch.Generator().manual_seed(2)) * read
    truth = _grads(truth_model, truth_logits, weights)
    theirs_logits = _reference_logits(model, batch)
    ours_logits = completion_logits(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                                    batch.completion_mask)
    assert ours_logits.dtype == torch.bfloat16

    def logit_error(logits):
        return ((logits.float() - truth_logits) * read).abs().max().item()

    def grad_error(grads):
        return max(((grads[k].float() - truth[k]).abs().max() / truth[k].abs().max()).item() for k in truth)

    assert logit_error(ours_logits) <= 2 * logit_error(theirs_logits) + 1e-6
    theirs, ours = _grads(model, theirs_logits, weights.bfloat16()), _grads(model, ours_logits, weights.bfloat16())
    assert grad_error(ours) <= 2 * grad_error(theirs)


@pytest.mark.parametrize("fast", [True, False])
def test_model_fast_paths_is_the_one_switch_for_both_fast_paths(fast, tiny_model_dir, prompt_file, tmp_path,
                                                                monkeypatch):
    """`model_fast_paths` decides, for a whole run, whether the lean decode step (generation) and the lean pass
    (scoring and training) are taken; with it off the run still samples the same first rollout (the keys
    decide the draws, and both paths compute the model's maths)."""
    from conftest import read_jsonl
    from test_train import base_config

    import tidyrl
    from tidyrl.models import forward, generation

    used = {"decode": 0, "pass": 0}
    real_step, real_pass = generation.decode_step_for, forward.logits_if_lean

    def step_spy(*a, **k):
        used["decode"] += 1
        return real_step(*a, **k)

    def pass_spy(*a, **k):
        used["pass"] += 1
        return real_pass(*a, **k)

    monkeypatch.setattr(generation, "decode_step_for", step_spy)
    monkeypatch.setattr(forward, "logits_if_lean", pass_spy)
    out = tmp_path / ("fast" if fast else "model")
    cfg = base_config(tiny_model_dir, prompt_file, out, model_fast_paths=fast, train={"rollouts": 2},
                      grpo={"kl_coef": 0.1})
    tidyrl.train(cfg)
    if fast:
        assert used["decode"] > 0 and used["pass"] > 0
    else:
        assert used == {"decode": 0, "pass": 0}
    first = [s for s in read_jsonl(out / "samples.jsonl") if s["rollout"] == 1]
    assert len(first) == 2  # log.samples_per_rollout
    reference = tmp_path / "reference"
    if not fast:  # the same run with the fast paths: the same first rollout's completions
        monkeypatch.undo()
        tidyrl.train(base_config(tiny_model_dir, prompt_file, reference, model_fast_paths=True,
                                 train={"rollouts": 2}, grpo={"kl_coef": 0.1}))
        assert first == [s for s in read_jsonl(reference / "samples.jsonl") if s["rollout"] == 1]

"""The output layer applied in chunks (tidyrl.models.chunked_head): the one-pass forward's log-probs, entropies and
gradients, without ever holding the whole (positions, vocabulary) logits."""

from __future__ import annotations

import contextlib
import gc
import warnings

import pytest
import torch
import torch.nn.functional as F
import yaml

from conftest import (bf16_grpo_metrics, completion_batch, interpreted_triton, llama, qwen2, recorded_outputs,
                      rerun_interpreted, within_bf16_units)
from tidyrl.models import chunked_head, fused_logprobs
from tidyrl.models.chunked_head import head_logprobs, head_of
from tidyrl.models.kernels import Kernels, attach
from tidyrl.models.ops import gather_logprobs_and_entropy

# Bit-equality between code paths, which may hold on some CPU kernels only: CI reruns these tests under
# other kernels (pytest -m kernels; tests/conftest.py).
pytestmark = pytest.mark.kernels


def _inputs(dtype, B=3, T=7, H=16, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H ** 0.5).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    return hidden, weight, ids


def _small_chunks(monkeypatch, V: int, itemsize: int):
    """Chunks of 4 positions and vocabulary slices of 16 entries (a test's sizes: several of each, and a
    remainder)."""
    monkeypatch.setattr(fused_logprobs, "BLOCK", 16)
    monkeypatch.setattr(chunked_head, "CHUNK_BYTES", 4 * V * itemsize)


def _ulps_apart(a: torch.Tensor, b: torch.Tensor, dtype) -> torch.Tensor:
    """|a - b| in units of `dtype`'s last place at b's magnitude."""
    unit = torch.finfo(dtype).eps * b.float().abs().clamp(min=torch.finfo(dtype).tiny)
    return (a.float() - b.float()).abs() / unit


# How far the chunked head may be from the whole logits, and why. Both apply the same arithmetic to logits that are
# a GEMM's products in the low-precision dtype; only the GEMM differs (a chunk of rows, or a slice of the
# vocabulary, against the whole product), and which kernel a library picks, and so how it rounds, may depend on the
# number of rows (oneDNN's bf16/fp16 kernels on CPUs with native bf16/fp16 do). On the kernels where the chunk's
# product is the whole product's rows, the results are bit-identical; elsewhere they stay within these bounds:
# - each logit z = h.w / T within delta = 2 units of the dtype at its row's largest |z| of the other's (a GEMM sums
#   in float32 and rounds once: two kernels' roundings are a unit apart at most; a unit more for the division);
# - log p(id) = z_id - logsumexp(z): two logits' worth, 2 delta;
# - the entropy lse - sum p z: 2 delta, and p moves by a factor exp(+-2 delta) times the largest |z|;
# - the logits' gradient g (onehot - p) / T moves by |g| p (exp(2 delta) - 1) / T, plus its own rounding; the
#   weights' and hidden states' gradients are its products with the hidden states and the weights, then rounded.
def _rounding_of_logits(z_NV: torch.Tensor, dtype) -> torch.Tensor:
    """delta per position (see above), from the logits z (after the temperature)."""
    return 2 * torch.finfo(dtype).eps * z_NV.float().abs().amax(-1)


def _assert_within_logit_rounding(logprobs, entropy, want, want_entropy, z_BTV: torch.Tensor, dtype) -> None:
    delta = _rounding_of_logits(z_BTV, dtype)
    assert ((logprobs - want).abs() <= 2 * delta).all(), ((logprobs - want).abs() / delta).max()
    if entropy is not None:
        bound = 2 * delta + torch.expm1(2 * delta) * z_BTV.float().abs().amax(-1)
        assert ((entropy - want_entropy).abs() <= bound).all()


def _other_kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """A GEMM that rounds as another kernel may: the exact product rounded toward zero, where torch's rounds to
    the nearest (a unit apart in about half the elements)."""
    exact = x.double() @ weight.double().t()
    out = exact.to(x.dtype)
    over = out.double().abs() > exact.abs()
    return torch.where(over, torch.nextafter(out, torch.zeros_like(out)), out)


def _check_against_whole_logits(dtype, temperature, with_entropy=True, other_kernel=False, monkeypatch=None):
    hidden, weight, ids = _inputs(dtype)
    B, T, _ = hidden.shape
    g = torch.Generator().manual_seed(5)
    loss_weights = torch.randn(B, T, generator=g)
    mine_h, mine_w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    ref_h, ref_w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    if other_kernel:  # the chunks' products by another kernel than the whole one's
        import types

        monkeypatch.setattr(chunked_head, "F", types.SimpleNamespace(linear=_other_kernel))

    logprobs, entropy = head_logprobs(mine_h, mine_w, ids, temperature, with_entropy)
    (logprobs * loss_weights).sum().backward()
    logits = F.linear(ref_h, ref_w)  # the one-pass forward: the whole logits, then / temperature
    logits.retain_grad()
    z = logits / temperature if temperature != 1.0 else logits
    want, want_entropy = gather_logprobs_and_entropy(z, ids, with_entropy)
    (want * loss_weights).sum().backward()

    assert logprobs.dtype == torch.float32 and logprobs.shape == (B, T)
    if with_entropy:
        assert not entropy.requires_grad
    else:
        assert entropy is None
    _assert_within_logit_rounding(logprobs, entropy, want, want_entropy, z.detach(), dtype)
    assert mine_h.grad.dtype == dtype and mine_w.grad.dtype == dtype
    eps, eps32 = torch.finfo(dtype).eps, torch.finfo(torch.float32).eps
    delta = _rounding_of_logits(z.detach(), dtype).reshape(-1, 1)
    p = torch.softmax(z.detach().float(), -1).reshape(B * T, -1)
    dl = logits.grad.float().reshape(B * T, -1)
    g_abs = loss_weights.abs().reshape(-1, 1)
    moved = g_abs * torch.expm1(2 * delta) * p / temperature + eps * dl.abs()  # (N, V) the logits' gradient
    h_abs, w_abs = hidden.float().abs().reshape(B * T, -1), weight.float().abs()
    bound_w = moved.t() @ h_abs + eps * ref_w.grad.float().abs() + eps32 * (dl.abs().t() @ h_abs)
    bound_h = moved @ w_abs + eps * ref_h.grad.float().abs().reshape(B * T, -1) + eps32 * (dl.abs() @ w_abs)
    assert ((mine_w.grad.float() - ref_w.grad.float()).abs() <= bound_w).all()
    assert ((mine_h.grad.float() - ref_h.grad.float()).abs().reshape(B * T, -1) <= bound_h).all()
    # The bounds are tight enough to catch a wrong slice, id or temperature: those are off by the gradient itself.
    assert (bound_w < 0.25 * ref_w.grad.float().abs().max()).all()
    rows, step = hidden.reshape(B * T, -1), chunked_head._rows_per_chunk(weight.shape[0], weight.element_size())
    chunks = torch.cat([F.linear(rows[i: i + step], weight) for i in range(0, B * T, step)])
    if not other_kernel and torch.equal(chunks, F.linear(hidden, weight).reshape(B * T, -1)):
        # this CPU's kernel gives a chunk's rows as the whole product's: the same products, row for row, and the
        # same float32 maths, so the same log-probs and entropies, bit for bit
        assert torch.equal(logprobs, want) and (entropy is None or torch.equal(entropy, want_entropy))
    return logprobs, want


@pytest.mark.parametrize("other_kernel", [False, True], ids=["this-cpu", "other-kernel"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_gives_the_whole_logits_log_probs_entropy_and_gradients(monkeypatch, dtype, temperature,
                                                                             other_kernel):
    """The chunked head against the whole logits, with this CPU's GEMM kernels and with chunks whose products
    round as another kernel may: within the bounds of the logits' rounding (above), bit for bit where the kernel
    gives a chunk's rows as the whole product's."""
    _small_chunks(monkeypatch, V=50, itemsize=2)
    logprobs, want = _check_against_whole_logits(dtype, temperature, other_kernel=other_kernel,
                                                 monkeypatch=monkeypatch)
    if other_kernel:  # the bounds were met with products that did round apart
        assert not torch.equal(logprobs, want)


def test_chunked_head_without_entropy(monkeypatch):
    _small_chunks(monkeypatch, V=50, itemsize=2)
    _check_against_whole_logits(torch.bfloat16, 1.0, with_entropy=False)


def test_the_logits_are_never_whole_and_only_hidden_states_are_kept(monkeypatch):
    """The forward pass writes vocabulary-wide tensors of one chunk of positions at most, the backward pass none
    (it works on slices of the vocabulary), and the pass keeps for backward only its inputs and a float32 logsumexp
    per position; the whole-logits path writes (B, T, V) tensors in both."""
    V = 50
    _small_chunks(monkeypatch, V=V, itemsize=2)  # 4 positions a chunk
    hidden, weight, ids = _inputs(torch.bfloat16, V=V)
    B, T, H = hidden.shape
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    weight_storage = weight.untyped_storage().data_ptr()

    def vocabulary_wide(func, out):
        # (new tensors: not views of the weight, such as its transpose)
        return out.dim() >= 1 and out.shape[-1] == V and out.untyped_storage().data_ptr() != weight_storage

    saved = []
    with recorded_outputs(vocabulary_wide) as forward_wide, torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t) or t, lambda t: t):
        logprobs, _ = head_logprobs(hidden, weight, ids, 1.0, True)
    with recorded_outputs(vocabulary_wide) as backward_wide:
        logprobs.sum().backward()
    assert forward_wide and max(torch.Size(shape).numel() for _, shape, _ in forward_wide) == 4 * V
    assert backward_wide == []
    kept = sorted(tuple(t.shape) for t in saved)
    assert kept == sorted([(B * T, H), (V, H), (B * T,), (B * T,)]), kept  # hidden, weight, ids, logsumexp

    with recorded_outputs(lambda func, out: out.shape == (B, T, V)) as whole:
        logits = F.linear(hidden, weight)
        gather_logprobs_and_entropy(logits, ids, True)[0].sum().backward()
    assert len(whole) >= 2  # the logits and their gradient


def test_an_id_outside_a_slice_gets_no_onehot_term(monkeypatch):
    """The backward pass shifts the ids to each vocabulary slice: ids in the first, the last (a remainder) and an
    inner slice, all of them in one position's row, give autograd's gradient."""
    _small_chunks(monkeypatch, V=50, itemsize=2)
    hidden, weight, _ = _inputs(torch.bfloat16, B=1, T=4)
    ids = torch.tensor([[0, 15, 16, 49]])
    h = hidden.clone().requires_grad_(True)
    head_logprobs(h, weight, ids, 1.0)[0].sum().backward()
    r = hidden.clone().requires_grad_(True)
    gather_logprobs_and_entropy(F.linear(r, weight), ids, False)[0].sum().backward()
    assert _ulps_apart(h.grad, r.grad, torch.bfloat16).max() <= 1.0


def test_the_fused_kernels_give_the_same_results_as_the_rows(monkeypatch):
    """On CUDA the statistics and the slices' gradient are `fused_logprobs`' kernels (one run in place over the
    slice's logits): in Triton's interpreter, the CPU maths' results to float32 rounding (log-probs, entropies)
    and to bf16 units of the gradients' scale."""
    fused = interpreted_triton(monkeypatch, "fused_logprobs")
    if fused is None:  # Triton already imported here, compiling: the same test in a process of its own
        return rerun_interpreted(f"{__file__}::test_the_fused_kernels_give_the_same_results_as_the_rows")
    try:
        _small_chunks(monkeypatch, V=50, itemsize=2)
        hidden, weight, ids = _inputs(torch.bfloat16)
        results = []
        for use_kernels in (False, True):
            monkeypatch.setattr(fused, "wanted", lambda logits, on=None, use=use_kernels: use)
            h, w = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            with warnings.catch_warnings():  # the interpreter evaluates both sides of tl.where
                warnings.simplefilter("ignore", RuntimeWarning)
                logprobs, entropy = head_logprobs(h, w, ids, 0.7, True)
                logprobs.sum().backward()
            results.append((logprobs, entropy, h.grad, w.grad))
        (lp, ent, gh, gw), (klp, kent, kgh, kgw) = results
        torch.testing.assert_close(klp, lp, atol=2e-6, rtol=0)
        torch.testing.assert_close(kent, ent, atol=1e-5, rtol=0)
        # (a slice's gradient differs from the rows' by a bf16 unit where float32 exp rounds the other way; the
        # products sum such units: bounded by the gradients' scale, not by each element's)
        assert within_bf16_units(kgw, gw, 2) and within_bf16_units(kgh, gh, 2)
    finally:
        fused._kernels.cache_clear()


def _on_cpu(monkeypatch):
    """The chunked head on CPU (it serves CUDA only), the one-pass forward the layout (CPU runs the lean pass)."""
    from tidyrl.models import forward

    monkeypatch.setattr(chunked_head, "HEAD_DEVICES", ("cpu",))
    monkeypatch.setitem(forward.LAYOUTS, "cpu", ("onepass",))


def _levers_on_cpu(monkeypatch):
    """Both memory levers on CPU, as they serve on CUDA: the chunked head (small chunks at the tiny models' bf16
    vocabulary) and the recompute, for a model that carries `LEVERS`."""
    from tidyrl.models import recompute

    _on_cpu(monkeypatch)
    _small_chunks(monkeypatch, V=40, itemsize=2)  # (the tiny models' vocabulary, bf16)
    monkeypatch.setattr(recompute, "RECOMPUTE_DEVICES", ("cpu",))


LEVERS = Kernels(recompute=True)  # (the chunked head is on by default, the recompute off)


def _head_calls(monkeypatch) -> list[bool]:
    """Each application of the chunked head by `completion_logprobs`, recorded as whether its hidden states carry
    gradients."""
    from tidyrl.models import forward

    calls = []
    real_head = chunked_head.head_logprobs
    monkeypatch.setattr(forward, "head_logprobs",
                        lambda *a, **k: calls.append(a[0].requires_grad) or real_head(*a, **k))
    return calls


@pytest.mark.parametrize("build", [llama, qwen2, lambda: llama(tie_word_embeddings=True)],
                         ids=["llama", "qwen2", "llama-tied"])
def test_completion_logprobs_through_the_chunked_head_equal_the_models_forward(monkeypatch, build):
    """`completion_logprobs` on a bf16 model: its base model's hidden states through the chunked head give the
    log-probs and entropies of the model's own forward (within the logits' rounding, bit for bit where the GEMM
    kernel gives a chunk's rows as the whole product's), and the parameters' gradients to a bf16 unit (those the
    hidden states' gradient reaches through the layers: at most a few)."""
    from tidyrl.models.forward import completion_logprobs

    _on_cpu(monkeypatch)
    _small_chunks(monkeypatch, V=40, itemsize=2)  # (the tiny models' vocabulary, bf16)
    model = build().to(torch.bfloat16)
    assert head_of(model) is model.lm_head
    batch, weights = completion_batch(2)

    def run():
        model.zero_grad()
        lp, ent = completion_logprobs(model, *batch, 0.8, with_entropy=True)
        (lp * weights).sum().backward()
        return lp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters()}

    chunked = run()
    calls = _head_calls(monkeypatch)
    completion_logprobs(model, *batch, 0.8, fast_path=False)
    assert calls == []  # model_fast_paths: false: the model's own output layer
    completion_logprobs(model, *batch, 0.8)
    assert calls == [True]
    attach(model, Kernels(chunked_head=False))
    assert head_of(model) is None
    whole = run()
    assert calls == [True]
    _assert_within_logit_rounding(*chunked[:2], *whole[:2], _logits(model, batch, 0.8), torch.bfloat16)
    for name, grad in whole[2].items():
        assert within_bf16_units(chunked[2][name], grad, 4), name


def _logits(model, batch, temperature: float) -> torch.Tensor:
    """The model's own logits of the completion tokens, / temperature (B, Tc, V): the scale of the bounds."""
    from tidyrl.models.forward import completion_logits

    with torch.no_grad():
        return completion_logits(model, *batch, fast_path=False).float() / temperature


def test_the_chunked_head_serves_only_plain_low_precision_causal_lms_on_its_devices(monkeypatch):
    model = llama().to(torch.bfloat16)
    assert head_of(model) is None  # CPU is not among HEAD_DEVICES
    monkeypatch.setattr(chunked_head, "HEAD_DEVICES", ("cpu",))
    assert head_of(model) is model.lm_head
    assert head_of(llama()) is None  # float32: the whole logits (their float32 path keeps no bf16 copy to save)
    assert head_of(llama(tie_word_embeddings=True).to(torch.bfloat16)) is not None  # tied: the embedding's grad too
    hooked = llama().to(torch.bfloat16)
    hooked.lm_head.register_forward_hook(lambda *a: None)
    assert head_of(hooked) is None  # something runs around the output layer: the model's forward
    autocast = llama().to(torch.bfloat16)
    autocast.forward = autocast.forward  # (an instance-level forward, as accelerate's mixed precision installs)
    assert head_of(autocast) is None
    biased = llama().to(torch.bfloat16)
    biased.lm_head = torch.nn.Linear(64, 40, bias=True).to(torch.bfloat16)
    assert head_of(biased) is None
    assert head_of(attach(model, Kernels(chunked_head=False))) is None  # the run's choice: kernels.chunked_head
    assert head_of(attach(model, Kernels())) is model.lm_head
    monkeypatch.setenv("TIDYRL_CHUNKED_HEAD", "0")  # a developer override, in every choice made after it
    assert head_of(model) is model.lm_head and head_of(attach(model, Kernels())) is None
    assert head_of(llama().to(torch.bfloat16)) is None  # (a model tidyrl did not load: the defaults, overridden)


@contextlib.contextmanager
def one_process_group(backend: str):
    """A process group of one process (DDP builds its reducer and syncs as with more), destroyed after."""
    import torch.distributed as dist

    from conftest import free_port

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        gc.collect()  # (the block's DDP and its reducer gone before their group)
        dist.destroy_process_group()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_inside_ddp_the_update_takes_the_chunked_head_and_recomputes_with_the_plain_models_numbers(
        monkeypatch, tied):
    """Under DDP (each process's update on N GPUs), `completion_logprobs` runs the model through DDP's forward, its
    output layer passing the hidden states through, and applies the output layer in chunks; the norms and MLP
    products are recomputed in the inner model: the log-probs and every gradient equal the plain model's bit for
    bit, over two steps (DDP's reducer sees every parameter's gradient: a parameter it waited for in vain would
    fail the second forward), where before DDP took the whole logits and kept everything (~4 GB more per GPU on
    the 0.5B update). Compiled on CUDA in tests/test_cuda.py."""
    _levers_on_cpu(monkeypatch)
    with one_process_group("gloo"):
        ddp_and_plain_agree(monkeypatch, llama(tie_word_embeddings=tied).to(torch.bfloat16), units=0)


def test_two_ddp_processes_take_the_chunked_head_and_average_the_model_s_own_gradient(tmp_path):
    """Two gloo processes (tests/ddp_head_child.py), each a half of the batch inside DDP with the chunked head and the
    recompute: every pass took the chunked head with gradients, and at each of two SGD steps the log-probs and DDP's
    averaged gradients are those of the model alone on the whole batch, from the same weights, to bf16 rounding
    (measured: under 1 unit; a gradient 10 % off is 14 units, a reducer that missed the output layer's gradient or
    counted a half twice is off by the gradient itself)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from conftest import free_port, gloo_cpu_env

    report = tmp_path / "report.json"
    child = Path(__file__).with_name("ddp_head_child.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(child), str(report)],
                          capture_output=True, text=True, timeout=300, env=gloo_cpu_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        r = json.loads(Path(f"{report}.{rank}").read_text())
        assert r["calls"] == [True] * 4 and r["restored"]  # 2 steps, the model alone and inside DDP
        assert max(r["lp_units"]) <= 2 and max(r["grad_units"]) <= 4, r


def ddp_and_plain_agree(monkeypatch, plain, units: int) -> None:
    """Two SGD steps of `plain` and of a copy inside DDP (a process group of one): both take the chunked head with
    gradients, and the recompute; the same log-probs, and gradients within `units` bf16 units (0: equal)."""
    import copy

    from torch.nn.parallel import DistributedDataParallel

    from tidyrl.models import recompute
    from tidyrl.models.forward import completion_logprobs

    attach(plain, LEVERS)  # (the copy inside DDP carries it too: read through DDP's wrapper)
    calls = _head_calls(monkeypatch)
    device = plain.lm_head.weight.device
    ddp = DistributedDataParallel(copy.deepcopy(plain), device_ids=[device.index] if device.type == "cuda" else None)
    assert head_of(ddp) is ddp.module.lm_head and len(recompute._cheap_parts(ddp)) == len(recompute._cheap_parts(plain))
    assert recompute._cheap_parts(ddp)
    batch, weights = completion_batch(2)
    weights = weights.to(device)
    runs = {}
    for name, model in (("plain", plain), ("ddp", ddp)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        steps = []
        for _ in range(2):
            optimizer.zero_grad()
            lp, _ = completion_logprobs(model, *batch, 0.8)
            (lp * weights).sum().backward()
            grads = {n.removeprefix("module."): p.grad.clone() for n, p in model.named_parameters()}
            steps.append((lp.detach(), grads))
            optimizer.step()
        runs[name] = steps
    assert calls == [True] * 4
    for (lp_plain, grads_plain), (lp_ddp, grads_ddp) in zip(runs["plain"], runs["ddp"]):
        assert torch.equal(lp_plain, lp_ddp) if units == 0 else within_bf16_units(lp_ddp, lp_plain, units)
        assert grads_plain.keys() == grads_ddp.keys()
        for name, grad in grads_plain.items():
            assert torch.equal(grads_ddp[name], grad) if units == 0 else within_bf16_units(grads_ddp[name], grad,
                                                                                            units), name
    assert not any("forward" in vars(m) for m in ddp.modules())  # every forward is the module's own again


def test_under_a_lora_adapter_the_chunked_head_and_the_recompute_serve_with_the_whole_logits_numbers(monkeypatch):
    """A LoRA run (peft): the adapter leaves the output layer the base model's, frozen, so `completion_logprobs`
    applies it in chunks through peft's forward, and the norms and MLP products are recomputed around the adapted
    projections: the whole logits' log-probs and entropies bit for bit, the adapter's gradients within a few bf16
    units (the hidden states' gradient is summed over the head's slices), none for the output layer. An adapter that
    trains the output layer (LoRA on it, or a trained copy in `modules_to_save`) gets the whole logits."""
    peft = pytest.importorskip("peft")
    from tidyrl.models import recompute
    from tidyrl.models.forward import completion_logprobs

    _levers_on_cpu(monkeypatch)

    def adapted(**config):
        torch.manual_seed(0)
        return peft.get_peft_model(attach(llama().to(torch.bfloat16), LEVERS), peft.LoraConfig(
            r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False, **config))

    model = adapted(target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])
    base = model.get_base_model()
    assert head_of(model) is base.lm_head and not base.lm_head.weight.requires_grad
    parts = recompute._cheap_parts(model)
    assert parts and len(parts) == len(recompute._cheap_parts(base))
    assert any(type(m.gate_proj).__module__.startswith("peft.") for m in parts if recompute._is_mlp(m))
    batch, weights = completion_batch(2)
    calls = _head_calls(monkeypatch)

    def run():
        model.zero_grad()
        lp, ent = completion_logprobs(model, *batch, 0.8, with_entropy=True)
        (lp * weights).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        assert base.lm_head.weight.grad is None
        return lp.detach(), ent, grads

    chunked = run()
    assert calls == [True]
    attach(model, Kernels(chunked_head=False, recompute=False))  # (through peft's wrapper, onto its base model)
    assert head_of(model) is None and recompute._cheap_parts(model) == []
    whole = run()
    assert calls == [True]
    _assert_within_logit_rounding(*chunked[:2], *whole[:2], _logits(model, batch, 0.8), torch.bfloat16)
    assert whole[2].keys() == chunked[2].keys() and all("lora_" in name for name in whole[2])
    for name, grad in whole[2].items():
        assert grad.abs().sum() > 0 and within_bf16_units(chunked[2][name], grad, 4), name
    assert head_of(adapted(target_modules=["q_proj", "lm_head"])) is None  # the output layer adapted
    assert head_of(adapted(target_modules=["q_proj"], modules_to_save=["lm_head"])) is None  # a trained copy


def test_vocabulary_slices_are_a_power_of_two_of_blocks_within_the_budget(monkeypatch):
    """The backward pass's slice width (each a compiled gradient kernel on CUDA): a power-of-two number of
    4096-token blocks, the largest within CHUNK_BYTES, at least one block; micro-batches of nearby sizes share it."""
    monkeypatch.setattr(chunked_head, "CHUNK_BYTES", 256 * 2**20)
    width = chunked_head._slice_width
    assert width(16 * 256, 2) == 8 * 4096  # 16 x 256 positions: 32 768 tokens (256 MiB / 8 KiB = 32 768)
    assert width(16 * 257, 2) == width(16 * 300, 2) == 4 * 4096  # (7 and 5 blocks fit: 4)
    assert width(200_000, 2) == 4096 and width(1, 2) == 32768 * 4096
    assert all(width(n, 2) * n * 2 <= 256 * 2**20 for n in (100, 4096, 4112, 9000, 32768))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_bf16_grpo_run_scores_and_trains_through_the_chunked_head(monkeypatch, tiny_model_dir, prompt_file,
                                                                   tmp_path, lora):
    """Through the RL loop (reference scoring for the KL, then two epochs of updates with entropy): every pass of a
    bf16 run takes the chunked head where it serves, and the run's first step, on the same samples, reports
    what the whole logits give, and so does the second, after the update (loss, KL, entropy to float rounding; the
    gradient's norm to bf16 units). So does a LoRA run (its reference: the adapter disabled). The whole logits are
    the run's with kernels.chunked_head: false, which its config.yaml says."""
    if lora:
        pytest.importorskip("peft")
    _on_cpu(monkeypatch)
    calls = []
    real = chunked_head.head_logprobs
    monkeypatch.setattr(chunked_head, "head_logprobs",
                        lambda *a, **k: calls.append(a[0].requires_grad) or real(*a, **k))
    from tidyrl.models import forward

    monkeypatch.setattr(forward, "head_logprobs", chunked_head.head_logprobs)
    chunked = bf16_grpo_metrics(tiny_model_dir, prompt_file, tmp_path / "chunked", lora)
    # the worst-case probe's reference chunk (no grad) and micro-batch; then the reference model's scoring of 8
    # episodes in chunks of 4 (no grad), then 2 epochs x 2 micro-batches
    assert calls == [False, True] + [False, False, True, True, True, True], calls
    whole = bf16_grpo_metrics(tiny_model_dir, prompt_file, tmp_path / "whole", lora, kernels={"chunked_head": False})
    assert len(calls) == 8 and len(chunked) == len(whole) == 2  # kernels.chunked_head: false: the whole logits
    for run, on in (("chunked", True), ("whole", False)):  # the choice is in the run's config.yaml
        assert yaml.safe_load((tmp_path / run / "config.yaml").read_text())["kernels"]["chunked_head"] is on
    for got, want in zip(chunked, whole):  # (step 2: after an update whose gradients differ by bf16 units)
        assert got["kl"] > 0 or got["step"] == 1
        for key in ("loss", "kl", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-9), (got["step"], key)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=0.02)

"""The trained model's decoder layers compiled (tidyrl.models.layer_kernels): which models it applies to, the same
numbers as the model's own layers, one compilation for every layer and width, and the model's own layers again where
compiling fails. It applies on CUDA; here the CPU is made one of its devices, and the compiled layers run on
torch.compile's `aot_eager` backend (dynamo's graphs and AOT autograd's forward/backward split, ATen's kernels): the
logic and the tracing, not inductor's code (tests/test_cuda.py runs that on a GPU)."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import completion_batch, llama, qwen2
from tidyrl.models import forward, layer_kernels
from tidyrl.models.kernels import OVERRIDES, Kernels, attach

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:torch._dynamo")
COMPILE = torch.nn.Module.compile  # (nn.Module.compile itself: the fixture and tests give it a backend)


@pytest.fixture
def on_cpu(monkeypatch):
    """The CPU as a device of layer_kernels and the one-pass layout on it; layers compiled for `aot_eager`."""
    monkeypatch.setattr(layer_kernels, "DEVICES", ("cpu",))
    monkeypatch.setitem(forward.LAYOUTS, "cpu", ("onepass",))
    for variable in OVERRIDES.values():  # (the models' own choices, whatever the developer's environment)
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: COMPILE(self, backend="aot_eager", **kw))
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _pass(model, batch, weights):
    lp, _ = forward.completion_logprobs(model, *batch, 1.0)
    (lp * weights).sum().backward()
    return lp.detach()


def test_compiled_layers_give_the_model_s_log_probs_and_accumulated_gradients(on_cpu):
    """Three micro-batches of three widths, gradients accumulated, then a no-grad scoring pass: the compiled layers
    give the model's own numbers (the same ATen kernels here, so to float32 rounding of a reordered graph)."""
    plain = llama().train()
    compiled = copy.deepcopy(plain)
    plain._tidyrl_layer_kernels = "none"  # (the reference: the model's own layers)
    assert layer_kernels.prepare(compiled) == "compile"
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.layers)
    for seed, width in ((0, 5), (1, 3), (2, 4)):
        (p, pm, c, cm), weights = completion_batch(seed)
        batch = (p[:, 5 - width:], pm[:, 5 - width:], c, cm)  # (the prompts' last `width` columns)
        torch.testing.assert_close(_pass(compiled, batch, weights), _pass(plain, batch, weights), atol=1e-6, rtol=1e-6)
    for (name, mine), theirs in zip(compiled.named_parameters(), plain.parameters()):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-6, rtol=1e-5, msg=name)
    with torch.no_grad():
        batch, _ = completion_batch(3)
        torch.testing.assert_close(forward.completion_logprobs(compiled, *batch, 0.7)[0],
                                   forward.completion_logprobs(plain, *batch, 0.7)[0], atol=1e-6, rtol=1e-6)


def test_every_layer_and_width_share_one_compilation_per_grad_mode(on_cpu):
    from torch._dynamo.utils import counters

    model = llama(num_hidden_layers=3).train()
    before = counters["stats"]["unique_graphs"]
    for seed in range(3):
        batch, weights = completion_batch(seed)
        _pass(model, (batch[0][:, seed:], batch[1][:, seed:], batch[2], batch[3]), weights)  # widths 11, 10, 9
    with torch.no_grad():
        forward.completion_logprobs(model, *completion_batch(4)[0], 1.0)
    assert counters["stats"]["unique_graphs"] - before == 2  # (with gradients, without)


@pytest.mark.parametrize("case", ["frozen", "lora", "checkpointing", "recompute", "exact", "switched off", "cpu"])
def test_the_layers_stay_the_model_s_own_where_compiling_does_not_apply(on_cpu, monkeypatch, case):
    """A frozen model (a KL reference, a teacher: their scoring measured no faster compiled), LoRA (peft's wrappers),
    gradient checkpointing, the recompute, train.exact_gradients, kernels.layer_kernels: none, a device not listed."""
    model = llama().train()
    if case == "frozen":
        model.requires_grad_(False)
    elif case == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    elif case == "checkpointing":
        from tidyrl.models.loading import enable_gradient_checkpointing

        enable_gradient_checkpointing(model)
    elif case == "recompute":
        attach(model, Kernels(recompute=True))
    elif case == "exact":
        forward.exact_forward(model)
    elif case == "switched off":
        attach(model, Kernels(layer_kernels="none"))
    else:
        monkeypatch.setattr(layer_kernels, "DEVICES", ("cuda",))
    forward.completion_logprobs(model, *completion_batch(0)[0], 1.0)  # (prepared on its first one-pass forward)
    assert layer_kernels.prepare(model) == "none"
    inner = model.get_base_model() if case == "lora" else model
    assert all(layer._compiled_call_impl is None for layer in inner.model.layers)


def test_a_qwen2_model_compiles_and_a_bad_mode_is_refused(on_cpu, monkeypatch):
    assert layer_kernels.prepare(qwen2().train()) == "compile"
    with pytest.raises(ValueError, match="kernels.layer_kernels: 'fast' is not one of compile, none"):
        Kernels(layer_kernels="fast")
    monkeypatch.setenv("TIDYRL_LAYER_KERNELS", "fast")  # a developer override that is none of the modes
    with pytest.raises(ValueError, match="TIDYRL_LAYER_KERNELS='fast' .*: expected compile or none"):
        layer_kernels.prepare(llama().train())
    monkeypatch.setenv("TIDYRL_LAYER_KERNELS", "none")  # one that is: a model tidyrl did not load takes it
    assert layer_kernels.prepare(qwen2().train()) == "none"


def test_where_compiling_fails_the_model_s_own_layers_run_with_a_warning(on_cpu, monkeypatch):
    """A backend that fails (as a missing compiler or an op dynamo cannot trace would): the forward runs again with the
    model's own layers, once, with a warning, and gives their numbers; later forwards do not try again."""
    def failing(gm, example_inputs):
        calls.append(1)
        raise RuntimeError("no C compiler here")

    calls = []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kw: COMPILE(self, backend=failing, dynamic=True))
    plain = llama().train()
    model = copy.deepcopy(plain)
    plain._tidyrl_layer_kernels = "none"
    batch, weights = completion_batch(0)
    with pytest.warns(UserWarning, match="compiling the decoder layers failed .*no C compiler here.*the model's own"):
        got = _pass(model, batch, weights)
    torch.testing.assert_close(got, _pass(plain, batch, weights), atol=0, rtol=0)
    assert calls == [1] and layer_kernels.prepare(model) == "none"
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)
    _pass(model, *completion_batch(1))
    assert calls == [1]


def test_an_error_that_is_not_compiling_s_is_the_caller_s(on_cpu, monkeypatch):
    model = llama().train()
    batch, _ = completion_batch(0)
    layer_kernels.prepare(model)
    monkeypatch.setattr(model.model, "forward", lambda *a, **kw: (_ for _ in ()).throw(MemoryError("out of memory")))
    with pytest.raises(MemoryError, match="out of memory"):
        forward.completion_logprobs(model, *batch, 1.0)
    assert layer_kernels.prepare(model) == "compile"

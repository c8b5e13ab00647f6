"""No deprecated call of tidyrl's: the key/value cache under the name the installed transformers' models take,
the activation-checkpointing names by feature test, and the suite's judge of whose deprecation a warning is
(conftest.caused_by_tidyrl)."""

from __future__ import annotations

import contextlib
import logging
import sys
import types
import warnings

import pytest
import torch
from conftest import DEPRECATIONS, LLAMA_LAYOUTS, caused_by_tidyrl

from tidyrl.models.forward import completion_logprobs
from tidyrl.models.generation import _buffered_cache, generate
from tidyrl.models.sequences import cache_argument, left_pad, returned_cache, sample_seed
from tidyrl.models.loading import activation_checkpointing_on, enable_gradient_checkpointing


@contextlib.contextmanager
def deprecations_fail():
    """Every deprecation warning raised inside the block is an error, whoever issued it and whatever
    pyproject.toml's filters ignore; transformers' deprecations that it logs instead fail the block too."""
    from transformers.utils import logging as hf_logging

    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    hf_root = hf_logging.get_logger("transformers")
    hf_root.addHandler(handler)
    try:
        with warnings.catch_warnings():
            for category in DEPRECATIONS:
                warnings.simplefilter("error", category)
            yield
    finally:
        hf_root.removeHandler(handler)
    assert not [m for m in logged if "deprecated" in m], logged


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2", "mistral"])
def test_generation_and_the_shared_prompt_passes_call_nothing_deprecated(name):
    """The model's own forward (fast paths off) in decoding and in the shared-prompt passes, with the cache under
    the name the model's forward takes."""
    model = LLAMA_LAYOUTS[name]()
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7], [8, 9]]
    with deprecations_fail():
        ids, mask, _ = generate(model, prompts, sample_keys=[sample_seed(0, 0, i) for i in range(4)],
                                max_new_tokens=6, eos_ids=[2], pad_id=0, batch_size=4, fast_path=False)
        p_ids, p_mask = left_pad(prompts, 0)
        logprobs, _ = completion_logprobs(model, p_ids, p_mask, ids, mask, temperature=1.0, fast_path=False)
        logprobs.sum().backward()


def test_activation_checkpointing_is_switched_on_and_read_by_the_installed_names():
    model = LLAMA_LAYOUTS["llama-gqa"]()
    with deprecations_fail():
        assert not activation_checkpointing_on(model)
        enable_gradient_checkpointing(model)
        assert activation_checkpointing_on(model)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2", "mistral"])
def test_the_cache_keyword_changes_no_number(name):
    """Where the model's forward takes `cache` and still `past_key_values` as its deprecated alias, decoding with
    either gives bit-identical logits and caches: the new name is the same path. Before the rename the forward
    takes `past_key_values` only, which cache_argument then picks."""
    import inspect

    model = LLAMA_LAYOUTS[name]()
    keyword = cache_argument(model)
    assert keyword in inspect.signature(type(model).forward).parameters
    if keyword == "past_key_values":
        pytest.skip("this transformers' forward takes `past_key_values` only")
    ids, mask = left_pad([[5, 6, 7, 8], [9, 10]], 0)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        prefill = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True)
        caches = [_buffered_cache(returned_cache(prefill), torch.arange(2), ids.shape[1] + 4) for _ in range(2)]
        token, full = prefill.logits[:, -1].argmax(-1), torch.cat([mask, torch.ones(2, 4, dtype=mask.dtype)], 1)
        for t in range(4):
            step = dict(input_ids=token[:, None], attention_mask=full[:, : ids.shape[1] + t + 1],
                        position_ids=pos[:, -1:] + 1 + t, use_cache=True)
            new = model(**step, cache=caches[0]).logits
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # the deprecated alias, on purpose
                old = model(**step, past_key_values=caches[1]).logits
            assert torch.equal(new, old)
            token = new[:, -1].argmax(-1)
    for a, b in zip(*(c.layers for c in caches)):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_the_cache_keyword_is_read_from_the_forward_under_its_wrappers():
    class New(torch.nn.Module):
        def forward(self, input_ids, cache=None, use_cache=True):
            return input_ids

    class Old(torch.nn.Module):
        def forward(self, input_ids, past_key_values=None, **kwargs):
            return input_ids

    class Wrapper(torch.nn.Module):  # DDP's way: the model as `.module`, a forward of *args, **kwargs
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    class PeftLike(Wrapper):  # peft's: get_base_model() and a peft_config
        peft_config = {"default": None}

        def get_base_model(self):
            return self.module

    assert cache_argument(New()) == "cache" and cache_argument(Old()) == "past_key_values"
    assert cache_argument(Wrapper(PeftLike(New()))) == "cache"
    assert cache_argument(PeftLike(Wrapper(Old()))) == "past_key_values"


def _module(name: str, source: str) -> types.ModuleType:
    """A module named `name` (its frames say so) made from `source`."""
    module = types.ModuleType(name)
    module.__dict__.update(caused_by_tidyrl=caused_by_tidyrl, sys=sys, torch=torch)
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


def test_the_suite_judges_whose_deprecation_a_warning_is():
    """Each "deprecated function" returns the judge's verdict on its own frame, as the suite's hook would see the
    frame that called warnings.warn."""
    third = _module("thirdparty.api", """
def deprecated():
    return caused_by_tidyrl(sys._getframe())

def internal():  # the package's own use of its deprecated function
    return deprecated()

def decorator(fn):
    def wrapped(*args, **kwargs):  # a wrapper closure, like transformers' deprecate_kwarg
        return fn(*args, **kwargs)
    return wrapped

class Model(torch.nn.Module):
    @decorator
    def forward(self):
        return caused_by_tidyrl(sys._getframe())
""")
    ours = _module("tidyrl._probe", """
def call(fn):
    return fn()

def issue():  # tidyrl's own warning, or a C function's that tidyrl called: left to the filters
    return caused_by_tidyrl(sys._getframe())
""")
    assert ours.call(third.deprecated)  # tidyrl called the deprecated function
    assert ours.call(third.Model().__call__)  # ... a forward, through torch's module call and a decorator
    assert not ours.issue()
    assert not ours.call(third.internal)  # the third party's own use, inside a call of tidyrl's
    assert not third.deprecated()  # a test's call


def test_a_deprecation_caused_by_tidyrl_fails_the_test(request):
    """The suite's policy end to end: pyproject.toml's filters (a warning attributed to tidyrl) and conftest's
    judge (a third party's warning attributed to itself, about tidyrl's call; the third party's own use is
    recorded as any warning, see test_the_suite_judges_whose_deprecation_a_warning_is)."""
    import conftest

    third = _module("thirdparty.api2", """
import warnings

def deprecated():
    warnings.warn("deprecated() is deprecated", FutureWarning)  # attributed to itself (no stacklevel)
""")
    ours = _module("tidyrl._probe2", """
import warnings

def call(fn):
    return fn()

def own():
    warnings.warn("tidyrl's own", DeprecationWarning)

def renamed():  # tidyrl's deprecation of its caller's call (attributed to the caller: stacklevel=2)
    warnings.warn("renamed", DeprecationWarning, stacklevel=2)
""")
    with pytest.raises(DeprecationWarning):
        ours.own()
    with pytest.raises(DeprecationWarning):
        ours.call(ours.renamed)  # tidyrl called it
    with pytest.warns(DeprecationWarning, match="renamed"):
        ours.renamed()  # a test called it: recorded as any warning (here by pytest.warns)
    with pytest.raises(FutureWarning, match="deprecated"):
        ours.call(third.deprecated)
    assert request.node.stash[conftest._TIDYRL_DEPRECATIONS] == ["FutureWarning: deprecated() is deprecated"]
    request.node.stash[conftest._TIDYRL_DEPRECATIONS].clear()  # else this test fails after its call, as meant

"""Every declared family (tidyrl.models.families) on the fast path gives the model's own numbers, over each family's
config space: the scoring pass's log-probs and the update's gradients (models.lean_forward), the prefill and every
decoding step's logits (models.lean_decode), and generation's returned log-probs, against the model's own forward,
to float rounding in float32 and to a few bf16 units in bfloat16. A config the declarations do not know takes the
model's own forward, and the reason names the attribute."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import VOCAB, bf16_units, with_random_norms_and_biases
from conftest import own_completion_logits as _own_logits

from tidyrl.models import families, lean_decode, lean_forward
from tidyrl.models.lean_layer import is_own_block
from tidyrl.models.forward import completion_logprobs
from tidyrl.models.generation import _BufferedLayer, generate
from tidyrl.models.sequences import left_pad
from tidyrl.models.ops import gather_logprobs_and_entropy

# Bit-equality is not claimed here (tolerances only), but the kernels marker reruns these under other CPU kernels.
pytestmark = pytest.mark.kernels

FAMILY_NAMES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "olmo2", "phi3", "qwen3_moe", "olmoe")
SEEDS = range(3)  # configs drawn per family


def random_config(name: str, seed: int) -> dict:
    """A tiny config of family `name` drawn from its config space: layer and head counts, grouped-query ratios,
    a head size that is not hidden / heads, sliding windows shorter than the test's sequences (and which layers
    slide), biases, rope scalings, tied embeddings, eager or SDPA attention."""
    rng = random.Random(f"{name}-{seed}")
    heads = rng.choice([2, 4])
    config = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=rng.choice([48, 64]),
                  num_hidden_layers=rng.choice([2, 3]), num_attention_heads=heads,
                  num_key_value_heads=rng.choice([h for h in (1, 2, heads) if heads % h == 0]),
                  head_dim=rng.choice([8, 16]), max_position_embeddings=64, pad_token_id=0, eos_token_id=2,
                  bos_token_id=1, tie_word_embeddings=rng.random() < 0.5,
                  attn_implementation=rng.choice(["sdpa", "eager"]))
    rope = rng.choice([{"rope_type": "default", "rope_theta": 1e4},
                       {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
                       {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 16, "rope_theta": 1e4},
                       {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4,
                        "original_max_position_embeddings": 32}])
    window = rng.choice([3, 5, 8])
    n = config["num_hidden_layers"]
    if name == "llama":
        config.update(rope_parameters=rope, attention_bias=rng.random() < 0.5, mlp_bias=rng.random() < 0.5)
    elif name in ("qwen2", "qwen3"):
        config.update(rope_parameters=rope, use_sliding_window=rng.random() < 0.7, sliding_window=window,
                      max_window_layers=rng.randrange(n))
        if name == "qwen3":
            config["attention_bias"] = rng.random() < 0.5
    elif name == "mistral":
        config.update(rope_parameters=rope, sliding_window=rng.choice([None, window]))
    elif name == "gemma3":
        config.update(layer_types=[rng.choice([families.SLIDING, families.FULL]) for _ in range(n)],
                      sliding_window=window, query_pre_attn_scalar=rng.choice([8, 24]),
                      rope_parameters={families.SLIDING: {"rope_type": "default", "rope_theta": 1e4},
                                       families.FULL: {**rope, "rope_theta": 1e6}},
                      attention_bias=rng.random() < 0.5)
    elif name == "olmo2":
        config.update(rope_parameters=rope, attention_bias=rng.random() < 0.5)
    elif name in ("qwen3_moe", "olmoe"):  # (experts as the model's own block; every layer sparse or some dense)
        config.update(rope_parameters=rope, num_experts=4, num_experts_per_tok=2, norm_topk_prob=rng.random() < 0.5,
                      attention_bias=rng.random() < 0.5)
        if name == "qwen3_moe":
            config.update(moe_intermediate_size=16, decoder_sparse_step=rng.choice([1, 2]),
                          mlp_only_layers=rng.choice([[], [0]]))
        else:
            del config["head_dim"]  # (OLMoE's heads are hidden / heads wide)
    elif name == "phi3":
        # (Phi-3's config takes the default rope or longrope only)
        config.update(rope_parameters={"rope_type": "default", "rope_theta": rng.choice([1e4, 500.0]),
                                       "partial_rotary_factor": 1.0}, sliding_window=rng.choice([None, window]))
    return config


def build(name: str, config: dict, dtype=torch.float32):
    """A randomly initialised model of family `name` (its norm weights and biases random too: freshly initialised
    they are ones or zeros, under which a pass that skipped one would still match)."""
    import transformers

    config_class, model_class = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"), "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
        "phi3": ("Phi3Config", "Phi3ForCausalLM"), "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    }[name]
    config = dict(config)
    impl = config.pop("attn_implementation", "sdpa")
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(**config)
    cfg._attn_implementation = impl
    model = getattr(transformers, model_class)(cfg).eval()
    return with_random_norms_and_biases(model).to(dtype)


def _batch(k: int = 3, width: int = 10):
    """Prompts of 2, 7 and 4 tokens (left-padded), k samples each, completions of `width` tokens with EOS (then
    padding) at different places: rows of 17 positions, longer than every window drawn."""
    prompts = [[5, 6], [7, 8, 9, 10, 11, 12, 13], [14, 15, 16, 17]]
    ids, mask = left_pad([p for p in prompts for _ in range(k)], 0)
    g = torch.Generator().manual_seed(1)
    completions = torch.randint(4, VOCAB, (len(ids), width), generator=g)
    cmask = torch.ones(len(ids), width)
    for row, eos_at in ((1, 3), (4, 0), (6, 8)):
        completions[row, eos_at] = 2
        completions[row, eos_at + 1:] = 0
        cmask[row, eos_at + 1:] = 0
    return ids, mask, completions, cmask


CASES = [(name, seed) for name in FAMILY_NAMES for seed in SEEDS]
# Families whose modules or config take another form in transformers 4.x (Gemma 3's local rope as a second rotary
# module and `rope_local_base_freq`; OLMoE's attention without `scaling`): there the declaration refuses them, naming
# why, and the model takes its own forward.
NEWER_LAYOUTS = ("gemma3", "olmoe")


def _skip_where_this_transformers_differs(model) -> None:
    import transformers

    name = families.family_of(model.config, type(model).__name__).name
    if int(transformers.__version__.split(".")[0]) < 5 and name in NEWER_LAYOUTS:
        reason = lean_decode.refusal(model)
        assert reason is not None
        pytest.skip(f"transformers {transformers.__version__}: {reason}")


@pytest.mark.parametrize("name,seed", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_scoring_and_gradients_are_the_model_s_own(name, seed):
    """The lean pass takes the model (its config is declared, its modules match), and every logit that is read
    and every parameter's gradient of a weighted sum of them equal the model's own forward's, in training mode."""
    config = random_config(name, seed)
    model = build(name, config).train()
    _skip_where_this_transformers_differs(model)
    assert lean_decode.refusal(model) is None, config
    assert lean_forward.can_run(model)
    family = families.family_of(model.config, type(model).__name__)
    own_blocks = [is_own_block(layer.mlp, family) for layer in model.model.layers]
    assert any(own_blocks) == family.moe  # (a mixture of experts: the model's own block in some layers)
    ids, mask, completions, cmask = _batch()
    read = cmask[..., None]
    want = _own_logits(model, ids, mask, completions, cmask)
    got = lean_forward.completion_logits(model, ids, mask, completions, cmask)
    torch.testing.assert_close(got * read, want * read, atol=2e-5, rtol=1e-5)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(2)) * read
    grads = []
    for logits in (want, got):
        model.zero_grad(set_to_none=True)
        (logits * weights).sum().backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    theirs, ours = grads
    # every parameter reached (an expert no token was routed to in this batch, on neither path, aside)
    assert theirs.keys() == ours.keys()
    assert {k for k, _ in model.named_parameters() if ".experts." not in k} <= theirs.keys()
    for key in theirs:
        scale = theirs[key].abs().max().item()
        # (the reference's own float32 noise reaches the smallest gradients as up to ~1e-4 of their largest; a wrong
        # mask, norm or weight is off by orders of magnitude more)
        torch.testing.assert_close(ours[key], theirs[key], atol=5e-4 * scale, rtol=1e-4, msg=key)
    # scoring's log-probs through the public pass (which takes the lean one on this CPU)
    with torch.no_grad():
        logprobs, _ = completion_logprobs(model.eval(), ids, mask, completions, cmask, temperature=0.7)
        own, _ = gather_logprobs_and_entropy(_own_logits(model, ids, mask, completions, cmask) / 0.7, completions)
    torch.testing.assert_close(logprobs * cmask, own * cmask, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,seed", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_prefill_and_decoding_steps_are_the_model_s_own(name, seed):
    """Left-padded prompts, then decoding steps past every window: the lean prefill's logits and each step's
    equal the model's own forward over the whole rows so far, at the last position."""
    model = build(name, random_config(name, seed))
    _skip_where_this_transformers_differs(model)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]
    ids, mask = left_pad(prompts, 0)
    steps, Lp = 10, ids.shape[1]
    step = lean_decode.DecodeStep(model, Lp + steps)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        empty = torch.empty((len(prompts), step.n_kv, 0, step.head_dim))
        layers = [_BufferedLayer(empty, empty, Lp + steps) for _ in step.layers]
        got = step.prefill(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), layers)
        rows, attn = ids, mask
        for t in range(steps):
            want = model(input_ids=rows, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                         use_cache=False).logits[:, -1]
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=f"step {t}")
            token = torch.randint(3, VOCAB, (len(prompts),), generator=g)
            rows, attn = torch.cat([rows, token[:, None]], 1), torch.cat([attn, torch.ones_like(attn[:, :1])], 1)
            bias = lean_decode.attention_bias(attn, got.dtype)
            got = step(token, bias, attn.sum(-1, keepdim=True) - 1, layers)


@pytest.mark.parametrize("static", [False, True], ids=["growing-cache", "fixed-shapes"])
@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_generation_draws_what_the_model_s_own_forward_draws(name, static):
    """generate() with the fast path (the lean step, shared prompts, buffered cache; with fixed shapes the
    static-cache step) draws the same tokens as with the model's own forward and cache, and its returned log-probs
    are the model's own forward's over the finished rows."""
    model = build(name, random_config(name, 0))
    _skip_where_this_transformers_differs(model)
    prompts = [[5, 6, 7, 8, 9], [12, 13], [5, 6, 7, 8, 9], [14, 15, 16]]
    common = dict(sample_keys=list(range(4)), max_new_tokens=12, eos_ids=[2], pad_id=0, batch_size=4,
                  min_new_tokens=6, temperature=1.0, return_logprobs=True)
    with torch.no_grad():
        fast_ids, fast_mask, _, fast_logprobs = generate(model, prompts, fast_path=True, static_cache=static, **common)
        own_ids, own_mask, _, own_logprobs = generate(model, prompts, fast_path=False, **common)
    assert torch.equal(fast_ids, own_ids) and torch.equal(fast_mask, own_mask)
    assert fast_mask.sum(-1).min() >= 6  # (long enough to pass the windows drawn)
    torch.testing.assert_close(fast_logprobs, own_logprobs, atol=1e-5, rtol=1e-5)
    ids, mask = left_pad(prompts, 0)
    with torch.no_grad():
        scored, _ = gather_logprobs_and_entropy(_own_logits(model, ids, mask, fast_ids, fast_mask), fast_ids)
    torch.testing.assert_close(fast_logprobs * fast_mask, scored * fast_mask, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_bfloat16_scoring_and_decoding_stay_within_rounding_of_the_model(name):
    """In bfloat16 the lean passes round as the model's own forward does, op for op, but for the order of some sums
    (attention's, the fused q/k/v product's): their logits stay within a few bf16 units of the model's largest
    logit (a wrong norm form, cast or mask is off by the logits' own size)."""
    model = build(name, random_config(name, 1), dtype=torch.bfloat16)
    _skip_where_this_transformers_differs(model)
    ids, mask, completions, cmask = _batch()
    read = cmask[..., None]
    with torch.no_grad():
        want = _own_logits(model, ids, mask, completions, cmask)
        got = lean_forward.completion_logits(model, ids, mask, completions, cmask)
        assert bf16_units(got * read, want * read) <= 8
        step = lean_decode.DecodeStep(model, ids.shape[1] + 1)
        empty = torch.empty((len(ids), step.n_kv, 0, step.head_dim), dtype=torch.bfloat16)
        layers = [_BufferedLayer(empty, empty, ids.shape[1]) for _ in step.layers]
        prefill = step.prefill(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), layers)
        own = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -1]
        assert bf16_units(prefill, own) <= 8


def test_an_undeclared_attribute_or_value_takes_the_model_s_own_forward_and_is_named():
    """The declarations' refusals, each naming what it does not compute."""
    gemma = {k: v for k, v in random_config("gemma3", 0).items() if k != "attn_implementation"}
    assert families.fast_path_refusal({**gemma, "architectures": ["Gemma3ForCausalLM"]}) is None
    capped = build("gemma3", {**gemma, "final_logit_softcapping": 30.0})
    assert lean_decode.refusal(capped) == ("final_logit_softcapping is 30.0, which the gemma3 declaration does not "
                                           "compute")
    assert not lean_forward.can_run(capped)
    llama = {**random_config("llama", 0), "architectures": ["LlamaForCausalLM"]}
    del llama["attn_implementation"]
    assert families.fast_path_refusal({**llama, "new_thing": 1}) == "new_thing is not declared for llama"
    assert families.fast_path_refusal({**llama, "architectures": ["GPT2LMHeadModel"]}) == \
        "GPT2LMHeadModel has no family declaration"
    phi3 = {**random_config("phi3", 0), "architectures": ["Phi3ForCausalLM"]}
    del phi3["attn_implementation"]
    partial = {**phi3, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}
    assert families.fast_path_refusal(partial).startswith("rope_parameters is ")
    olmoe = {**random_config("olmoe", 0), "architectures": ["OlmoeForCausalLM"]}
    del olmoe["attn_implementation"]
    assert families.fast_path_refusal({**olmoe, "clip_qkv": 8.0}) == \
        "clip_qkv is 8.0, which the olmoe declaration does not compute"
    trained = build("phi3", {**random_config("phi3", 0), "resid_pdrop": 0.1}).train()
    assert lean_decode.refusal(trained) is None  # decoding applies no dropout (generation runs without grad)
    assert not lean_forward.can_run(trained) and lean_forward.can_run(trained.eval())


def test_a_window_is_honoured_by_scoring_where_it_once_was_not():
    """A Mistral with a window of 8 and rows of 32 positions: the lean scoring pass's log-probs are the model's
    own (they once attended to the whole row: 0.23 apart), and differ from full attention's."""
    config = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=8, pad_token_id=0)
    model = build("mistral", config)
    full = build("mistral", {**config, "sliding_window": None})
    g = torch.Generator().manual_seed(0)
    ids, mask = torch.randint(3, VOCAB, (4, 8), generator=g), torch.ones(4, 8, dtype=torch.long)
    completions, cmask = torch.randint(3, VOCAB, (4, 24), generator=g), torch.ones(4, 24)
    with torch.no_grad():
        got, _ = completion_logprobs(model, ids, mask, completions, cmask, temperature=1.0)
        own, _ = gather_logprobs_and_entropy(_own_logits(model, ids, mask, completions, cmask), completions)
        unwindowed, _ = completion_logprobs(full, ids, mask, completions, cmask, temperature=1.0)
    torch.testing.assert_close(got, own, atol=1e-5, rtol=1e-5)
    assert (got - unwindowed).abs().max() > 1e-2


def test_a_loaded_model_whose_modules_refuse_the_fast_path_is_said():
    """The config promised the fast path; a hook on a loaded module (something a pass calling no forward would
    skip) sends it to its own forward, and the run says so."""
    from tidyrl.loops.rl.inputs import loaded_path_note

    model = build("qwen3", random_config("qwen3", 0))
    predicted = {"policy": "fast path (qwen3)"}
    assert loaded_path_note("policy", model, predicted) is None
    model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert loaded_path_note("policy", model, predicted) == (
        "policy: its own forward after all, as loaded (model.layers.0.mlp has a hook or its own forward)")
    assert loaded_path_note("policy", model, {"policy": "its own forward (model_fast_paths is false)"}) is None


def test_a_loaded_model_keeps_its_own_layers_not_the_hub_s_kernels(tiny_model_dir):
    """transformers 5.25 kernelizes a from_pretrained model with the hub's kernels by default, again at every
    train()/eval() (which raises on the meta device); tidyrl loads every model with its own layers (OWN_LAYERS)."""
    from tidyrl.models.loading import load_causal_lm

    model = load_causal_lm(str(tiny_model_dir))
    assert not getattr(model, "use_kernels", False)
    model.to("meta").train()
    model.eval()

"""Generation and scoring: EOS handling, sampling options, keyed sampling, chunked log-probs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tidyrl.models.generation import filter_logits, generate

from tidyrl.models.sequences import left_pad, sample_seed, eos_token_ids
from tidyrl.rollouts import Rollout, score_logprobs

# Bit-equality between code paths, which may hold on some CPU kernels only: CI reruns these tests under
# other kernels (pytest -m kernels; tests/conftest.py).
pytestmark = pytest.mark.kernels

PAD, EOS, EOS2, V = 0, 2, 3, 12


class ScriptedLM(torch.nn.Module):
    """A stand-in causal LM: the row whose prompt starts with token s emits SCRIPTS[s] (logit +50 on the
    scripted token, 0 elsewhere), through the same call signature the decode loop uses."""

    def __init__(self, scripts: dict[int, list[int]]):
        super().__init__()
        self.scripts = scripts
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None, use_cache=True,
                logits_to_keep=0):
        if past_key_values is None:  # prefill: remember each row's script and the prompt width
            first = [int(row[(m > 0).nonzero()[0]]) for row, m in zip(input_ids, attention_mask)]
            past_key_values = {"first": first, "width": input_ids.shape[1]}
        step = attention_mask.shape[1] - past_key_values["width"]
        logits = torch.zeros(input_ids.shape[0], 1, V)
        for i, f in enumerate(past_key_values["first"]):
            script = self.scripts[f]
            if step < len(script):
                logits[i, 0, script[step]] = 50.0
        return SimpleNamespace(logits=logits, past_key_values=past_key_values)


def run(model, prompts, **kw):
    args = dict(sample_keys=list(range(len(prompts))), max_new_tokens=5, eos_ids=[EOS, EOS2], pad_id=PAD,
                batch_size=2)
    args.update(kw)
    return generate(model, prompts, **args)


def test_generation_stops_at_every_eos_id_and_masks_what_follows():
    model = ScriptedLM({5: [6, 7, EOS, 8, 9], 6: [7, EOS2, 9, 9, 9], 7: [8, 9, 10, 11, 8]})
    ids, mask, truncated = run(model, [[5, 4], [6], [7, 4, 4]])
    assert ids.tolist() == [[6, 7, EOS, PAD, PAD], [7, EOS2, PAD, PAD, PAD], [8, 9, 10, 11, 8]]
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]
    assert truncated.tolist() == [False, False, True]


def test_min_new_tokens_forbids_eos_early():
    model = ScriptedLM({5: [EOS, EOS, EOS, EOS, EOS]})
    ids, mask, truncated = run(model, [[5]] * 4, min_new_tokens=3)
    for row in ids.tolist():
        assert EOS not in row[:3] and EOS2 not in row[:3]  # both EOS ids forbidden
        assert row[3] == EOS  # allowed from the 4th token on, and the script wants it
    assert mask.sum(1).tolist() == [4, 4, 4, 4]
    assert not truncated.any()


def test_sampling_is_keyed_per_sample_not_per_chunk(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    prompts = [tok(w)["input_ids"] for w in ["apple:", "fig:", "a much longer prompt:", "kiwi:"]] * 3
    keys = [sample_seed(0, 3, i) for i in range(len(prompts))]
    common = dict(sample_keys=keys, max_new_tokens=12, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    a = generate(model, prompts, batch_size=1, **common)
    b = generate(model, prompts, batch_size=5, **common)
    c = generate(model, prompts, batch_size=32, **common)
    for x, y in ((a, b), (a, c)):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and torch.equal(x[2], y[2])
    # A sample's completion depends on its key only: the same prompt with other keys differs.
    assert not torch.equal(a[0][0], a[0][4])
    # Reordering the samples (with their keys) reorders the completions.
    perm = list(reversed(range(len(prompts))))
    d = generate(model, [prompts[i] for i in perm], batch_size=3, **{**common, "sample_keys": [keys[i] for i in perm]})
    assert torch.equal(d[0], a[0][perm])


def test_top_k_one_is_greedy(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    prompt = tok("lemon:")["input_ids"]
    ids, mask, _ = generate(model, [prompt, prompt], sample_keys=[1, 2], max_new_tokens=6, eos_ids=[tok.eos_token_id],
                            pad_id=tok.pad_token_id, batch_size=2, top_k=1)
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(int(mask[0].sum())):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert ids[0, : int(mask[0].sum())].tolist() == seq[len(prompt):]
    assert torch.equal(ids[0], ids[1])


def test_filter_logits_top_k_and_top_p_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    inf = float("-inf")
    assert filter_logits(logits, 2, 1.0).isinf().tolist() == [[False, False, True, True]]
    # top_p = 0.8: 0.5 < 0.8, 0.5 + 0.3 = 0.8 reaches it -> keep the first two.
    assert filter_logits(logits, 0, 0.8).isinf().tolist() == [[False, False, True, True]]
    # top_p = 0.81 needs the third token too.
    assert filter_logits(logits, 0, 0.81).isinf().tolist() == [[False, False, False, True]]
    # A tiny top_p still keeps the most likely token.
    assert filter_logits(logits, 0, 0.01).isinf().tolist() == [[False, True, True, True]]
    shuffled = logits[:, [2, 0, 3, 1]]
    assert filter_logits(shuffled, 0, 0.8).tolist()[0][1] != inf and filter_logits(shuffled, 0, 0.8).isinf().tolist() == [[True, False, True, False]]


def test_temperature_sharpens_sampling():
    # Token 4 has logit 1, every other 0. At temperature 0.05 it is almost always drawn; at 1.0, rarely.
    class Flat(ScriptedLM):
        def forward(self, input_ids, attention_mask, position_ids, past_key_values=None, **kw):
            logits = torch.zeros(input_ids.shape[0], 1, V)
            logits[:, 0, 4] = 1.0
            logits[:, 0, EOS] = -100.0
            return SimpleNamespace(logits=logits, past_key_values={})

    model = Flat({})
    cold, _, _ = run(model, [[5]] * 50, temperature=0.05, max_new_tokens=4, batch_size=50,
                     sample_keys=list(range(50)))
    hot, _, _ = run(model, [[5]] * 50, temperature=1.0, max_new_tokens=4, batch_size=50, sample_keys=list(range(50)))
    assert (cold == 4).float().mean() > 0.95
    assert (hot == 4).float().mean() < 0.5


def test_scored_logprobs_match_full_log_softmax_and_do_not_depend_on_chunks(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    prompts = [tok(w)["input_ids"] for w in ["apple:", "fig:", "a longer prompt:", "kiwi:", "x"]]
    ids, mask, truncated = generate(model, prompts, sample_keys=list(range(5)), max_new_tokens=7,
                                    eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, batch_size=5)
    p_ids, p_mask = left_pad(prompts, tok.pad_token_id)
    rollout = Rollout(p_ids, p_mask, ids, mask, truncated)
    a = score_logprobs(model, rollout, temperature=0.7, chunk_size=2)
    b = score_logprobs(model, rollout, temperature=0.7, chunk_size=64)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # Reference: each sequence alone, no padding, full log_softmax.
    with torch.no_grad():
        for i, prompt in enumerate(prompts):
            n = int(mask[i].sum())
            seq = torch.tensor([prompt + ids[i, :n].tolist()])
            logp = torch.log_softmax(model(seq).logits[0] / 0.7, -1)
            want = logp[len(prompt) - 1: len(prompt) - 1 + n].gather(-1, ids[i, :n, None]).squeeze(-1)
            torch.testing.assert_close(a[i, :n], want, atol=1e-5, rtol=0)
            assert (a[i, n:] == 0).all()


def test_rollout_select_trims_shared_padding():
    p_ids, p_mask = left_pad([[1, 2, 3], [4], [5, 6]], 0)
    c_ids = torch.tensor([[7, 8, 2, 0], [9, 2, 0, 0], [7, 7, 7, 7]])
    c_mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    r = Rollout(p_ids, p_mask, c_ids, c_mask, torch.tensor([False, False, True]), advantages=torch.tensor([1.0, 2, 3]))
    part = r.select([1, 0])
    assert part.prompt_ids.tolist() == [[0, 0, 4], [1, 2, 3]]
    assert part.completion_ids.tolist() == [[9, 2, 0], [7, 8, 2]]
    assert part.advantages.tolist() == [2.0, 1.0]
    part = r.select([1])
    assert part.prompt_ids.tolist() == [[4]] and part.completion_ids.tolist() == [[9, 2]]


def test_inverse_transform_sampling_draws_each_token_with_its_probability():
    """Hand-worked: probabilities (0.1, 0.2, 0.3, 0.4) have cumulative sums (0.1, 0.3, 0.6, 1.0), so u = 0.05
    draws token 0, 0.25 token 1, 0.59 token 2, 0.61 and 0.999 token 3. A banned token (-inf) takes no mass:
    (0.1, 0.2, -, 0.4) / 0.7 sum to (1/7, 3/7, 3/7, 1), so u = 0.5 draws token 3. And 200 000 draws of seeded
    uniforms land on each token with its probability to 0.3 percentage points."""
    from tidyrl.models.generation import sample_from_logits

    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    u = torch.tensor([0.05, 0.25, 0.59, 0.61, 0.999], dtype=torch.float64)
    assert sample_from_logits(logits.expand(5, 4), u).tolist() == [0, 1, 2, 3, 3]
    banned = logits.clone()
    banned[2] = float("-inf")
    assert sample_from_logits(banned.expand(3, 4), torch.tensor([0.1, 0.2, 0.5], dtype=torch.float64)).tolist() \
        == [0, 1, 3]
    n = 200_000
    draws = sample_from_logits(logits.expand(n, 4), torch.rand(n, generator=torch.Generator().manual_seed(0),
                                                                dtype=torch.float64))
    freq = torch.bincount(draws, minlength=4).double() / n
    assert (freq - torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)).abs().max() < 0.003


@pytest.mark.parametrize("block", [7, 16, 1024])
def test_the_two_level_sum_draws_what_one_float64_running_sum_draws(block, monkeypatch):
    """Blocks of 7 and 16 tokens over vocabularies of 5 to 300 (whole blocks, a partial last one, one block), masked
    tokens, mass piled into the last tokens: every draw equals the first index whose float64 running sum of the
    softmax exceeds u * total, and never a masked token."""
    from tidyrl.models import generation
    from tidyrl.models.generation import sample_from_logits

    monkeypatch.setattr(generation, "_SAMPLING_BLOCK", block)
    g = torch.Generator().manual_seed(5)
    for V in (5, 7, 16, 59, 300):
        for case in range(10):
            logits = 3 * torch.randn(64, V, generator=g)
            logits[:, 1::3] = float("-inf")
            if case == 0:
                logits[:, -1] = 40.0  # nearly all the mass in the last token
            u = torch.rand(64, generator=g, dtype=torch.float64)
            cumulative = torch.softmax(logits, -1).double().cumsum(-1)
            want = (cumulative > (u * cumulative[:, -1])[:, None]).long().argmax(-1)
            got = sample_from_logits(logits, u)
            assert torch.equal(got, want), (V, case)
            assert torch.isfinite(logits.gather(1, got[:, None])).all()


def test_eos_ids_are_the_union_of_generation_config_and_tokenizer():
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[5, 7]))
    assert eos_token_ids(model, SimpleNamespace(eos_token_id=2)) == [2, 5, 7]
    with pytest.raises(ValueError, match="no EOS token"):
        eos_token_ids(SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=None)),
                      SimpleNamespace(eos_token_id=None))


def _reference_completion(model, prompt, key, max_new_tokens, eos_ids, min_new_tokens=0, temperature=1.0):
    """The decode loop's maths without any of its machinery: no cache, no batch, no shared prefill; the whole
    sequence is re-run at every step; the row's generator draws its max_new_tokens uniforms first, and step t's
    token is the first whose cumulative probability exceeds uniform t times the total."""
    gen = torch.Generator().manual_seed(key)
    uniforms = torch.rand(max_new_tokens, generator=gen, dtype=torch.float64)
    seq, out = list(prompt), []
    with torch.no_grad():
        for step in range(max_new_tokens):
            z = model(torch.tensor([seq])).logits[0, -1].float() / temperature
            if step < min_new_tokens:
                z[eos_ids] = float("-inf")
            cumulative = torch.softmax(z, -1).double().cumsum(0)
            token = int((cumulative > uniforms[step] * cumulative[-1]).nonzero()[0])
            out.append(token)
            seq.append(token)
            if token in eos_ids:
                break
    return out


@pytest.mark.parametrize("min_new_tokens", [2, 7])
def test_lean_decoding_matches_a_naive_reference(tiny_model_and_tokenizer, min_new_tokens):
    """Shared prefill (k samples per prompt), buffered keys/values, dropping finished rows (with their uniforms)
    and the EOS ban change no completion: each equals the one a cache-free, one-sequence-at-a-time loop draws
    from the same key."""
    model, tok = tiny_model_and_tokenizer
    eos = [tok.eos_token_id]
    prompts = [tok(w)["input_ids"] for w in ["apple:", "a much longer prompt:", "fig:"] for _ in range(6)]
    keys = [sample_seed(7, 1, i) for i in range(len(prompts))]
    ids, mask, truncated = generate(model, prompts, sample_keys=keys, max_new_tokens=30,
                                    min_new_tokens=min_new_tokens, temperature=1.5, eos_ids=eos,
                                    pad_id=tok.pad_token_id, batch_size=18)
    lengths = mask.sum(1).long().tolist()
    assert sum(not t for t in truncated.tolist()) >= 5 and truncated.any()  # rows ended early (and were dropped)
    assert min(lengths) > min_new_tokens
    for i, (prompt, key) in enumerate(zip(prompts, keys)):
        want = _reference_completion(model, prompt, key, 30, eos, min_new_tokens=min_new_tokens, temperature=1.5)
        assert ids[i, : lengths[i]].tolist() == want
        assert (ids[i, lengths[i]:] == tok.pad_token_id).all()


def test_each_distinct_prompt_is_prefilled_once(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    prompts = [tok(w)["input_ids"] for w in ["kiwi:", "lemon:"] for _ in range(4)]
    widths = []

    class Spy(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids, **kw):
            widths.append(tuple(input_ids.shape))
            return self.inner(input_ids=input_ids, **kw)

    ids, _, _ = generate(Spy(model), prompts, sample_keys=list(range(8)), max_new_tokens=3, min_new_tokens=3,
                         eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, batch_size=8)
    assert widths[0][0] == 2 and all(w == (8, 1) for w in widths[1:])  # 2 prompts prefilled, 8 rows decoded
    alone, _, _ = generate(model, prompts, sample_keys=list(range(8)), max_new_tokens=3, min_new_tokens=3,
                           eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, batch_size=1)
    assert torch.equal(ids, alone)


def _rollout_with_groups(model, tok, k=4):
    prompts = [tok(w)["input_ids"] for w in ["apple:", "a longer prompt:", "x"] for _ in range(k)]
    ids, mask, truncated = generate(model, prompts, sample_keys=list(range(len(prompts))), max_new_tokens=9,
                                    eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, batch_size=64)
    p_ids, p_mask = left_pad(prompts, tok.pad_token_id)
    return Rollout(p_ids, p_mask, ids, mask, truncated)


def _one_pass_logprobs(model, batch, temperature):
    """The plain forward over [prompt, completion] (without sharing a prompt between its samples)."""
    from tidyrl.models.ops import gather_logprobs
    from tidyrl.models.forward import model_inputs as _model_inputs

    tc = batch.completion_ids.shape[1]
    logits = model(**_model_inputs(model, *batch.sequences), use_cache=False, logits_to_keep=tc + 1).logits[:, :-1] / temperature
    return gather_logprobs(logits, batch.completion_ids)


@pytest.mark.parametrize("lean", [False, True], ids=["two-pass", "lean-pass"])
def test_shared_prompt_forward_gives_the_one_pass_logprobs_and_gradients(lean, tiny_model_dir,
                                                                          tiny_model_and_tokenizer):
    """Both ways of running a shared prompt once: the model's forward in two passes (any model) and the lean
    Llama pass (tidyrl.models.lean_forward)."""
    from transformers import AutoModelForCausalLM

    from tidyrl.models.forward import _shared_prompt_logits, completion_logprobs

    _, tok = tiny_model_and_tokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rollout = _rollout_with_groups(model.eval(), tok)
    batch = rollout.select([0, 5, 1, 9, 4, 2, 10])  # groups interleaved, as a shuffled micro-batch holds them
    model.train()
    assert _shared_prompt_logits(model, *batch.sequences) is not None  # the shared path is the one under test

    def grads_of(fn):
        model.zero_grad()
        lp = fn()
        (lp * batch.completion_mask * torch.linspace(-1, 1, lp.shape[1])).sum().backward()
        return lp.detach(), [p.grad.clone() for p in model.parameters()]

    lp_shared, g_shared = grads_of(lambda: completion_logprobs(model, *batch.sequences, 0.8, fast_path=lean)[0])
    lp_plain, g_plain = grads_of(lambda: _one_pass_logprobs(model, batch, 0.8))
    mask = batch.completion_mask > 0
    torch.testing.assert_close(lp_shared[mask], lp_plain[mask], atol=1e-5, rtol=0)
    for a, b in zip(g_shared, g_plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_the_two_pass_logprobs_read_each_pass_s_logits_without_concatenating_them(tiny_model_dir,
                                                                                  tiny_model_and_tokenizer):
    """The shared-prompt passes give the first completion token's logits and the rest's apart: the log-probs and
    entropies are read from each (bit for bit those of their concatenation) instead of copying the logits, the
    largest tensor of the pass, into one."""
    from transformers import AutoModelForCausalLM

    from conftest import recorded_outputs
    from tidyrl.models.forward import completion_logits, completion_logprobs
    from tidyrl.models.ops import entropy_from_logits, gather_logprobs

    _, tok = tiny_model_and_tokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = _rollout_with_groups(model.eval(), tok).select([0, 5, 1, 9, 4, 2, 10])
    B, Tc = batch.completion_ids.shape
    V = model.config.vocab_size
    with torch.no_grad():
        logits = completion_logits(model, *batch.sequences, fast_path=False) / 0.8
        lp, entropy = completion_logprobs(model, *batch.sequences, 0.8, with_entropy=True, fast_path=False)
    assert torch.equal(lp, gather_logprobs(logits, batch.completion_ids))
    assert torch.equal(entropy, entropy_from_logits(logits))
    with torch.no_grad(), recorded_outputs(lambda func, out: func == torch.ops.aten.cat.default
                                           and out.shape[-1] == V and out.shape[1] > 1) as copies:
        completion_logprobs(model, *batch.sequences, 1.0, with_entropy=True, fast_path=False)
    assert copies == [] and Tc > 2 and B == 7


def test_the_one_pass_logprobs_read_the_logits_without_slicing_them(tiny_model_dir, tiny_model_and_tokenizer):
    """Distinct prompts take the model's one forward over [prompt, completion], whose last position predicts
    nothing: it is read with a dummy id and dropped, not sliced off the logits (a slice's backward is a zero-filled
    copy of them all). The same log-probs and gradients as the sliced formulation."""
    from transformers import AutoModelForCausalLM

    from conftest import vocabulary_slice_backwards
    from tidyrl.models.forward import _shared_prompt_logits, completion_logprobs

    _, tok = tiny_model_and_tokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    batch = _rollout_with_groups(model.eval(), tok).select([0, 4, 8])  # one sample of each prompt
    model.train()
    assert _shared_prompt_logits(model, *batch.sequences) is None  # the one-pass forward is the one under test
    weights = batch.completion_mask * torch.linspace(-1, 1, batch.completion_ids.shape[1])
    results = []
    for fn in (lambda: completion_logprobs(model, *batch.sequences, 0.8, fast_path=False)[0],
               lambda: _one_pass_logprobs(model, batch, 0.8)):  # the logits sliced
        model.zero_grad()
        lp = []
        _, slices = vocabulary_slice_backwards(lambda: (lp.append(fn()) or lp[0] * weights).sum(),
                                               model.config.vocab_size)
        results.append((lp[0].detach(), [p.grad.clone() for p in model.parameters()], slices))
    (ours, our_grads, our_slices), (sliced, sliced_grads, sliced_slices) = results
    assert our_slices == [] and sliced_slices != []
    assert torch.equal(ours, sliced) and all(torch.equal(a, b) for a, b in zip(our_grads, sliced_grads))


def test_prompts_are_not_shared_under_gradient_checkpointing(tiny_model_dir, tiny_model_and_tokenizer):
    """Gradient checkpointing drops the cache in training, so the shared-prompt path must step aside."""
    from transformers import AutoModelForCausalLM

    from tidyrl.models.loading import enable_gradient_checkpointing
    from tidyrl.models.forward import _shared_prompt_logits, completion_logprobs

    _, tok = tiny_model_and_tokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    rollout = _rollout_with_groups(model.eval(), tok)
    enable_gradient_checkpointing(model)
    model.train()
    assert _shared_prompt_logits(model, *rollout.sequences) is None
    lp, _ = completion_logprobs(model, *rollout.sequences, 1.0)
    torch.testing.assert_close(lp.detach(), _one_pass_logprobs(model, rollout, 1.0).detach(), atol=1e-6, rtol=0)


def test_a_sliding_window_cache_keeps_the_model_s_own_decoding(tmp_path, tiny_model_and_tokenizer):
    """Models whose cache is not plain keys/values (here Mistral's sliding window) decode with their own
    cache, one prefill per row, and stay keyed per sample."""
    from transformers import MistralConfig, MistralForCausalLM

    from tidyrl.models.sequences import plain_kv_cache

    _, tok = tiny_model_and_tokenizer
    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                             sliding_window=4, max_position_embeddings=64)).eval()
    assert not plain_kv_cache(model)
    prompts = [tok(w)["input_ids"] for w in ["apple:", "fig:"] for _ in range(3)]
    common = dict(sample_keys=[sample_seed(0, 0, i) for i in range(6)], max_new_tokens=8,
                  eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    a = generate(model, prompts, batch_size=6, **common)
    b = generate(model, prompts, batch_size=1, **common)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_sampled_logprobs_are_what_scoring_gives(tiny_model_and_tokenizer):
    """generate(return_logprobs=True) returns log softmax(logits / T)[token] of the unfiltered policy (top-k,
    top-p and the min_new_tokens ban only shape the sampling), 0 past EOS: the old log-probs without a pass."""
    model, tok = tiny_model_and_tokenizer
    prompts = [tok(w)["input_ids"] for w in ["apple:", "a longer prompt:", "fig:"] for _ in range(4)]
    common = dict(sample_keys=[sample_seed(1, 2, i) for i in range(12)], max_new_tokens=20, min_new_tokens=2,
                  temperature=0.7, top_k=8, top_p=0.9, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id,
                  return_logprobs=True)
    ids, mask, truncated, logprobs = generate(model, prompts, batch_size=12, **common)
    assert not truncated.all() and (mask == 0).any()
    p_ids, p_mask = left_pad(prompts, tok.pad_token_id)
    scored = score_logprobs(model, Rollout(p_ids, p_mask, ids, mask, truncated), temperature=0.7, chunk_size=5)
    torch.testing.assert_close(logprobs, scored, atol=1e-5, rtol=0)
    assert (logprobs[mask == 0] == 0).all() and (logprobs[mask > 0] < 0).all()
    ids1, _, _, logprobs1 = generate(model, prompts, batch_size=5, **common)
    assert torch.equal(ids1, ids)
    torch.testing.assert_close(logprobs1, logprobs, atol=1e-6, rtol=0)

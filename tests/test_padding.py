"""Less padding, the same maths: padding-free micro-batches (one row, positions restarting) and micro-batches
grouped by length give the loss and update of plain padded micro-batches; a model that would mix packed
examples is refused by name."""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, llama, mistral, qwen2, read_jsonl, vocabulary_slice_backwards, write_jsonl
from test_dpo import dpo_config
from test_offline_runs import same_weights_within
from test_sft import sft_config

import tidyrl
from tidyrl.config import ConfigError
from tidyrl.loops.offline.loop import pad_batch, packed_attention_error, target_logprobs
from tidyrl.data.offline import TokenizedSequence

# Bit-equality between code paths, which may hold on some CPU kernels only: CI reruns these tests under
# other kernels (pytest -m kernels; tests/conftest.py).
pytestmark = pytest.mark.kernels

WORDS = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon", "mango", "peach"]


def mixed_sft_rows():
    """Completions of 1, 4 and 7 words: lengths that differ, so padding matters."""
    return [{"prompt": f"{w}:", "completion": " ".join([w[::-1]] * (1 + 3 * (i % 3)))} for i, w in enumerate(WORDS)]


def sequences(generator, lengths, vocab=40):
    out = []
    for n in lengths:
        ids = torch.randint(3, vocab, (n,), generator=generator).tolist()
        out.append(TokenizedSequence(ids, [0] + [int(x) for x in torch.rand(n - 1, generator=generator) < 0.7]))
    return out


@pytest.mark.parametrize("build", [llama, qwen2, mistral], ids=["llama", "qwen2", "mistral"])
def test_a_flat_row_gives_each_token_the_log_prob_it_has_alone(build):
    model = build()
    seqs = sequences(torch.Generator().manual_seed(0), [7, 3, 12, 5])
    with torch.no_grad():
        padded, padded_mask = target_logprobs(model, pad_batch(seqs, 0, "cpu"))
        flat, flat_mask = target_logprobs(model, pad_batch(seqs, 0, "cpu", flat=True))
    assert flat.shape == padded.shape == (4, 11)
    assert torch.equal(flat_mask, padded_mask)
    assert torch.allclose(flat * flat_mask, padded * padded_mask, atol=2e-6)
    assert float(padded_mask.sum()) > 10  # targets on every example, not just the first


def test_the_flat_layout_is_differentiable_like_the_padded_one():
    model = llama()
    seqs = sequences(torch.Generator().manual_seed(1), [6, 9, 4])
    grads = []
    for flat in (False, True):
        model.zero_grad()
        logprobs, mask = target_logprobs(model, pad_batch(seqs, 0, "cpu", flat=flat))
        (-(logprobs * mask).sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-5, rtol=1e-4)


def test_target_logprobs_read_the_logits_without_slicing_them():
    """The last position predicts no token: it is read with a dummy id and dropped, not sliced off the logits
    (a slice's backward is a zero-filled copy of all of them). The same numbers as the sliced formulation."""
    from tidyrl.models.ops import gather_logprobs

    model = llama().train()
    batch = pad_batch(sequences(torch.Generator().manual_seed(2), [6, 9, 4]), 0, "cpu")
    results = []
    for sliced in (False, True):
        model.zero_grad()

        def loss():
            if sliced:
                logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
                logprobs, mask = gather_logprobs(logits[:, :-1], batch["input_ids"][:, 1:]), batch["target_mask"][:, 1:]
            else:
                logprobs, mask = target_logprobs(model, batch)
            results.append(logprobs.detach())
            return -(logprobs * mask).sum()

        _, slices = vocabulary_slice_backwards(loss, VOCAB)
        results.append([p.grad.clone() for p in model.parameters()])
        assert bool(slices) == sliced, slices
    assert torch.equal(results[0], results[2])
    assert all(torch.equal(a, b) for a, b in zip(results[1], results[3]))


def test_models_that_mix_packed_examples_are_named():
    from transformers import BloomConfig, BloomForCausalLM, OPTConfig, OPTForCausalLM

    assert packed_attention_error(llama()) is None
    assert packed_attention_error(llama(attn_implementation="eager")) is None
    torch.manual_seed(0)
    bloom = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4))
    assert "the model (bloom, attention 'eager') does not keep examples apart" in packed_attention_error(bloom)
    opt = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                   num_attention_heads=4, word_embed_proj_dim=32))
    assert "(opt, attention 'sdpa')" in packed_attention_error(opt)


VARIANTS = {
    "padded": {"group_by_length": False, "padding_free": False},
    "grouped": {"group_by_length": True, "padding_free": False},
    "flat": {"group_by_length": False, "padding_free": True},
    "grouped-flat": {"group_by_length": True, "padding_free": True},
}


@pytest.mark.parametrize("stage", ["sft", "dpo"])
def test_padding_free_and_grouping_change_padding_not_the_maths(stage, tiny_model_dir, tmp_path):
    if stage == "sft":
        data = write_jsonl(tmp_path / "data.jsonl", mixed_sft_rows())
        make = sft_config
    else:
        data = write_jsonl(tmp_path / "data.jsonl", [{"prompt": f"{w}:", "chosen": w[::-1] * (1 + i % 3),
                                                      "rejected": "zz" + w} for i, w in enumerate(WORDS)])
        make = dpo_config
    runs = {}
    for name, knobs in VARIANTS.items():
        cfg = make(tiny_model_dir, data, tmp_path / name, train={"batch_size": 10, "micro_batch_size": 2,
                                                                 "dataset_epochs": None, "max_steps": 3, **knobs})
        result = tidyrl.train(cfg)
        runs[name] = (result, read_jsonl(tmp_path / name / "metrics.jsonl"))
    base_rows = runs["padded"][1]
    for name, (result, rows) in runs.items():
        for key in ("loss", "grad_norm", "rewards/margin" if stage == "dpo" else "nll_token_mean"):
            assert [r[key] for r in rows] == pytest.approx([r[key] for r in base_rows], rel=1e-5, abs=1e-6), (name, key)
        same_weights_within(result.final_dir, runs["padded"][0].final_dir, 1e-5)
    padding = {name: sum(r["padding_fraction"] for r in rows) for name, (_, rows) in runs.items()}
    assert padding["flat"] == padding["grouped-flat"] == 0.0
    assert 0 < padding["grouped"] < padding["padded"]


def test_padding_free_is_refused_for_a_model_that_mixes_examples(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BloomConfig, BloomForCausalLM, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz:"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>")
    torch.manual_seed(0)
    model_dir = tmp_path / "bloom"
    BloomForCausalLM(BloomConfig(vocab_size=len(vocab), hidden_size=32, n_layer=2, n_head=4, bos_token_id=1,
                                 eos_token_id=2, pad_token_id=0)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = write_jsonl(tmp_path / "data.jsonl", mixed_sft_rows())
    for knobs, key in (({"train": {"padding_free": True}}, "train.padding_free"),
                       ({"sft": {"packing": True}, "data": {"max_length": 64}}, "sft.packing")):
        out = tmp_path / key
        with pytest.raises(ConfigError, match=rf"{key}: the model \(bloom, attention 'eager'\) does not keep "
                                               rf"examples apart.*Set {key}=false"):
            tidyrl.train(sft_config(model_dir, data, out, **knobs))
        assert not (out / "metrics.jsonl").exists() and not (out / "config.yaml").exists()
    # Left to choose (null), a plain CPU model runs padded: grouped by length, nothing refused.
    result = tidyrl.train(sft_config(model_dir, data, tmp_path / "auto"))
    assert read_jsonl(result.output_dir / "metrics.jsonl")[0]["padding_fraction"] > 0


@pytest.mark.parametrize("build", [llama, qwen2], ids=["llama", "qwen2"])
def test_rows_padded_to_a_width_multiple_give_the_same_log_probs_values_and_gradients(build, monkeypatch):
    """models.devices.WIDTH_MULTIPLE (CUDA: 16, so that shapes recur) left-pads [prompt, completion] rows with masked
    columns: the log-probs, entropies, critic values and gradients are the unpadded rows' (float32 rounding), the
    forward sees the padded width, and the result keeps the completions' width."""
    from tidyrl.models import devices, forward

    prompts = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 5, 6, 7]])
    pmask = (prompts != 0).long()
    completions = torch.tensor([[11, 12, 2, 0, 0], [13, 14, 15, 16, 17], [18, 19, 20, 21, 0]])
    cmask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]).float()
    monkeypatch.setitem(forward.LAYOUTS, "cpu", ("onepass",))
    model = build()
    results = {}
    for multiple in (1, 16):
        monkeypatch.setitem(devices.WIDTH_MULTIPLE, "cpu", multiple)
        widths = []
        real = model.forward
        monkeypatch.setattr(model, "forward", lambda *a, **kw: widths.append(kw["input_ids"].shape[1]) or real(*a, **kw))
        model.zero_grad(set_to_none=True)
        logprobs, entropy = forward.completion_logprobs(model, prompts, pmask, completions, cmask, 1.0,
                                                        with_entropy=True)
        (logprobs * cmask).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        with torch.no_grad():  # (the policy stands in for a critic: its first logit as the value)
            values = forward.completion_values(model, prompts, pmask, completions, cmask)
        monkeypatch.setattr(model, "forward", real)
        results[multiple] = (logprobs.detach(), entropy, grads, widths, values)
    (lp1, h1, g1, w1, v1), (lp16, h16, g16, w16, v16) = results[1], results[16]
    assert w1 == [9, 9] and w16 == [16, 16] and lp16.shape == lp1.shape == v16.shape == completions.shape
    torch.testing.assert_close(v16 * cmask, v1 * cmask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp16 * cmask, lp1 * cmask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h16 * cmask, h1 * cmask, atol=1e-5, rtol=1e-5)
    for a, b in zip(g16, g1):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed rows"])
def test_offline_batches_padded_to_a_width_multiple_give_the_same_log_probs(packed, monkeypatch):
    """pad_batch rounds the width up to models.devices.WIDTH_MULTIPLE's multiple for the device (CUDA: 16, so that
    shapes recur); the targets' log-probs and mask are the unpadded batch's."""
    from tidyrl.models import devices

    model = llama()
    seqs = sequences(torch.Generator().manual_seed(3), [7, 3, 12, 5])
    if packed:  # two examples per row, positions restarting
        seqs = [TokenizedSequence(a.input_ids + b.input_ids, a.target_mask + b.target_mask,
                                  list(range(len(a.input_ids))) + list(range(len(b.input_ids))))
                for a, b in (seqs[:2], seqs[2:])]
    with torch.no_grad():
        plain = pad_batch(seqs, 0, "cpu")
        monkeypatch.setitem(devices.WIDTH_MULTIPLE, "cpu", 16)
        padded = pad_batch(seqs, 0, "cpu")
        want, want_mask = target_logprobs(model, plain)
        got, got_mask = target_logprobs(model, padded)
    longest = max(len(s.input_ids) for s in seqs)
    assert plain["input_ids"].shape[1] == longest and padded["input_ids"].shape[1] == -(-longest // 16) * 16
    n = want.shape[1]
    assert torch.equal(got_mask[:, :n], want_mask) and not got_mask[:, n:].any()
    torch.testing.assert_close(got[:, :n] * want_mask, want * want_mask, atol=1e-5, rtol=1e-5)


def test_a_batch_repeating_long_prompts_takes_the_lean_pass_where_the_device_lists_only_the_model_s_forward(
        monkeypatch):
    """models.forward.LEAN_FROM_SHARE (CUDA: 25 %): a batch whose repeated prompt tokens are that share of its columns
    takes the lean pass first (each prompt run once), its widths padded to WIDTH_MULTIPLE; a batch of short prompts
    keeps the model's forward. The same log-probs and gradients either way (float32 rounding)."""
    from tidyrl.models import devices, forward

    monkeypatch.setitem(forward.LAYOUTS, "cpu", ("onepass",))
    monkeypatch.setitem(forward.LEAN_FROM_SHARE, "cpu", 0.25)
    monkeypatch.setitem(devices.WIDTH_MULTIPLE, "cpu", 16)
    model = llama()
    long_prompt = [0, 0] + list(range(5, 25))  # 20 real tokens, shared by 4 samples
    prompts = torch.tensor([long_prompt] * 4 + [[0] * 18 + [7, 8, 9, 10]] * 4)
    pmask = (prompts != 0).long()
    completions = torch.tensor([[11, 12, 2, 0, 0], [13, 14, 15, 16, 17], [18, 19, 20, 21, 0], [22, 23, 0, 0, 0]] * 2)
    cmask = (completions != 0).float()
    share = forward.repeated_prompt_share(prompts, pmask, completions)
    assert share == pytest.approx((3 * 20 + 3 * 4) / (8 * (22 + 5)))  # 33 %
    assert forward.repeated_prompt_share(prompts[::4], pmask[::4], completions[::4]) == 0  # every prompt distinct
    lean_calls = []
    real = forward.logits_if_lean
    monkeypatch.setattr(forward, "logits_if_lean", lambda *a: lean_calls.append([t.shape for t in a[1:]]) or real(*a))

    def run(fast_path):
        model.zero_grad(set_to_none=True)
        logprobs, _ = forward.completion_logprobs(model, prompts, pmask, completions, cmask, 1.0,
                                                  fast_path=fast_path)
        (logprobs * cmask).sum().backward()
        return logprobs.detach(), [p.grad.clone() for p in model.parameters()]

    (lean, lean_grads), (plain, plain_grads) = run(True), run(False)  # fast_path False: the model's forward only
    assert lean_calls == [[(8, 32), (8, 32), (8, 16), (8, 16)]]  # prompts 22 -> 32 wide, completions 5 -> 16
    assert lean.shape == plain.shape == completions.shape
    torch.testing.assert_close(lean * cmask, plain * cmask, atol=1e-5, rtol=1e-5)
    for a, b in zip(lean_grads, plain_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    lean_calls.clear()
    short = prompts[:, -6:]  # 6 and 4 real tokens before 20-token completions: 14 % repeated
    wide = torch.cat([completions, torch.randint(3, 40, (8, 15), generator=torch.Generator().manual_seed(0))], 1)
    assert forward.repeated_prompt_share(short, (short != 0).long(), wide) == pytest.approx(30 / (8 * 26))
    forward.completion_logprobs(model, short, (short != 0).long(), wide, torch.ones(wide.shape), 1.0)
    assert lean_calls == []

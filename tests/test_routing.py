"""Mixture-of-experts routing recorded and replayed (tidyrl.models.routing): tidyrl's forward of the blocks is the
model's own bit for bit, records the experts the model's own router chooses, sends each token to replayed experts
exactly (checked per layer), keeps the router's gradient, and refuses a route tensor of the wrong shape; the expert
load by hand."""

from __future__ import annotations

import pytest
import torch

from tidyrl.models.routing import (NO_ROUTE, check_routes, expert_load, load_metrics, moe_layers, replay, routed)
from tidyrl.models.tiny import MOE_FAMILIES, build_tiny_moe, build_tiny_llama

VOCAB = 40


def tiny(family: str, num_layers: int = 3, **kw):
    return build_tiny_moe(family, VOCAB, hidden_size=32, num_layers=num_layers, num_heads=4, num_experts=6,
                          experts_per_token=2, seed=3, **kw).eval()


def batch(rows: int = 3, positions: int = 9):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, VOCAB, (rows, positions), generator=g)
    mask = torch.ones(rows, positions, dtype=torch.long)
    mask[0, :3] = 0  # a left-padded row
    return ids, mask


def random_routes(rows: int, positions: int, layers: int, experts: int, k: int, seed: int = 1) -> torch.Tensor:
    """k distinct experts per position and layer, drawn at random."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(rows, positions, layers, experts, generator=g).argsort(-1)[..., :k]


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_the_routed_forward_is_the_models_own_and_records_its_routers_choice(family, norm_topk_prob):
    model = tiny(family, norm_topk_prob=norm_topk_prob)
    ids, mask = batch()
    layers = moe_layers(model)
    assert [m.layer for m in layers] == [0, 1, 2] and {(m.num_experts, m.top_k) for m in layers} == {(6, 2)}
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask, output_router_logits=True)
        with routed(model) as state:
            ours = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(ours, own.logits)
    routes = state.routes_of(*ids.shape)
    assert routes.shape == (3, 9, 3, 2)
    for j, logits in enumerate(own.router_logits):  # the model's own router: the top 2 of its softmax
        top = torch.topk(torch.softmax(logits.float(), -1), 2, dim=-1).indices.reshape(3, 9, 2)
        assert torch.equal(routes[:, :, j], top)
    # the blocks are the model's own again after the block
    assert all("forward" not in vars(m.block) for m in layers)


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_replayed_routes_are_taken_exactly_and_the_router_keeps_its_gradient(family):
    model = tiny(family)
    ids, mask = batch()
    with torch.no_grad(), routed(model) as state:
        own = model(input_ids=ids, attention_mask=mask).logits
    recorded = state.routes_of(*ids.shape)
    # replaying the model's own choice changes nothing, bit for bit, and no decision
    with torch.no_grad(), routed(model, recorded) as state:
        again = model(input_ids=ids, attention_mask=mask).logits
    assert torch.equal(again, own) and state.changed_fraction() == 0.0
    # other experts everywhere but one row's last position (no route: the router's own choice)
    routes = random_routes(3, 9, 3, 6, 2)
    routes[2, -1] = NO_ROUTE
    with routed(model, routes) as state:
        out = model(input_ids=ids, attention_mask=mask).logits
    taken = state.routes_of(*ids.shape)
    for j in range(3):  # per layer: the replayed experts, and the router's own where there was none
        assert torch.equal(taken[:, :, j][routes[:, :, j, 0] >= 0].reshape(-1, 2),
                           routes[:, :, j][routes[:, :, j, 0] >= 0].reshape(-1, 2))
        assert torch.equal(taken[2, -1, j], recorded[2, -1, j])
    assert not torch.allclose(out, own, atol=1e-4)
    # the changed decisions: of one layer (its input the same as without replay, so its router's own choice is the
    # recorded one), counted by hand over the 26 replayed positions x 2
    one = tiny(family, num_layers=1)
    with torch.no_grad(), routed(one) as state:
        one(input_ids=ids, attention_mask=mask)
    own_sets = state.routes_of(*ids.shape)[:, :, 0]
    given = random_routes(3, 9, 1, 6, 2)
    given[2, -1] = NO_ROUTE
    with torch.no_grad(), routed(one, given) as state:
        one(input_ids=ids, attention_mask=mask)
    replayed = given[:, :, 0, 0] >= 0
    changed = sum(int(e not in o.tolist()) for g, o in zip(given[:, :, 0][replayed], own_sets[replayed]) for e in g)
    assert 0 < changed < 52 and state.changed_fraction() == changed / 52
    # the router's weights get gradients through w_te; an expert no route names gets none
    routes[..., :] = torch.tensor([0, 1])
    with routed(model, routes):
        loss = model(input_ids=ids, attention_mask=mask).logits.logsumexp(-1).sum()
    model.zero_grad()
    loss.backward()
    gate = moe_layers(model)[1].block.gate.weight.grad
    assert gate is not None and gate.abs().sum() > 0
    experts = moe_layers(model)[1].block.experts
    if isinstance(experts, torch.nn.ModuleList):  # transformers 4.x: a module per expert
        grads = [e.down_proj.weight.grad for e in experts]
        assert all(g is not None and g.abs().sum() > 0 for g in grads[:1]) and all(
            g is None or g.abs().sum() == 0 for g in grads[2:])
    else:
        per_expert = experts.down_proj.grad.abs().sum(dim=(1, 2))
        assert (per_expert[:2] > 0).all() and (per_expert[2:] == 0).all()


def test_routes_of_the_wrong_shape_or_experts_are_refused():
    model = tiny("qwen3_moe")
    ids, mask = batch()
    layers = moe_layers(model)
    with pytest.raises(ValueError, match=r"routes of shape \(3, 9, 2, 2\) for a forward that needs \(3, 9, 3, 2\)"):
        check_routes(random_routes(3, 9, 2, 6, 2), layers)
    with pytest.raises(ValueError, match=r"needs \(3, 9, 3, 2\)"):
        check_routes(random_routes(3, 9, 3, 6, 1), layers)
    with pytest.raises(ValueError, match="outside 0..5"):
        check_routes(torch.full((3, 9, 3, 2), 6), layers)
    with pytest.raises(ValueError, match="integer tensor"):
        check_routes(torch.zeros(3, 9, 3, 2), layers)
    # a forward of other positions than the routes': refused in the forward, naming both
    with routed(model, random_routes(3, 8, 3, 6, 2)), pytest.raises(ValueError, match=r"\(3, 8, 3, 2\).*\(3, 9, 3, 2\)"):
        model(input_ids=ids, attention_mask=mask)
    with routed(model) as state, pytest.raises(ValueError, match="outside"):
        replay(state, torch.full((3, 9, 3, 2), -2))


def test_a_dense_model_has_no_moe_layers_and_runs_as_it_is():
    model = build_tiny_llama(VOCAB, hidden_size=16, num_heads=2).eval()
    ids, mask = batch()
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask).logits
        with routed(model) as state:
            assert state.layers == [] and torch.equal(model(input_ids=ids, attention_mask=mask).logits, own)


def test_expert_load_and_its_metrics_by_hand():
    # 2 rows x 3 positions, 2 layers, top-2 of 4 experts; row 1's last position is padding, row 0's first unrouted
    routes = torch.tensor([
        [[[0, 1], [2, 3]], [[0, 2], [2, 3]], [[0, 1], [3, 1]]],
        [[[1, 0], [2, 0]], [[3, 0], [2, 3]], [[3, 3], [3, 3]]],
    ])
    routes[0, 0] = NO_ROUTE
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    load = expert_load(routes, 4, mask)
    # layer 0 over 4 positions x 2: expert 0 x4, 1 x2, 2 x1, 3 x1; layer 1: 0 x1, 1 x1, 2 x3, 3 x3
    assert load.tolist() == [[4 / 8, 2 / 8, 1 / 8, 1 / 8], [1 / 8, 1 / 8, 3 / 8, 3 / 8]]
    model = tiny("olmoe")
    layers = moe_layers(model)[:2]
    metrics = load_metrics(load, layers)
    assert metrics["moe/layer_0/max_over_mean"] == 0.5 * 4 and metrics["moe/layer_1/max_over_mean"] == 0.375 * 4
    assert metrics["moe/max_over_mean"] == 2.0 and metrics["moe/layer_1/load"] == [0.125, 0.125, 0.375, 0.375]


def episodes(rows_per_prompt: int = 2):
    """Three prompts (one left-padded), each with `rows_per_prompt` right-padded completions."""
    g = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, VOCAB, (3, 5), generator=g)
    p_mask = torch.ones(3, 5, dtype=torch.long)
    p_mask[1, :2] = 0
    prompt_ids, prompt_mask = prompts.repeat_interleave(rows_per_prompt, 0), p_mask.repeat_interleave(rows_per_prompt, 0)
    B = len(prompt_ids)
    completion_ids = torch.randint(3, VOCAB, (B, 6), generator=g)
    completion_mask = torch.ones(B, 6, dtype=torch.long)
    completion_mask[0, 4:] = 0
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def sampler_routes(prompt_ids, completion_ids, layers: int, experts: int, k: int) -> torch.Tensor:
    """Routes over [prompt, completion] as a sampler records them: the rows of one prompt share its prefill's
    routes, the last sampled token has none (never fed back)."""
    B, Lp = prompt_ids.shape
    routes = random_routes(B, Lp + completion_ids.shape[1], layers, experts, k, seed=7)
    _, inverse = torch.unique(prompt_ids, dim=0, return_inverse=True)
    for b in range(B):
        routes[b, :Lp] = routes[int((inverse == inverse[b]).nonzero()[0])][:Lp]
    routes[:, -1] = NO_ROUTE
    return routes


LAYOUT_CASES = {"lean": (("lean", "onepass"), True), "shared": (("shared", "onepass"), True),
                "onepass-chunked-head": (("onepass",), True), "onepass-own-head": (("onepass",), False)}


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("layout", list(LAYOUT_CASES))
def test_every_training_layout_replays_each_tokens_route_and_scores_the_replayed_models_log_probs(
        family, layout, monkeypatch):
    """The lean pass (distinct prompts once and the completions in one call), the shared-prompt passes (two calls)
    and the one-pass forward each send every token of [prompt, completion] to the experts its route names (checked
    per layer and call) and give the log-probs of the model's own forward over whole rows with the same routes."""
    from tidyrl.models import forward, lean_decode, lean_forward
    from tidyrl.models.forward import completion_logprobs

    layouts, fast_path = LAYOUT_CASES[layout]
    monkeypatch.setattr(forward, "DEFAULT_LAYOUTS", layouts)
    model = tiny(family)
    if layout == "lean" and not lean_forward.can_run(model):  # (older transformers' OLMoE: tests/test_families.py)
        pytest.skip(f"the lean pass refuses this {family}: {lean_decode.refusal(model)}")
    prompt_ids, prompt_mask, completion_ids, completion_mask = episodes()
    routes = sampler_routes(prompt_ids, completion_ids, 3, 6, 2)
    rows = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    with torch.no_grad(), routed(model, routes):  # the reference: the model's own forward over whole rows
        own = model(input_ids=rows, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    reference = torch.log_softmax(own[:, 4:-1].float(), -1).gather(-1, completion_ids[..., None])[..., 0]
    with torch.no_grad(), routed(model, routes) as state:
        logprobs, _ = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 1.0,
                                          fast_path=fast_path, routing=state)
    real = completion_mask > 0
    assert torch.allclose(logprobs[real], reference[real], atol=2e-5), (logprobs - reference).abs().max()
    calls = {"lean": 1, "shared": 2}.get(layout, 1)
    assert len(state.calls) == calls and all(len(c) == calls for c in state.chosen)
    flat = routes.reshape(-1, 3, 2)
    replayed = own_routed = 0
    for call, index in enumerate(state.calls):
        taken, named = state.chosen_in(call), index >= 0
        given = named.clone()
        given[named] = (flat[index[named]] >= 0).all(-1).all(-1)
        assert torch.equal(taken[given], flat[index[given]])  # every layer at once: (tokens, layers, k)
        replayed, own_routed = replayed + int(given.sum()), own_routed + int((named & ~given).sum())
    # every position of [prompt, completion] once, but the distinct prompts' k - 1 copies where prompts are run once;
    # the last completion column (no route: the router's own) left out of the lean and shared passes
    once = layout in ("lean", "shared")
    assert (replayed, own_routed) == ((6 * 11 - 3 * 5 - 6, 0) if once else (6 * 11 - 6, 6))


def test_a_route_tensor_for_other_rows_than_the_batch_is_refused_before_the_forward():
    from tidyrl.models.forward import completion_logprobs

    model = tiny("qwen3_moe")
    prompt_ids, prompt_mask, completion_ids, completion_mask = episodes()
    with routed(model, random_routes(6, 10, 3, 6, 2)) as state, pytest.raises(ValueError, match=r"\(6, 10\).*6 rows of 5 \+ 6"):
        completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 1.0, routing=state)


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("fast_path", [True, False], ids=["lean-decode", "own-forward"])
def test_the_engine_records_every_tokens_route_and_the_replayed_trainer_scores_the_samplers_log_probs(
        family, fast_path):
    """The built-in engine's routes: the same draws as without recording; every prompt token's experts (from the
    prefill of its distinct prompt) and every sampled token's (from the step that fed it back) are the ones a
    forward over the whole rows replaying them takes, and that forward's log-probs are the sampler's to rounding;
    -1 at the prompts' padding, at the last sampled token and past each end."""
    from tidyrl.models.forward import completion_logprobs
    from tidyrl.models.generation import generate
    from tidyrl.models.sequences import left_pad

    model = tiny(family)
    prompts = [[5, 6, 7, 8], [9, 10], [5, 6, 7, 8], [11, 12, 13]]
    settings = dict(sample_keys=[1, 2, 3, 4], max_new_tokens=7, eos_ids=[2], pad_id=0, batch_size=3,
                    return_logprobs=True, fast_path=fast_path)
    ids, mask, _, logprobs = generate(model, prompts, **settings)
    r_ids, r_mask, _, r_logprobs, prompt_routes, completion_routes = generate(model, prompts, return_routes=True,
                                                                              **settings)
    assert torch.equal(ids, r_ids) and torch.equal(mask, r_mask) and torch.equal(logprobs, r_logprobs)
    assert prompt_routes.shape == (4, 4, 3, 2) and completion_routes.shape == (4, 7, 3, 2)
    assert prompt_routes.dtype == torch.int16
    p_ids, p_mask = left_pad(prompts, 0)
    assert ((prompt_routes >= 0).all(-1).all(-1) == (p_mask > 0)).all()
    assert torch.equal(prompt_routes[0], prompt_routes[2])  # one prefill of the shared prompt
    lengths = mask.sum(1).long()
    fed = torch.arange(7)[None] < (lengths - 1)[:, None]  # every sampled token but the last
    assert ((completion_routes >= 0).all(-1).all(-1) == fed).all()
    routes = torch.cat([prompt_routes, completion_routes], 1).long()
    with torch.no_grad(), routed(model, routes) as state:
        trainer, _ = completion_logprobs(model, p_ids, p_mask, ids, mask, 1.0, routing=state)
        assert state.changed_fraction() == 0.0  # the trainer's own router agrees here (one kernel, one batch)
    real = mask > 0
    assert torch.allclose(trainer[real], logprobs[real], atol=1e-5)
    for call, index in enumerate(state.calls):
        named = (index >= 0)
        named[named.clone()] = (routes.reshape(-1, 3, 2)[index[named]] >= 0).all(-1).all(-1)
        assert torch.equal(state.chosen_in(call)[named], routes.reshape(-1, 3, 2)[index[named]])


def test_a_dense_model_records_no_routes():
    from tidyrl.models.generation import generate

    model = build_tiny_llama(VOCAB, hidden_size=16, num_heads=2).eval()
    out = generate(model, [[5, 6]], sample_keys=[1], max_new_tokens=3, eos_ids=[2], pad_id=0, batch_size=1,
                   return_logprobs=True, return_routes=True)
    assert len(out) == 6 and out[4] is None and out[5] is None


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_load_balancing_loss_is_the_models_own_over_the_real_tokens_with_its_gradient(family):
    from tidyrl.models.routing import add_aux_loss, aux_loss_coef

    model = tiny(family).train()
    ids, mask = batch()
    own = model(input_ids=ids, attention_mask=mask, output_router_logits=True).aux_loss
    with routed(model, record=False, keep_logits=True) as state:
        model(input_ids=ids, attention_mask=mask)
        add_aux_loss(state, [mask.reshape(-1) > 0])
    assert len(state.aux) == 1 and torch.allclose(state.aux[0], own, atol=1e-6)
    model.zero_grad()
    state.aux[0].backward()
    assert moe_layers(model)[0].block.gate.weight.grad.abs().sum() > 0
    with torch.no_grad(), routed(model, record=False, keep_logits=True) as state:  # no gradients: nothing kept
        model(input_ids=ids, attention_mask=mask)
        add_aux_loss(state)
    assert state.aux == []
    # the weight: as set; unset, the model's own training's (its output_router_logits), 0 for a dense model
    assert aux_loss_coef(0.5, model) == 0.5 and aux_loss_coef(None, model) == 0.0
    model.config.output_router_logits = True
    assert aux_loss_coef(None, model) == model.config.router_aux_loss_coef > 0
    assert aux_loss_coef(0.5, build_tiny_llama(VOCAB, hidden_size=16, num_heads=2)) == 0.0


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_load_balancing_loss_and_the_changed_decisions_are_the_same_in_every_layout(family, monkeypatch):
    """A prompt run once for its k rows counts k times: the load-balancing loss over the inputs of the scored
    predictions, and the count of decisions compared, equal across the lean, shared-prompt and one-pass layouts
    (the loss to rounding; of those decisions, the ones the router's own choice changes differ by its near-ties),
    and the loss equals the model's own over whole rows."""
    from tidyrl.loops.rl.update import aux_tokens
    from tidyrl.models import forward
    from tidyrl.models.forward import completion_logprobs
    from tidyrl.models.routing import add_aux_loss, replaying
    from tidyrl.rollouts.record import Rollout

    model = tiny(family).train()
    prompt_ids, prompt_mask, completion_ids, completion_mask = episodes()
    part = Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                   completion_mask=completion_mask.float(), truncated=torch.zeros(6, dtype=torch.bool))
    routes = sampler_routes(prompt_ids, completion_ids, 3, 6, 2)
    got = {}
    for layout, (layouts, fast_path) in LAYOUT_CASES.items():
        monkeypatch.setattr(forward, "DEFAULT_LAYOUTS", layouts)
        with replaying(model, routes, replay=False, keep_logits=True) as state:
            completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 1.0,
                                fast_path=fast_path, routing=state)
            add_aux_loss(state, state.weights(aux_tokens(part)))
        got[layout] = (float(state.aux[0].detach()), *(float(x) for x in state.changed_decisions()))
    # the model's own: whole rows, every input of a scored prediction (the last real completion token left out)
    rows = torch.cat([prompt_ids, completion_ids], 1)
    mask = torch.cat([prompt_mask, completion_mask], 1)
    own = model(input_ids=rows, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                output_router_logits=True)
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    want = float(load_balancing_loss_func(own.router_logits, 6, 2, aux_tokens(part).float()).detach())
    for layout, (aux, changed, decisions) in got.items():
        assert aux == pytest.approx(want, abs=1e-5), layout
        assert decisions == got["onepass-own-head"][2], layout
        # (the router's own choice flips at near-ties by each layout's rounding: a few of ~250)
        assert abs(changed - got["onepass-own-head"][1]) <= 0.02 * decisions, layout
    # decisions: every routed position of the whole rows (but the last column, which has no route), k each
    assert got["lean"][2] == 2 * int((routes[..., 0, 0] >= 0).sum()) * 3


def test_under_gradient_checkpointing_a_recomputed_layer_replays_its_own_routes():
    """The one-pass forward with gradient checkpointing (each layer run again in backward): the same log-probs and
    gradients as without it, with the routes replayed, and each call's decisions counted once."""
    from tidyrl.models.forward import completion_logprobs
    from tidyrl.models.loading import enable_gradient_checkpointing
    from tidyrl.models.routing import replaying

    prompt_ids, prompt_mask, completion_ids, completion_mask = episodes()
    routes = sampler_routes(prompt_ids, completion_ids, 3, 6, 2)
    out = {}
    for checkpointing in (False, True):
        model = tiny("qwen3_moe").train()
        model.config.use_cache = False
        if checkpointing:
            enable_gradient_checkpointing(model)
        with replaying(model, routes) as state:
            logprobs, _ = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, 1.0,
                                              fast_path=not checkpointing, routing=state)
            (logprobs * completion_mask).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        out[checkpointing] = (logprobs.detach(), grads, [float(x) for x in state.changed_decisions()],
                              [len(o) for o in state.own])
    (lp0, g0, d0, n0), (lp1, g1, d1, n1) = out[False], out[True]
    assert torch.allclose(lp0, lp1, atol=1e-5)
    assert g0.keys() == g1.keys() and all(torch.allclose(g0[n], g1[n], atol=1e-5) for n in g0)
    assert n1 == [1, 1, 1]  # one recorded call per layer, the recomputation not counted again
    assert d1[1] == 2 * 3 * int((routes[..., 0, 0] >= 0).sum())  # every routed position, k each, in 3 layers

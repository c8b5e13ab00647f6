"""Mixture-of-experts routing, recorded and replayed: which experts every token of a forward was sent to in every
mixture-of-experts layer, and a forward made to send its tokens to given experts.

A mixture-of-experts layer (Shazeer et al. 2017; the top-k softmax router of Qwen3-MoE and OLMoE) sends token t to
the k experts of the largest router probabilities p_t = softmax(W_r x_t) and sums their outputs weighted by those
probabilities (renormalised over the k where the config's `norm_topk_prob` says so):

    y_t = sum over e in E_t of w_te * expert_e(x_t),   E_t = top-k(p_t),   w_te = p_te (/ sum over E_t of p_te')

The sampler and the trainer compute p_t from the same weights on other batch shapes and kernels, so rounding flips
some choices of E_t, and a flipped choice changes the token's output: the trainer's log-probs are then those of
another function than the one that sampled. Rollout routing replay (R3: Ma et al. 2025, "Stabilizing MoE
Reinforcement Learning by Aligning Training and Inference Routers", arXiv:2510.11370) records E_t in the sampler
and forces it in the trainer's forward: the trainer's w_te are still its own softmax's at the recorded experts, so
the router keeps its gradient (through w_te), while which experts run is the sampler's.

`routed(model, ...)` gives every mixture-of-experts block of the model (the model's own `...SparseMoeBlock`, of a
family with `moe` in `models.families`) tidyrl's forward of it for the duration of a block: the same operations as
the model's own forward, on either layout transformers has had (the router a linear layer and the experts a list of
MLPs, transformers 4.x; the router a `...TopKRouter` module and the experts one `...Experts` module of stacked
weights, transformers 5), so that without replay its numbers are the model's own bit for bit (tests/test_routing.py),
with three additions: the chosen experts recorded per layer, the router's logits kept (for a load-balancing loss in
the update), and given experts replayed.

Routes are (rows, positions, MoE layers, k) integer tensors, one row per sequence of the forward's batch and one
position per token of its input: -1 where nothing was recorded (padding; the last sampled token, which the sampler
never fed back), where the forward takes its own choice.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tidyrl.models.families import family_of

NO_ROUTE = -1
"""A position of a route tensor with no recorded experts: the forward routes it itself."""
ROUTE_DTYPE = torch.int16
"""What routes are carried as (a rollout's, a checkpoint's): up to 32767 experts, 2 bytes per token, layer and
choice."""


@dataclass(frozen=True)
class MoeLayer:
    """One mixture-of-experts block of a model: its decoder layer's index and how it routes."""
    layer: int
    block: nn.Module
    num_experts: int
    top_k: int
    norm_topk_prob: bool


def moe_layers(model) -> list[MoeLayer]:
    """The model's mixture-of-experts blocks in layer order (a wrapper such as DDP, FSDP2 or peft around the model
    alike); [] for a dense model or an architecture without a declared family that has them."""
    config = _config_of(model)
    family = family_of(config) if config is not None else None
    if family is None or not family.moe:
        return []
    found = []
    for name, module in model.named_modules():
        if type(module).__name__.endswith("SparseMoeBlock"):
            parts = name.split(".")
            layer = int(parts[parts.index("layers") + 1])
            gate = module.gate
            experts = getattr(module, "num_experts", None) or getattr(gate, "num_experts", None) or \
                gate.out_features
            top_k = getattr(module, "top_k", None) or gate.top_k
            norm = getattr(module, "norm_topk_prob", None)
            norm = gate.norm_topk_prob if norm is None else norm
            found.append(MoeLayer(layer, module, int(experts), int(top_k), bool(norm)))
    return found


@dataclass
class Routing:
    """What the blocks did in the forwards run inside `routed`, per MoE layer in layer order: the experts chosen
    (`chosen`: one (tokens, k) tensor per call, in call order) and, with `keep_logits`, the router's logits
    ((tokens, experts), with their graph). With `routes`, the experts each position was sent to came from it; the
    experts the forward's own router would have chosen there are `own` (for the changed-decision count).

    `routes` is a route tensor of the episodes' rows (rows, positions, layers, k). By default every forward is
    over those rows as they are; a pass that lays the tokens out otherwise (the distinct prompts once, the
    completions after them) says so with `expect`: per forward call, where each of its tokens sits among the
    routes' rows x positions."""
    layers: list[MoeLayer]
    routes: Optional[torch.Tensor] = None
    record: bool = True
    keep_logits: bool = False
    replay: bool = True
    """False: the routes are only compared with the forward's own choice (`changed_fraction`), which it takes."""
    calls: list[torch.Tensor] = field(default_factory=list)
    counts: list[torch.Tensor] = field(default_factory=list)
    """Per expected call, how many of the rows' positions each of its tokens stands for (a prompt run once for its
    k rows: k), so that what is summed over tokens is the same in every layout."""
    chosen: list[list[torch.Tensor]] = field(default_factory=list)
    own: list[list[torch.Tensor]] = field(default_factory=list)
    replayed: list[list[torch.Tensor]] = field(default_factory=list)
    logits: list[list[torch.Tensor]] = field(default_factory=list)
    given: list[Optional[torch.Tensor]] = field(default_factory=list)
    made: list[int] = field(default_factory=list)
    aux: list[torch.Tensor] = field(default_factory=list)
    """With `keep_logits`, each trained forward's load-balancing loss (`add_aux_loss`), until read."""

    def __post_init__(self) -> None:
        if self.routes is not None:
            check_routes(self.routes, self.layers)
        self._clear()

    def _clear(self) -> None:
        n = len(self.layers)
        self.chosen, self.own = [[] for _ in range(n)], [[] for _ in range(n)]
        self.replayed, self.logits = [[] for _ in range(n)], [[] for _ in range(n)]
        self.made = [0] * n
        self.given = [None if self.routes is None else _given(self.routes, index) for index in self.calls]

    def routes_of(self, rows: int, positions: int, call: int = -1) -> torch.Tensor:
        """What was chosen in a forward (the last by default) of (rows, positions) tokens, as a route tensor (rows,
        positions, layers, k)."""
        return self.chosen_in(call).reshape(rows, positions, len(self.layers), -1)

    def chosen_in(self, call: int = -1) -> torch.Tensor:
        """The experts chosen in one forward call (the last by default), per token and layer: (tokens, layers, k)."""
        return torch.stack([c[call] for c in self.chosen], dim=1)

    def changed_fraction(self) -> Optional[float]:
        """Of the replayed decisions (each replayed position's k experts in each layer), the fraction the forward's
        own router would have made otherwise (a replayed expert outside the router's own top-k); None where nothing
        was replayed."""
        changed, total = self.changed_decisions()
        return float(changed) / float(total) if float(total) else None

    def changed_decisions(self) -> tuple:
        """`changed_fraction`'s two counts: the replayed decisions the own router would have made otherwise, and
        all replayed decisions (tensors on the forward's device: no synchronisation; 0 where none)."""
        changed = total = 0
        for j, (own, replayed) in enumerate(zip(self.own, self.replayed)):
            for call, (o, r) in enumerate(zip(own, replayed)):
                count = self.counts[call].to(o.device)[r] if self.calls else torch.ones((), device=o.device)
                c = self._given_in(j, call, o.shape[0]).to(o.device)[r]
                o = o[r]
                changed = changed + ((~(c[:, :, None] == o[:, None, :]).any(-1)).sum(-1) * count).sum()
                total = total + (torch.ones_like(c[:, 0]) * count).sum() * c.shape[-1]
        return changed, total

    def _given_in(self, j: int, call: int, tokens: int) -> torch.Tensor:
        """The routes layer j's `call`-th recorded call was given (tokens, k)."""
        if not self.calls:
            return self.routes[:, :, j].reshape(tokens, -1)
        return self.given[call][:, j]

    def weights(self, mask: torch.Tensor) -> list[torch.Tensor]:
        """Per expected forward call (`expect`), the weight of each of its tokens in a sum over the rows' positions
        where `mask` (the routes' rows x positions) is nonzero: its count there, 0 elsewhere; (tokens,) floats."""
        flat = (mask.reshape(-1) != 0).float()
        return [torch.where(index >= 0, flat.to(index.device)[index.clamp(min=0)], 0.0) * count
                for index, count in zip(self.calls, self.counts)]


def expect(state: Routing, calls: Sequence[torch.Tensor], counts: Optional[Sequence[torch.Tensor]] = None) -> None:
    """The forward calls the next pass makes, in order: for each, where each of its tokens (in the order its blocks
    see them, rows x positions flattened) sits among the routes' rows x positions flattened (-1: nowhere, a
    position the forward routes itself). Clears what earlier forwards recorded. A block called more often than
    this (a layer recomputed in backward under gradient checkpointing) takes the routes of its call modulo their
    number again and records nothing more. `counts`: per call, how many rows' positions each token stands for
    (default 1 each)."""
    state.calls = [torch.as_tensor(index, dtype=torch.long) for index in calls]
    state.counts = [torch.ones(len(index)) for index in state.calls] if counts is None else \
        [torch.as_tensor(c, dtype=torch.float) for c in counts]
    state._clear()


def _given(routes: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The routes (tokens, layers, k) of one forward call's tokens: the route tensor's at `index`, -1 where it is
    -1."""
    flat = routes.reshape(-1, *routes.shape[2:])
    index = index.to(flat.device)
    picked = flat[index.clamp(min=0)]
    return torch.where((index >= 0)[:, None, None], picked, torch.full_like(picked, NO_ROUTE))


def check_routes(routes: torch.Tensor, layers: Sequence[MoeLayer], rows: Optional[int] = None,
                 positions: Optional[int] = None) -> None:
    """ValueError unless `routes` is a route tensor for these layers (and, where given, a forward of rows x
    positions tokens): (rows, positions, MoE layers, k) integers, each -1 or an expert index."""
    if not isinstance(routes, torch.Tensor) or routes.dim() != 4 or routes.dtype.is_floating_point:
        shape = tuple(routes.shape) if isinstance(routes, torch.Tensor) else type(routes).__name__
        raise ValueError(f"routes must be an integer tensor (rows, positions, MoE layers, k); got {shape}")
    _check_shape(routes, layers, rows, positions)
    experts = layers[0].num_experts
    if routes.numel() and (int(routes.min()) < NO_ROUTE or int(routes.max()) >= experts):
        raise ValueError(f"routes name experts outside 0..{experts - 1} (or -1 for none): "
                         f"{int(routes.min())}..{int(routes.max())}")


def _check_shape(routes: torch.Tensor, layers: Sequence[MoeLayer], rows: Optional[int],
                 positions: Optional[int]) -> None:
    """`check_routes`'s shape rule alone (what each block's call checks: no device synchronisation)."""
    k = layers[0].top_k
    want = (rows if rows is not None else routes.shape[0], positions if positions is not None else routes.shape[1],
            len(layers), k)
    if tuple(routes.shape) != want:
        raise ValueError(f"routes of shape {tuple(routes.shape)} for a forward that needs {want} (rows, positions, "
                         f"{len(layers)} MoE layers, top-{k} experts)")


def routing_weights(logits: torch.Tensor, experts: torch.Tensor, norm_topk_prob: bool,
                    dtype: torch.dtype) -> torch.Tensor:
    """w_te: the router's float32 softmax at the given experts (tokens, k), renormalised over them where the config
    says so, in `dtype`: the model's own router's operations, at any experts."""
    return _normalised(F.softmax(logits, dim=-1, dtype=torch.float).gather(-1, experts), norm_topk_prob, dtype)


def _normalised(weights: torch.Tensor, norm_topk_prob: bool, dtype: torch.dtype) -> torch.Tensor:
    """The k float32 router probabilities of each token, renormalised over them where the config says so, in
    `dtype` (the routers' own last steps)."""
    if norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype)


def _experts_forward(block: nn.Module, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum over e of w_te * expert_e(x_t), on the block's own experts: transformers 5's `...Experts` module as it
    is; transformers 4.x's list of MLPs by its block's own loop (each expert hit, in order, its tokens' outputs
    added in place)."""
    if not isinstance(block.experts, nn.ModuleList):
        return block.experts(x, experts, weights)
    out = torch.zeros_like(x)
    mask = F.one_hot(experts, num_classes=len(block.experts)).permute(2, 1, 0)
    for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero():
        slot, token = torch.where(mask[e].squeeze(0))
        y = block.experts[e](x[None, token].reshape(-1, x.shape[-1])) * weights[token, slot, None]
        out.index_add_(0, token, y.to(x.dtype))
    return out


def _block_forward(state: Routing, j: int, hidden_states: torch.Tensor):
    layer = state.layers[j]
    block = layer.block
    B, T, h = hidden_states.shape
    x = hidden_states.view(-1, h)
    if isinstance(block.gate, nn.Linear):  # transformers 4.x: the block routes
        logits = block.gate(x)
        probs = F.softmax(logits, dim=1, dtype=torch.float)
        top, own = torch.topk(probs, layer.top_k, dim=-1)
        dtype = x.dtype
    else:  # transformers 5: the router module routes
        logits, top, own = block.gate(x)
        dtype = logits.dtype
    call, state.made[j] = state.made[j], state.made[j] + 1
    fresh = not state.calls or call < len(state.calls)  # (else a recomputation of an expected call)
    given = _routes_for_call(state, j, call, B, T)
    chosen = own
    if given is not None:
        given = given.to(own.device)
        replayed = (given >= 0).all(-1)
        if fresh:
            state.own[j].append(own.detach())
            state.replayed[j].append(replayed)
    if given is not None and state.replay:
        chosen = torch.where(replayed[:, None], given, own)
        weights = routing_weights(logits, chosen, layer.norm_topk_prob, dtype)
    else:  # (transformers 5's router has normalised and cast its own)
        weights = _normalised(top, layer.norm_topk_prob, dtype) if isinstance(block.gate, nn.Linear) else top
    if state.record and fresh:
        state.chosen[j].append(chosen.detach())
    if state.keep_logits and fresh and logits.requires_grad:  # (a forward with gradients: the one trained)
        state.logits[j].append(logits)
    out = _experts_forward(block, x, chosen, weights).reshape(B, T, h)
    return (out, logits) if isinstance(block.gate, nn.Linear) else out


def _routes_for_call(state: Routing, j: int, call: int, rows: int, positions: int) -> Optional[torch.Tensor]:
    """The routes (tokens, k) that layer j's `call`-th block call of (rows, positions) tokens replays, or None."""
    if state.routes is None:
        return None
    if not state.calls:  # every forward over the routes' own rows
        _check_shape(state.routes, state.layers, rows, positions)
        return state.routes[:, :, j].reshape(-1, state.layers[j].top_k)
    n = len(state.calls)
    given = state.given[call % n]
    if given.shape[0] != rows * positions:
        raise ValueError(f"a forward of {rows} x {positions} tokens where the expected call {call % n} has "
                         f"{given.shape[0]}")
    return given[:, j]


@contextlib.contextmanager
def routed(model, routes: Optional[torch.Tensor] = None, *, record: bool = True, keep_logits: bool = False,
           replay: bool = True) -> Iterator[Routing]:
    """Run the model's mixture-of-experts blocks through tidyrl's forward of them (module docstring) until the
    block ends: recording the experts chosen, keeping the router's logits, and with `routes` (a route tensor of
    each forward's batch: call `replay` between forwards of other batches) sending each position with a route to
    its experts (with `replay` False: only compared with the forward's own choice). Yields the `Routing`; a dense
    model runs as it is (no layers)."""
    state = Routing(moe_layers(model), routes, record, keep_logits, replay)
    patched, outer = [], vars(model).get(_ACTIVE)
    try:
        for j, layer in enumerate(state.layers):
            layer.block.forward = _bound(state, j)
            patched.append(layer.block)
        vars(model)[_ACTIVE] = state
        yield state
    finally:
        for block in patched:
            del block.forward  # (the instance attribute: the class's forward again)
        vars(model).pop(_ACTIVE, None)
        if outer is not None:
            vars(model)[_ACTIVE] = outer


_ACTIVE = "_tidyrl_routing"
"""Where `routed` leaves its state on the model it was given, for `active`."""


@contextlib.contextmanager
def replaying(model, routes: Optional[torch.Tensor], replay: bool = True,
              keep_logits: bool = False) -> Iterator[Optional[Routing]]:
    """`routed(model, routes)` for a mixture-of-experts model given routes (ROUTE_DTYPE or any integers), with
    `replay` False comparing them only, and `keep_logits` for a load-balancing loss (`add_aux_loss`); None (and
    the model as it is) for a dense model, or without routes or logits to keep. What the training forwards
    (`models.forward.completion_logprobs(..., routing=)`) run inside."""
    if (routes is None and not keep_logits) or not moe_layers(model):
        yield None
        return
    with routed(model, None if routes is None else routes.long(), record=False, replay=replay,
                keep_logits=keep_logits) as state:
        yield state


def _bound(state: Routing, j: int):
    def forward(hidden_states):
        return _block_forward(state, j, hidden_states)
    return forward


def add_aux_loss(state: Routing, weights: Optional[Sequence[torch.Tensor]] = None) -> None:
    """The load-balancing loss of the forward just run (its kept router logits, each call's tokens weighted by
    `weights`: 0 for padding, k for a prompt run once for k rows, `Routing.weights`) onto `state.aux`, its logits
    then dropped. The loss is the model's own
    (transformers' `load_balancing_loss_func` of its modeling module: Switch Transformers', Fedus et al. 2021,
    eq. 4, over every MoE layer's tokens together: E * sum over e of (share of top-k assignments to e) x (mean
    router probability of e)). Nothing where the forward kept no logits (no gradients)."""
    import sys

    kept = [logits for logits in state.logits if logits]
    if kept:
        gate_logits = tuple(torch.cat(calls) for calls in kept)
        weight = None if weights is None else torch.cat(list(weights)).to(gate_logits[0].device)[None]
        module = sys.modules[type(state.layers[0].block).__module__]
        state.aux.append(module.load_balancing_loss_func(gate_logits, state.layers[0].num_experts,
                                                         state.layers[0].top_k, weight))
    for logits in state.logits:
        logits.clear()


def aux_loss_coef(coef: Optional[float], model) -> float:
    """train.router_aux_loss_coef for `model`: `coef` where set, else its config's router_aux_loss_coef where its
    output_router_logits says its own training added the loss, else 0; 0 for a dense model."""
    if not moe_layers(model):
        return 0.0
    if coef is not None:
        return float(coef)
    config = _config_of(model)
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if getattr(
        config, "output_router_logits", False) else 0.0


def _config_of(model):
    for candidate in (model, getattr(model, "module", None), getattr(getattr(model, "base_model", None), "model", None)):
        if candidate is not None and getattr(candidate, "config", None) is not None:
            return candidate.config
    return None


def active(model) -> Optional[Routing]:
    """The `Routing` of the `routed` block that was given this model (the same object), or None: a lookup, not a
    walk over its modules (the offline stages' every forward asks)."""
    return vars(model).get(_ACTIVE)


def take(state: Routing) -> torch.Tensor:
    """The experts chosen in the forward just run (tokens, layers, k), ROUTE_DTYPE, forgetting what was recorded
    (a decode loop's memory stays one step's)."""
    chosen = state.chosen_in(-1).to(ROUTE_DTYPE)
    for recorded in state.chosen:
        recorded.clear()
    return chosen


def routing_shape(state: Routing) -> tuple[int, int]:
    """(MoE layers, k): a route tensor's last two sizes for this model."""
    return len(state.layers), state.layers[0].top_k


def replay(state: Routing, routes: Optional[torch.Tensor]) -> None:
    """The routes the next forwards inside `routed` replay (None: their own routing), over their own rows unless
    `expect` says otherwise; clears what earlier forwards recorded."""
    if routes is not None:
        check_routes(routes, state.layers)
    state.routes = routes
    state._clear()


def expert_load(chosen: torch.Tensor, num_experts: int, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The fraction of the token-expert assignments of each layer that went to each expert: (layers, experts),
    each row summing to 1, from a route tensor (rows, positions, layers, k); positions where `mask` (rows,
    positions) is 0, or with no route, left out."""
    keep = (chosen >= 0).all(-1)  # (rows, positions, layers)
    if mask is not None:
        keep = keep & (mask > 0)[:, :, None]
    counts = torch.zeros(chosen.shape[2], num_experts, dtype=torch.float64)
    for j in range(chosen.shape[2]):
        picked = chosen[:, :, j][keep[:, :, j]].reshape(-1).long()
        counts[j] = torch.bincount(picked, minlength=num_experts).double()
    total = counts.sum(-1, keepdim=True)
    return torch.where(total > 0, counts / total.clamp(min=1), counts)


def load_metrics(load: torch.Tensor, layers: Sequence[MoeLayer]) -> dict:
    """Metrics of an expert load (`expert_load`): per MoE layer `moe/layer_{i}/max_over_mean` (the busiest
    expert's share over the mean share 1/experts: 1 = balanced, experts = every token to one expert) and
    `moe/layer_{i}/load` (each expert's share), and `moe/max_over_mean` (the layers' largest)."""
    out = {}
    worst = 0.0
    for row, layer in zip(load, layers):
        ratio = float(row.max()) * len(row) if float(row.sum()) > 0 else 0.0
        out[f"moe/layer_{layer.layer}/max_over_mean"] = ratio
        out[f"moe/layer_{layer.layer}/load"] = [round(float(v), 6) for v in row]
        worst = max(worst, ratio)
    out["moe/max_over_mean"] = worst
    return out

"""The built-in engine's sampling: tidyrl's own decode loop over a Hugging Face model and its key/value cache.

Why not `model.generate`: sampling must be keyed per (seed, rollout, sample index) so that chunk sizes and
process counts never change the completions. Each sequence owns a `torch.Generator` seeded from its key and
draws its own uniforms, one per token, all at once before decoding; a token is drawn from the softmax by inverse
transform sampling (`sample_from_logits`: the first token whose cumulative probability exceeds the uniform), so a
sequence's draws never depend on which other sequences share its chunk.

What makes it fast, none of which changes a draw or the maths (docs/benchmarks.md has the figures,
docs/benchmarking.md the profiles):
- the k samples of a prompt share one prompt pass: each distinct prompt is prefilled once and its keys/values
  are copied to its samples;
- keys and values are written into buffers allocated once (`_BufferedLayer`) instead of concatenated at every
  step, which copies the whole cache each time;
- models of a declared family decode with our own one-token step (`models.lean_decode`: the same maths as their
  forward without its per-call overhead; `model_fast_paths: false` turns it off); other models get their 4D
  attention mask ready-made;
- each sequence draws its max_new_tokens uniforms in one call before decoding: no random-number call per token
  (a Gumbel vector per row per token over a 150k vocabulary would cost a generator call per row per token: on a
  GPU, one kernel launch per row per token; docs/benchmarks.md has its cost on a CPU);
- finished rows leave the decoding batch (except with fixed shapes: a CUDA graph replays one batch size);
- the sampling pass returns each token's log-prob, the sampler's log-probs of the rollout: no separate
  scoring pass of the policy.

With `return_routes`, a mixture-of-experts model's routes come back too (`models.routing`): the experts every
prompt token went to in the prefill and every sampled token in the decode step that fed it back, per layer, what
the trainer replays (rollout routing replay). Recording decodes with growing shapes (a captured graph records
nothing).
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace
from typing import Optional, Sequence

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from tidyrl import liveness
from tidyrl.models import fused_decode
from tidyrl.models.devices import width_padding
from tidyrl.models.sequences import cache_argument, left_pad, model_device, plain_kv_cache, returned_cache
from tidyrl.models.lean_decode import Replayed, StaticDecode, attention_bias, decode_step_for
from tidyrl.models.routing import NO_ROUTE, ROUTE_DTYPE, Routing, moe_layers, routed, routing_shape, take


SAMPLER = "inverse-transform-float64"
"""The built-in engine's draw scheme, written into RL checkpoints. A run resumed under another scheme samples its
later rollouts from the same distribution, but not with the draws the uninterrupted run would have made, so it is
not bit-exact with it; the resume says so. Every RL checkpoint records its scheme (its state's `sampler`)."""


def sampler_change_note(saved_state: dict, draws_here: bool = True) -> Optional[str]:
    """A warning for a resume whose checkpoint was sampled with another draw scheme than this version's, or None.
    `draws_here`: the run's engine draws with this sampler (the engine decides: `tidyrl.engines.resume_note`);
    False, its draws are its own and nothing is compared."""
    saved = saved_state["sampler"]
    if not draws_here or saved == SAMPLER:
        return None
    return (f"warning: the checkpoint's rollouts were sampled with {saved!r} draws, this version of tidyrl draws "
            f"with {SAMPLER!r}: the rollouts from here on follow the same distributions, but they are not the samples "
            "the run would have drawn uninterrupted (a resume is bit-exact within one draw scheme)")


def sample_from_logits(logits_BV: torch.Tensor, uniforms_B: torch.Tensor) -> torch.Tensor:
    """One token per row drawn from softmax(logits) by inverse transform sampling: the first token whose cumulative
    probability exceeds u * (total probability), for u uniform in [0, 1) (float64, one per row). Tokens at -inf
    (filtered, banned) add no mass and are never drawn.

    The softmax is float32, as the log-probs of training. A float32 running sum over 150k tokens would move mass
    between them, a float64 one over all of them costs 5x the softmax on a CPU: the sums are taken in two levels,
    blocks of `_SAMPLING_BLOCK` tokens summed in float32 (relative error ~1e-7, the softmax's own) and accumulated
    in float64, the block where u * total falls found, then the float64 running sum within that block alone."""
    B, V = logits_BV.shape
    C = min(V, _SAMPLING_BLOCK)
    probs = torch.softmax(logits_BV.float(), dim=-1)
    full = V // C * C
    sums = probs[:, :full].view(B, -1, C).sum(-1)  # (B, blocks): whole blocks, then the rest as one more
    if full < V:
        sums = torch.cat([sums, probs[:, full:].sum(-1, keepdim=True)], dim=1)
    block_cdf = sums.double().cumsum(-1)
    target = uniforms_B.double() * block_cdf[:, -1]  # < the total, as u < 1
    block = torch.searchsorted(block_cdf, target[:, None], right=True).clamp_max(block_cdf.shape[1] - 1)  # (B, 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp_min(0)), 0.0)[:, 0]
    index = block * C + torch.arange(C, device=probs.device)  # (B, C): the block's tokens (past V: none)
    inner = probs.gather(1, index.clamp_max(V - 1)).masked_fill(index >= V, 0.0).double().cumsum(-1)
    # The rest of the target inside its block, kept under the block's own total (summed in another order).
    rest = torch.minimum(target - before, torch.nextafter(inner[:, -1], torch.zeros_like(inner[:, -1])))
    within = torch.searchsorted(inner, rest[:, None], right=True)[:, 0]
    return (block[:, 0] * C + within).clamp_max(V - 1)


# Tokens per block of `sample_from_logits`'s two-level cumulative sum (a 150k vocabulary: 149 blocks).
_SAMPLING_BLOCK = 1024


def filters(top_k: int, top_p: float, vocab: int) -> bool:
    """Whether top-k/top-p remove anything from a vocabulary of `vocab` tokens (`filter_logits`)."""
    return bool(top_k and top_k < vocab) or top_p < 1.0


def filter_logits(logits_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then nucleus (Holtzman et al. 2020) filtering: removed tokens get -inf. Always keeps one token."""
    if top_k and top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits_BV, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits_BV = logits_BV.masked_fill(drop, float("-inf"))
    return logits_BV


@torch.no_grad()
def generate(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    sample_keys: Sequence[int],
    max_new_tokens: int,
    eos_ids: Sequence[int],
    pad_id: int,
    batch_size: int,
    min_new_tokens: int = 0,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    return_logprobs: bool = False,
    fast_path: bool = True,
    static_cache: Optional[bool] = None,
    return_routes: bool = False,
) -> tuple[torch.Tensor, ...]:
    """Sample one completion per prompt, in chunks of `batch_size`.

    `sample_keys[i]` seeds prompt i's sampler (see `sample_seed`). Returns
    (completion_ids (B, max_new_tokens) right-padded with pad_id,
    completion_mask (B, max_new_tokens) float, 1 up to and including EOS,
    truncated (B,) bool), and with `return_logprobs` a fourth tensor (B, max_new_tokens): the log-probability
    of each sampled token under the sampling model at `temperature`, before top-k/top-p filtering and the
    min_new_tokens ban (what `score_logprobs` computes with the same weights, up to float rounding), 0 past
    EOS. These are the old log-probs of PPO-style ratios, without a second forward pass.

    `fast_path`: decode models of a declared family with `models.lean_decode` (the same maths as the model's
    forward, without its per-call overhead); False always calls the model's own forward.
    `static_cache`: with the fast path, decode with fixed shapes (`lean_decode.StaticDecode`), each step one
    CUDA graph replay on a GPU; None = on CUDA devices only.
    `return_routes` (with `return_logprobs`): two more tensors, a mixture-of-experts model's routes
    (`models.routing`), ROUTE_DTYPE: the prompts' (B, longest prompt, MoE layers, k), left-aligned as `left_pad`
    pads them, and the completions' (B, max_new_tokens, MoE layers, k), at position t the experts completion token
    t was sent to when fed back (none for the last one, never fed); -1 at padding and past the end. None for a
    dense model.
    """
    assert len(prompts) == len(sample_keys)
    ids = torch.full((len(prompts), max_new_tokens), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), max_new_tokens))
    logprobs = torch.zeros((len(prompts), max_new_tokens))
    layers = moe_layers(model) if return_routes else []
    recording = routed(model) if layers else contextlib.nullcontext()
    if layers:
        k, Lp = layers[0].top_k, max(len(p) for p in prompts)
        prompt_routes = torch.full((len(prompts), Lp, len(layers), k), NO_ROUTE, dtype=ROUTE_DTYPE)
        completion_routes = torch.full((len(prompts), max_new_tokens, len(layers), k), NO_ROUTE, dtype=ROUTE_DTYPE)
    with recording as routing:
        for start in range(0, len(prompts), batch_size):
            chunk = slice(start, min(start + batch_size, len(prompts)))
            routes = _generate_chunks_of(model, prompts, sample_keys, chunk, ids, mask, logprobs, routing,
                                         max_new_tokens=max_new_tokens, eos_ids=eos_ids, pad_id=pad_id,
                                         min_new_tokens=min_new_tokens, temperature=temperature, top_p=top_p,
                                         top_k=top_k, fast_path=fast_path, static_cache=static_cache)
            if routing is not None:
                c_prompt, c_completion = routes
                prompt_routes[chunk, Lp - c_prompt.shape[1]:] = c_prompt.cpu()
                completion_routes[chunk, :c_completion.shape[1]] = c_completion.cpu()
    ended = (ids.unsqueeze(-1) == torch.as_tensor(list(eos_ids))).any(-1) & (mask > 0)
    truncated = ~ended.any(-1)
    out = (ids, mask, truncated, logprobs) if return_logprobs else (ids, mask, truncated)
    if return_routes:
        out += (prompt_routes, completion_routes) if layers else (None, None)
    return out


def _generate_chunks_of(model, prompts, sample_keys, chunk: slice, ids, mask, logprobs, routing: Optional[Routing],
                        **settings) -> list:
    """The `chunk` of `generate`'s prompts, written into its ids, mask and log-probs; with `routing`, its routes
    [prompts', completions'] (`_generate_chunk`), else []."""
    rows = prompts[chunk]
    shapes = (f"sequences {chunk.start + 1}-{chunk.start + len(rows)} of {len(prompts)}: prompts of up to "
              f"{max(len(p) for p in rows)} tokens + up to {settings['max_new_tokens']} new")
    # (less bookkeeping per op than no_grad; only our copies leave the block)
    with liveness.working("generation", shapes), torch.inference_mode():
        c_ids, c_mask, c_logprobs, *routes = _generate_chunk(model, rows, sample_keys[chunk], routing=routing,
                                                             **settings)
    ids[chunk, : c_ids.shape[1]] = c_ids.cpu()
    mask[chunk, : c_mask.shape[1]] = c_mask.cpu()
    logprobs[chunk, : c_logprobs.shape[1]] = c_logprobs.cpu()
    liveness.mark(f"generated sequences {chunk.start + 1}-{chunk.start + len(rows)} of {len(prompts)}")
    return routes


def _generate_chunk(model, prompts, keys, *, max_new_tokens, eos_ids, pad_id, min_new_tokens, temperature,
                    top_p, top_k, fast_path=True, static_cache=None, routing: Optional[Routing] = None
                    ) -> tuple[torch.Tensor, ...]:
    """Decode one chunk: (ids, mask, log-probs of the sampled tokens), each (B, steps taken), and with `routing`
    (a `models.routing.routed` state recording the model's choices) the routes of the prompts (B, Lp, MoE layers,
    k) and of the completions (B, steps taken, MoE layers, k), -1 at padding. Where the model's
    cache is a plain per-layer key/value cache (most decoder LMs), three things make it lean without changing
    any draw: each distinct prompt is prefilled once and its cache copied to its samples (GRPO/RLOO chunks hold
    k samples of each prompt); keys and values are written into buffers allocated once instead of being
    concatenated (which copies the whole cache at every step); and finished rows are dropped from the batch
    once they are a quarter of it (not with fixed shapes, `static_cache`, where they decode padding)."""
    device = model_device(model)
    B = len(prompts)
    eos = torch.as_tensor(list(eos_ids), dtype=torch.long, device=device)
    generators = [torch.Generator(device=device).manual_seed(k) for k in keys]
    # Declared families get our own prefill and decode step (tidyrl.models.lean_decode), which takes the mask as an
    # additive bias and keeps every position in plain buffers (a sliding window masks keys, never drops them).
    step_fn = decode_step_for(model, max(len(p) for p in prompts) + max_new_tokens) if fast_path else None
    lean = step_fn is not None or plain_kv_cache(model)
    if lean:  # prefill each distinct prompt once
        first_row: dict[tuple, int] = {}
        inverse = [first_row.setdefault(tuple(p), len(first_row)) for p in prompts]
        unique = [list(p) for p in first_row]
    else:
        inverse, unique = list(range(B)), list(prompts)
    u_ids, u_attn = left_pad(unique, pad_id)
    u_ids, u_attn = u_ids.to(device), u_attn.to(device)
    u_pos = (u_attn.cumsum(-1) - 1).clamp(min=0)
    Lp = u_ids.shape[1]
    inv = torch.as_tensor(inverse, device=device)
    if step_fn is not None:
        empty = torch.empty((len(unique), step_fn.n_kv, 0, step_fn.head_dim), dtype=step_fn.embed.dtype,
                            device=device)
        prefill_cache = SimpleNamespace(layers=[_BufferedLayer(empty, empty, Lp) for _ in step_fn.layers])
        u_logits = step_fn.prefill(u_ids, u_attn, u_pos, prefill_cache.layers)
    else:
        out = model(input_ids=u_ids, attention_mask=u_attn, position_ids=u_pos, use_cache=True, logits_to_keep=1)
        u_logits, prefill_cache = out.logits[:, -1, :], returned_cache(out)
    logits = u_logits[inv]  # (B, V)
    if routing is not None:  # each distinct prompt's routes to its rows, none at padding
        prompt_routes = take(routing).view(len(unique), Lp, *routing_shape(routing))[inv]
        prompt_routes.masked_fill_(~u_attn[inv].bool()[:, :, None, None], NO_ROUTE)
        completion_routes = torch.full((B, max_new_tokens, *routing_shape(routing)), NO_ROUTE,
                                       dtype=prompt_routes.dtype, device=device)
    # (recording: growing shapes, whose every step's routes can be read)
    fixed = step_fn is not None and (static_cache if static_cache is not None else device.type == "cuda") and \
        routing is None
    capacity = Lp + max_new_tokens
    if fixed:  # (on CUDA a multiple of 16 positions, those past the last token never written: masked throughout)
        capacity += width_padding(capacity, device)
    cache = _buffered_cache(prefill_cache, inv, capacity) if lean else prefill_cache
    attn = torch.ones((B, capacity), dtype=u_attn.dtype, device=device)
    attn[:, :Lp] = u_attn[inv]
    if step_fn is not None:
        attn = attention_bias(attn, logits.dtype)
    elif lean and getattr(model.config, "_attn_implementation", None) == "sdpa":
        # A one-token step under SDPA needs only "which keys may I see": hand the model that 4D boolean mask
        # (B, 1, 1, L) directly, which it uses as is, instead of having it rebuilt from the 2D one every step.
        attn = attn.bool()[:, None, None, :]
    next_pos = u_pos[inv, -1:] + 1  # (B, 1)
    # Each sequence's uniforms for every step, from its own generator in one call (a function of its key and
    # max_new_tokens only: chunking never changes a draw).
    uniforms = torch.stack([torch.rand(max_new_tokens, generator=g, device=device, dtype=torch.float64)
                            for g in generators])  # (B, T)
    vocab = logits.shape[-1]
    eos_column = torch.zeros((1, vocab), dtype=torch.bool, device=device).index_fill_(1, eos, True)
    draw = functools.partial(draw_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    filtering = filters(top_k, top_p, vocab)
    if fixed:
        # Fixed shapes (and a CUDA graph on a GPU): no launch per kernel per token, no host value per token.
        # A graph only where the step's rope is a table lookup: position-dependent ropes (dynamic scaling) branch
        # on the sequence length on the host, which a captured graph cannot replay.
        # (the model's device made current: a graph, its stream and Triton's kernels are on the current device)
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            # one kernel per row (fused_decode), where the step's choice of kernels has them
            fused_draw = not filtering and fused_decode.draw_wanted(logits, step_fn.kernels.fused_decode)

            def decode():
                def draw_at(step_logits, t):
                    if fused_draw:
                        return fused_decode.draw(step_logits, uniforms, t, temperature=temperature, eos=eos,
                                                 ban_until=min_new_tokens, block=_SAMPLING_BLOCK)
                    banned = eos_column & (t < min_new_tokens) if min_new_tokens else None  # EOS: no mass to draw
                    return draw(step_logits, uniforms.index_select(1, t).squeeze(1), banned=banned)

                return _decode_fixed(StaticDecode(step_fn, cache.layers, attn, Lp), logits, next_pos, draw_at,
                                     max_new_tokens, pad_id=pad_id, eos=eos,
                                     use_graph=device.type == "cuda" and step_fn.rope_tables is not None)

            try:
                ids, logprobs, steps = decode()
            except Exception as err:  # noqa: BLE001 - only where our fused kernels ran: the same decoding without
                if not (fused_draw or step_fn.fused) or isinstance(err, torch.OutOfMemoryError):
                    raise  # (out of memory: the unfused ops need more, not less)
                # A kernel that cannot compile or run on this GPU must not fail the run: the same decoding with the
                # unfused ops (StaticDecode starts the cache and mask again from the prompts), the kernels off for
                # this process, and a warning that says why. An error of the unfused ops is raised as it is.
                fused_decode.give_up(err)
                fused_draw, step_fn.fused = False, False
                ids, logprobs, steps = decode()
    else:
        ids = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
        logprobs = torch.zeros((B, max_new_tokens), device=device)
        at: slice | torch.Tensor = slice(None)  # the chunk rows still in the batch (all, until the first drop)
        finished = torch.zeros(B, dtype=torch.bool, device=device)
        done = 0  # rows that have ended but are still in the batch
        steps = 0
        cache_arg = cache_argument(model)
        for step in range(max_new_tokens):
            token, chosen = draw(logits, uniforms[:, step], banned=eos_column if step < min_new_tokens else None)
            if done:  # rows that ended earlier emit padding, masked out
                token = torch.where(finished, torch.full_like(token, pad_id), token)
                chosen = chosen.masked_fill(finished, 0.0)
            ids[at, step] = token
            logprobs[at, step] = chosen
            finished = finished | (token == eos_ids[0] if len(eos_ids) == 1 else torch.isin(token, eos))
            steps = step + 1
            if step == max_new_tokens - 1:
                break
            done = int(finished.sum())
            if done == len(finished):
                break
            if lean and 4 * done >= len(finished):  # drop the finished rows (a copy of the cache)
                keep = (~finished).nonzero().squeeze(1)
                at = keep if isinstance(at, slice) else at[keep]
                token, attn, next_pos, finished = token[keep], attn[keep], next_pos[keep], finished[keep]
                uniforms = uniforms[keep]
                cache.batch_select_indices(keep)
                done = 0
            if step_fn is not None:
                logits = step_fn(token, attn[..., : Lp + step + 1], next_pos, cache.layers)
            else:
                out = model(input_ids=token[:, None], attention_mask=attn[..., : Lp + step + 1],
                            position_ids=next_pos, **{cache_arg: cache}, use_cache=True)
                logits = out.logits[:, -1, :]
            if routing is not None:  # the experts of the token just fed back
                completion_routes[at, step] = take(routing)
            next_pos = next_pos + 1
    ids = ids[:, :steps]
    # A position is part of the completion up to and including the first EOS: where no EOS came before it (rows
    # emit padding after theirs, or left the batch with padding in place, whatever pad_id is).
    is_eos = torch.isin(ids, eos)
    alive = (is_eos.cumsum(-1) == is_eos.long()).float()
    if routing is None:
        return ids, alive, logprobs[:, :steps]
    completion_routes = completion_routes[:, :steps].masked_fill_(alive[:, :, None, None] == 0, NO_ROUTE)
    return ids, alive, logprobs[:, :steps], prompt_routes, completion_routes


def draw_tokens(logits_BV: torch.Tensor, uniforms_B: torch.Tensor, *, temperature: float, top_k: int, top_p: float,
                banned: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from the logits at `temperature`, `banned` tokens (a boolean mask broadcast over the
    rows: EOS before min_new_tokens) and top-k/top-p filtered out, drawn with the row's uniform
    (`sample_from_logits`); and its log-prob under the unfiltered policy at that temperature, log
    softmax(logits / temperature)[token], as training computes it. Fixed shapes, no host value: a captured
    graph replays it."""
    scaled = logits_BV.float() / temperature if temperature != 1.0 else logits_BV.float()  # (B, V)
    z = scaled if banned is None else scaled.masked_fill(banned, float("-inf"))
    if filters(top_k, top_p, z.shape[-1]):
        z = filter_logits(z, top_k, top_p)
    token = sample_from_logits(z, uniforms_B)
    return token, torch.log_softmax(scaled, dim=-1).gather(-1, token[:, None]).squeeze(-1)


def _decode_fixed(static: StaticDecode, logits: torch.Tensor, positions: torch.Tensor, draw_at, T: int, *, pad_id: int,
                  eos: torch.Tensor, use_graph: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """`_generate_chunk`'s decoding with fixed shapes: (ids, log-probs, steps taken). One unit per token, the step
    that decodes the last token and the draw of the next (`draw_at(logits, t)`: (tokens, log-probs) of step t),
    with every index a device tensor (the draw's step `t`, the cache's write position, the rows' positions), so
    that on CUDA the whole unit is one captured graph replayed per token (`Replayed`): no kernel launched from
    Python and no host value read per token, but whether every row has ended, asked every _END_CHECK_EVERY tokens.
    Finished rows stay in the batch and draw padding (masked out). The same draws as the growing cache's loop
    (tests/test_lean_decode.py)."""
    B = logits.shape[0]
    device = logits.device
    ids = torch.full((B, T), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((B, T), device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    t = torch.zeros(1, dtype=torch.long, device=device)  # the step whose token is drawn next

    def draw_at_t(step_logits: torch.Tensor) -> None:
        token, chosen = draw_at(step_logits, t)
        token = torch.where(finished, pad_id, token)  # rows that ended earlier emit padding, masked out
        ids.index_copy_(1, t, token[:, None])
        logprobs.index_copy_(1, t, chosen.masked_fill(finished, 0.0)[:, None])
        # (== against each EOS id, not torch.isin: for more tokens than ids isin sorts through torch.unique, which
        # reads a size on the host and cannot be captured)
        finished.logical_or_((token[:, None] == eos).any(-1))
        static.tokens.copy_(token)
        t.add_(1)

    def unit() -> None:  # decode the last token drawn, draw the next
        draw_at_t(static())

    draw_at_t(logits)  # the first token, from the prompts' logits
    static.positions.copy_(positions)
    replay = Replayed(unit, use_graph)
    steps = 1
    while steps < T and (steps % _END_CHECK_EVERY or not bool(finished.all())):
        replay()
        steps += 1
    return ids, logprobs, steps


# With fixed shapes, tokens decoded between two checks of whether every row has ended (see _decode_fixed).
_END_CHECK_EVERY = 8


class _BufferedLayer(DynamicLayer):
    """One decoder layer's keys and values in buffers allocated once with room for every position: `update`
    writes the new positions in place where DynamicLayer concatenates (which copies the whole cache at every
    decoding step). For no-grad decoding only (the writes are in place)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, capacity: int):
        super().__init__()
        b, h, length, d = keys.shape
        self._k = keys.new_empty((b, h, capacity, d))
        self._v = values.new_empty((b, values.shape[1], capacity, values.shape[3]))
        self._k[:, :, :length] = keys
        self._v[:, :, :length] = values
        self.length, self.is_initialized = length, True
        self.dtype, self.device = keys.dtype, keys.device
        self._views()

    def _views(self) -> None:
        self.keys, self.values = self._k.narrow(2, 0, self.length), self._v.narrow(2, 0, self.length)

    def update(self, key_states, value_states, *args, **kwargs):
        n = key_states.shape[-2]
        self._k.narrow(2, self.length, n).copy_(key_states)
        self._v.narrow(2, self.length, n).copy_(value_states)
        self.length += n
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._k, self._v = self._k[indices], self._v[indices]
        self._views()


def _buffered_cache(prefill_cache, rows: torch.Tensor, capacity: int):
    """A DynamicCache whose layers are `_BufferedLayer`s holding the prefill's keys and values of `rows`
    (row i of the new cache is row rows[i] of the prefill: each prompt's cache copied to its samples)."""
    cache = DynamicCache()
    cache.layers = [_BufferedLayer(layer.keys[rows], layer.values[rows], capacity) for layer in prefill_cache.layers]
    cache.layer_class_to_replicate = None
    return cache



"""The training forward: log-probs (and PPO's values) of completion tokens given their prompts, as tensors.

Every pass that reads a completion's log-probs goes through `completion_logprobs`: the no-grad scoring of a
rollout (`tidyrl.rollouts.score_logprobs`), the reference model's, and the policy-gradient update. It takes
the four tensors of a batch of episodes (left-padded prompts, right-padded completions, their masks), so it
knows nothing of rollouts, losses or loops.

When several rows share a prompt (the k samples of a group), the prompt is run once and its keys and values
are copied to its rows: for the declared families (`models.families`) in one lean pass of our own
(`models.lean_forward`, the fast path: `model_fast_paths: false` turns it off), for other models in two passes of
the model's forward
(`_shared_prompt_logits`): the same maths with fewer FLOPs. Which of these a device takes is decided per device
type by measurement (`LAYOUTS`): on CUDA the model's own forward over whole rows, measured faster there, its output
layer applied in chunks by `models.chunked_head` where the model allows (`head_of`): the whole logits are never made;
its decoder layers compiled where the model trains (`models.layer_kernels`); and with `kernels.recompute: true` its
norms and MLP products recomputed in the backward pass (`models.recompute`). Which of these kernels a model runs is
the choice it carries (`models.kernels.kernels_of`).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tidyrl.models import layer_kernels
from tidyrl.models.chunked_head import head_logprobs, head_of, passed_through
from tidyrl.models.devices import to_device
from tidyrl.models.sequences import plain_kv_cache, cache_argument, model_device, returned_cache
from tidyrl.models.kernels import kernels_of
from tidyrl.models.devices import width_padding
from tidyrl.models.lean_forward import distinct_prompts, logits_if_lean
from tidyrl.models.loading import activation_checkpointing_on
from tidyrl.models.ops import gather_logprobs_and_entropy
from tidyrl.models.recompute import cheap_parts_recomputed
from tidyrl.models.routing import Routing, expect
from tidyrl.models.sharding import ddp_inner, is_sharded


def model_inputs(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> dict:
    """Prompt and completion side by side, with the attention mask (see `model_mask`) and positions of the left
    padding; on WIDTH_MULTIPLE's devices left-padded to a multiple of its width."""
    if extra := width_padding(prompt_ids.shape[1] + completion_ids.shape[1], model_device(model)):
        prompt_ids, prompt_mask = F.pad(prompt_ids, (extra, 0)), F.pad(prompt_mask, (extra, 0))
    input_ids, attn, positions = _rows(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    return {"input_ids": input_ids, "attention_mask": model_mask(model, attn, input_ids.shape[1]),
            "position_ids": positions}


def _rows(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """The rows [prompt, completion] on the model's device: ids, their 0/1 mask, and the positions of the left
    padding (cumsum - 1, padding at 0)."""
    device = model_device(model)
    input_ids = to_device(torch.cat([prompt_ids, completion_ids], dim=1), device)
    attn = to_device(torch.cat([prompt_mask, completion_mask.long()], dim=1), device)
    return input_ids, attn, (attn.cumsum(-1) - 1).clamp(min=0)


# Devices where the model builds its attention mask from the (B, L) one itself. Elsewhere (CUDA) transformers'
# mask building reads the padding mask on the host (`_ignore_causal_mask_sdpa` asks whether it is all ones): a
# wait for the device at every forward. There `model_mask` hands the model its finished 4D mask instead, which
# transformers uses as it is.
HOST_MASK_DEVICES = ("cpu",)


def model_mask(model, mask_BL: torch.Tensor, queries: int) -> torch.Tensor:
    """The attention mask to give `model` for its last `queries` positions of keys `mask_BL` (B, L): the 0/1 mask as
    is on HOST_MASK_DEVICES, for attention other than SDPA/eager, or for layouts that are not full attention in
    every layer (sliding windows, chunks: the model's own masks); else the (B, 1, queries, L) mask the model would
    build: causal, keys at padding masked, and a query at padding attending to itself (its output is never read;
    one key keeps it finite), boolean for SDPA, additive (0 / dtype min) for eager attention."""
    inner = ddp_inner(model)
    impl = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    if mask_BL.device.type in HOST_MASK_DEVICES or impl not in ("sdpa", "eager") or not plain_kv_cache(inner):
        return mask_BL
    L = mask_BL.shape[1]
    columns = torch.arange(L, device=mask_BL.device)
    query_columns = columns[L - queries:, None]  # (queries, 1): where each query sits among the keys
    allowed = ((columns <= query_columns) & (mask_BL[:, None, None, :] != 0)) | (columns == query_columns)
    if impl == "sdpa":
        return allowed  # (B, 1, queries, L)
    dtype = next(inner.parameters()).dtype
    return torch.zeros(allowed.shape, dtype=dtype, device=mask_BL.device).masked_fill_(~allowed,
                                                                                        torch.finfo(dtype).min)


# The layouts of the training forward, in the order tried, by device type (DEFAULT_LAYOUTS elsewhere); each later one
# is the fallback where an earlier one does not apply:
#   "lean"     models.lean_forward: declared families, one pass of our own, distinct prompts once (`model_fast_paths`)
#   "shared"   `_shared_prompt_logits`: the model's forward twice, distinct prompts once (rows that share a prompt)
#   "onepass"  the model's forward over [prompt, completion] with logits_to_keep: always applies (layouts listed
#              after it are never tried), and runs where none listed applies
# Chosen per device by measurement (benchmarks/bench_passes.py: each layout's scoring chunk and update micro-batch
# side by side on the device; docs/benchmarking.md, "Which layout on which device"):
# - CPU (and the default): the lean pass, faster there than the model's forward per update micro-batch.
# - CUDA: the model's own forward over whole rows, faster there than the lean and the shared-prompt passes with
#   short prompts: at these sizes the GPU waits on the host's launches, and the model's forward, with fewer and
#   larger kernels, wins over the FLOPs that running each prompt once saves. With long prompts shared by the samples
#   the lean pass wins: a batch that repeats that many prompt tokens takes it first (LEAN_FROM_SHARE).
# `model_fast_paths: false` removes "lean" wherever it is listed, and nothing else.
DEFAULT_LAYOUTS = ("lean", "shared", "onepass")
LAYOUTS: dict[str, tuple[str, ...]] = {"cuda": ("onepass",)}


def layouts_for(device: torch.device | str) -> tuple[str, ...]:
    """The layouts `completion_logits` tries on `device`, in order (see LAYOUTS)."""
    return LAYOUTS.get(torch.device(device).type, DEFAULT_LAYOUTS)


# Devices where a batch whose rows repeat long prompts takes the lean pass first although LAYOUTS does not list it,
# from this share of the rows' columns that are repeated prompt tokens on (the columns running each prompt once
# saves). Measured at two shares (docs/benchmarking.md, "Which layout on which device"), the lean pass's time over the
# one-pass forward's crosses 1 near 18 % when interpolated linearly; 25 % keeps a margin
# (`bench_passes.py --prompt-width N` measures other points).
LEAN_FROM_SHARE: dict[str, float] = {"cuda": 0.25}


def repeated_prompt_share(prompt_ids, prompt_mask, completion_ids) -> float:
    """The share of a batch's columns, B x (Lp + Tc), that are prompt tokens of rows repeating an earlier row's
    prompt (the k samples of a group): what running each distinct prompt once saves."""
    unique, counts = torch.unique(torch.cat([prompt_ids, prompt_mask], dim=1), dim=0, return_counts=True)
    repeated = ((counts - 1) * unique[:, prompt_ids.shape[1]:].sum(1)).sum()
    return float(repeated) / max(prompt_ids.numel() + completion_ids.numel(), 1)


def _layouts_for_batch(device: torch.device, prompt_ids, prompt_mask, completion_ids, fast_path: bool
                       ) -> tuple[str, ...]:
    """The device's layouts, with the lean pass first where the batch repeats enough prompt tokens (LEAN_FROM_SHARE)."""
    layouts = layouts_for(device)
    threshold = LEAN_FROM_SHARE.get(device.type)
    if fast_path and threshold is not None and "lean" not in layouts and \
            repeated_prompt_share(prompt_ids, prompt_mask, completion_ids) >= threshold:
        return ("lean", *layouts)
    return layouts


def _padded_widths(device: torch.device, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """On WIDTH_MULTIPLE's devices, prompts left-padded and completions right-padded to its multiple (the lean
    pass's two widths; masked columns: the same maths, widths that recur)."""
    if extra := width_padding(prompt_ids.shape[1], device):
        prompt_ids, prompt_mask = F.pad(prompt_ids, (extra, 0)), F.pad(prompt_mask, (extra, 0))
    if extra := width_padding(completion_ids.shape[1], device):
        completion_ids, completion_mask = F.pad(completion_ids, (0, extra)), F.pad(completion_mask, (0, extra))
    return prompt_ids, prompt_mask, completion_ids, completion_mask


def completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                      fast_path: bool = True, routing: Optional[Routing] = None) -> torch.Tensor:
    """Logits that predict each completion token: (B, Tc, V). Only Tc + 1 positions are projected.
    `fast_path`: the lean pass for declared families where it applies (`models.lean_forward.can_run`). `routing`:
    see `completion_logprobs`."""
    parts = _completion_logit_parts(model, prompt_ids, prompt_mask, completion_ids, completion_mask, fast_path,
                                    routing)
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=1))[:, :completion_ids.shape[1]]


def _completion_logit_parts(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                            fast_path: bool, routing: Optional[Routing] = None) -> list[torch.Tensor]:
    """`completion_logits` as the passes give it: consecutive (B, t_i, V) column blocks (two for the shared-prompt
    passes, whose concatenation would copy the largest tensor of the pass; `completion_logprobs` reads each),
    possibly one column wider than the completions (the one-pass forward's last position, which predicts nothing:
    slicing it off would cost the backward pass a zero-filled copy of the whole logits)."""
    parts = _lean_or_shared_parts(model, prompt_ids, prompt_mask, completion_ids, completion_mask, fast_path, routing)
    return parts if parts is not None else [_onepass_logits(model, prompt_ids, prompt_mask, completion_ids,
                                                            completion_mask, routing)]


def _onepass_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                    routing: Optional[Routing] = None) -> torch.Tensor:
    """The model's forward over [prompt, completion]: (B, Tc + 1, V), position t predicting completion token t, the
    last one nothing."""
    inputs = model_inputs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    _expect_rows(routing, inputs["input_ids"].shape, prompt_ids.shape[1], completion_ids.shape[1])
    with cheap_parts_recomputed(model):  # (with gradients: norms and MLP products recomputed in backward)
        return _own_forward(model, inputs, completion_ids.shape[1] + 1).logits


def _own_forward(model, inputs: dict, keep: int):
    """The model's own forward over whole rows, its last `keep` positions projected; on CUDA with its decoder layers
    compiled where `models.layer_kernels` applies, and where compiling them fails, with its own layers instead."""
    layer_kernels.prepare(model, exact=_exact(model))
    try:
        return model(**inputs, use_cache=False, logits_to_keep=keep)
    except Exception as err:
        if not layer_kernels.give_up(model, err):
            raise
    return model(**inputs, use_cache=False, logits_to_keep=keep)


EXACT_FORWARD = "_tidyrl_exact_forward"


def exact_forward(model):
    """Mark `model` (a policy, a KL reference, a teacher) for train.exact_gradients: each of its training and
    scoring forwards is then the model's own one pass with its own output layer, which is what runs under FSDP2
    (it takes neither the lean nor the shared-prompt pass, nor the chunked output layer), on one process, under
    DDP and under FSDP2 alike: the same sums in the same order on any split. Returns `model`."""
    setattr(ddp_inner(model), EXACT_FORWARD, True)
    return model


def _exact(model) -> bool:
    return getattr(ddp_inner(model), EXACT_FORWARD, False)


def _lean_or_shared_parts(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                          fast_path: bool, routing: Optional[Routing] = None) -> Optional[list[torch.Tensor]]:
    """The logits of the first layout in the device's order (LAYOUTS; the lean pass first for long repeated
    prompts) that applies, when it is the lean or the shared-prompt pass; None where the one-pass forward is next
    (always for a model marked by `exact_forward`)."""
    if _exact(model):
        return None
    tc, device = completion_ids.shape[1], model_device(model)
    for layout in _layouts_for_batch(device, prompt_ids, prompt_mask, completion_ids, fast_path):
        if layout == "lean" and fast_path:
            padded = _padded_widths(device, prompt_ids, prompt_mask, completion_ids, completion_mask)
            if routing is not None:
                _expect_lean(routing, padded, prompt_ids.shape[1], completion_ids.shape[1])
            lean = logits_if_lean(model, *padded)
            if lean is not None:
                return [lean]  # (possibly wider than tc: the padding's columns are read with token 0 and dropped)
        elif layout == "shared" and tc > 1:
            shared = _shared_prompt_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, routing)
            if shared is not None:
                return shared
        elif layout == "onepass":
            break
    return None


def _onepass_hidden(model, head, prompt_ids, prompt_mask, completion_ids, completion_mask,
                    routing: Optional[Routing] = None) -> torch.Tensor:
    """The one-pass forward's last hidden states at the positions that predict the completion tokens (B, Tc, H):
    the causal LM's own forward over [prompt, completion] (through DDP where it runs inside it), its output layer
    `head` passing its input through."""
    inputs = model_inputs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    _expect_rows(routing, inputs["input_ids"].shape, prompt_ids.shape[1], completion_ids.shape[1])
    tc = completion_ids.shape[1]
    # (with gradients: norms and MLP products recomputed in backward)
    with cheap_parts_recomputed(model), passed_through(head):
        hidden = _own_forward(model, inputs, tc + 1).logits  # (B, Tc + 1, H)
    return hidden[:, :tc]


def _shared_prompt_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask,
                          routing: Optional[Routing] = None) -> Optional[list[torch.Tensor]]:
    """`completion_logits` in two passes: the U distinct prompts once (U, Lp), then the B completions
    (B, Tc - 1) on the prompts' keys and values indexed per row. Gradients flow through that index into the
    shared prompt pass, where backward sums them: the gradient of a prompt's k copies. Returns the logits of
    the first completion token (B, 1, V) and of the rest (B, Tc - 1, V). None when it would not help (every
    prompt distinct) or cannot be used (see `_can_share_prompts`)."""
    unique, inverse = distinct_prompts(prompt_ids, prompt_mask)
    if len(unique) == len(prompt_ids) or not _can_share_prompts(model):
        return None
    device = model_device(model)
    lp = prompt_ids.shape[1]
    if routing is not None:  # the prompts' pass, then the completions' but their last token
        width = lp + completion_ids.shape[1]
        columns = torch.arange(width)
        p_index, p_counts = _once_run_prompts(inverse, len(unique), width, columns[:lp])
        c_index = torch.arange(len(prompt_ids))[:, None] * width + columns[None, lp:-1]
        expect(routing, [p_index, c_index.reshape(-1)], [p_counts, torch.ones(c_index.numel())])
    u_ids, u_mask = to_device(unique[:, :lp], device), to_device(unique[:, lp:], device)
    u_pos = (u_mask.cumsum(-1) - 1).clamp(min=0)
    # The prompt pass runs the module inside DDP, so that every process makes exactly one DDP forward per
    # micro-batch, shared prompts or not (DDP syncs buffers at each forward: unequal counts would deadlock).
    # Its gradients still reach the parameters, whose DDP hooks fire once per backward with the summed grad.
    inner = ddp_inner(model)
    prompt = inner(input_ids=u_ids, attention_mask=model_mask(inner, u_mask, lp), position_ids=u_pos, use_cache=True,
                   logits_to_keep=1)
    inverse = to_device(inverse, device)
    cache = returned_cache(prompt)
    for layer in cache.layers:  # (U, ...) -> (B, ...); index_select's backward (index_add) sums the k copies
        layer.keys, layer.values = layer.keys.index_select(0, inverse), layer.values.index_select(0, inverse)
    # the full rows' mask and positions, as in the one-pass forward (the last completion token predicts nothing)
    ids, attn, positions = _rows(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    attn = attn[:, :-1]
    rest = model(input_ids=ids[:, lp:-1], attention_mask=model_mask(model, attn, attn.shape[1] - lp),
                 position_ids=positions[:, lp:-1], **{cache_argument(inner): cache}, use_cache=True).logits
    return [prompt.logits[:, -1:].index_select(0, inverse), rest]  # (B, 1, V), (B, Tc - 1, V)


def _can_share_prompts(model) -> bool:
    """Two forward passes on one graph are safe on a plain model or under DDP, with a plain key/value cache
    and without gradient checkpointing (which drops the cache in training). FSDP, DeepSpeed and other
    wrappers get the one-pass forward."""
    from transformers import PreTrainedModel

    inner = ddp_inner(model)
    if not isinstance(inner, PreTrainedModel):
        return False
    if activation_checkpointing_on(inner):
        return False
    if is_sharded(inner):  # FSDP2 shards the parameters in place
        return False
    return plain_kv_cache(inner)


def _once_run_prompts(inverse: torch.Tensor, distinct: int, width: int, at: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct prompts run once, their columns `at` (-1: padding of the pass's own), among the rows
    [prompt, completion] of `width`: each token's index there, its prompt's first row's (whose routes it replays:
    the k rows of a group share the prompt and, from one sampler's prefill, its routes), and how many rows it stands
    for; both flattened (distinct x len(at))."""
    inverse = inverse.cpu()
    rows = torch.arange(len(inverse))
    first = torch.full((distinct,), len(inverse), dtype=torch.long).scatter_reduce(0, inverse, rows, "amin")
    index = torch.where(at >= 0, first[:, None] * width + at[None, :], -1)
    counts = torch.bincount(inverse, minlength=distinct)[:, None].expand(index.shape)
    return index.reshape(-1), counts.reshape(-1)


def _expect_rows(routing: Optional[Routing], shape, prompt: int, completion: int) -> None:
    """The one-pass forward over (rows, columns): the rows [prompt, completion], left-padded by columns - prompt -
    completion (WIDTH_MULTIPLE's padding: no route)."""
    if routing is None:
        return
    rows, columns = shape
    left, width = columns - prompt - completion, prompt + completion
    at = torch.arange(columns) - left
    index = torch.where(at >= 0, torch.arange(rows)[:, None] * width + at[None, :], -1)
    expect(routing, [index.reshape(-1)])


def _expect_lean(routing: Routing, padded, prompt: int, completion: int) -> None:
    """The lean pass's one call: the distinct prompts' tokens (U x Lp'), then every row's completion tokens but the
    last column (B x (Tc' - 1)), of prompts left-padded and completions right-padded to Lp' and Tc'
    (`_padded_widths`)."""
    prompt_ids, prompt_mask, completion_ids, _ = padded
    left, right = prompt_ids.shape[1] - prompt, completion_ids.shape[1] - completion
    width = prompt + completion
    unique, inverse = distinct_prompts(prompt_ids, prompt_mask)
    p_index, p_counts = _once_run_prompts(inverse, len(unique), width, torch.arange(prompt_ids.shape[1]) - left)
    c_at = torch.arange(completion + right - 1)
    c_index = torch.where(c_at < completion, torch.arange(len(inverse))[:, None] * width + prompt + c_at[None, :], -1)
    expect(routing, [torch.cat([p_index, c_index.reshape(-1)])], [torch.cat([p_counts, torch.ones(c_index.numel())])])


def completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask, temperature: float,
                        with_entropy: bool = False, fast_path: bool = True, routing: Optional[Routing] = None
                        ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (B, Tc) of the completion tokens under `model` at `temperature`, and optionally the
    per-token entropy (computed without grad). Gradients flow when called outside no_grad. `fast_path`: see
    `completion_logits`; off, also the model's own output layer (whole logits), not `models.chunked_head` (always
    off for a model marked by `exact_forward`). `routing`: the `models.routing.routed` state of a mixture of
    experts, its routes (if any) over the rows [prompt, completion] (B, Lp + Tc, layers, k): each pass tells it where
    its forward calls' tokens sit among those rows (`routing.expect`), so that every token replays its own route
    whatever the layout, and what was chosen can be read back per call."""
    fast_path = fast_path and not _exact(model)
    if routing is not None and routing.routes is not None and \
            tuple(routing.routes.shape[:2]) != (len(prompt_ids), prompt_ids.shape[1] + completion_ids.shape[1]):
        raise ValueError(f"routes over {tuple(routing.routes.shape[:2])} rows x positions for a batch of "
                         f"{len(prompt_ids)} rows of {prompt_ids.shape[1]} + {completion_ids.shape[1]} positions")
    parts = _lean_or_shared_parts(model, prompt_ids, prompt_mask, completion_ids, completion_mask, fast_path, routing)
    # the one-pass forward, its output layer in chunks (not with `fast_path` off: the model's own output layer)
    if parts is None and fast_path and (head := head_of(model)) is not None:
        hidden = _onepass_hidden(model, head, prompt_ids, prompt_mask, completion_ids, completion_mask, routing)
        return head_logprobs(hidden, head.weight, to_device(completion_ids, hidden.device), temperature,
                             with_entropy, fused=kernels_of(model).fused_logprobs)
    if parts is None:
        parts = [_onepass_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask, routing)]
    tc, widths = completion_ids.shape[1], [p.shape[1] for p in parts]
    # A column that predicts nothing is read with token 0 and dropped: per-position maths, the same numbers.
    ids = F.pad(to_device(completion_ids, parts[0].device), (0, sum(widths) - tc)).split(widths, dim=1)
    logprobs, entropy, fused = [], [], kernels_of(model).fused_logprobs
    for logits, part_ids in zip(parts, ids):  # per column block: the same numbers as on their concatenation
        if temperature != 1.0:  # (x / 1.0 is x: skip a copy of the largest tensor of the pass)
            logits = logits / temperature
        # entropy without grad; a low-precision row is upcast once for both (tidyrl.models.ops)
        part = gather_logprobs_and_entropy(logits, part_ids, with_entropy, fused=fused)
        logprobs.append(part[0])
        entropy.append(part[1])
    return torch.cat(logprobs, dim=1)[:, :tc], torch.cat(entropy, dim=1)[:, :tc] if with_entropy else None


def completion_values(critic, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
    """PPO values (B, Tc): V of the state before completion token t, read at the position that predicts
    it (the same alignment as the log-probs). `critic` is a token classifier with one label."""
    tc = completion_ids.shape[1]
    inputs = model_inputs(critic, prompt_ids, prompt_mask, completion_ids, completion_mask)
    values = critic(**inputs).logits[..., 0]  # (B, Lp + Tc)
    return values[:, -tc - 1: -1]

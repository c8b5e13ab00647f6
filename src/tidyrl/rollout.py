"""Generation and no-grad scoring (DESIGN §3, steps 2–3).

Generation is our own lean decode loop over the Hugging Face model and its KV
cache, rather than `model.generate`, for one reason: sampling must be keyed per
(seed, rollout, sample index) so that chunk sizes and process counts never
change the completions. Each sequence owns a `torch.Generator` seeded from its
key and draws one uniform vector per decoding step; a token is drawn by the
Gumbel-max trick (argmax of logits + Gumbel noise is an exact sample of the
softmax; Gumbel 1954, Maddison et al. 2014), so a sequence's draws never
depend on which other sequences share its chunk.

What makes it fast, none of which changes a draw or the maths (docs/benchmarks.md
has the profiles and figures):
- the k samples of a prompt share one prompt pass: generation prefills each
  distinct prompt once and copies its keys/values to its samples, and scoring
  and training run a micro-batch's distinct prompts once, then the completions
  on their keys/values (`_shared_prompt_logits`; gradients sum over the copies);
- keys and values are written into buffers allocated once (`_BufferedLayer`)
  instead of concatenated at every step, which copies the whole cache each time;
- Llama-layout models decode with our own one-token step (`tidyrl.llama_decode`: the same maths as their
  forward without its per-call overhead); other models get their 4D attention mask ready-made;
- each sequence draws its sampling noise for many steps at once (on CPU the same numbers as one draw per
  step; on any device a function of the sample's key, V and max_new_tokens only, never of the chunking);
- finished rows leave the decoding batch;
- the sampling pass returns each token's log-prob, which are the old log-probs
  of the ratio: no separate scoring pass of the policy.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Iterator, Optional, Sequence

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers.cache_utils import DynamicCache, DynamicLayer

from tidyrl.llama_decode import attention_bias, decode_step_for
from tidyrl.llama_forward import logits_if_lean
from tidyrl.loops.common import activation_checkpointing_on
from tidyrl.ops import entropy_from_logits, gather_logprobs
from tidyrl.sharding import is_sharded


@dataclass
class Rollout:
    """One rollout's episodes, R of them (per process: R / W), prompt-major:
    episode p*k + j is sample j of prompt p.

    Shapes: R episodes, Lp = longest prompt, Tc = longest completion.
    """

    prompt_ids: torch.Tensor  # (R, Lp) long, left-padded
    prompt_mask: torch.Tensor  # (R, Lp) long, 1 = real token
    completion_ids: torch.Tensor  # (R, Tc) long, right-padded
    completion_mask: torch.Tensor  # (R, Tc) float, 1 up to and including EOS
    truncated: torch.Tensor  # (R,) bool, reached max_new_tokens without EOS
    old_logprobs: Optional[torch.Tensor] = None  # (R, Tc) policy before the updates; None when E*M == 1
    ref_logprobs: Optional[torch.Tensor] = None  # (R, Tc) frozen reference; None when no KL term
    advantages: Optional[torch.Tensor] = None  # (R,) or (R, Tc)
    old_values: Optional[torch.Tensor] = None  # (R, Tc) PPO: the critic's values before the updates
    returns: Optional[torch.Tensor] = None  # (R, Tc) PPO: GAE returns, the critic's targets
    action_mask: Optional[torch.Tensor] = None  # (R, Tc) multi-turn: 1 = the model's token, 0 = the environment's
    is_weights: Optional[torch.Tensor] = None  # (R, Tc) truncated importance weights min(pi_trainer/pi_sampler, cap)
    sampler_logprobs: Optional[torch.Tensor] = None  # (R, Tc) the engine's, when the weights are taken in the update

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def select(self, idx: Sequence[int] | torch.Tensor) -> "Rollout":
        """The episodes `idx`, with padding columns that none of them use trimmed away."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        pm = self.prompt_mask[idx]
        cm = self.completion_mask[idx]
        first = int((pm.sum(0) > 0).nonzero()[0]) if pm.numel() else 0  # left padding shared by all
        width = int(cm.sum(1).max().item()) if cm.numel() else 0
        width = max(width, 1)

        def cut(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if t is None:
                return None
            t = t[idx]
            return t[:, :width] if t.dim() == 2 else t

        return Rollout(
            prompt_ids=self.prompt_ids[idx][:, first:],
            prompt_mask=pm[:, first:],
            completion_ids=cut(self.completion_ids),
            completion_mask=cut(self.completion_mask),
            truncated=self.truncated[idx],
            old_logprobs=cut(self.old_logprobs),
            ref_logprobs=cut(self.ref_logprobs),
            advantages=cut(self.advantages),
            old_values=cut(self.old_values),
            returns=cut(self.returns),
            action_mask=cut(self.action_mask),
            is_weights=cut(self.is_weights),
            sampler_logprobs=cut(self.sampler_logprobs),
        )


def eos_token_ids(model, tokenizer) -> list[int]:
    """Every EOS id of the generation config and the tokenizer (models often list several)."""
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for source in (gen_eos, tokenizer.eos_token_id):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else list(source))
    if not ids:
        raise ValueError(
            "The model's generation config and the tokenizer define no EOS token: completions could never end. "
            "Set `eos_token_id` in the model's generation_config.json or the tokenizer's eos_token."
        )
    return sorted(ids)


def pad_token_id(tokenizer, eos_ids: Sequence[int]) -> int:
    """Padding filler. Padded positions are masked out everywhere, so EOS serves when there is no pad token."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else int(eos_ids[0])


def sample_seed(seed: int, rollout: int, sample_index: int) -> int:
    """A 63-bit generator seed for one sequence, keyed by (seed, rollout, global sample index)."""
    digest = hashlib.blake2b(f"tidyrl:{seed}:{rollout}:{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, L) ids and mask, padded on the left so that every sequence ends at the last column."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s):] = torch.as_tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


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
    use_lean_step: bool = True,
) -> tuple[torch.Tensor, ...]:
    """Sample one completion per prompt, in chunks of `batch_size`.

    `sample_keys[i]` seeds prompt i's sampler (see `sample_seed`). Returns
    (completion_ids (B, max_new_tokens) right-padded with pad_id,
    completion_mask (B, max_new_tokens) float, 1 up to and including EOS,
    truncated (B,) bool), and with `return_logprobs` a fourth tensor (B, max_new_tokens): the log-probability
    of each sampled token under the sampling model at `temperature`, before top-k/top-p filtering and the
    min_new_tokens ban (what `score_logprobs` computes with the same weights, up to float rounding), 0 past
    EOS. These are the old log-probs of PPO-style ratios, without a second forward pass.

    `use_lean_step`: decode Llama-layout models with `tidyrl.llama_decode` (the same maths as the model's
    forward, without its per-call overhead); False always calls the model's own forward.
    """
    assert len(prompts) == len(sample_keys)
    ids = torch.full((len(prompts), max_new_tokens), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), max_new_tokens))
    logprobs = torch.zeros((len(prompts), max_new_tokens))
    for start in range(0, len(prompts), batch_size):
        chunk = slice(start, start + batch_size)
        with torch.inference_mode():  # less bookkeeping per op than no_grad; only our copies leave the block
            c_ids, c_mask, c_logprobs = _generate_chunk(
                model, prompts[chunk], sample_keys[chunk], max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                pad_id=pad_id, min_new_tokens=min_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
                use_lean_step=use_lean_step,
            )
        ids[chunk, : c_ids.shape[1]] = c_ids.cpu()
        mask[chunk, : c_mask.shape[1]] = c_mask.cpu()
        logprobs[chunk, : c_logprobs.shape[1]] = c_logprobs.cpu()
    ended = (ids.unsqueeze(-1) == torch.as_tensor(list(eos_ids))).any(-1) & (mask > 0)
    truncated = ~ended.any(-1)
    return (ids, mask, truncated, logprobs) if return_logprobs else (ids, mask, truncated)


def _generate_chunk(model, prompts, keys, *, max_new_tokens, eos_ids, pad_id, min_new_tokens, temperature,
                    top_p, top_k, use_lean_step=True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode one chunk: (ids, mask, log-probs of the sampled tokens), each (B, steps taken). Where the model's cache is a plain per-layer key/value cache (most decoder LMs), three
    things make it lean without changing any draw: each distinct prompt is prefilled once and its cache copied
    to its samples (GRPO/RLOO chunks hold k samples of each prompt); keys and values are written into buffers
    allocated once instead of being concatenated (which copies the whole cache at every step); and finished
    rows are dropped from the batch once they are a quarter of it."""
    device = model_device(model)
    B = len(prompts)
    eos = torch.as_tensor(list(eos_ids), device=device)
    generators = [torch.Generator(device=device).manual_seed(k) for k in keys]
    lean = _plain_kv_cache(model)
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
    # Llama layouts get our own prefill and decode step (tidyrl.llama_decode), which takes the mask as an
    # additive bias.
    step_fn = decode_step_for(model, Lp + max_new_tokens) if lean and use_lean_step else None
    if step_fn is not None:
        empty = torch.empty((len(unique), step_fn.n_kv, 0, step_fn.head_dim), dtype=step_fn.embed.dtype,
                            device=device)
        prefill_cache = SimpleNamespace(layers=[_BufferedLayer(empty, empty, Lp) for _ in step_fn.layers])
        u_logits = step_fn.prefill(u_ids, u_attn, u_pos, prefill_cache.layers)
    else:
        out = model(input_ids=u_ids, attention_mask=u_attn, position_ids=u_pos, use_cache=True, logits_to_keep=1)
        u_logits, prefill_cache = out.logits[:, -1, :], out.past_key_values
    logits = u_logits[inv]  # (B, V)
    cache = _buffered_cache(prefill_cache, inv, Lp + max_new_tokens) if lean else prefill_cache
    attn = torch.ones((B, Lp + max_new_tokens), dtype=u_attn.dtype, device=device)
    attn[:, :Lp] = u_attn[inv]
    if step_fn is not None:
        attn = attention_bias(attn, logits.dtype)
    elif lean and getattr(model.config, "_attn_implementation", None) == "sdpa":
        # A one-token step under SDPA needs only "which keys may I see": hand the model that 4D boolean mask
        # (B, 1, 1, L) directly, which it uses as is, instead of having it rebuilt from the 2D one every step.
        attn = attn.bool()[:, None, None, :]
    next_pos = u_pos[inv, -1:] + 1  # (B, 1)

    ids = torch.full((B, max_new_tokens), pad_id, dtype=torch.long, device=device)
    logprobs = torch.zeros((B, max_new_tokens), device=device)
    at: slice | torch.Tensor = slice(None)  # the chunk rows still in the batch (all, until the first drop)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    done = 0  # rows that have ended but are still in the batch
    vocab, steps = logits.shape[-1], 0
    # Each sequence draws its uniforms from its own generator, `block` steps at a time (block depends on V and
    # max_new_tokens only, so chunking never changes a draw): on CPU (block, V) at once is the same stream as
    # `block` draws of V. The Gumbel noise of a block is computed in one go.
    block = max(1, min(max_new_tokens, _UNIFORMS_PER_DRAW // vocab))
    filtering = bool(top_k and top_k < vocab) or top_p < 1.0
    for step in range(max_new_tokens):
        if step % block == 0:
            u = torch.stack([torch.rand((block, vocab), generator=g, device=device) for g in generators])
            gumbel_BSV = -torch.log(-torch.log(u.clamp_min(torch.finfo(u.dtype).tiny)))  # (b, block, V)
            if not filtering and step < min_new_tokens:
                # The EOS ban, for the block's steps before min_new_tokens, in the noise: the same argmax as
                # banning in the logits, since -inf + anything finite is -inf; one write per block, not per step.
                gumbel_BSV[:, : min_new_tokens - step, eos] = float("-inf")
        gumbel = gumbel_BSV[:, step % block]  # (b, V)
        scaled = logits.float() / temperature if temperature != 1.0 else logits.float()  # (b, V)
        if filtering:
            z = scaled.clone() if step < min_new_tokens else scaled
            if step < min_new_tokens:
                z[:, eos] = float("-inf")
            noisy = filter_logits(z, top_k, top_p) + gumbel
        else:
            noisy = scaled + gumbel
        token = torch.argmax(noisy, dim=-1)
        # log softmax(scaled)[token]: the unfiltered policy, as in training.
        chosen = torch.log_softmax(scaled, dim=-1).gather(-1, token[:, None]).squeeze(-1)
        if done:  # rows that ended earlier emit padding, masked out
            token = torch.where(finished, torch.full_like(token, pad_id), token)
            chosen = chosen.masked_fill(finished, 0.0)
        ids[at, step] = token
        logprobs[at, step] = chosen
        finished = finished | (token == eos_ids[0] if len(eos_ids) == 1 else torch.isin(token, eos))
        steps = step + 1
        if step == max_new_tokens - 1:
            break
        done = int(finished.sum())  # one host sync per step, as any EOS check needs
        if done == len(finished):
            break
        if lean and 4 * done >= len(finished):  # drop the finished rows (a copy of the cache: not for each one)
            keep = (~finished).nonzero().squeeze(1)
            at = keep if isinstance(at, slice) else at[keep]
            token, attn, next_pos, finished = token[keep], attn[keep], next_pos[keep], finished[keep]
            generators = [generators[i] for i in keep.tolist()]
            gumbel_BSV = gumbel_BSV[keep]
            cache.batch_select_indices(keep)
            done = 0
        if step_fn is not None:
            logits = step_fn(token, attn[..., : Lp + step + 1], next_pos, cache.layers)
        else:
            out = model(input_ids=token[:, None], attention_mask=attn[..., : Lp + step + 1], position_ids=next_pos,
                        past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1, :]
        next_pos = next_pos + 1
    ids = ids[:, :steps]
    # A position is part of the completion up to and including the first EOS: where no EOS came before it (rows
    # emit padding after theirs, or left the batch with padding in place, whatever pad_id is).
    is_eos = torch.isin(ids, eos)
    alive = (is_eos.cumsum(-1) == is_eos.long()).float()
    return ids, alive, logprobs[:, :steps]


# Uniforms one sequence draws at once (its next `block` steps of V each; one step when V is larger).
_UNIFORMS_PER_DRAW = 2**16


def _plain_kv_cache(model) -> bool:
    """True when the model's cache is one plain growing key/value layer per decoder layer (Llama, Qwen,
    Mistral without sliding windows, ...): then prompts can be shared and keys buffered. Sliding-window,
    linear-attention and other special caches keep the model's own cache and one prefill per row."""
    config = getattr(model, "config", None)
    if config is None:
        return False
    try:
        cache = DynamicCache(config=config)
    except Exception:  # a config the cache cannot read: use the model's own
        return False
    return all(type(layer) is DynamicLayer for layer in cache.layers)


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


def _model_inputs(model, batch: Rollout) -> dict:
    """Prompt and completion side by side, with the attention mask and positions of the left padding."""
    device = model_device(model)
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1).to(device)
    attn = torch.cat([batch.prompt_mask, batch.completion_mask.long()], dim=1).to(device)
    return {"input_ids": input_ids, "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0)}


def _forward_logits(model, batch: Rollout, use_lean_pass: bool = True) -> torch.Tensor:
    """Logits that predict each completion token: (B, Tc, V). Only Tc + 1 positions are projected.

    When several rows share a prompt (the k samples of a group), the prompt is run once and its keys and
    values are copied to its rows: for Llama layouts in one lean pass of our own (`tidyrl.llama_forward`,
    unless `use_lean_pass` is False), for other models in two passes of the model's forward
    (`_shared_prompt_logits`): the same maths with fewer FLOPs."""
    tc = batch.completion_ids.shape[1]
    if use_lean_pass:
        lean = logits_if_lean(model, batch.prompt_ids, batch.prompt_mask, batch.completion_ids,
                              batch.completion_mask)
        if lean is not None:
            return lean
    shared = _shared_prompt_logits(model, batch) if tc > 1 else None
    if shared is not None:
        return shared
    logits = model(**_model_inputs(model, batch), use_cache=False, logits_to_keep=tc + 1).logits
    return logits[:, :-1, :]  # (B, Tc, V): position t predicts completion token t


def _shared_prompt_logits(model, batch: Rollout) -> Optional[torch.Tensor]:
    """`_forward_logits` in two passes: the U distinct prompts once (U, Lp), then the B completions
    (B, Tc - 1) on the prompts' keys and values indexed per row. Gradients flow through that index into the
    shared prompt pass, where backward sums them: the gradient of a prompt's k copies. None when it would not
    help (every prompt distinct) or cannot be used (see `_can_share_prompts`)."""
    rows = torch.cat([batch.prompt_ids, batch.prompt_mask], dim=1)  # a prompt is its ids and its padding
    unique, inverse = torch.unique(rows, dim=0, return_inverse=True)
    if len(unique) == len(rows) or not _can_share_prompts(model):
        return None
    device = model_device(model)
    lp = batch.prompt_ids.shape[1]
    u_ids, u_mask = unique[:, :lp].to(device), unique[:, lp:].to(device)
    u_pos = (u_mask.cumsum(-1) - 1).clamp(min=0)
    # The prompt pass runs the module inside DDP, so that every process makes exactly one DDP forward per
    # micro-batch, shared prompts or not (DDP syncs buffers at each forward: unequal counts would deadlock).
    # Its gradients still reach the parameters, whose DDP hooks fire once per backward with the summed grad.
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    prompt = inner(input_ids=u_ids, attention_mask=u_mask, position_ids=u_pos, use_cache=True, logits_to_keep=1)
    inverse = inverse.to(device)
    cache = prompt.past_key_values
    for layer in cache.layers:  # (U, ...) -> (B, ...); index_select's backward (index_add) sums the k copies
        layer.keys, layer.values = layer.keys.index_select(0, inverse), layer.values.index_select(0, inverse)
    inputs = _model_inputs(model, batch)  # the full rows' mask and positions, as in the one-pass forward
    rest = model(input_ids=inputs["input_ids"][:, lp:-1], attention_mask=inputs["attention_mask"][:, :-1],
                 position_ids=inputs["position_ids"][:, lp:-1], past_key_values=cache, use_cache=True).logits
    return torch.cat([prompt.logits[:, -1:].index_select(0, inverse), rest], dim=1)  # (B, Tc, V)


def _can_share_prompts(model) -> bool:
    """Two forward passes on one graph are safe on a plain model or under DDP, with a plain key/value cache
    and without gradient checkpointing (which drops the cache in training). FSDP, DeepSpeed and other
    wrappers get the one-pass forward."""
    from transformers import PreTrainedModel

    inner = model.module if isinstance(model, DistributedDataParallel) else model
    if not isinstance(inner, PreTrainedModel):
        return False
    if activation_checkpointing_on(inner):
        return False
    if is_sharded(inner):  # FSDP2 shards the parameters in place
        return False
    return _plain_kv_cache(inner)


def completion_values(critic, batch: Rollout) -> torch.Tensor:
    """PPO values (B, Tc): V of the state before completion token t, read at the position that predicts
    it (the same alignment as the log-probs). `critic` is a token classifier with one label."""
    tc = batch.completion_ids.shape[1]
    values = critic(**_model_inputs(critic, batch)).logits[..., 0]  # (B, Lp + Tc)
    return values[:, -tc - 1: -1]


@torch.no_grad()
def score_values(critic, rollout: Rollout, chunk_size: int) -> torch.Tensor:
    """No-grad values (R, Tc) in chunks of `chunk_size`; positions past EOS are 0."""
    out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32)
    for idx in chunks(range(len(rollout)), chunk_size):
        part = rollout.select(idx)
        v = completion_values(critic, part)
        out[idx[0]: idx[-1] + 1, : v.shape[1]] = v.float().cpu() * part.completion_mask
    return out


def completion_logprobs(model, batch: Rollout, temperature: float, with_entropy: bool = False,
                        use_lean_pass: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (B, Tc) of the completion tokens under `model` at `temperature`, and optionally the
    per-token entropy (computed without grad). Gradients flow when called outside no_grad. `use_lean_pass`:
    see `_forward_logits`."""
    logits = _forward_logits(model, batch, use_lean_pass)  # (B, Tc, V)
    if temperature != 1.0:  # (x / 1.0 is x: skip a copy of the largest tensor of the pass)
        logits = logits / temperature
    ids = batch.completion_ids.to(logits.device)
    logprobs = gather_logprobs(logits, ids)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits)
    return logprobs, entropy


@torch.no_grad()
def score_logprobs(model, rollout: Rollout, temperature: float, chunk_size: int) -> torch.Tensor:
    """No-grad log-probs (R, Tc) of every completion token, in chunks of `chunk_size`, so that at most one
    chunk's (chunk, Tc, V) logits exist at a time. Positions past EOS are 0."""
    out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32)
    for idx in chunks(range(len(rollout)), chunk_size):
        part = rollout.select(idx)
        lp, _ = completion_logprobs(model, part, temperature)
        out[idx[0]: idx[-1] + 1, : lp.shape[1]] = lp.float().cpu() * part.completion_mask
    return out


def model_device(model) -> torch.device:
    """The device of a model, also when it is wrapped (DDP has no `.device`)."""
    return next(model.parameters()).device


def chunks(seq: Sequence[int], size: int) -> Iterator[list[int]]:
    seq = list(seq)
    for start in range(0, len(seq), size):
        yield seq[start: start + size]

"""Generation and no-grad scoring (DESIGN §3, steps 2–3).

Generation is our own lean decode loop over the Hugging Face model and its KV
cache, rather than `model.generate`, for one reason: sampling must be keyed per
(seed, rollout, sample index) so that chunk sizes and process counts never
change the completions. Each sequence owns a `torch.Generator` seeded from its
key and draws one uniform vector per decoding step; a token is drawn by the
Gumbel-max trick (argmax of logits + Gumbel noise is an exact sample of the
softmax; Gumbel 1954, Maddison et al. 2014), so a sequence's draws never
depend on which other sequences share its chunk.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from tidyrl.ops import entropy_from_logits, gather_logprobs


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample one completion per prompt, in chunks of `batch_size`.

    `sample_keys[i]` seeds prompt i's sampler (see `sample_seed`). Returns
    (completion_ids (B, max_new_tokens) right-padded with pad_id,
    completion_mask (B, max_new_tokens) float, 1 up to and including EOS,
    truncated (B,) bool).
    """
    assert len(prompts) == len(sample_keys)
    ids = torch.full((len(prompts), max_new_tokens), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), max_new_tokens))
    for start in range(0, len(prompts), batch_size):
        chunk = slice(start, start + batch_size)
        c_ids, c_mask = _generate_chunk(
            model, prompts[chunk], sample_keys[chunk], max_new_tokens=max_new_tokens, eos_ids=eos_ids,
            pad_id=pad_id, min_new_tokens=min_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        )
        ids[chunk, : c_ids.shape[1]] = c_ids.cpu()
        mask[chunk, : c_mask.shape[1]] = c_mask.cpu()
    ended = (ids.unsqueeze(-1) == torch.as_tensor(list(eos_ids))).any(-1) & (mask > 0)
    truncated = ~ended.any(-1)
    return ids, mask, truncated


def _generate_chunk(model, prompts, keys, *, max_new_tokens, eos_ids, pad_id, min_new_tokens, temperature,
                    top_p, top_k) -> tuple[torch.Tensor, torch.Tensor]:
    device = model_device(model)
    input_ids, attn = left_pad(prompts, pad_id)
    input_ids, attn = input_ids.to(device), attn.to(device)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    generators = [torch.Generator(device=device).manual_seed(k) for k in keys]
    eos = torch.as_tensor(list(eos_ids), device=device)
    B = len(prompts)

    out = model(input_ids=input_ids, attention_mask=attn, position_ids=positions, use_cache=True, logits_to_keep=1)
    cache, logits = out.past_key_values, out.logits[:, -1, :]
    vocab = logits.shape[-1]
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    tokens, alive = [], []
    next_pos = positions[:, -1:] + 1
    for step in range(max_new_tokens):
        z = logits.float() / temperature  # (B, V)
        if step < min_new_tokens:
            z[:, eos] = float("-inf")
        z = filter_logits(z, top_k, top_p)
        # One uniform vector per sequence from its own generator: draws independent of chunking.
        u = torch.stack([torch.rand(vocab, generator=g, device=device) for g in generators])
        gumbel = -torch.log(-torch.log(u.clamp_min(torch.finfo(u.dtype).tiny)))
        token = torch.argmax(z + gumbel, dim=-1)
        alive.append(~finished)
        token = torch.where(finished, torch.full_like(token, pad_id), token)
        tokens.append(token)
        finished = finished | torch.isin(token, eos)
        if bool(finished.all()) or step == max_new_tokens - 1:
            break
        attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=device)], dim=1)
        out = model(input_ids=token[:, None], attention_mask=attn, position_ids=next_pos, past_key_values=cache,
                    use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1, :]
        next_pos = next_pos + 1
    return torch.stack(tokens, 1), torch.stack(alive, 1).float()


def _model_inputs(model, batch: Rollout) -> dict:
    """Prompt and completion side by side, with the attention mask and positions of the left padding."""
    device = model_device(model)
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1).to(device)
    attn = torch.cat([batch.prompt_mask, batch.completion_mask.long()], dim=1).to(device)
    return {"input_ids": input_ids, "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0)}


def _forward_logits(model, batch: Rollout) -> torch.Tensor:
    """Logits that predict each completion token: (B, Tc, V). Only Tc + 1 positions are projected."""
    tc = batch.completion_ids.shape[1]
    logits = model(**_model_inputs(model, batch), use_cache=False, logits_to_keep=tc + 1).logits
    return logits[:, :-1, :]  # (B, Tc, V): position t predicts completion token t


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


def completion_logprobs(model, batch: Rollout, temperature: float, with_entropy: bool = False
                        ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-probs (B, Tc) of the completion tokens under `model` at `temperature`, and optionally the
    per-token entropy (computed without grad). Gradients flow when called outside no_grad."""
    logits = _forward_logits(model, batch) / temperature  # (B, Tc, V)
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

"""Reward models: a sequence classifier that keeps its own tokenizer and chat template (DESIGN §3).

The policy's token ids are never fed to the reward model. Each sample is
re-rendered as text for it: a conversation (message-list prompt) becomes the
messages plus the completion as the assistant's turn, through the reward
model's own chat template; a plain-string prompt is followed by the completion
text. That text is tokenised with the reward model's tokenizer and cut from the
left to its maximum length, so the end of the completion is always scored.

Scoring runs without grad in chunks of `rollout.forward_batch_size`. Chunks are
left-padded, so every sequence ends at the last column; the padding filler is a
token id that does not occur in the chunk, so the classifier's "last token that
is not padding" pooling always lands on the last real token, whatever pad/EOS
conventions the checkpoint has. On CUDA a chunk's width is padded up to a multiple
(`models.devices.WIDTH_MULTIPLE`), so that widths recur (a new one costs the
attention kernel a new plan).
"""

from __future__ import annotations

from typing import Optional

from tidyrl import liveness


class RewardModelError(RuntimeError):
    """A reward model cannot be used as configured; the message says what to do."""


class RewardModel:
    """Callable like a reward function: `rm(prompts=..., completions=...) -> list[float]`."""

    def __init__(self, path: str, *, key: str = "rewards[i].model", batch_size: int = 64,
                 max_length: Optional[int] = None, dtype: str = "float32"):
        from transformers import AutoConfig, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        self.path, self.key, self.batch_size, self.dtype = path, key, batch_size, dtype
        from tidyrl.models.lora import adapter_folder_problem

        problem = adapter_folder_problem(path, key, "a reward model")
        if problem:
            raise RewardModelError(problem)
        from tidyrl.models.loading import check_model_source

        check_model_source(path, key)
        try:
            self.config = AutoConfig.from_pretrained(path)
            self.tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as err:
            raise RewardModelError(
                f"{key}={path!r} does not load ({type(err).__name__}: {str(err).splitlines()[0]}). Point it at a "
                "sequence-classification model folder (AutoModelForSequenceClassification) with its tokenizer."
            ) from None
        if getattr(self.config, "num_labels", 1) != 1:
            raise RewardModelError(
                f"{key}={path!r} has a {self.config.num_labels}-label head; a reward model gives one score per "
                "sequence (num_labels=1). Convert it (e.g. the difference of its two logits as one head), or train "
                "one with `algorithm: reward`."
            )
        context = getattr(self.config, "max_position_embeddings", None)
        limit = self.tokenizer.model_max_length if self.tokenizer.model_max_length < 1_000_000 else None
        self.max_length = max_length or min(x for x in (context, limit, 1_000_000) if x)
        self.model = None

    def load(self, device=None) -> "RewardModel":
        """Load the weights (once), eval mode, no grad, dropout off."""
        if self.model is None:
            from transformers import AutoModelForSequenceClassification

            from tidyrl.models.loading import OWN_LAYERS, placed, torch_dtype, without_dropout

            self.model = placed(AutoModelForSequenceClassification.from_pretrained(
                self.path, config=without_dropout(self.config), dtype=torch_dtype(self.dtype), **OWN_LAYERS), device)
            self.model.eval().requires_grad_(False)
        if device is not None:
            self.model.to(device)
        return self

    def texts(self, prompts: list, completions: list[str]) -> list[str]:
        """Each sample as the reward model reads it (its own chat template for conversations)."""
        out = []
        for prompt, completion in zip(prompts, completions):
            if isinstance(prompt, str):
                out.append(prompt + completion)
                continue
            if getattr(self.tokenizer, "chat_template", None) is None:
                raise RewardModelError(
                    f"{self.key}={self.path!r}: the prompts are chat messages but this reward model's tokenizer "
                    "has no chat_template to render them. Give the reward model a chat template (its "
                    "tokenizer_config.json) or use plain-string prompts."
                )
            messages = [{k: v for k, v in m.items() if v is not None} for m in prompt]
            messages.append({"role": "assistant", "content": completion})
            out.append(self.tokenizer.apply_chat_template(messages, tokenize=False))
        return out

    def encode(self, prompts: list, completions: list[str]) -> list[list[int]]:
        """Token ids for the reward model, cut from the left to max_length (the completion's end stays)."""
        ids = []
        for prompt, text in zip(prompts, self.texts(prompts, completions)):
            # A chat template writes its own special tokens; plain text gets the tokenizer's (e.g. BOS).
            encoded = self.tokenizer(text, add_special_tokens=isinstance(prompt, str))["input_ids"]
            ids.append(list(encoded)[-self.max_length:])
        return ids

    def __call__(self, prompts: list, completions: list[str], **_) -> list[float]:
        import torch
        import torch.nn.functional as F

        from tidyrl.models.devices import width_padding
        from tidyrl.models.sequences import absent_id, left_pad
        from tidyrl.models.sharding import forward_calls

        self.load()
        device = next(self.model.parameters()).device
        encoded = self.encode(prompts, completions)
        scores: list[float] = []
        starts = range(0, len(encoded), self.batch_size)
        # Sharded under FSDP2 (`models.sharding.place_frozen`), a forward is a collective: a process with fewer
        # chunks than another (an evaluation's uneven share) runs a one-token forward per missing chunk and drops it.
        calls = forward_calls(self.model, len(starts))
        with torch.no_grad():
            for k in range(calls):
                chunk = encoded[starts[k]: starts[k] + self.batch_size] if k < len(starts) else [[0]]
                filler = absent_id(chunk)
                ids, mask = left_pad(chunk, filler)
                if extra := width_padding(ids.shape[1], device):  # CUDA: widths that recur
                    ids, mask = F.pad(ids, (extra, 0), value=filler), F.pad(mask, (extra, 0))
                positions = (mask.cumsum(-1) - 1).clamp(min=0)
                self.model.config.pad_token_id = filler  # pooling: the last token that is not `filler`
                with liveness.working("scoring", f"reward model {self.path}: {ids.shape[0]} rows of {ids.shape[1]} "
                                      "tokens"):
                    logits = self.model(input_ids=ids.to(device), attention_mask=mask.to(device),
                                        position_ids=positions.to(device)).logits  # (B, 1)
                if k < len(starts):
                    scores += logits[:, 0].float().cpu().tolist()
                liveness.mark(f"scored chunk {k + 1} of {calls} with reward model {self.path}")
        return scores


class RunningMoments:
    """Running mean and variance of every score seen so far (Chan et al. parallel update), for
    `rewards[i].normalize`: scores are shifted and scaled by the statistics including the current batch."""

    def __init__(self):
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    def update(self, values: list[float]) -> None:
        n = len(values)
        if n == 0:
            return
        batch_mean = sum(values) / n
        batch_m2 = sum((v - batch_mean) ** 2 for v in values)
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta ** 2 * self.count * n / total
        self.count = total

    @property
    def std(self) -> float:
        return (self.m2 / self.count) ** 0.5 if self.count > 1 else 1.0

    def normalize(self, value: float) -> float:
        return (value - self.mean) / max(self.std, 1e-8)

    def state_dict(self) -> dict:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = state["count"], state["mean"], state["m2"]

"""A distillation teacher of another tokenizer than the student's (`teacher.cross_tokenizer: true`).

The student's completion is text to the teacher: each episode is re-rendered for the teacher, its prompt by the
teacher's own chat template (`data.encode_prompts`, as the student's was by the student's) and its completion as
the student's tokens decoded one by one and concatenated, tokenised by the teacher's tokenizer with character
offsets. The teacher scores its own tokens (no grad, in chunks, at the rollout's temperature), and each teacher
token's log-prob is spread over the characters it covers, evenly: a student token's value is the sum over its
characters (`spread_by_characters`). So

- a student token covering several teacher tokens gets the sum of their log-probs (the teacher's log-prob of
  that text);
- a teacher token split across student tokens gives each the share of its log-prob that their characters are of
  its characters;
- the values of a completion's student tokens add up to the teacher's log-prob of the whole completion text.

A student token with no characters of its own is an end-of-sequence token (the completion's last) or another
special token: the first gets the teacher's log-prob of its own end-of-sequence token after the text, the others
the student's own log-prob (an advantage of 0: the teacher has no opinion of them).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch


def spread_by_characters(student_spans: Sequence[tuple[int, int]], teacher_spans: Sequence[tuple[int, int]],
                         teacher_values: Sequence[float]) -> list[Optional[float]]:
    """Each student span's value: sum over teacher spans t of value_t * |student span ∩ t| / |t| (a teacher
    token's value spread evenly over its characters). Spans are [start, end) character offsets into one text; a
    student span with no characters gets None; teacher spans of no characters give nothing."""
    out: list[Optional[float]] = []
    for a, b in student_spans:
        if b <= a:
            out.append(None)
            continue
        total = 0.0
        for (c, d), value in zip(teacher_spans, teacher_values):
            overlap = min(b, d) - max(a, c)
            if overlap > 0 and d > c:
                total += value * overlap / (d - c)
        out.append(total)
    return out


class CrossTokenizerTeacher:
    """A local teacher model with its own tokenizer, scoring the student's episodes as text (see the module
    docstring). `logprobs(prompts, completions, student_logprobs)` gives the values per student token."""

    renders_prompts = True
    """It renders each episode's prompt itself, with its own tokenizer (`scoring.teacher_logprobs` hands it the
    prompts and the student's log-probs, not token ids)."""

    def __init__(self, model, tokenizer, student_tokenizer, student_eos_ids: Sequence[int], *, temperature: float,
                 chunk_size: int, fast_path: bool):
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("teacher.cross_tokenizer needs a fast (tokenizers) teacher tokenizer: its character "
                             "offsets map its tokens onto the student's")
        self.model, self.tokenizer, self.student_tokenizer = model, tokenizer, student_tokenizer
        self.student_eos = set(int(i) for i in student_eos_ids)
        self.temperature, self.chunk_size, self.fast_path = temperature, chunk_size, fast_path

    def render(self, prompt, completion_ids: Sequence[int]):
        """One episode for the teacher: (its prompt ids, its completion ids, their character spans in the completion
        text, the student tokens' spans, whether the teacher's end-of-sequence token was appended: the student's
        completion ended with one and the teacher has one)."""
        from tidyrl.data import encode_prompts

        prompt_ids = encode_prompts([prompt], self.tokenizer)[0]
        pieces, spans, at = [], [], 0
        ended = False
        for token in completion_ids:
            text = "" if int(token) in self.student_eos else self.student_tokenizer.decode(
                [int(token)], skip_special_tokens=True)
            ended = ended or int(token) in self.student_eos
            pieces.append(text)
            spans.append((at, at + len(text)))
            at += len(text)
        text = "".join(pieces)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        teacher_ids = list(encoded["input_ids"])
        teacher_spans = [tuple(span) for span in encoded["offset_mapping"]]
        appended = ended and self.tokenizer.eos_token_id is not None
        if appended:
            teacher_ids.append(int(self.tokenizer.eos_token_id))
            teacher_spans.append((at, at))  # after the text; its log-prob goes to the student's end-of-sequence
        return prompt_ids, teacher_ids, teacher_spans, spans, appended

    @torch.no_grad()
    def logprobs(self, prompts: Sequence, completions: Sequence[Sequence[int]],
                 student_logprobs: Sequence[Sequence[float]]) -> list[list[float]]:
        """Per student token of each completion, the teacher's value (see the module docstring)."""
        from tidyrl.models.sequences import left_pad
        from tidyrl.models.sharding import full_weights
        from tidyrl.rollouts.record import Rollout
        from tidyrl.rollouts.scoring import score_logprobs

        rendered = [self.render(p, c) for p, c in zip(prompts, completions)]
        if not rendered:
            return []
        p_ids, p_mask = left_pad([r[0] for r in rendered], self.tokenizer.pad_token_id or 0)
        width = max(1, max(len(r[1]) for r in rendered))
        c_ids = torch.full((len(rendered), width), self.tokenizer.pad_token_id or 0, dtype=torch.long)
        c_mask = torch.zeros(len(rendered), width)
        for i, r in enumerate(rendered):
            c_ids[i, : len(r[1])] = torch.tensor(r[1], dtype=torch.long)
            c_mask[i, : len(r[1])] = 1.0
        tokens = Rollout(p_ids, p_mask, c_ids, c_mask, torch.zeros(len(rendered), dtype=torch.bool))
        with full_weights(self.model):
            scored = score_logprobs(self.model, tokens, self.temperature, self.chunk_size, fast_path=self.fast_path)
        out = []
        for i, (_, ids, teacher_spans, spans, appended) in enumerate(rendered):
            values = scored[i, : len(ids)].tolist()
            text_values = spread_by_characters(spans, teacher_spans[: len(ids) - int(appended)],
                                               values[: len(ids) - int(appended)])
            row = []
            for j, (value, token) in enumerate(zip(text_values, completions[i])):
                if value is None and appended and int(token) in self.student_eos:
                    value = values[-1]  # the teacher's own end of sequence
                row.append(float(student_logprobs[i][j]) if value is None else value)
            out.append(row)
        return out

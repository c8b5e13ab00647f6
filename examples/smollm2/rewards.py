"""The example's verifiable rewards: 1 when the last number the completion writes is the answer (`last_number`), or
when the last \\boxed{...} holds it (`boxed`, the format task), else 0."""

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(completions, answer, **kwargs):
    """1.0 where the completion's last number (an integer or decimal, with its sign) equals `answer`, else 0.0.
    "7 + 5 = 12." scores 1 for answer "12"; "12, I think. 7 + 5" scores 0: the last number is what counts."""
    scores = []
    for completion, gold in zip(completions, answer):
        numbers = NUMBER.findall(completion.replace(",", ""))
        scores.append(1.0 if numbers and float(numbers[-1]) == float(gold) else 0.0)
    return scores


BOXED = re.compile(r"\\boxed\{\s*(-?\d+(?:\.\d+)?)\s*\}")


def boxed(completions, answer, **kwargs):
    """1.0 where the completion's last \\boxed{N} holds the answer, else 0.0: the right number elsewhere, or no
    \\boxed{} at all, scores 0 ("4 * 9 = 36." scores 0; "The answer is \\boxed{36}." scores 1 for "36")."""
    scores = []
    for completion, gold in zip(completions, answer):
        found = BOXED.findall(completion.replace(",", ""))
        scores.append(1.0 if found and float(found[-1]) == float(gold) else 0.0)
    return scores

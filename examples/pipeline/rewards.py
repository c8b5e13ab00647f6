"""The GRPO stage's reward function: how much of the reversed word the completion spells, letter by letter."""


def reversal(completions, word, **_):
    """Letters in the right place, over the longer of the two lengths: 1.0 for exactly the reversed word."""
    scores = []
    for text, w in zip(completions, word):
        target, text = w[::-1], text.strip()
        right = sum(a == b for a, b in zip(text, target))
        scores.append(right / max(len(text), len(target)))
    return scores

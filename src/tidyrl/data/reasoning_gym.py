"""Procedural reasoning tasks from `reasoning-gym` (Stojanovski et al. 2025): a prompt source and its scorer,
named in the YAML, nothing downloaded:

    data:
      reasoning_gym: basic_arithmetic          # any of reasoning_gym's task names (tidyrl.data.reasoning_gym.task_names())
      reasoning_gym_size: 2000                 # prompts generated (seed: the run's seed)
      reasoning_gym_options: {min_terms: 2}    # the task's own configuration
    rewards:
      - function: tidyrl.data.reasoning_gym:reasoning_gym_score

Each prompt is the task's question after reasoning-gym's default system prompt (think, then
<answer>...</answer>); the rows carry `answer` and the whole generated entry (`reasoning_gym_entry`, JSON),
which `reasoning_gym_score` hands to the task's own scorer with the completion's <answer> text: 1.0 for a
correct answer, partial credit where the task gives it, 0.0 without an answer. `pip install 'tidyrl[gym]'`.
"""

from __future__ import annotations

import json
from typing import Sequence

ENTRY_COLUMN = "reasoning_gym_entry"


def _reasoning_gym():
    try:
        import reasoning_gym
    except ImportError:
        raise ImportError("data.reasoning_gym needs the reasoning-gym package: pip install 'tidyrl[gym]'") from None
    return reasoning_gym


def task_names() -> list[str]:
    """The task names reasoning-gym offers."""
    return sorted(_reasoning_gym().factory.DATASETS)


def reasoning_gym_dataset(task: str, size: int, seed: int, options: dict, prompt_column: str = "prompt"):
    """A `datasets.Dataset` of `size` generated problems of `task`: prompt (chat messages), answer and the entry."""
    import datasets

    from tidyrl.data.errors import DataError

    rg = _reasoning_gym()
    if task not in rg.factory.DATASETS:
        import difflib

        close = difflib.get_close_matches(task, rg.factory.DATASETS, n=3)
        raise DataError(f"data.reasoning_gym = {task!r} is not a reasoning-gym task"
                        f"{'; did you mean ' + ', '.join(close) + '?' if close else ''} (tidyrl.data.reasoning_gym.task_names() "
                        "lists them all)")
    try:
        generated = rg.create_dataset(task, size=size, seed=seed, **options)
    except (TypeError, ValueError, AssertionError) as err:
        raise DataError(f"data.reasoning_gym_options = {options!r} do not configure {task!r}: {err}") from None
    system = rg.utils.SYSTEM_PROMPTS["default"]
    rows = [{prompt_column: [{"role": "system", "content": system}, {"role": "user", "content": entry["question"]}],
             "answer": str(entry["answer"]), ENTRY_COLUMN: json.dumps(entry, default=str)} for entry in generated]
    return datasets.Dataset.from_list(rows)


def reasoning_gym_score(completions: Sequence[str], reasoning_gym_entry: Sequence[str]) -> list[float]:
    """The task's own score of each completion's <answer>...</answer> (0.0 when there is none)."""
    rg = _reasoning_gym()
    scores = []
    for completion, entry_json in zip(completions, reasoning_gym_entry):
        entry = json.loads(entry_json)
        answer = rg.utils.extract_answer(completion, tag_name="answer")
        score = rg.get_score_answer_fn(entry["metadata"]["source_dataset"])
        scores.append(float(score(answer=answer, entry=entry)) if answer is not None else 0.0)
    return scores

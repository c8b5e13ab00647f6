"""Reward functions: loading from specs, hand-worked weighted sums, every error message."""

from __future__ import annotations

import math
import os
import sys
import textwrap

import numpy as np
import pytest
import torch

from tidyrl.config import RewardConfig
from tidyrl.rewards import (
    RewardError,
    RewardFunction,
    RewardResult,
    build_reward_functions,
    compute_rewards,
    load_reward_function,
)

REWARD_FILE = textwrap.dedent(
    """
    import math

    SCALE = 2.0

    def exact_match(prompts, completions, answer, **kwargs):
        return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    class Scorer:
        pass
    """
)


def write_module(folder, name="my_rewards.py", text=REWARD_FILE):
    path = folder / name
    path.write_text(text)
    return path


def batch(completions, prompts=None, **columns):
    prompts = prompts if prompts is not None else [f"p{i}" for i in range(len(completions))]
    return dict(
        prompts=prompts,
        completions=completions,
        completion_ids=[[ord(c) for c in text] for text in completions],
        columns=columns,
    )


# ---------------------------------------------------------------------------
# Loading


def test_load_from_absolute_file_path(tmp_path):
    path = write_module(tmp_path)
    fn = load_reward_function(f"{path}:exact_match")
    assert fn(prompts=["q"], completions=[" 4 "], answer=["4"]) == [1.0]


def test_load_relative_to_cwd(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    write_module(tmp_path / "sub")
    monkeypatch.chdir(tmp_path)
    fn = load_reward_function("sub/my_rewards.py:length")
    assert fn(completions=["abc"]) == [3.0]


def test_load_relative_to_base_dir(tmp_path, monkeypatch):
    config_dir = tmp_path / "configs"
    config_dir.mkdir()
    write_module(config_dir)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    fn = load_reward_function("my_rewards.py:length", base_dir=str(config_dir))
    assert fn(completions=["ab"]) == [2.0]


def test_cwd_wins_over_base_dir(tmp_path, monkeypatch):
    (tmp_path / "cwd").mkdir()
    (tmp_path / "base").mkdir()
    write_module(tmp_path / "cwd", text="def f(completions): return [1.0]\n")
    write_module(tmp_path / "base", text="def f(completions): return [2.0]\n")
    monkeypatch.chdir(tmp_path / "cwd")
    assert load_reward_function("my_rewards.py:f", base_dir=str(tmp_path / "base"))(completions=["x"]) == [1.0]


def test_same_file_name_in_two_folders_does_not_clash(tmp_path):
    for folder, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / folder).mkdir()
        write_module(tmp_path / folder, name="rewards.py", text=f"def f(completions): return [{value}]\n")
    fa = load_reward_function(f"{tmp_path / 'a' / 'rewards.py'}:f")
    fb = load_reward_function(f"{tmp_path / 'b' / 'rewards.py'}:f")
    assert (fa(completions=["x"]), fb(completions=["x"])) == ([1.0], [2.0])
    assert fa.__module__ != fb.__module__


def test_file_can_import_a_sibling_and_use_dataclasses(tmp_path):
    (tmp_path / "helper_for_rewards.py").write_text("BONUS = 3.0\n")
    write_module(
        tmp_path,
        text=(
            "from dataclasses import dataclass\n"
            "from helper_for_rewards import BONUS\n"
            "@dataclass\nclass Box:\n    x: float\n"
            "def f(completions): return [Box(BONUS).x for _ in completions]\n"
        ),
    )
    assert load_reward_function(f"{tmp_path / 'my_rewards.py'}:f")(completions=["a"]) == [3.0]
    assert str(tmp_path) not in sys.path
    sys.modules.pop("helper_for_rewards", None)


def test_load_from_module_spec(tmp_path, monkeypatch):
    package = tmp_path / "rewardpkg_for_tests"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write_module(package, name="scoring.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward_function("rewardpkg_for_tests.scoring:exact_match")
    assert fn(prompts=["q"], completions=["no"], answer=["4"]) == [0.0]


def test_callable_is_returned_as_is():
    def mine(completions, **kwargs):
        return [0.0] * len(completions)

    assert load_reward_function(mine) is mine


# ---------------------------------------------------------------------------
# Loading errors


def test_error_missing_colon():
    with pytest.raises(RewardError) as info:
        load_reward_function("my_rewards.py")
    assert str(info.value) == (
        "rewards[i].function = 'my_rewards.py' must name the function after a colon: "
        "'package.module:function' or 'path/to/file.py:function'."
    )


def test_error_file_not_found(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RewardError) as info:
        load_reward_function("missing.py:f", base_dir=str(tmp_path / "cfg"), key="rewards[1].function")
    message = str(info.value)
    assert message.startswith("rewards[1].function = 'missing.py:f': file 'missing.py' not found; looked at [")
    assert str(tmp_path / "missing.py") in message
    assert str(tmp_path / "cfg" / "missing.py") in message


def test_error_module_not_found():
    with pytest.raises(RewardError) as info:
        load_reward_function("no_such_module_xyz.sub:f")
    message = str(info.value)
    assert "rewards[i].function = 'no_such_module_xyz.sub:f': module 'no_such_module_xyz.sub' not found" in message
    assert "No module named 'no_such_module_xyz'" in message
    assert "'path/to/file.py:function'" in message


def test_error_file_import_fails_with_original_message(tmp_path):
    path = write_module(tmp_path, text="raise ImportError('needs the sympy package')\n")
    with pytest.raises(RewardError) as info:
        load_reward_function(f"{path}:f")
    assert "importing" in str(info.value)
    assert "failed: ImportError: needs the sympy package" in str(info.value)
    assert isinstance(info.value.__cause__, ImportError)
    assert not any(getattr(m, "__file__", None) == os.path.realpath(path) for m in list(sys.modules.values()))


def test_error_module_import_fails_with_original_message(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards_mod.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError) as info:
        load_reward_function("broken_rewards_mod:f")
    assert "importing module 'broken_rewards_mod' failed: ModuleNotFoundError: No module named 'not_installed_dependency_xyz'" in str(info.value)


def test_error_syntax_error_in_file(tmp_path):
    path = write_module(tmp_path, text="def f(:\n")
    with pytest.raises(RewardError, match="failed: SyntaxError"):
        load_reward_function(f"{path}:f")


def test_error_attribute_missing_lists_callables(tmp_path):
    path = write_module(tmp_path)
    with pytest.raises(RewardError) as info:
        load_reward_function(f"{path}:exact_mach")
    message = str(info.value)
    assert f"module '{path}' has no attribute 'exact_mach'" in message
    assert "Callables available in it: ['Scorer', 'exact_match', 'length']." in message
    assert "Did you mean 'exact_match'?" in message


def test_error_not_callable(tmp_path):
    path = write_module(tmp_path)
    with pytest.raises(RewardError) as info:
        load_reward_function(f"{path}:SCALE")
    assert str(info.value) == f"rewards[i].function = '{path}:SCALE': 'SCALE' is a float, not a callable."


def test_error_spec_of_wrong_type():
    with pytest.raises(RewardError, match="must be a string 'module:function' or 'file.py:function', or a callable"):
        load_reward_function(42)


# ---------------------------------------------------------------------------
# build_reward_functions


def test_build_names_weights_and_duplicates(tmp_path):
    path = write_module(tmp_path)

    def bonus(completions, **kwargs):
        return [0.0] * len(completions)

    funcs = build_reward_functions(
        [
            RewardConfig(function=f"{path}:exact_match", weight=1.0),
            RewardConfig(function=f"{path}:exact_match", weight=0.5),
            RewardConfig(function="my_rewards.py:length", weight=2, name="len"),
            RewardConfig(function=bonus),
            RewardConfig(function=bonus, name="exact_match"),
            RewardConfig(function=lambda completions: [0.0] * len(completions)),
        ],
        base_dir=str(tmp_path),
    )
    assert [f.name for f in funcs] == ["exact_match", "exact_match_2", "len", "bonus", "exact_match_3", "reward"]
    assert [f.weight for f in funcs] == [1.0, 0.5, 2.0, 1.0, 1.0, 1.0]
    assert all(isinstance(f.weight, float) for f in funcs)
    assert funcs[3].fn is bonus


def test_build_names_the_entry_in_errors(tmp_path):
    with pytest.raises(RewardError, match=r"^rewards\[1\]\.function = 'nocolon' must name the function"):
        build_reward_functions([RewardConfig(function=lambda completions: []), RewardConfig(function="nocolon")])


def test_build_names_a_reward_model_that_does_not_load(tmp_path):
    with pytest.raises(RuntimeError, match=r"^rewards\[0\]\.model='path/to/rm': no such folder or hub id"):
        build_reward_functions([RewardConfig(model="path/to/rm")])
    with pytest.raises(RuntimeError, match=rf"^rewards\[0\]\.model='{tmp_path}' does not load"):  # no config.json
        build_reward_functions([RewardConfig(model=str(tmp_path))])


def test_build_rejects_empty_entry_and_bad_weight():
    with pytest.raises(RewardError, match=r"rewards\[0\] sets no function"):
        build_reward_functions([RewardConfig()])
    with pytest.raises(RewardError, match=r"rewards\[0\]\.weight = nan must be a finite number"):
        build_reward_functions([RewardConfig(function=len, weight=float("nan"))])


# ---------------------------------------------------------------------------
# compute_rewards: hand-worked numbers


def correct(completions, answer, **kwargs):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answer)]


def formatted(completions, **kwargs):
    # Scores only completions that look like a number; None for the rest.
    return [2.0 if c.isdigit() else None for c in completions]


def test_weighted_sum_with_none():
    funcs = [RewardFunction("correct", correct, 1.0), RewardFunction("formatted", formatted, 0.5)]
    result = compute_rewards(funcs, **batch(["4", "5", "four"], answer=["4", "4", "four"]))
    # sample 0: 1*1 + 0.5*2 = 2.0; sample 1: 1*0 + 0.5*2 = 1.0;
    # sample 2: only `correct` scored it (formatted -> None): 1*1 = 1.0
    assert result.total == [2.0, 1.0, 1.0]
    assert result.per_function == {"correct": [1.0, 0.0, 1.0], "formatted": [2.0, 2.0, None]}
    assert result.means() == {"correct": pytest.approx(2 / 3), "formatted": 2.0}


def test_means_none_when_nothing_scored():
    result = RewardResult(total=[1.0], per_function={"a": [1.0], "b": [None]})
    assert result.means() == {"a": 1.0, "b": None}


def test_accepted_return_types():
    outputs = {
        "list": [1, 2.5],
        "tuple": (1.0, None),
        "numpy": np.array([0.5, 1.5], dtype=np.float32),
        "torch": torch.tensor([3.0, -1.0]),
        "numpy scalars": [np.float64(1.0), np.int64(2)],
    }
    funcs = [RewardFunction(name, (lambda out: lambda completions: out)(out), 1.0) for name, out in outputs.items()]
    result = compute_rewards(funcs, **batch(["a", "b"]))
    assert result.per_function == {
        "list": [1.0, 2.5],
        "tuple": [1.0, None],
        "numpy": [0.5, 1.5],
        "torch": [3.0, -1.0],
        "numpy scalars": [1.0, 2.0],
    }
    assert result.total == [1 + 1 + 0.5 + 3 + 1, 2.5 + 1.5 - 1 + 2]
    assert all(type(x) is float for x in result.per_function["numpy"])


def test_arguments_passed_by_signature():
    seen = {}

    def takes_kwargs(prompts, completions, **kwargs):
        seen["kwargs"] = sorted(kwargs)
        return [0.0] * len(completions)

    def fixed(completions, answer):  # no **kwargs, lacks `topic`, `prompts`, `completion_ids`
        seen["fixed"] = (completions, answer)
        return [1.0] * len(completions)

    def keyword_only(*, completion_ids, topic="none"):
        seen["keyword_only"] = (completion_ids, topic)
        return [float(len(ids)) for ids in completion_ids]

    funcs = [RewardFunction("a", takes_kwargs, 1.0), RewardFunction("b", fixed, 1.0), RewardFunction("c", keyword_only, 1.0)]
    result = compute_rewards(funcs, **batch(["xy", "z"], answer=["1", "2"], topic=["t1", "t2"]))
    assert seen["kwargs"] == ["answer", "completion_ids", "topic"]
    assert seen["fixed"] == (["xy", "z"], ["1", "2"])
    assert seen["keyword_only"] == ([[120, 121], [122]], ["t1", "t2"])
    assert result.total == [3.0, 2.0]


def test_prompts_are_raw_chat_messages():
    chat = [{"role": "user", "content": "hi"}]

    def sees_messages(prompts, completions):
        return [1.0 if p == chat else 0.0 for p in prompts]

    assert compute_rewards([RewardFunction("m", sees_messages, 1.0)], **batch(["a"], prompts=[chat])).total == [1.0]


# ---------------------------------------------------------------------------
# compute_rewards: errors


def constant(value):
    return lambda completions: value


def test_error_wrong_length():
    with pytest.raises(RewardError) as info:
        compute_rewards([RewardFunction("short", constant([1.0]), 1.0)], **batch(["a", "b", "c"]))
    assert str(info.value) == "reward function 'short' returned the wrong number of scores: expected 3, got 1."


@pytest.mark.parametrize(
    "value, text",
    [
        (True, "returned True for sample 1; a score must be a number (int or float, not bool) or None."),
        ("1.0", "returned '1.0' for sample 1; a score must be a number (int or float, not bool) or None."),
        ([1.0], "returned [1.0] for sample 1; a score must be a number"),
        (float("nan"), "returned nan for sample 1; a score must be finite (not NaN or inf)."),
        (math.inf, "returned inf for sample 1; a score must be finite (not NaN or inf)."),
    ],
)
def test_error_invalid_entry(value, text):
    with pytest.raises(RewardError) as info:
        compute_rewards([RewardFunction("bad", constant([0.0, value]), 1.0)], **batch(["a", "b"]))
    assert str(info.value).startswith(f"reward function 'bad' {text}")


def test_error_not_a_list():
    with pytest.raises(RewardError) as info:
        compute_rewards([RewardFunction("scalar", constant(1.0), 1.0)], **batch(["a"]))
    assert str(info.value) == (
        "reward function 'scalar' returned a float; expected a list of 1 scores (float or None), one per completion."
    )
    with pytest.raises(RewardError, match=r"returned an array of shape \(2, 1\)"):
        compute_rewards([RewardFunction("2d", constant(np.zeros((2, 1))), 1.0)], **batch(["a", "b"]))


def test_error_raise_names_the_failing_sample():
    def picky(prompts, completions, **kwargs):
        return [float(int(c)) for c in completions]

    with pytest.raises(RewardError) as info:
        compute_rewards([RewardFunction("picky", picky, 1.0)], **batch(["1", "2", "three" * 30], prompts=["a", "b", "c"]))
    message = str(info.value)
    assert message.startswith("reward function 'picky' raised on sample 2 (prompt: 'c', completion: 'threethree")
    assert "...)" in message  # long completions are shortened
    assert message.endswith("ValueError: invalid literal for int() with base 10: '" + "three" * 30 + "'")
    assert isinstance(info.value.__cause__, ValueError)


def test_error_raise_on_batch_only():
    def batch_only(completions):
        if len(completions) > 1:
            raise MemoryError("batch too big")
        return [1.0]

    with pytest.raises(RewardError) as info:
        compute_rewards([RewardFunction("batchy", batch_only, 1.0)], **batch(["a", "b"]))
    assert str(info.value) == (
        "reward function 'batchy' raised on the batch of 2 samples, but on no sample alone: MemoryError: batch too big"
    )
    assert isinstance(info.value.__cause__, MemoryError)


def test_error_sample_scored_by_no_function():
    funcs = [RewardFunction("f1", constant([1.0, None]), 1.0), RewardFunction("f2", constant([None, None]), 0.5)]
    with pytest.raises(RewardError) as info:
        compute_rewards(funcs, **batch(["a", "b"], prompts=["p0", "p1"]))
    assert str(info.value) == (
        "sample 1 (prompt: 'p1', completion: 'b') got no score: every reward function (f1, f2) returned None for it. "
        "Make at least one function score every sample."
    )


def test_error_missing_required_argument():
    def needs_answer(completions, answer):
        return [0.0] * len(completions)

    with pytest.raises(RewardError) as info:
        compute_rewards([RewardFunction("needs", needs_answer, 1.0)], **batch(["a"], topic=["t"]))
    assert str(info.value) == (
        "reward function 'needs' requires argument(s) ['answer'], which are neither prompts, completions, "
        "completion_ids nor dataset columns (columns: ['topic']). Add the column to the prompt data or give the "
        "argument a default."
    )


def test_error_column_clashes_with_argument():
    with pytest.raises(RewardError, match="the dataset column 'completions' has the name of a reward-function argument"):
        compute_rewards([RewardFunction("f", correct, 1.0)], prompts=["p"], completions=["a"], completion_ids=[[1]], columns={"completions": ["x"]})


def test_error_no_functions():
    with pytest.raises(RewardError, match="no reward functions"):
        compute_rewards([], **batch(["a"]))


def test_function_cannot_mutate_another_functions_inputs():
    def mutator(completions):
        scores = [0.0] * len(completions)
        completions.clear()
        return scores

    def reader(completions):
        return [float(len(completions))] * len(completions)

    funcs = [RewardFunction("m", mutator, 1.0), RewardFunction("r", reader, 1.0)]
    assert compute_rewards(funcs, **batch(["a", "b"])).total == [2.0, 2.0]


def test_async_reward_functions_run_concurrently_and_their_errors_are_named():
    import asyncio
    import time

    from tidyrl.config import RewardConfig

    async def slow_judge(completions, **kwargs):
        await asyncio.sleep(0.3)  # e.g. a request to a judge model
        return [float(len(c)) for c in completions]

    async def other_judge(completions, **kwargs):
        await asyncio.sleep(0.3)
        return [1.0 for _ in completions]

    def plain(completions, **kwargs):
        return [0.5 for _ in completions]

    funcs = build_reward_functions([RewardConfig(function=slow_judge), RewardConfig(function=plain, weight=2.0),
                                    RewardConfig(function=other_judge)])
    start = time.perf_counter()
    result = compute_rewards(funcs, prompts=["p", "p"], completions=["ab", "abc"], completion_ids=[[1], [2]],
                             columns={})
    assert time.perf_counter() - start < 0.55  # the two 0.3 s judges ran at once
    assert list(result.per_function) == ["slow_judge", "plain", "other_judge"]
    assert result.total == [2 + 1.0 + 1, 3 + 1.0 + 1]

    async def broken(completions, **kwargs):
        raise ConnectionError("judge unreachable")

    with pytest.raises(RewardError, match="reward function 'broken' .async. raised ConnectionError: judge unreachable"):
        compute_rewards(build_reward_functions([RewardConfig(function=broken)]), prompts=["p"], completions=["a"],
                        completion_ids=[[1]], columns={})

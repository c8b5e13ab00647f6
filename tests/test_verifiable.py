"""Built-in verifiable rewards on real cases: math answers by math-verify, a format regex, code run against
tests in a sandboxed subprocess; reward options from the YAML; a GRPO run rewarded by math_answer."""

from __future__ import annotations

import importlib.util
import os
import threading
import time

import pytest
from conftest import read_jsonl, write_jsonl

import tidyrl
from tidyrl.rewards import RewardError, build_reward_functions, compute_rewards
from tidyrl.rewards import sandbox
from tidyrl.rewards.verifiable import code_tests, extract_code, format_match, math_answer, run_python_tests

SANDBOXED = sandbox.problem() is None
"""The limits are tested in the sandbox where this machine has one, else without (allow_unsandboxed); the sandbox's
own tests, and the refusal where it is missing, are in tests/test_code_sandbox.py."""
MODES = [pytest.param(True, marks=pytest.mark.skipif(not SANDBOXED, reason=f"no sandbox: {sandbox.problem()}"),
                      id="sandboxed"), pytest.param(False, id="unsandboxed")]


# In the [test] extra (CI installs it); a machine without it (a GPU image, say) skips these instead of failing them.
needs_math_verify = pytest.mark.skipif(importlib.util.find_spec("math_verify") is None,
                                       reason="needs math-verify: pip install -e '.[test]'")


@needs_math_verify
def test_math_answer_accepts_equivalent_forms_and_rejects_the_rest():
    completions = [
        "The sum is 1/2, so the answer is \\boxed{\\frac{1}{2}}.",  # LaTeX fraction vs a decimal reference
        "Therefore \\boxed{0.5}",  # decimal vs a LaTeX reference
        "\\boxed{3}",  # integer vs 3.0
        "We get \\boxed{\\{1, 2\\}}",  # a set, in any order
        "\\boxed{4}",  # wrong
        "Let me think step by step: first we",  # cut before any answer (truncated)
        "",  # empty
        "\\boxed{\\frac{1}{0}",  # malformed LaTeX
    ]
    answers = ["0.5", "\\frac{1}{2}", "3.0", "\\{2, 1\\}", "5", "7", "1", "2"]
    assert math_answer(completions, answers) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert math_answer(["x = \\boxed{42}"], [42]) == [1.0]  # a numeric column


@needs_math_verify
def test_math_answer_reads_the_last_box_as_the_answer():
    """A correction after a first attempt is the answer: the last \\boxed{} counts, not the set of every box
    (math-verify alone reads `\\boxed{5} ... \\boxed{6}` as {5, 6}). A last box cut before its brace closes is no
    answer, and an earlier box does not stand in for it."""
    completions = ["\\boxed{5}. Wait, I made an error: \\boxed{6}", "\\boxed{5}. Wait, I made an error: \\boxed{6}",
                   "first \\boxed{5} then \\boxed{\\frac{12}{2", "no box: the answer is 6",
                   "\\boxed{\\frac{1}{2}} and then \\boxed{\\frac{3}{4}}"]
    answers = ["6", "5", "5", "6", "0.75"]
    assert math_answer(completions, answers) == [1.0, 0.0, 0.0, 1.0, 1.0]


@needs_math_verify
def test_math_answer_works_from_a_worker_thread():
    result = []
    thread = threading.Thread(target=lambda: result.append(math_answer(["\\boxed{2}", "\\boxed{3}"], ["2", "2"])))
    thread.start()
    thread.join()
    assert result == [[1.0, 0.0]]  # math-verify's signal timeouts are main-thread only: off here, no error


def test_format_match_default_and_custom_pattern():
    assert format_match(["<think>a\nb</think>\n<answer>3</answer>", "<answer>3</answer>",
                         "<think>x</think><answer>3</answer> trailing"]) == [1.0, 0.0, 0.0]
    assert format_match(["Answer: 12", "answer 12"], pattern=r"Answer: \d+") == [1.0, 0.0]


def test_extract_code_takes_the_last_python_block():
    text = "First:\n```python\nx = 1\n```\nbetter:\n```py\nx = 2\n```\nand a shell line\n```bash\nls\n```"
    assert extract_code(text) == "x = 2\n"
    assert extract_code("```\nprint(1)\n```") == "print(1)\n"
    assert extract_code("no code here") is None


def test_code_tests_pass_fail_error_and_limits():
    tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0"
    completions = [
        "```python\ndef add(a, b):\n    return a + b\n```",
        "```python\ndef add(a, b):\n    return a - b\n```",  # a failed assert
        "```python\ndef add(a, b)\n    return a + b\n```",  # a syntax error
        "I would write a function that adds.",  # no code block
        "```python\nwhile True:\n    pass\n```",  # never ends: killed at the time limit
        "```python\nblob = bytearray(10 * 2**30)\n```",  # 10 GiB: over the memory limit
    ]
    start = time.perf_counter()
    scores = code_tests(completions, [tests] * len(completions), timeout_s=2.0, memory_mb=256, allow_unsandboxed=True)
    assert scores == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert time.perf_counter() - start < 15  # the loop ends at its limit, never hangs the run


@pytest.mark.parametrize("sandboxed", MODES)
def test_an_exit_before_the_tests_end_is_no_pass_whatever_its_status(sandboxed):
    """The reward hacks a plain exit-status check pays for: exiting with status 0 before the asserts run."""
    tests = "assert add(2, 3) == 5"
    wrong = "def add(a, b):\n    return 0\n"
    hacks = [f"```python\n{wrong}{exit_call}\n```" for exit_call in (
        "import sys\nsys.exit(0)", "import os\nos._exit(0)", "raise SystemExit", "exit()", "quit(0)",
        "import __main__, os\nprint(getattr(__main__, 'token', ''))\nos._exit(0)")]  # the runner's token: not there
    honest = "```python\ndef add(a, b):\n    print('adding', end='')\n    return a + b\n```"  # no newline at its end
    scores = [run_python_tests(extract_code(c), tests, sandbox=sandboxed)[0] for c in [*hacks, honest]]
    assert scores == [False] * len(hacks) + [True]
    passed, why = run_python_tests(wrong + "import sys\nsys.exit(0)", tests, sandbox=sandboxed)
    assert not passed and why == "exited before the tests ended (exit status 0)"
    assert run_python_tests(wrong + "import os\nos._exit(0)", tests, sandbox=sandboxed) == (
        False, "exited before the tests ended (exit status 0)")


@pytest.mark.parametrize("sandboxed", MODES)
def test_the_limits_and_the_scratch_folder(sandboxed, tmp_path, monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:1")
    monkeypatch.setenv("SECRET_TOKEN", "s3cret")
    passed, why = run_python_tests("import os\nopen('big', 'wb').write(b'x' * (64 * 2**20))", "", timeout_s=5,
                                   sandbox=sandboxed)
    assert not passed and "File too large" in why
    code = ("import os, sys\nprint(os.getcwd())\nassert 'SECRET_TOKEN' not in os.environ\n"
            "assert 'HTTPS_PROXY' not in os.environ\nopen('note.txt', 'w').write('hi')\n")
    created = []
    real_mkdtemp = __import__("tempfile").mkdtemp

    def remember(*args, **kwargs):
        created.append(real_mkdtemp(*args, **kwargs))
        return created[-1]

    monkeypatch.setattr("tidyrl.rewards.verifiable.tempfile.mkdtemp", remember)
    assert run_python_tests(code, "", timeout_s=5, sandbox=sandboxed) == (True, "passed")
    if sandboxed:  # the scratch folder is the sandbox's own tmpfs: nothing of it on the host, ever
        assert created == []
    else:
        assert created and not os.path.exists(created[0])  # the scratch folder is gone


def test_reward_options_come_from_the_config_and_are_checked():
    from tidyrl.config import RewardConfig

    funcs = build_reward_functions([RewardConfig(function="tidyrl.rewards.verifiable:format_match",
                                                 kwargs={"pattern": r"Answer: \d+"})])
    result = compute_rewards(funcs, prompts=["q", "q"], completions=["Answer: 7", "no"], completion_ids=[[1], [2]],
                             columns={"pattern": ["(ignored)", "(ignored)"]})  # a column never overrides an option
    assert result.per_function["format_match"] == [1.0, 0.0]
    with pytest.raises(RewardError, match=r"rewards\[0\].kwargs: 'math_answer' takes no argument\(s\) \['patern'\]"):
        build_reward_functions([RewardConfig(function="tidyrl.rewards.verifiable:math_answer", kwargs={"patern": "x"})])


@needs_math_verify
def test_a_grpo_run_rewarded_by_math_answer(tiny_model_dir, tmp_path):
    data = write_jsonl(tmp_path / "math.jsonl", [{"prompt": f"{a}+{b}=", "answer": str(a + b)}
                                                 for a, b in [(1, 2), (3, 4), (2, 2), (5, 1)]])
    result = tidyrl.train({
        "algorithm": "grpo", "model": str(tiny_model_dir), "output_dir": str(tmp_path / "run"), "seed": 0,
        "data": {"path": str(data)},
        "rewards": [{"function": "tidyrl.rewards.verifiable:math_answer"},
                    {"function": "tidyrl.rewards.verifiable:format_match", "kwargs": {"pattern": r"\d+"}, "weight": 0.1}],
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 2, "max_new_tokens": 3},
        "train": {"rollouts": 2, "micro_batch_size": 4},
        "log": {"progress_bar": False},
    })
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert len(rows) == 2 and all("reward/math_answer" in r and "reward/format_match" in r for r in rows)
    assert all(r["reward/math_answer"] in (0.0, 0.25, 0.5, 0.75, 1.0) for r in rows)

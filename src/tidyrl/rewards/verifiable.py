"""Verifiable rewards, built in: name them in the YAML like any reward function.

    rewards:
      - function: tidyrl.rewards.verifiable:math_answer      # data column `answer`: the reference answer
      - function: tidyrl.rewards.verifiable:format_match     # options: `kwargs: {pattern: ...}`
        weight: 0.2
      - function: tidyrl.rewards.verifiable:code_tests       # data column `tests`: Python asserts
        kwargs: {timeout_s: 5, memory_mb: 512}

Each returns one float per completion and never raises on what a model writes: a completion that was cut
before its answer, holds no code block or loops forever scores 0.

- `math_answer`: the completion's final answer (the last \\boxed{} when there is one, else the last
  expression) equals the reference by `math-verify` (symbolic and numeric equivalence: 1/2 = 0.5 =
  \\frac{1}{2}, sets, intervals). `pip install 'tidyrl[math]'`.
- `format_match`: 1 when the completion matches a regular expression (default: <think>...</think> then
  <answer>...</answer>), else 0.
- `code_tests`: the last fenced code block of the completion, run with the row's tests in a fresh Python
  process (`python -I`) isolated by the kernel (tidyrl.rewards.sandbox, through bubblewrap: no network, a
  read-only view of the system and of Python and nothing else of the host's files, a scratch tmpfs, its own PID
  namespace, an unprivileged user), with a wall-clock limit, an address-space limit, a CPU-time limit, a
  file-size limit and an environment without proxies or credentials. 1 when the tests ran to their end without
  an error (an exit before that, `sys.exit(0)` or `os._exit(0)` included, is 0, and so is a process left
  running). Where the machine cannot sandbox (no bubblewrap, no user namespaces, macOS) it refuses before the
  run starts, unless the reward option `allow_unsandboxed: true` lets the code run with the limits only.
  docs/verifiable-rewards.md says what is isolated and what is not.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

from tidyrl.console import say
from tidyrl.rewards import sandbox as sandbox_module
from tidyrl.rewards.functions import RewardError

DEFAULT_FORMAT = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"
"""format_match's default: a reasoning block, then an answer block, nothing around them (DeepSeek-R1's format)."""


# ---------------------------------------------------------------------------------------------- math


def _math_verify():
    try:
        import math_verify
    except ImportError:
        raise ImportError("tidyrl.rewards.verifiable:math_answer needs the math-verify package: pip install 'tidyrl[math]'") \
            from None
    return math_verify


def _gold_text(answer) -> str:
    """The reference as math-verify reads it: LaTeX goes between $ signs (a bare `\\frac{1}{2}` is not found
    otherwise); numbers and plain text are read as expressions."""
    text = str(answer).strip()
    if "\\" in text and "$" not in text:
        return f"${text}$"
    return text


def last_boxed(text: str) -> Optional[str]:
    """The last `\\boxed{...}` of `text`, braces balanced (e.g. `\\boxed{\\frac{1}{2}}`); "" when that last box is
    never closed (the completion was cut inside its answer); None when there is no box."""
    start = text.rfind("\\boxed{")
    if start == -1:
        return None
    depth = 0
    for j in range(start + len("\\boxed"), len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[start:j + 1]
    return ""


def math_answer(completions: Sequence[str], answer: Sequence) -> list[float]:
    """1.0 where the completion's final answer equals the row's `answer` (math-verify's equivalence), else 0.0.

    The final answer is the completion's last `\\boxed{}` when it has one (math-verify alone would read every
    boxed answer of `\\boxed{5} ... \\boxed{6}` as the set {5, 6} and score the completion 0 against 6: a
    correction after a first attempt is the answer, as the docs say), else its last expression. A last box cut
    before its closing brace is no answer (0.0), not a reason to score an earlier one.

    math-verify bounds its parsing with signal.alarm, which only the main thread may use; called from another
    thread (e.g. a reward running beside generation), its timeouts are off, and a pathological expression could
    take long. tidyrl calls reward functions in the main thread."""
    mv = _math_verify()
    main = threading.current_thread() is threading.main_thread()
    timeouts = {} if main else {"parsing_timeout": None}
    scores = []
    for completion, gold in zip(completions, answer):
        boxed = last_boxed(completion)
        if boxed == "":
            scores.append(0.0)
            continue
        try:
            target = mv.parse(f"${boxed}$" if boxed else completion, **timeouts)
            reference = mv.parse(_gold_text(gold), **timeouts)
            correct = bool(target) and bool(reference) and mv.verify(
                reference, target, **({} if main else {"timeout_seconds": None}))
        except Exception:  # an expression sympy cannot handle: not a verified answer
            correct = False
        scores.append(1.0 if correct else 0.0)
    return scores


# -------------------------------------------------------------------------------------------- format


def format_match(completions: Sequence[str], pattern: str = DEFAULT_FORMAT) -> list[float]:
    """1.0 where the whole completion matches `pattern` (re.fullmatch with DOTALL: `.` spans lines), else 0.0."""
    compiled = re.compile(pattern, re.DOTALL)
    return [1.0 if compiled.fullmatch(c) else 0.0 for c in completions]


# ---------------------------------------------------------------------------------------------- code

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> Optional[str]:
    """The last fenced code block of `completion` (```python ... ```, or an unlabelled ```), or None."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(completion)]
    python = [body for lang, body in blocks if lang in ("python", "py", "python3", "")]
    return python[-1] if python else None


_RUNNER = r"""
import json, os, resource, sys, traceback

def main():  # the token stays a local of this frame, not a global the solution could import from __main__
    job = json.loads(sys.stdin.read())  # the parent's one-time token and the files: nothing of them on disk before
    sys.stdin.close()
    token = job["token"]
    memory, cpu, files, sandboxed = (int(x) for x in sys.argv[1:5])
    for name in ("solution.py", "tests.py"):  # in the scratch folder, the working directory
        with open(name, "w", encoding="utf-8") as f:
            f.write(job[name] + "\n")
    del job
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_FSIZE, (files, files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.getuid() != 0:  # root ignores RLIMIT_NPROC; elsewhere it stops fork bombs
        resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
    namespace = {"__name__": "__main__"}
    try:
        for name in ("solution.py", "tests.py"):
            with open(name, encoding="utf-8") as f:
                source = f.read()
            exec(compile(source, name, "exec"), namespace)
    except SystemExit as stop:  # an exit before the tests' end is no pass, whatever its status
        sys.stderr.write(f"exited before the tests ended (exit status {stop.code!r})\n")
        sys.stderr.flush()
        os._exit(3)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    if sandboxed:  # in its own PID namespace every other process is the code's: one still running is no pass
        left = []
        for pid in os.listdir("/proc"):
            if pid.isdigit() and int(pid) not in (1, os.getpid()):
                try:
                    with open(f"/proc/{pid}/stat") as f:
                        if f.read().rpartition(")")[2].split()[0] != "Z":  # a zombie has ended
                            left.append(pid)
                except OSError:
                    pass
        if left:
            sys.stderr.write(f"left {len(left)} process(es) running after the tests\n")
            sys.stderr.flush()
            os._exit(4)
    sys.stdout.flush()
    os.write(1, ("\n" + token + "\n").encode())
    os._exit(0)

main()
"""
"""The sandbox's own first lines, run by `python -I -c` in the child: it reads the token and the files from stdin
and writes the files into its scratch folder (inside the sandbox that folder is a tmpfs the host never sees), sets
its limits (here, in the child: the `preexec_fn` of subprocess is unsafe beside threads, and code_tests runs
several at once), then runs the solution and the tests in one namespace. A pass is the exit status 0 AND the
parent's one-time token on the last line, which the runner writes only after the tests ran: `sys.exit(0)` or
`os._exit(0)` in the solution (reward hacks that a plain exit-status check counts as a pass) end the process
before it. In the sandbox, a process the code left running (a daemon, say) also fails it: the kernel kills it
when the sandbox ends, but the completion tried to outlive its run."""


class SandboxUnavailable(RewardError):
    """code_tests cannot isolate the code on this machine and was not allowed to run it unsandboxed."""


def sandbox_refusal(reason: str) -> str:
    """What code_tests says when it will not run: the missing piece and the option that would run it anyway."""
    return (f"code_tests runs code the model wrote and will not run it unsandboxed, but this machine cannot "
            f"sandbox it: {reason}. Install bubblewrap on a Linux kernel that allows user namespaces, or, to run "
            "the code with only the time, memory and file-size limits (it can then read and write your files and "
            "use the network), set the reward option `allow_unsandboxed: true` (rewards[i].kwargs).")


def run_python_tests(code: str, tests: str, timeout_s: float = 5.0, memory_mb: int = 512,
                     file_mb: int = 16, disk_mb: int = 64, sandbox: bool = True) -> tuple[bool, str]:
    """Run `code` followed by `tests` in a fresh Python process; (passed, why). See the module docstring.

    `sandbox=True` isolates it by the kernel (tidyrl.rewards.sandbox: no network, a read-only view of the system,
    a scratch tmpfs of `disk_mb`, its own PID namespace, an unprivileged user) and raises SandboxUnavailable where
    the machine cannot; `sandbox=False` keeps only the limits (time, memory, file size, a clean environment)."""
    import secrets

    if sandbox and sandbox_module.problem() is not None:
        raise SandboxUnavailable(sandbox_refusal(sandbox_module.problem()))
    token = secrets.token_hex(16)
    job = json.dumps({"token": token, "solution.py": code, "tests.py": tests or ""}).encode()
    limits = [str(memory_mb * 2**20), str(int(timeout_s) + 1), str(file_mb * 2**20), str(int(sandbox))]
    argv = [sys.executable, "-I", "-c", _RUNNER, *limits]
    # Outside the sandbox the scratch folder is a host folder, deleted afterwards; inside, the sandbox's own.
    scratch = None if sandbox else tempfile.mkdtemp(prefix="tidyrl-code-")
    home = sandbox_module.SCRATCH if sandbox else scratch
    env = {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1"}  # no proxies, tokens or the parent's PYTHONPATH
    if sandbox:
        argv = sandbox_module.command(argv, tmp_bytes=disk_mb * 2**20)
    try:
        # Output goes to an unlinked file, not a pipe: a process left holding a pipe would keep us waiting.
        with tempfile.TemporaryFile() as out:
            proc = subprocess.Popen(argv, cwd=scratch or "/", env=env, stdin=subprocess.PIPE, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            # The limit is a timer that kills the group, and the wait a blocking one: Popen.wait(timeout=...)
            # polls with sleeps growing to 50 ms, which added up to the run's own length to every completion.
            expired = threading.Event()
            timer = threading.Timer(timeout_s, _expire, (proc, expired))
            timer.start()
            try:
                proc.communicate(job)
            finally:
                timer.cancel()
            if expired.is_set():
                return False, f"timed out after {timeout_s} s"
            code_ = proc.returncode
            _kill_group(proc)  # outside the sandbox: anything it left running in the background
            out.seek(0)
            lines = out.read().decode("utf-8", "replace").strip().splitlines()
        if code_ == 0 and lines and lines[-1] == token:
            return True, "passed"
        if code_ == 0:
            return False, "exited before the tests ended (exit status 0)"
        return False, (lines[-1] if lines else f"exit status {code_}")
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def _expire(proc, expired: threading.Event) -> None:
    """The time limit: kill the whole group (the waiting thread then reaps it)."""
    expired.set()
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def code_tests(completions: Sequence[str], tests: Sequence[str], timeout_s: float = 5.0, memory_mb: int = 512,
               workers: int = 4, allow_unsandboxed: bool = False) -> list[float]:
    """1.0 where the completion's last code block passes the row's `tests` (Python asserts run after it), else
    0.0 (no code block, an error, a failed assert, over the time or memory limit, a process left running).
    Completions run concurrently, `workers` at a time, each in a sandbox of its own (tidyrl.rewards.sandbox).
    Where the machine cannot sandbox, this raises SandboxUnavailable, unless `allow_unsandboxed=True`: then the
    code runs with the limits only, and a warning says so once."""
    sandboxed = _sandboxed(allow_unsandboxed)

    def one(pair):
        completion, test = pair
        code = extract_code(completion)
        if code is None:
            return 0.0
        passed, _ = run_python_tests(code, test, timeout_s=timeout_s, memory_mb=memory_mb, sandbox=sandboxed)
        return 1.0 if passed else 0.0

    pairs = list(zip(completions, tests))
    if not pairs:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(pairs)))) as pool:
        return list(pool.map(one, pairs))


_warned: set = set()


def _sandboxed(allow_unsandboxed: bool) -> bool:
    """Whether code_tests can sandbox here; raises SandboxUnavailable when not and not allowed to go without."""
    reason = sandbox_module.problem()
    if reason is None:
        return True
    if not allow_unsandboxed:
        raise SandboxUnavailable(sandbox_refusal(reason))
    if reason not in _warned:
        _warned.add(reason)
        say(f"warning: {_unsandboxed_note(reason)}", err=True)
    return False


def _unsandboxed_note(reason: str) -> str:
    return (f"code_tests runs the completions' code WITHOUT a sandbox (allow_unsandboxed: true; {reason}): it can "
            "read and write your files and use the network")


def _code_tests_before_run(allow_unsandboxed: bool = False, **_options) -> str:
    """Checked before the run starts (tidyrl.loops.rl.inputs, `tidyrl plan` too): raises SandboxUnavailable, or
    returns a warning line when the code will run unsandboxed, else ""."""
    reason = sandbox_module.problem()
    if reason is None:
        return ""
    if not allow_unsandboxed:
        raise SandboxUnavailable(sandbox_refusal(reason))
    return f"warning: {_unsandboxed_note(reason)}"


code_tests.before_run = _code_tests_before_run
"""A reward function may carry `before_run(**options) -> str`: the loop calls it with the reward's options before
any weights load; it raises to stop the run, or returns a line for the run's report."""

"""code_tests' sandbox under attack: completions that try to write outside their scratch folder, read
the run's files, reach 127.0.0.1, fork without bound, outlive their parent, fill the disk or read the trainer's
environment are each blocked and score 0, and the run's files are byte-identical afterwards. Where this machine
cannot sandbox, the attacks skip (with the reason) and the refusal is tested instead: it names what is missing and
the option that opts out, before the run starts (`tidyrl plan` included)."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import write_jsonl

import tidyrl
from tidyrl.rewards import sandbox
from tidyrl.rewards.verifiable import SandboxUnavailable, code_tests, run_python_tests

NO_SANDBOX = sandbox.problem()
needs_sandbox = pytest.mark.skipif(NO_SANDBOX is not None, reason=f"this machine cannot sandbox: {NO_SANDBOX}")

TESTS = "assert add(2, 3) == 5"
ADD = "def add(a, b):\n    return a + b\n"
SETPRIV = shutil.which("setpriv") or shutil.which("setpriv", path="/usr/bin:/bin:/usr/sbin:/sbin")
MARK = "31337.4242"  # a sleep length no other process on the machine uses: how survivors are found


def block(attack: str) -> str:
    """A completion that attacks, then solves the task: it scores 1 only if the attack went through."""
    return f"```python\n{attack}\n{ADD}```"


def tree_digest(*roots: Path) -> dict:
    """Every file under `roots`, by path: its bytes' sha256 (what 'byte-identical afterwards' compares)."""
    digest = {}
    for root in roots:
        for path in sorted(root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                digest[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return digest


def survivors() -> list[str]:
    """Processes left from the attacks (their command line carries MARK), after a moment for the kernel."""
    found = []
    for _ in range(20):
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if MARK.encode() in cmdline and b"pytest" not in cmdline:
                found.append(pid)
        if not found:
            return []
        time.sleep(0.1)
    return found


@pytest.fixture
def run_dir(tmp_path):
    """A run's output directory as a run leaves it: config, metrics, a checkpoint."""
    run = tmp_path / "run"
    (run / "checkpoint-2").mkdir(parents=True)
    (run / "config.yaml").write_text("algorithm: grpo\nmodel: m\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 0.5}\n')
    (run / "checkpoint-2" / "model.safetensors").write_bytes(os.urandom(4096))
    return run


@pytest.fixture
def listener():
    """A TCP server of the trainer's on 127.0.0.1: (port, the bytes anyone sent it)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    received, stop = [], threading.Event()

    def serve():
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            received.append(conn.recv(100))
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], received
    stop.set()
    thread.join()
    server.close()


@needs_sandbox
def test_attacks_are_blocked_score_0_and_leave_the_run_byte_identical(run_dir, listener, monkeypatch):
    package = Path(tidyrl.__file__).parent
    site = __import__("sysconfig").get_paths()["purelib"]
    port, received = listener
    secret = "s3cret-" + os.urandom(8).hex()
    monkeypatch.setenv("TIDYRL_TEST_SECRET", secret)  # the trainer's environment: a credential
    before = tree_digest(run_dir, package)
    attacks = {
        "write the run's config": f"open({str(run_dir / 'config.yaml')!r}, 'w').write('pwned')",
        "add a file to the run": f"open({str(run_dir / 'checkpoint-2' / 'evil.py')!r}, 'w').write('pwned')",
        "write the package": f"open({str(package / 'rewards' / 'verifiable.py')!r}, 'a').write('# pwned')",
        "write site-packages": f"open({site!r} + '/tidyrl_pwned.pth', 'w').write('import os')",
        "read the run's checkpoint": (f"stolen = open({str(run_dir / 'checkpoint-2' / 'model.safetensors')!r}, "
                                      "'rb').read()\nassert stolen"),
        "socket to 127.0.0.1": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'pwned')",
        "fork bomb": "import os\nwhile True:\n    os.fork()",
        "fork bomb of sleepers": f"import os\nwhile True:\n    if os.fork() == 0:\n        os.execv('/bin/sleep', ['sleep', '{MARK}'])",
        "outlive the parent": (f"import subprocess\nsubprocess.Popen(['sleep', '{MARK}'], start_new_session=True, "
                               "stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)"),
        "double-forked daemon": (f"import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                                 f"        os.execv('/bin/sleep', ['sleep', '{MARK}'])\n    os._exit(0)\nos.wait()"),
        "fill the disk": "i = 0\nwhile True:\n    open(f'fill{i}', 'wb').write(b'x' * (8 << 20))\n    i += 1",
        "fill /dev/shm": "open('/dev/shm/fill', 'wb').write(b'x' * (8 << 20))",
        "read the trainer's environment": (
            "import os\nfound = [v for v in os.environ.values() if v.startswith('s3cret-')]\n"
            "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
            "    try:\n        found += [pid] if b's3cret-' in open(f'/proc/{pid}/environ', 'rb').read() else []\n"
            "    except OSError:\n        pass\n"
            f"found += [1] if os.path.exists('/proc/{os.getpid()}/environ') and b's3cret-' in "
            f"open('/proc/{os.getpid()}/environ', 'rb').read() else []\nassert found"),
    }
    start = time.perf_counter()
    scores = code_tests([block(a) for a in attacks.values()], [TESTS] * len(attacks), timeout_s=10)
    assert dict(zip(attacks, scores)) == dict.fromkeys(attacks, 0.0)
    assert time.perf_counter() - start < 30  # each ended by the kernel's refusal, not the 10 s limit
    assert tree_digest(run_dir, package) == before  # byte-identical, and no file added
    assert not os.path.exists(site + "/tidyrl_pwned.pth")
    assert received == []  # nothing reached the trainer's server
    assert survivors() == []  # the PID namespace took every process with it
    # what each attack met: the kernel, not a Python-level check
    why = {name: run_python_tests(attack + "\n" + ADD, TESTS, timeout_s=10)[1] for name, attack in attacks.items()}
    assert "No such file or directory" in why["write the run's config"]  # the run is not in the sandbox's view
    assert "No such file or directory" in why["read the run's checkpoint"]
    assert "Read-only file system" in why["write site-packages"]  # Python is, read-only
    assert "Connection refused" in why["socket to 127.0.0.1"]  # its own loopback, nothing listening
    start = time.perf_counter()  # RLIMIT_NPROC binds (the code is not root): the bomb fails at once, no timer
    assert run_python_tests(attacks["fork bomb"] + "\n" + ADD, TESTS, timeout_s=10)[0] is False
    assert time.perf_counter() - start < 5
    assert why["outlive the parent"] == why["double-forked daemon"] == "left 1 process(es) running after the tests"
    assert "No space left on device" in why["fill the disk"]  # its tmpfs is full, not the host's disk
    assert "Read-only file system" in why["fill /dev/shm"]
    assert why["read the trainer's environment"].startswith("AssertionError")
    assert survivors() == []


@needs_sandbox
def test_without_the_sandbox_the_same_attacks_go_through(tmp_path, listener):
    """The contrast that shows the attack tests can fail: unsandboxed, a write lands and a socket connects."""
    port, received = listener
    canary = tmp_path / "canary"
    write = f"open({str(canary)!r}, 'w').write('pwned')"
    assert run_python_tests(write + "\n" + ADD, TESTS, sandbox=False) == (True, "passed") and canary.exists()
    canary.unlink()
    assert run_python_tests(write + "\n" + ADD, TESTS)[0] is False and not canary.exists()
    connect = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')"
    assert run_python_tests(connect + "\n" + ADD, TESTS, sandbox=False) == (True, "passed")
    for _ in range(20):
        if received:
            break
        time.sleep(0.05)
    assert received == [b"hi"]


# What the code finds in the sandbox (run as the completion, from this file's own Python and from a venv under /tmp)
UNPRIVILEGED_IN_NAMESPACES = (
    "import os, socket, subprocess\nassert os.getuid() != 0 and os.getgid() != 0\n"
    f"assert os.getcwd() == {sandbox.SCRATCH!r}, os.getcwd()\n"
    "assert sorted(os.listdir('.')) == ['solution.py', 'tests.py'], os.listdir('.')\n"
    f"assert not os.path.exists({__file__!r})\n"  # the host's files: not in the view
    "assert not any(os.path.exists(d) for d in ('/home', '/var', '/run', '/mnt', '/srv'))\n"
    "assert socket.if_nameindex() == [(1, 'lo')]\n"  # no interface but a loopback of its own
    "status = open('/proc/self/status').read()\n"
    "assert 'CapEff:\\t0000000000000000' in status and 'NoNewPrivs:\\t1' in status, status\n"
    "assert sorted(p for p in os.listdir('/proc') if p.isdigit()) == ['1', str(os.getpid())]\n"
    "assert subprocess.run(['unshare', '--user', 'true'], stderr=subprocess.DEVNULL).returncode != 0\n"
    "open('note.txt', 'w').write('the scratch folder is writable')\n"
    "open('/tmp/note.txt', 'w').write('and so is /tmp')\n")


@needs_sandbox
def test_the_sandbox_runs_as_an_unprivileged_user_in_its_own_namespaces():
    assert run_python_tests(UNPRIVILEGED_IN_NAMESPACES, "") == (True, "passed")


def _sandbox_says(monkeypatch, *, path=None, platform=None):
    """sandbox.problem() re-probed under another PATH or platform (the cache cleared before and after)."""
    sandbox.problem.cache_clear()
    if path is not None:
        monkeypatch.setenv("PATH", str(path))
    if platform is not None:
        monkeypatch.setattr(sys, "platform", platform)
    return sandbox.problem()


@pytest.fixture
def fresh_probe():
    sandbox.problem.cache_clear()
    yield
    sandbox.problem.cache_clear()


def test_code_tests_refuses_where_the_kernel_cannot_isolate_and_names_the_opt_out(tmp_path, monkeypatch,
                                                                                  fresh_probe, capsys):
    empty = tmp_path / "bin"
    empty.mkdir()
    reason = _sandbox_says(monkeypatch, path=empty)
    assert reason.startswith("bubblewrap is not installed") and "apt-get install bubblewrap" in reason
    completion = f"```python\n{ADD}```"
    with pytest.raises(SandboxUnavailable) as refused:
        code_tests([completion], [TESTS])
    assert "bubblewrap is not installed" in str(refused.value) and "allow_unsandboxed: true" in str(refused.value)
    with pytest.raises(SandboxUnavailable):
        run_python_tests(ADD, TESTS)
    monkeypatch.setattr("tidyrl.rewards.verifiable._warned", set())  # the warning comes once per process
    assert code_tests([completion], [TESTS], allow_unsandboxed=True) == [1.0]  # the explicit opt-in: limits only
    assert "WITHOUT a sandbox" in capsys.readouterr().err

    # a kernel (or a container) without user namespaces: bwrap itself says no
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "bwrap").write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace, likely because "
                                "the kernel does not allow non-privileged user namespaces.' >&2\nexit 1\n")
    (fake / "bwrap").chmod(0o755)
    if SETPRIV:
        (fake / "setpriv").symlink_to(SETPRIV)
    reason = _sandbox_says(monkeypatch, path=fake)
    assert "No permissions to creating new namespace" in reason and "user namespaces may be disabled" in reason
    with pytest.raises(SandboxUnavailable, match="allow_unsandboxed"):
        code_tests([completion], [TESTS])

    assert "needs Linux namespaces; this is darwin" in _sandbox_says(monkeypatch, platform="darwin")  # macOS


def _code_run_config(tiny_model_dir, tmp_path, **kwargs) -> Path:
    data = write_jsonl(tmp_path / "code.jsonl", [{"prompt": "Write add(a, b).", "tests": TESTS}] * 4)
    config = {"algorithm": "grpo", "model": str(tiny_model_dir), "output_dir": str(tmp_path / "run"),
              "data": {"path": str(data)},
              "rewards": [{"function": "tidyrl.rewards.verifiable:code_tests", "kwargs": {"timeout_s": 2, **kwargs}}],
              "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 2, "max_new_tokens": 4},
              "train": {"rollouts": 1, "micro_batch_size": 4}}
    path = tmp_path / "code.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_tidyrl_plan_refuses_before_the_run_and_warns_when_opted_in(tiny_model_dir, tmp_path):
    """`tidyrl plan` (the checks a run makes before loading weights) on a machine without bubblewrap: PATH lacks it."""
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {**os.environ, "PATH": str(empty)}
    config = _code_run_config(tiny_model_dir, tmp_path)
    done = subprocess.run([sys.executable, "-m", "tidyrl", "plan", str(config)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "rewards[0] (code_tests): code_tests runs code the model wrote and will not run it unsandboxed" in done.stderr
    assert "bubblewrap is not installed" in done.stderr and "allow_unsandboxed: true" in done.stderr
    assert not (tmp_path / "run").exists()  # nothing of a run started
    config = _code_run_config(tiny_model_dir, tmp_path, allow_unsandboxed=True)
    done = subprocess.run([sys.executable, "-m", "tidyrl", "plan", str(config)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "tidyrl: rewards[0] (code_tests): warning: code_tests runs the completions' code WITHOUT a sandbox" in done.stderr
    assert '"total_episodes": 4' in done.stdout


@needs_sandbox
def test_a_grpo_run_rewarded_by_code_tests_in_the_sandbox(tiny_model_dir, tmp_path):
    config = yaml.safe_load(_code_run_config(tiny_model_dir, tmp_path).read_text())
    config["log"] = {"progress_bar": False}
    result = tidyrl.train(config)
    rows = [__import__("json").loads(line) for line in (result.output_dir / "metrics.jsonl").open()]
    assert rows and rows[0]["reward/code_tests"] == 0.0  # a tiny random model writes no code block


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3") or shutil.which("setpriv") is None
                    or NO_SANDBOX is not None, reason="needs root (to become nobody), /usr/bin/python3 and a sandbox")
def test_the_sandbox_of_an_unprivileged_trainer():
    """A trainer that is not root: one bwrap, which makes its own user namespace. Run as nobody, with the system's
    Python (readable by nobody), the sandbox module's source given on the command line."""
    source = Path(sandbox.__file__).read_text()
    probe = source + (
        "\nimport os, subprocess, sys\nassert os.geteuid() != 0\nassert problem() is None, problem()\n"
        "code = ('import os, socket\\nopen(\"note\", \"w\").write(\"ok\")\\n'\n"
        "        'for p in (\"/usr/pwned\", \"/etc/pwned\", \"/dev/shm/pwned\"):\\n'\n"
        "        '    try:\\n        open(p, \"w\")\\n        raise SystemExit(\"wrote \" + p)\\n'\n"
        "        '    except OSError:\\n        pass\\n'\n"
        "        'assert socket.if_nameindex() == [(1, \"lo\")]\\n'\n"
        "        'assert not os.path.exists(\"/root\") and not os.path.exists(\"/work\")\\n'\n"
        "        'print(\"sandboxed\", os.getuid())')\n"
        "done = subprocess.run(command([sys.executable, '-I', '-c', code]), capture_output=True, text=True)\n"
        "print(done.stdout, done.stderr)\nassert done.returncode == 0\n")
    done = subprocess.run([shutil.which("setpriv"), "--reuid=65534", "--regid=65534", "--clear-groups", "--",
                           "/usr/bin/python3", "-I", "-c", probe], capture_output=True, text=True, cwd="/",
                          env={"PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "sandboxed 65534" in done.stdout


def test_the_benchmark_prints_completions_per_second_with_and_without_the_sandbox():
    bench = Path(__file__).parent.parent / "benchmarks" / "bench_code_sandbox.py"
    done = subprocess.run([sys.executable, str(bench), "--completions", "4", "--rounds", "1", "--workers", "1", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("  ")[0].strip(): line for line in done.stdout.splitlines()}
    for name in ("unsandboxed x1", "unsandboxed x2") + (() if NO_SANDBOX else ("sandboxed x1", "sandboxed x2")):
        assert "completions/s" in rows[name] and float(rows[name].split()[2]) > 0, done.stdout
    assert ("sandbox cost" in done.stdout) == (NO_SANDBOX is None)
    assert NO_SANDBOX is None or f"sandbox: unavailable here ({NO_SANDBOX})" in done.stdout


def test_tidyrl_eval_refuses_before_it_generates_where_code_cannot_be_sandboxed(tiny_model_dir, prompt_file, tmp_path,
                                                                               monkeypatch, fresh_probe):
    """`tidyrl eval` asks the rewards' before-the-run checks too: refused before the model loads, not at the first
    scoring after generation."""
    import tidyrl.models.loading as loading
    from tidyrl.evaluate import evaluate

    empty = tmp_path / "bin"
    empty.mkdir()
    assert _sandbox_says(monkeypatch, path=empty).startswith("bubblewrap is not installed")
    monkeypatch.setattr(loading, "load_causal_lm", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(SandboxUnavailable, match=r"rewards\[0\] \(code_tests\).*allow_unsandboxed: true"):
        evaluate(model=str(tiny_model_dir), data=str(prompt_file),
                 rewards=["tidyrl.rewards.verifiable:code_tests"], output_dir=tmp_path / "eval", quiet=True)


@needs_sandbox
def test_a_python_installed_under_tmp_is_seen_over_the_sandboxs_fresh_tmp(tmp_path):
    """A venv under /tmp (pytest's tmp_path is there, and so is many a user's first checkout): the sandbox's /tmp
    is a fresh tmpfs, which would hide that Python; its folders are bound again over it, read-only, and the
    working directory, a path of the sandbox's own, stays writable and holds only what the sandbox put there. The
    completion's checks of the sandbox pass from that venv as from this one."""
    import venv

    if not str(tmp_path).startswith("/tmp/"):
        pytest.skip(f"tmp_path is not under /tmp here ({tmp_path})")
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, symlinks=True).create(env_dir)
    probe = ("import subprocess, sys\nfrom tidyrl.rewards.sandbox import command, problem\n"
             "assert problem() is None, problem()\n"
             "code = ('import os\\nopen(\"note\", \"w\").write(\"ok\")\\n'\n"
             "        'assert not os.path.exists(\"/work\")\\n'\n"
             "        'try:\\n    open(sys.prefix + \"/pwned\", \"w\")\\n    raise SystemExit(\"wrote\")\\n'\n"
             "        'except OSError:\\n    pass\\n'\n"
             "        'import sys\\nprint(\"sandboxed\", sys.prefix)')\n"
             "done = subprocess.run(command([sys.executable, '-I', '-c', 'import sys\\n' + code]), capture_output=True,"
             " text=True)\nprint(done.stdout, done.stderr)\nassert done.returncode == 0\n"
             "from tidyrl.rewards.verifiable import run_python_tests\n"
             f"print('in namespaces', run_python_tests({UNPRIVILEGED_IN_NAMESPACES!r}, ''))\n")
    src = Path(sandbox.__file__).resolve().parents[2]
    done = subprocess.run([str(env_dir / "bin" / "python"), "-c", probe], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(src)}, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"sandboxed {env_dir}" in done.stdout
    assert "in namespaces (True, 'passed')" in done.stdout, done.stdout

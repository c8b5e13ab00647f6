"""Kernel isolation for code a model wrote (used by `verifiable.code_tests`), through bubblewrap.

Why bubblewrap (`bwrap`, Debian/Ubuntu/Fedora package `bubblewrap`): it is the maintained, audited tool that
Flatpak builds its sandboxes with; it sets up the namespaces, mounts and capability drops in the right order in
one small C program, where doing it by hand (`unshare` + mounts + capsets) is easy to get subtly wrong. What it
adds to a run: benchmarks/bench_code_sandbox.py, docs/benchmarks.md.

What a sandboxed command gets:
- its own network namespace: only a loopback of its own (no route out, nothing of the host's 127.0.0.1);
- its own mount namespace with a read-only view of the system (/usr, /etc, /bin, /lib...) and of the Python
  installation (sys.prefix, sys.base_prefix), nothing else of the host's file system (no /home, /root, /work,
  /tmp, /var, /run: the run's output directory and the user's files are not there to read), a fresh /proc of its
  own PID namespace, a minimal read-only /dev, and two writable tmpfs of `tmp_bytes` each (a full disk is its
  own, and they vanish with the sandbox): its working directory `SCRATCH`, a path of the sandbox's own that holds
  only what the sandbox puts there, and /tmp. A Python installed under /tmp (a venv there) is bound again over
  the fresh /tmp, read-only, at its own path: it shows in /tmp, never in the working directory;
- its own PID namespace: when the command ends, the kernel kills every process left in it (a fork bomb, a
  daemon that double-forked); bwrap's --die-with-parent kills it if the trainer dies;
- its own user, IPC, UTS and cgroup namespaces, no capabilities, no further user namespaces (--disable-userns:
  no tmpfs or mounts of its own), a new session (no terminal to inject into);
- an unprivileged user: when the trainer runs as root, a first bwrap (as root, so it can read the interpreter
  wherever it lives, e.g. under /root) builds the read-only view, `setpriv` (util-linux) drops to `nobody`,
  and a second bwrap builds the sandbox from there. The code then runs as uid 65534 in a user namespace of its
  own, so RLIMIT_NPROC binds (the kernel exempts root from it) and counts this sandbox's processes only.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from typing import Optional

NOBODY = 65534
"""The unprivileged uid/gid a root trainer's sandboxes run as (Debian's nobody/nogroup)."""
SCRATCH = "/sandbox"
"""The working directory inside the sandbox: a tmpfs at a path of the sandbox's own, not the host's /tmp, where
a checkout and its venv often live."""


def _python_dirs() -> list[str]:
    """The Python installation, as this process sees it: the venv and the interpreter it was made from."""
    dirs = set()
    for path in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):
        dirs.update((os.path.abspath(path), os.path.realpath(path)))  # a venv reached through a symlink
    return sorted(dirs)


def _view() -> list[str]:
    """bwrap arguments for the read-only view: the system's directories and the Python installation. Parents of
    a bound directory are created 0755 (bwrap's default, 0700, would shut the unprivileged user out)."""
    args, binds = [], ["/usr", "/etc"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):  # merged /usr: keep the symlink
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            binds.append(top)
    for path in _python_dirs():
        if path != "/" and not any(path == b or path.startswith(b.rstrip("/") + "/") for b in binds):
            binds.append(path)
    made = set()
    for path in sorted(binds):
        parts = path.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            parent = "/" + "/".join(parts[:i])
            if parent not in made and parent not in binds:
                made.add(parent)
                args += ["--perms", "0755", "--dir", parent]
        args += ["--ro-bind", path, path]
    return args


_NAMESPACES = ["--unshare-user", "--disable-userns", "--unshare-ipc", "--unshare-pid", "--unshare-net",
               "--unshare-uts", "--unshare-cgroup-try", "--die-with-parent", "--new-session"]


def command(argv: list[str], tmp_bytes: int = 64 * 2**20) -> list[str]:
    """The command line that runs `argv` (an interpreter of the view, e.g. sys.executable) in the sandbox, its
    working directory `SCRATCH`, a fresh tmpfs of `tmp_bytes` (and /tmp another). Check `problem()` first."""
    bwrap = shutil.which("bwrap")
    inner = ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/dev"]  # /dev/shm would be an unbounded tmpfs
    for top in ("/tmp", SCRATCH):
        inner += ["--size", str(int(tmp_bytes)), "--tmpfs", top]
        for path in _python_dirs():  # a Python installed under it (a venv under /tmp): bound again over the tmpfs
            if path.startswith(top + "/"):
                inner += ["--ro-bind", path, path]
    inner += ["--chdir", SCRATCH]
    if os.geteuid() != 0:  # unprivileged already: one bwrap, which makes its user namespace itself
        return [bwrap, *_NAMESPACES, *_view(), *inner, *argv]
    # root: build the view as root (it can read a Python under /root), drop to nobody, sandbox from there. The
    # outer bwrap only makes a mount namespace; /proc is the host's for the inner bwrap's sake (the kernel lets a
    # user namespace mount a new proc only where a full one is visible), then hidden under the sandbox's own.
    setpriv = shutil.which("setpriv")
    return [bwrap, "--die-with-parent", *_view(), "--dir", "/tmp", "--dir", SCRATCH, "--bind", "/proc", "/proc",
            "--dev", "/dev",
            setpriv, f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
            bwrap, *_NAMESPACES, "--ro-bind", "/", "/", *inner, *argv]


@functools.lru_cache(maxsize=None)
def problem() -> Optional[str]:
    """Why this machine cannot sandbox (one line), or None when it can. Checked once per process by running the
    sandbox for real: a container without user namespaces, a kernel that forbids them, a missing tool."""
    if not sys.platform.startswith("linux"):
        return f"the kernel isolation needs Linux namespaces; this is {sys.platform}"
    if shutil.which("bwrap") is None:
        return ("bubblewrap is not installed (no `bwrap` on PATH; Debian/Ubuntu: apt-get install bubblewrap, "
                "Fedora: dnf install bubblewrap)")
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return "running as root, the sandbox drops to an unprivileged user with `setpriv` (util-linux), not on PATH"
    try:
        done = subprocess.run(command([sys.executable, "-I", "-S", "-c", "pass"]), capture_output=True,
                              stdin=subprocess.DEVNULL, env={"PATH": "/usr/bin:/bin"}, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"bwrap did not start ({err})"
    if done.returncode != 0:
        said = done.stderr.decode("utf-8", "replace").strip().splitlines()
        return (f"bwrap could not build the sandbox ({said[-1] if said else f'exit status {done.returncode}'}); "
                "user namespaces may be disabled (a container without them, or a sysctl such as "
                "kernel.unprivileged_userns_clone=0 or user.max_user_namespaces=0)")
    return None

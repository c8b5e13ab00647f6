"""One run per output folder: a lock the run holds for its lifetime.

Two runs writing one `output_dir` corrupt each other (one deletes checkpoints the other is about to load,
both append to metrics.jsonl). So a run takes `output_dir/.tidyrl.lock` before it writes anything:

- the lock is the kernel's (`fcntl.flock`): it is released when the process ends, however it ends (kill -9
  included), so a crash never leaves a folder locked;
- the file holds a JSON record of the holder (pid, host, start time, command), so a second run can say who
  holds the folder, and a record left behind by a process that died without cleaning up is recognised as
  stale (nobody holds the kernel lock), reported, and replaced.

On file systems without `flock` (some network mounts) the record alone decides: a record of a live process on
this host, or of any process on another host, holds the folder.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from tidyrl.console import say

LOCK_NAME = ".tidyrl.lock"


class RunLockError(RuntimeError):
    """Another run holds the output folder."""


def _record() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": shlex.join(sys.orig_argv)}


def _read(path: Path) -> Optional[dict]:
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def describe(record: Optional[dict]) -> str:
    """`pid 123 on host h, started ..., command: ...` (whatever the record holds)."""
    if not record:
        return "a process that left no readable record"
    return (f"pid {record.get('pid')} on host {record.get('host')}, started {record.get('started')}, "
            f"command: {record.get('command')}")


def _alive_here(record: dict) -> bool:
    """Whether the record's process runs on this host (a process on another host cannot be checked: assume so)."""
    if record.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(record.get("pid")), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError):
        return True  # exists, owned by someone else (or an unreadable pid: do not take over)
    return True


class RunLock:
    """The lock on one output folder. `acquire()` takes it or raises RunLockError naming the holder; `release()`
    (also on process exit, by the kernel) gives it back. `stale` is the record of a dead holder it replaced."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_NAME
        self.stale: Optional[dict] = None
        self._fd: Optional[int] = None

    def acquire(self) -> "RunLock":
        self.folder.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            taken = _flock(fd)
            # The holder before us may have removed the file between our open and our flock: then we locked
            # a file nobody else will see. Lock the one at the path, or try again.
            if taken is False or _same_file(fd, self.path):
                break
            os.close(fd)
        previous = _read(self.path)
        if taken is False or (taken is None and previous and _alive_here(previous)):
            os.close(fd)
            raise RunLockError(self._held_message(previous))
        self._fd = fd
        self.stale = previous  # a record nobody holds: its process died without releasing it
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_record()).encode(), 0)
        os.fsync(fd)
        return self

    def release(self) -> None:
        """Remove the record and drop the lock (removed first, while still held, so no run reads a half-gone one)."""
        if self._fd is None:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def _held_message(self, record: Optional[dict]) -> str:
        return (f"output_dir {self.folder} is in use by another tidyrl run ({describe(record)}). Two runs in one "
                "folder would overwrite each other's checkpoints and metrics. Wait for that run to finish or stop "
                f"it, or choose another `output_dir`. If that run is gone (e.g. on another host), delete "
                f"{self.path}.")


def _flock(fd: int) -> Optional[bool]:
    """Take the kernel lock without waiting: True if taken, False if another process holds it, None where the
    file system (or the OS) has no flock."""
    try:
        import fcntl
    except ImportError:  # Windows
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError:  # ENOLCK, EOPNOTSUPP: a file system without flock
        return None
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (mine.st_dev, mine.st_ino)


_held: dict[Path, RunLock] = {}
"""The locks this process holds, by folder: taken by `hold_output_dir`, given back by `release_output_dir`."""


def hold_output_dir(folder: Path, accelerator) -> None:
    """Lock `folder` for this run (the main process takes it; every process raises the same RunLockError when
    another run holds it, so none waits on a sibling that gave up). Says so when it replaces a stale record."""
    folder = Path(folder).resolve()
    problem = None
    if accelerator.is_main_process and folder not in _held:
        try:
            lock = RunLock(folder).acquire()
        except RunLockError as err:
            problem = str(err)
        except OSError as err:  # the folder cannot be created or written: say so in every process
            problem = (f"output_dir {folder} cannot be created or written ({type(err).__name__}: {err}); choose "
                       "another `output_dir` or fix its permissions.")
        else:
            _held[folder] = lock
            if lock.stale:
                say(f"{folder} had a lock left by a run that is gone ({describe(lock.stale)}); taking it over.")
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        problem = broadcast_object_list([problem], from_process=0)[0]
    if problem:
        raise RunLockError(problem)


def release_output_dir(folder) -> None:
    """Give back the lock `hold_output_dir` took on `folder` (nothing if none is held)."""
    lock = _held.pop(Path(folder).resolve(), None)
    if lock is not None:
        lock.release()

"""What this process last got done, and when: the one record the fault watch (`loops.run.faults`) reads to tell a
process that is working from one that hangs. The loops, the rollouts, the engines and the rewards mark each piece of
work they finish (a generation batch, a reward call, a scoring chunk, a micro-batch of the update, a checkpoint);
marking is two assignments, cheap enough for every batch. Every part but the algorithms may use it; it imports no
part (tests/test_layers.py)."""

from __future__ import annotations

import time

_last: tuple[float, float, str] = (time.monotonic(), time.time(), "starting")


def mark(what: str) -> None:
    """Record that this process has just finished (or started) `what`, a few words a person reads in a hang's
    message, e.g. "generated sequences 1-8 of 32". Any thread may call it; the newest mark counts."""
    global _last
    _last = (time.monotonic(), time.time(), what)


def last() -> tuple[float, str]:
    """(time.time() of the newest mark, its words): the wall clock, which processes on several machines share."""
    return _last[1], _last[2]


def idle_s() -> float:
    """Seconds since the newest mark (this process's monotonic clock)."""
    return time.monotonic() - _last[0]

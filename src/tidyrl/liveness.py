"""What this process last got done, and when, and what it was working on: the record the fault watch
(`loops.run.faults`) reads to tell a process that is working from one that hangs, and the one an out-of-memory
error's message (`loops.run.out_of_memory`) reads to say where it struck (`struck_in`). The loops, the rollouts,
the engines and the rewards mark each piece of work they finish (a generation batch, a reward call, a scoring
chunk, a micro-batch of the update, a checkpoint) and wrap each in the phase of the memory plan it belongs to, with
its shapes; each is a few assignments, cheap enough for every batch. Every part but the algorithms may use it; it imports no part
(tests/test_layers.py)."""

from __future__ import annotations

import contextlib
import time
from typing import Optional

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


@contextlib.contextmanager
def working(phase: str, shapes: str):
    """Around a piece of work of `phase` of the memory plan ("generation", "scoring", "update") on `shapes`,
    words such as "8 sequences of up to 40 prompt + 32 new tokens": an exception that leaves it is tagged with
    both (the innermost `working` it leaves), which `struck_in` reads where it is caught, on whichever thread."""
    try:
        yield
    except BaseException as err:
        if getattr(err, "_tidyrl_working", None) is None:
            try:
                err._tidyrl_working = (phase, shapes)
            except AttributeError:  # (an exception type without a __dict__)
                pass
        raise


def struck_in(err: BaseException) -> Optional[tuple[str, str]]:
    """(phase, shapes) of the innermost `working` that `err` left, or None."""
    return getattr(err, "_tidyrl_working", None)

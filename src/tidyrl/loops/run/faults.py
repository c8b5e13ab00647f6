"""A fault on one process ends every process of the run, within seconds, with that process's message.

Without this, one process that fails leaves the others waiting in their next collective until its timeout (30
minutes), and one that hangs leaves them all waiting forever. Under torchrun (and `accelerate launch`, which runs
it) a process that exits is seen by the launcher, which stops the others; a process that hangs is not, nor is a
process on another machine, nor any of it under a launcher that is not torchrun. So each process of a multi-process
run holds a `FaultWatch`: a thread with its own connection to the launch's key-value store (the TCP store at
MASTER_ADDR:MASTER_PORT that the process group was formed through), which every `BEAT_S`

- writes this process's beat: a counter, when it last finished a piece of work and what (`tidyrl.liveness`, which
  the loops, rollouts, engines and rewards mark), and whether it waits in a collective (`waiting_for_others`);
- reads the run's fault key: a fault another process posted there (its kind and message) (`report`, called as a run's exception leaves
  `tidyrl.train`) ends this process at once with that message (os._exit: a process waiting in a collective cannot be
  stopped any other way; every file the run writes is flushed line by line or written whole and renamed, so nothing
  written is lost);
- ends the run when this process has finished no work for `train.watchdog_s` (a hang: a reward function that never
  returns, a collective one process never reaches, a driver that wedged): the message names the process whose last
  finished work is the oldest (the one that hangs: the others went on until a collective it never joined), and
  every process prints its threads' stacks as it ends, so the output shows where each one was;
- on the main process, reads every other process's beat every `SILENT_CHECK_S`: a process whose beat stops for
  `SILENT_S` has died without a word (SIGKILL, the host's out-of-memory killer) and the run ends naming it.

The store's keys are scoped by the launch's run id, its restart count (torchrun's elastic restarts use the same store)
and the number of runs this process has started, so a restarted or second run never reads an earlier one's fault.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from itertools import count
from typing import Optional

from tidyrl import liveness
from tidyrl.console import say

BEAT_S = 1.0
"""How often each process writes its beat and reads the fault key: the bound on how long a posted fault takes to end
every process."""
SILENT_S = 20.0
"""A process whose beat has not changed for this long is gone (its watch thread writes every BEAT_S whatever the
process is doing; 20x leaves room for a busy host)."""
SILENT_CHECK_S = 5.0
"""How often the main process reads the other processes' beats."""
EXIT_GRACE_S = 2.0
"""How long a process waits, once another has posted its failure, before it ends (the failing one ends first), and
how long the process that posts a hang's verdict waits after printing it (the others read and print it first)."""
EXIT_CODE = 3
"""The exit status of a process the watch ends (it did not fail itself: another one did, or it hung)."""
_runs = count()
_current: Optional["FaultWatch"] = None


BROKEN_COLLECTIVE = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted")
"""What gloo's and NCCL's errors say when another process of the collective has gone."""
FAILED, HANGS, SILENT = "failed", "hangs", "silent"
"""The kinds of fault a process posts: its own exception, a hang, a process that stopped answering."""


def broke_collective(err: BaseException) -> bool:
    """Whether `err` is a collective's error because another process of it has gone."""
    return any(words in str(err) for words in BROKEN_COLLECTIVE)


def message_of(err: BaseException) -> str:
    """The words a fault posts: tidyrl's own errors say what is wrong and how to fix it; another exception is named
    with its type, and a collective another process broke by ending says so."""
    text = str(err)
    if type(err).__module__.startswith("tidyrl"):
        return text
    if broke_collective(err):
        text = (f"{text.splitlines()[0] if text else ''} -- another process ended without a word (killed, or the "
                "host's out-of-memory killer): the launcher's summary names it and its exit status")
    return f"{type(err).__name__}: {text}"


class FaultWatch:
    """One process's watch over the run (the module docstring has what it does). `store`: a client of the launch's
    key-value store (`set`, `get`, `check`, `compare_set`); `watchdog_s`: seconds without finished work that make a
    hang (0: never)."""

    def __init__(self, store, rank: int, world_size: int, watchdog_s: float, prefix: str):
        self.store, self.rank, self.world_size, self.watchdog_s = store, rank, world_size, watchdog_s
        self.prefix = prefix
        self.failing = False  # this process is ending of its own fault: it reports it and ignores the others'
        self.armed = False  # hangs are watched for once the run steps (`arm`): loading weights marks no work
        self._stop = threading.Event()
        self._beats = 0
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (its last beat counter, when it changed)
        self._thread = threading.Thread(target=self._watch, name="tidyrl-fault-watch", daemon=True)

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}"

    def start(self) -> "FaultWatch":
        liveness.mark("starting the run")
        self._beat()
        self._thread.start()
        return self

    def arm(self) -> None:
        """From now on, watchdog_s without finished work is a hang (called as the loop takes its first step)."""
        liveness.mark("starting the steps")
        self.armed = True

    def stop(self) -> None:
        """The run is over on this process: the thread ends, and its last beat says so (a finished process is not a
        silent one)."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * BEAT_S)
        try:
            self.store.set(self.key(f"beat/{self.rank}"), json.dumps({"done": True}))
        except Exception:
            pass

    def report(self, err: BaseException) -> None:
        """Post this process's fault for the others (the first process to post is the one every process names)."""
        self.failing = True  # from here on this process ends by itself, whatever its watch reads
        message = message_of(err)
        if self._post(FAILED, f"process {self.rank} failed: {message}"):
            if broke_collective(err):  # no other process said why: its traceback shows the collective's words only
                say(f"error: {message}", err=True, prefix=f"tidyrl[{self.rank}]")
            return
        try:  # another process failed first: this exception is what its end did to this one (a broken collective)
            posted = self._fault()
        except Exception:
            posted = None
        if posted is not None:
            self._exit(posted)

    def _post(self, kind: str, message: str) -> bool:
        """Set the fault key to (`kind`, `message`) unless another process has; True where this fault is the run's."""
        fault = json.dumps({"kind": kind, "message": message})
        try:
            return self.store.compare_set(self.key("fault"), "", fault).decode() == fault
        except Exception:  # the store is gone (its host ended): the launcher ends the rest
            return False

    def _fault(self) -> dict:
        """The fault posted for the run: {"kind": FAILED, HANGS or SILENT, "message": ...}."""
        return json.loads(self.store.get(self.key("fault")))

    def _beat(self) -> None:
        self._beats += 1
        when, what = liveness.last()
        self.store.set(self.key(f"beat/{self.rank}"), json.dumps({"beat": self._beats, "when": when, "last": what,
                                                                  "waiting": waiting_for_others()}))

    def _watch(self) -> None:
        last_silent_check = time.monotonic()
        while not self._stop.wait(BEAT_S):
            try:
                self._beat()
                if self.store.check([self.key("fault")]):
                    self._end_on(self._fault())
                if self.armed and self.watchdog_s and liveness.idle_s() > self.watchdog_s:
                    self._hang()
                if self.rank == 0 and time.monotonic() - last_silent_check >= SILENT_CHECK_S:
                    last_silent_check = time.monotonic()
                    self._check_silent()
            except Exception as err:  # the store is unreachable: its host is gone, and the launcher ends the rest
                if not self._stop.is_set() and not self.failing:
                    self._exit({"kind": SILENT, "message": f"the run's key-value store stopped answering "
                                                           f"({type(err).__name__}: {err}); the process that held it "
                                                           "has ended"})
                return

    def _beats_of_all(self) -> dict[int, dict]:
        beats = {}
        for rank in range(self.world_size):
            key = self.key(f"beat/{rank}")
            if self.store.check([key]):
                beats[rank] = json.loads(self.store.get(key))
        return beats

    def _check_silent(self) -> None:
        now = time.monotonic()
        for rank, beat in self._beats_of_all().items():
            if beat.get("done"):
                continue
            counter, since = self._seen.get(rank, (-1, now))
            if beat["beat"] != counter:
                self._seen[rank] = (beat["beat"], now)
            elif rank != self.rank and now - since > SILENT_S:
                self._post(SILENT, f"process {rank} stopped answering {now - since:.0f} s ago, without a word (killed? "
                           f"the host's out-of-memory killer, or a lost machine); its last work done: {beat['last']}")
        for rank in set(range(self.world_size)) - set(self._seen):
            self._seen[rank] = (-1, now)

    def _hang(self) -> None:
        """This process has finished no work for watchdog_s: the run hangs. Named: the process that is not waiting
        in a collective (`waiting_for_others`) whose last finished work is the oldest; where every process waits
        (collectives that do not match), the one whose last work is the oldest."""
        if self.failing:  # this process posted its own fault watchdog_s ago and has not ended: it ends now
            self._exit(self._fault())
        beats = {r: b for r, b in self._beats_of_all().items() if not b.get("done")}
        when, what = liveness.last()
        beats[self.rank] = {"when": when, "last": what, "waiting": waiting_for_others()}
        working = [r for r in beats if not beats[r]["waiting"]] or list(beats)
        hung = min(working, key=lambda r: (beats[r]["when"], r))
        others = "; ".join(f"process {r} " + ("waits in a collective" if beats[r]["waiting"] else
                                              f"last finished {beats[r]['last']}")
                           for r in sorted(beats) if r != hung)
        verdict = {"kind": HANGS, "message": f"process {hung} hangs: it has finished no work for "
                   f"{time.time() - beats[hung]['when']:.0f} s (train.watchdog_s = {self.watchdog_s:g}); the last it "
                   f"finished: {beats[hung]['last']}" + (f" ({others})" if others else "")
                   + "; each process's threads' stacks follow in its output"}
        if self._post(verdict["kind"], verdict["message"]):
            # The run's verdict: printed here at once, then the others read it (within BEAT_S) and print theirs
            # before this process ends, which would have the launcher stop them before they had.
            self._exit(verdict, linger_s=EXIT_GRACE_S)
        self._end_on(self._fault())

    def _end_on(self, fault: dict) -> None:
        if self.failing:
            return  # this process reports its own fault and ends by itself
        if fault["kind"] == FAILED:  # the failing process ends first, so the launcher's summary names it as the cause
            time.sleep(EXIT_GRACE_S)
        self._exit(fault)

    def _exit(self, fault: dict, linger_s: float = 0.0) -> None:
        """Print `fault` (a hang: with this process's threads' stacks) and end the process, `linger_s` later."""
        say(f"error: {fault['message'].rstrip('.')}. Every process of the run stops.", err=True,
            prefix=f"tidyrl[{self.rank}]")
        if fault["kind"] == HANGS:
            say("where each thread of this process is:", err=True, prefix=f"tidyrl[{self.rank}]")
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(linger_s)
        os._exit(EXIT_CODE)


def waiting_for_others() -> bool:
    """Whether a thread of this process (other than the caller) is inside torch.distributed or autograd's engine:
    waiting in a collective, or in a backward whose gradients a DDP reducer synchronises. Read from each thread's
    innermost Python frame: what a process that hangs on its own (a reward function that never returns, a lock) is
    not doing."""
    me = threading.get_ident()
    return any(frame.f_globals.get("__name__", "").startswith(("torch.distributed", "torch.autograd"))
               for ident, frame in sys._current_frames().items() if ident != me)


def store_client(timeout_s: float = 30.0):
    """A connection of this process's own to the launch's TCP store (MASTER_ADDR:MASTER_PORT), or None where the
    process group was formed otherwise. Its own, so the watch thread never shares a socket with the process group."""
    from datetime import timedelta

    import torch.distributed as dist

    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def watch_faults(accelerator, watchdog_s: float) -> Optional[FaultWatch]:
    """Start this process's FaultWatch where the run has several processes (the watch a run's exception is
    reported to: `report_fault`); None on one process, or where there is no TCP store to meet through."""
    global _current
    stop_watching()
    if accelerator.num_processes < 2:
        return None
    store = store_client()
    if store is None:
        return None
    run = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    _current = FaultWatch(store, accelerator.process_index, accelerator.num_processes, watchdog_s,
                          prefix=f"tidyrl-faults/{run}/{next(_runs)}").start()
    return _current


def arm_watchdog() -> None:
    """The run's loop takes its first step: its watch starts watching for hangs (where there is a watch)."""
    if _current is not None:
        _current.arm()


def report_fault(err: BaseException) -> None:
    """A run's exception, as it leaves `tidyrl.train`: posted for the other processes, which end with its message.
    (Ctrl-C and SIGTERM are not faults, and `tidyrl.train` reports neither: every process stops after its step and
    saves, loops.run.steps.StopSignals.)"""
    if _current is not None:
        _current.report(err)


def stop_watching() -> None:
    """The run is over (however it ended): its watch stops."""
    global _current
    if _current is not None:
        _current.stop()
        _current = None

"""Rollouts made ahead at a fixed lag (`rollout.lag`, DESIGN §3): generation beside training, deterministic.

With lag L, rollout r is generated with the weights the learner has at the start of rollout r - L (those after
rollout r - 1 - L's updates; the starting weights for r <= L), so while the learner trains on rollout r the
engine already makes rollouts r + 1 .. r + L:

    learner at rollout r:   launch(r + L, snapshot of the weights now)      (r = the first: launch r .. r + L)
                            take(r)  -> the rollout made ahead, waited for if it is not done yet
                            score, advantages, E*M optimizer steps

Which weights make which rollout is fixed by the config (`behaviour_version`), never by timing: a launch copies
the weights it needs (`snapshot`) before the learner moves them, the rollouts are made one at a time in order, and
sampling is keyed per episode. So the same config makes the same run whether generation runs on a background
thread beside training (`background=True`) or on the learner's thread when the rollout is taken, whatever the
speed of either side. A checkpoint holds the rollouts made ahead (`pending`), so a resumed run continues exactly.
With L = 0 each rollout is made when it is taken, from the live weights: today's on-policy run.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

from tidyrl.rollouts.making import make_rollout
from tidyrl.rollouts.weights import weight_snapshot

BACKGROUND = True
"""Make rollouts on a background thread where the run allows it. Tests set it False to show that the thread
changes no number (the rollouts are then made on the learner's thread when taken)."""


def behaviour_version(r: int, lag: int) -> int:
    """The version of the weights that make rollout r (0-based) at lag `lag`: version v is the learner's weights
    after v rollouts' updates, so rollout r is made with those after rollout r - 1 - lag's updates."""
    return max(0, r - lag)


def launches_due(r: int, lag: int, total: int, held) -> list[int]:
    """The rollouts to launch when the learner starts rollout r: every rollout of r .. r + lag (within the run's
    `total`) that is not already made or under way (`held`). At the run's first rollout that is r .. r + lag (all
    with the same weights); afterwards r + lag alone."""
    return [q for q in range(r, max(r, min(r + lag, total - 1)) + 1) if q not in held]


class RolloutsAhead:
    """Launches and hands over rollouts at a fixed lag (see the module docstring): each is
    `making.make_rollout(source, r, version, snapshot)`, the weights of `version` from a weight snapshot of
    `source.policy` (`weights.weight_snapshot`; None at lag 0: the live weights). `engine_lock` is held while a
    rollout is made: evaluation takes it too, so the one engine never serves two callers at once."""

    def __init__(self, source, lag: int, total: int, *, background: bool):
        self.source, self.lag, self.total = source, lag, total
        self.background = background and lag > 0 and BACKGROUND
        self.engine_lock = threading.Lock()
        # r -> (version, snapshot): launched, not started, in launch order (the order they are made in)
        self._queued: dict[int, tuple[int, Optional[dict]]] = {}
        self._made: dict[int, Any] = {}  # r -> made, not taken
        self._errors: dict[int, BaseException] = {}
        self._done = threading.Condition()
        self._busy: Optional[int] = None
        self._closed = False
        self._worker: Optional[threading.Thread] = None

    # ------------------------------------------------------------------ the learner's side
    def launch_due(self, r: int) -> None:
        """At the start of the learner's rollout r: launch what is due (one weight snapshot for all of them)."""
        held = set(self._made) | set(self._queued) | ({self._busy} if self._busy is not None else set())
        due = launches_due(r, self.lag, self.total, held)
        if not due:
            return
        weights = weight_snapshot(self.source.policy) if self.lag > 0 else None
        with self._done:
            for q in due:
                self._queued[q] = (r, weights)  # the learner's weights now: version r
            self._done.notify_all()
        if self.background and self._worker is None:
            self._worker = threading.Thread(target=self._work, name="tidyrl-rollouts-ahead", daemon=True)
            self._worker.start()

    def take(self, r: int) -> tuple[Any, float]:
        """Rollout r, made (waited for where it is still under way). Returns (it, seconds the learner waited)."""
        t0 = time.perf_counter()
        if not self.background:
            self._make_next(r)
        with self._done:
            if r not in self._made and r not in self._queued and self._busy != r and not self._errors:
                raise RuntimeError(f"rollout {r + 1} was never launched (launch_due first)")
            while r not in self._made and not self._errors:
                self._done.wait(timeout=1.0)
            if r not in self._made:
                raise next(iter(self._errors.values()))
            made = self._made.pop(r)
        return made, time.perf_counter() - t0

    def drain(self) -> None:
        """Wait until the background thread has made every launched rollout (and is idle until the next launch):
        before another use of the engine whose order must be the same on every process (a collective in it)."""
        if self.background:
            self.pending()

    def pending(self) -> dict[int, Any]:
        """Every launched rollout not yet taken, made (waited for): what a checkpoint must hold."""
        if not self.background:
            self._make_next(None)
        with self._done:
            while (self._queued or self._busy is not None) and not self._errors:
                self._done.wait(timeout=1.0)
            if self._errors:
                raise next(iter(self._errors.values()))
            return dict(sorted(self._made.items()))

    def restore(self, made: dict[int, Any]) -> None:
        """A resumed run: the rollouts its checkpoint made ahead."""
        self._made.update(made)

    def close(self) -> None:
        with self._done:
            self._closed = True
            self._done.notify_all()
        if self._worker is not None:
            self._worker.join(timeout=0.1)

    # ------------------------------------------------------------------ making
    def _make_next(self, until: Optional[int]) -> None:
        """On the learner's thread: make the launched rollouts in order until `until` is made (None: all)."""
        while self._queued and (until is None or until not in self._made):
            q, version, weights = self._first_queued()
            self._made[q] = self._make_one(q, version, weights)

    def _first_queued(self) -> tuple[int, int, Optional[dict]]:
        q = next(iter(self._queued))
        return (q, *self._queued.pop(q))

    def _make_one(self, q: int, version: int, weights):
        with self.engine_lock:
            return make_rollout(self.source, q, version, weights)

    def _work(self) -> None:
        """The background thread: make each launched rollout in launch order; an error stops it and is raised where
        the learner takes a rollout (or checkpoints)."""
        while True:
            with self._done:
                while not self._queued and not self._closed:
                    self._done.wait()
                if self._closed:
                    return
                q, version, weights = self._first_queued()
                self._busy = q
            try:
                made = self._make_one(q, version, weights)
            except BaseException as err:  # noqa: BLE001 -- handed to the learner, raised where it takes q
                with self._done:
                    self._errors[q], self._busy = err, None
                    self._done.notify_all()
                return
            with self._done:
                self._made[q], self._busy = made, None
                self._done.notify_all()

"""A run's rollouts as the learner takes them: the one entry of rollouts/ that the RL learner calls.

    rollouts = Rollouts(source, lag=..., total=..., background=..., pad_id=...)
    rollout = rollouts.take(r, scorers)      # made (or made ahead), scored by the learner's models, gathered
    metrics = rollouts.evaluate(producer, policy, k, prompts)     # the held-out prompts, the engine to itself

`take` makes rollout r through the lag (`ahead.RolloutsAhead`, which calls `making.make_rollout`), scores it with
the `scorers` it is handed (`scoring.score_rollout`: the learner's models as they are now) and gathers every
process's share, so the learner gets the global `Rollout` record and computes its advantages. Nothing of the
learner's is called: it hands over its models and the accelerator, as data.
"""

from __future__ import annotations

from dataclasses import replace

from tidyrl.rollouts.ahead import RolloutsAhead
from tidyrl.rollouts.evaluation import evaluate_held_out
from tidyrl.rollouts.making import RolloutSource
from tidyrl.rollouts.record import Rollout
from tidyrl.rollouts.scoring import Scorers, score_rollout


class Rollouts:
    """The run's rollouts (see the module docstring). `background`: make the rollouts ahead on a thread beside the
    updates (rollout.lag, where the making has no collective)."""

    def __init__(self, source: RolloutSource, *, lag: int, total: int, background: bool, pad_id: int):
        self.source, self.lag, self.pad_id = source, lag, pad_id
        self.ahead = RolloutsAhead(source, lag, total, background=background)

    def take(self, r: int, scorers: Scorers) -> Rollout:
        """Rollout r (0-based), global: made by the weights of its version (`ahead.behaviour_version`; made now at
        lag 0), scored by `scorers`, gathered. Its `info` holds its making's and scoring's metrics, and with a lag
        async/policy_lag and time/wait_rollout_s (what the learner waited for it)."""
        source = self.source
        self.ahead.launch_due(r)  # with rollout.lag = L: rollout r + L, from the weights now
        made, waited = self.ahead.take(r)
        k = source.samples_per_prompt
        scored = score_rollout(made, scorers, source.accelerator,
                               prompts=[made.prompts[e // k] for e in source.episodes])
        # (the completions' texts were the rewards': the learner decodes the rows it shows, so they are not gathered)
        rollout = replace(scored, completions=None).gathered(source.accelerator, self.pad_id)
        if self.lag:  # how far behind the weights that made it, and what the learner waited for it
            rollout = replace(rollout, info={**rollout.info, "async/policy_lag": r - rollout.version,
                                             "time/wait_rollout_s": waited})
        return rollout

    def evaluate(self, producer, policy, k: int, prompts: int) -> dict:
        """The held-out prompts of `producer` through the rollout path with `policy` as it is
        (`evaluation.evaluate_held_out`): the engine first finishes a rollout it is making ahead, and with several
        processes every launched one (an engine's sync may be a collective: the same order on every process)."""
        if self.source.accelerator.num_processes > 1:
            self.ahead.drain()
        with self.ahead.engine_lock:
            return evaluate_held_out(producer, self.source.engine, policy, k, prompts, self.source.accelerator)[0]

    def pending(self) -> dict:
        """Every launched rollout not yet taken, made: what a checkpoint holds (`RolloutsAhead.pending`)."""
        return self.ahead.pending()

    def restore(self, made: dict) -> None:
        self.ahead.restore(made)

    def close(self) -> None:
        self.ahead.close()

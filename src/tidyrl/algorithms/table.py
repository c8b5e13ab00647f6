"""The algorithm table: what differs between the on-policy RL algorithms, as data (DESIGN §6).

The config's checks, the plan and the learner read these entries; none of them tests an algorithm's name. A
new named algorithm is one entry here (plus its pure functions, with hand-worked tests, where it needs new
maths): e.g. `cispo` below is GRPO's group advantages with CISPO's policy loss, and nothing else in the
package names it.

Pure data: imports nothing (the config module reads it without torch).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Algorithm:
    """One on-policy RL algorithm."""

    name: str
    section: str
    """The config section holding its options (`grpo`, `rloo`, `ppo`, `reinforce_pp`, `distill`)."""
    advantages: str
    """Its advantage estimator (`algorithms.estimators.ESTIMATORS`): group, leave_one_out, gae, returns,
    group_returns or reverse_kl."""
    kl_in: str
    """Where the KL penalty to the reference goes: `loss` (a term of each token's loss, GRPO eq. 3) or `reward`
    (subtracted from the rewards before the advantages, RLHF-style)."""
    critic: bool
    """A learned value model (PPO): values scored with the rollout, a value loss in the update."""
    grouped: bool
    """Its advantages compare the k completions of a prompt (a group baseline): k >= 2 is needed, and dynamic
    sampling may drop groups whose rewards are all equal."""
    sequence_advantages: bool
    """One advantage per completion (not per token): the sequence-level ratio (GSPO) can use it."""
    policy_loss: str
    """Its default policy loss (`<section>.policy_loss` when unset): token, sequence (GSPO) or cispo."""
    summary: str
    """One line for docs and errors."""
    teacher: bool = False
    """Its advantages read a teacher's log-probs of the sampled tokens (on-policy distillation): the `teacher`
    section names the teacher, which scores every rollout."""


ALGORITHMS: dict[str, Algorithm] = {a.name: a for a in (
    Algorithm("grpo", "grpo", advantages="group", kl_in="loss", critic=False, grouped=True,
              sequence_advantages=True, policy_loss="token",
              summary="group-normalised rewards (Shao et al. 2024), KL in the loss"),
    Algorithm("rloo", "rloo", advantages="leave_one_out", kl_in="reward", critic=False, grouped=True,
              sequence_advantages=True, policy_loss="token",
              summary="leave-one-out baseline (Ahmadian et al. 2024), KL in the reward"),
    Algorithm("ppo", "ppo", advantages="gae", kl_in="reward", critic=True, grouped=False,
              sequence_advantages=False, policy_loss="token",
              summary="GAE on a learned critic (Schulman et al. 2017), KL in the per-token reward"),
    Algorithm("reinforce_pp", "reinforce_pp", advantages="returns", kl_in="reward", critic=False, grouped=False,
              sequence_advantages=False, policy_loss="token",
              summary="returns whitened over the batch (Hu 2025), KL in the per-token reward"),
    Algorithm("reinforce_pp_baseline", "reinforce_pp", advantages="group_returns", kl_in="reward", critic=False,
              grouped=True, sequence_advantages=False, policy_loss="token",
              summary="REINFORCE++ with the group's mean reward subtracted first"),
    Algorithm("cispo", "grpo", advantages="group", kl_in="loss", critic=False, grouped=True,
              sequence_advantages=True, policy_loss="cispo",
              summary="GRPO's advantages with CISPO's clipped-weight loss (MiniMax 2025)"),
    Algorithm("distill", "distill", advantages="reverse_kl", kl_in="loss", critic=False, grouped=False,
              sequence_advantages=False, policy_loss="token", teacher=True,
              summary="on-policy distillation: a teacher's per-token log-probs as the reward (Agarwal et al. "
                      "2024), task rewards optional"),
)}
"""Every on-policy RL algorithm, by its `algorithm:` name."""

POLICY_LOSSES = ("token", "sequence", "cispo")
"""`<section>.policy_loss` values: PPO's per-token clipped ratio, GSPO's sequence ratio, CISPO's clipped weight."""

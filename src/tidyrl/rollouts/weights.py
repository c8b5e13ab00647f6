"""The weights that generate a rollout made ahead (rollout.lag): a frozen copy of the policy, and the snapshots of
the trained weights that each launch loads into it."""

from __future__ import annotations


def behaviour_copy(policy):
    """A frozen copy of the policy (eval mode, no gradients) that generates the rollouts made ahead; each launch
    loads a snapshot into it. Costs one more copy of the model's weights on its device."""
    import copy

    return copy.deepcopy(policy).eval().requires_grad_(False)


def weight_snapshot(policy) -> dict:
    """The policy's trained parameters now (a clone each; with LoRA only the adapter's): what a launch needs, as
    the frozen ones never change from the copy's. An FSDP2-sharded policy has no behaviour copy (it would need the
    whole weights on every process): its snapshot is the full weights, gathered (a collective: every process takes
    it at the same launch) into the first process, which makes the servers' syncs (`engines.base.FullWeights`)."""
    from tidyrl.models.sharding import is_sharded

    if is_sharded(policy):
        import torch.distributed as dist

        from tidyrl.engines.base import gathered_weights

        return gathered_weights(policy, keep=not dist.is_initialized() or dist.get_rank() == 0)
    return {name: p.detach().clone() for name, p in policy.named_parameters() if p.requires_grad}


def load_snapshot(model, snapshot: dict) -> None:
    """Copy a `weight_snapshot` into `model` (the behaviour copy), in place (an engine's captured graphs stay
    valid)."""
    import torch

    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in snapshot.items():
            params[name].copy_(value)

"""Sharded models: FSDP through accelerate (`examples/accelerate/fsdp.yaml`), and what tidyrl does about it.

Under FSDP each process holds a shard of every weight and a layer's full weights are all-gathered for each
forward call of that layer, then freed. Training calls each layer a few times per micro-batch, which is what
FSDP is built for. Generation calls every layer once per generated token: left alone, a 256-token rollout
would all-gather the whole model 256 times. `full_weights` gathers each shard group once for the whole
generation call instead (and for the no-grad scoring passes), keeps the full weights while decoding, and
frees them at the end: memory of one full copy of the weights for the span of the rollout, communication of
one all-gather per rollout.

Supported: FSDP2 (torch's `fully_shard`; accelerate `fsdp_version: 2`). Refused up front, with the reason:
FSDP1 (its forward cannot run inside `summon_full_params`, so generation would gather per token) and DeepSpeed
(its engine steps the optimizer inside `backward` and rescales the loss by its own accumulation count, which
bypasses tidyrl's loss normalisation, the NaN check before each update and the once-per-step LR schedule).
Checkpoints for exact resume under FSDP would need the sharded optimizer state gathered; until they do, the loops
refuse their checkpoint settings under FSDP (the final model is saved in full), and an engine refuses what it
cannot do on a sharded policy (`tidyrl.loops.common.check_sharding`).
"""

from __future__ import annotations

from contextlib import contextmanager


class ShardingError(RuntimeError):
    """The launch configuration asks for a sharding mode tidyrl does not support; the message says what to use."""


def ddp_inner(model):
    """The module `model` wraps where it is DistributedDataParallel (what runs inside DDP's forward), else `model`."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def sharding_kind(accelerator) -> str:
    """'fsdp2', 'fsdp1', 'deepspeed' or 'none' (DDP, a single process)."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return "deepspeed"
    if kind == DistributedType.FSDP:
        return "fsdp2" if getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2 else "fsdp1"
    return "none"


def check_supported(kind: str) -> None:
    """Raise ShardingError before any weights are loaded when tidyrl cannot run under `kind` (from
    `sharding_kind`) at all. What a run's settings cannot do under FSDP2 its loop checks
    (`tidyrl.loops.common.check_sharding`)."""
    if kind == "deepspeed":
        raise ShardingError(
            "DeepSpeed is not supported yet: its engine steps the optimizer inside backward() and rescales the "
            "loss by its own accumulation count, which would bypass tidyrl's loss normalisation, the NaN check "
            "before each update and the once-per-step LR schedule. Shard with FSDP2 instead: accelerate launch "
            "--config_file examples/accelerate/fsdp.yaml -m tidyrl train CONFIG.yaml (docs/memory.md)."
        )
    if kind == "fsdp1":
        raise ShardingError(
            "FSDP1 is not supported: generation would all-gather every layer at every generated token. Set "
            "fsdp_version: 2 in the accelerate config (examples/accelerate/fsdp.yaml)."
        )


def is_sharded(model) -> bool:
    """True when some of the model's modules are FSDP2-sharded (`fully_shard`)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


@contextmanager
def full_weights(model):
    """Within the block, every FSDP2 shard group of `model` is all-gathered once and stays whole: forward calls
    (one per generated token) gather nothing more. On exit each group is freed back to its shard and its
    reshard-after-forward setting restored. A no-op for a model that is not sharded."""
    from torch.distributed.fsdp import FSDPModule

    groups = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not groups:
        yield model
        return
    settings = [_reshard_after_forward(m) for m in groups]
    try:
        for m in groups:
            m.set_reshard_after_forward(False, recurse=False)  # a forward then leaves the weights whole
            m.unshard()
        yield model
    finally:
        for m, setting in zip(groups, settings):
            m.reshard()
            m.set_reshard_after_forward(setting, recurse=False)


def _reshard_after_forward(module) -> bool:
    state = module._get_fsdp_state()  # torch keeps the setting on the module's parameter group only
    group = getattr(state, "_fsdp_param_group", None)
    return True if group is None else bool(group.post_forward_mesh_info is not None)


def full_state_dict(accelerator, model):
    """The full state dict of a sharded model (a collective: call it in every process; the main process gets the
    tensors), or None for a model that is not sharded (save it as it is)."""
    if not is_sharded(accelerator.unwrap_model(model)):
        return None
    return accelerator.get_state_dict(model)


def full_parameters(state: dict):
    """(name, tensor) for every entry of a state dict, each FSDP2 shard (a DTensor) all-gathered on its own
    as it is reached: a consumer that copies each tensor away before taking the next (the vLLM engine's weight
    sync) never holds more than one parameter in full on a process, where `full_weights` would gather them all.
    A collective under FSDP: every process must walk the same state dict in the same order."""
    from torch.distributed.tensor import DTensor

    for name, tensor in state.items():
        tensor = tensor.detach()
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


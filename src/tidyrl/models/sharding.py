"""Sharded models: FSDP through accelerate (`examples/accelerate/fsdp.yaml`), and what tidyrl does about it.

Under FSDP each process holds a shard of every weight and a layer's full weights are all-gathered for each
forward call of that layer, then freed. Training calls each layer a few times per micro-batch, which is what
FSDP is built for. Generation calls every layer once per generated token: left alone, a 256-token rollout
would all-gather the whole model 256 times. `full_weights` gathers each shard group once for the whole
generation call instead (and for the no-grad scoring passes), keeps the full weights while decoding, and
frees them at the end: memory of one full copy of the weights for the span of the rollout, communication of
one all-gather per rollout.

Supported: FSDP2, applied by tidyrl itself with torch's `fully_shard` (the API accelerate's FSDP2 wraps), on CPU
(gloo) and GPU alike, so that the path the tests run on CPU processes is the one a GPU run takes. The launch asks
for it as accelerate does (`accelerate launch --config_file examples/accelerate/fsdp.yaml`, which sets
ACCELERATE_USE_FSDP and FSDP_VERSION=2 in each process): `launch_sharding` reads that request, `make_accelerator`
keeps accelerate's own FSDP preparation out of it (accelerate prepares FSDP only on GPUs and would silently train
plain DDP on CPUs), and `shard` puts one shard group on every decoder layer and one on the rest. Refused up front,
with the reason: FSDP1 (its forward cannot run inside `summon_full_params`, so generation would gather per token),
DeepSpeed (its engine steps the optimizer inside `backward` and rescales the loss by its own accumulation count,
which bypasses tidyrl's loss normalisation, the NaN check before each update and the once-per-step LR schedule), and
FSDP settings tidyrl would not honour (`check_fsdp_settings`). What a run's settings cannot do under FSDP2 its loop
checks (`tidyrl.loops.run.setup.check_sharding`).
"""

from __future__ import annotations

from contextlib import contextmanager


class ShardingError(RuntimeError):
    """The launch configuration asks for a sharding mode tidyrl does not support; the message says what to use."""


def ddp_inner(model):
    """The module `model` wraps where it is DistributedDataParallel (what runs inside DDP's forward), else `model`."""
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def base_of(model):
    """The transformers model under a peft wrapper (PeftModel), or `model` itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if get_base is not None and hasattr(model, "peft_config") else model


def _flag(environ, name: str, default: str = "false") -> bool:
    return environ.get(name, default).strip().lower() in ("1", "true", "yes")


def launch_sharding(environ=None) -> str:
    """What the launch asks for, from the variables accelerate launch sets in each process: 'fsdp2', 'fsdp1',
    'deepspeed' or 'none' (DDP, or a single process). A single process (WORLD_SIZE 1 or unset) has nothing to
    shard: 'none' whatever the accelerate config says."""
    import os

    environ = os.environ if environ is None else environ
    if int(environ.get("WORLD_SIZE", "1")) <= 1:
        return "none"
    if _flag(environ, "ACCELERATE_USE_DEEPSPEED"):
        return "deepspeed"
    if _flag(environ, "ACCELERATE_USE_FSDP"):
        return "fsdp2" if environ.get("FSDP_VERSION", "1").strip() == "2" else "fsdp1"
    return "none"


def sharding_kind(accelerator) -> str:
    """'fsdp2', 'fsdp1', 'deepspeed' or 'none' (DDP, a single process): accelerate's own distributed type where it
    prepared DeepSpeed or FSDP itself, else what the launch asks for (`launch_sharding`), which tidyrl applies."""
    from accelerate.utils import DistributedType

    kind = accelerator.distributed_type
    if kind == DistributedType.DEEPSPEED:
        return "deepspeed"
    if kind == DistributedType.FSDP:
        return "fsdp2" if getattr(accelerator.state.fsdp_plugin, "fsdp_version", 1) == 2 else "fsdp1"
    return launch_sharding()


def distribution(kind: str, processes: int) -> str:
    """How a run's model is distributed, in the words plan.json and the summary use: 'fsdp2, N shards',
    'ddp, N processes' or 'one process'."""
    if processes <= 1:
        return "one process"
    return f"fsdp2, {processes} shards" if kind == "fsdp2" else f"ddp, {processes} processes"


def check_fsdp_settings(environ=None) -> None:
    """Raise ShardingError for an accelerate FSDP setting tidyrl does not honour when it shards, with what to use
    instead; silence would train otherwise than the config says. Honoured: fsdp_version 2, the transformer-layer
    wrap (one shard group per decoder layer), fsdp_reshard_after_forward, fsdp_offload_params (on GPUs).
    fsdp_cpu_ram_efficient_loading is refused: transformers would load the weights on the first process only and
    leave the others empty, which accelerate's own preparation fills and tidyrl's sharding does not."""
    import os

    environ = os.environ if environ is None else environ
    problems = []
    policy = environ.get("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP").strip().upper()
    if policy not in ("TRANSFORMER_BASED_WRAP", ""):
        problems.append(f"fsdp_auto_wrap_policy {policy} (tidyrl puts one shard group on each decoder layer, as "
                        "TRANSFORMER_BASED_WRAP does: set that)")
    if _flag(environ, "FSDP_CPU_RAM_EFFICIENT_LOADING"):
        problems.append("fsdp_cpu_ram_efficient_loading (every process reads the weights, then keeps its shards: "
                        "set it false)")
    if _flag(environ, "FSDP_ACTIVATION_CHECKPOINTING"):
        problems.append("fsdp_activation_checkpointing (set it false and train.gradient_checkpointing: true)")
    precision = environ.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if precision not in ("no", ""):
        problems.append(f"mixed_precision {precision} (load the model in that dtype instead: model_dtype, and set "
                        "mixed_precision: \"no\")")
    if problems:
        raise ShardingError("FSDP is asked for with settings tidyrl does not apply when it shards: "
                            + "; ".join(problems) + " (examples/accelerate/fsdp.yaml).")


def reshard_after_forward(environ=None) -> bool:
    """fsdp_reshard_after_forward of the launch (default true: ZeRO-3-like; false keeps each layer's full weights
    from its forward to its backward, ZeRO-2-like)."""
    import os

    return _flag(os.environ if environ is None else environ, "FSDP_RESHARD_AFTER_FORWARD", "true")


def offload_params(environ=None) -> bool:
    """fsdp_offload_params of the launch: parameters, gradients and optimizer state kept on the host."""
    import os

    return _flag(os.environ if environ is None else environ, "FSDP_OFFLOAD_PARAMS")


def shard(model, device_type: str, reshard: bool = True, offload: bool = False):
    """Shard `model` in place over every process of the default process group with FSDP2 (`fully_shard`): one
    shard group per decoder layer (the classes of `model._no_split_modules`, as accelerate's
    TRANSFORMER_BASED_WRAP), then one for the rest (embeddings, final norm, head: tied weights stay one
    parameter). FSDP2 moves the weights to the mesh's device. `offload` keeps parameters, gradients and optimizer
    state on the host (a GPU run; on a CPU they are there anyway). Returns the model (its class renamed FSDP...,
    its parameters DTensors); build the optimizer after this."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    policy = CPUOffloadPolicy() if offload and device_type != "cpu" else OffloadPolicy()
    layers = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if module is not model and type(module).__name__ in layers:
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy)
    return model


def shard_frozen(model, device_type: str, offload: bool = False):
    """Shard a frozen scorer (a KL or DPO reference, a reward model) as `shard` shards the policy, in eval mode and
    without grad, every shard group resharded after each forward whatever fsdp_reshard_after_forward says: it runs
    no-grad forwards only, with no backward to keep the weights for, so a process holds 1/W of it plus the group
    being run (ZeRO-3-like). Each forward is then a collective (its all-gathers): every process must make as many
    (`forward_calls`)."""
    model.eval().requires_grad_(False)
    return shard(model, device_type, reshard=True, offload=offload)


def frozen_device(accelerator):
    """Where a frozen scorer loads: the host under FSDP2 (`place_frozen` shards it from there), else this process's
    device."""
    return None if sharding_kind(accelerator) == "fsdp2" else accelerator.device


def place_frozen(model, accelerator):
    """A frozen scorer loaded on `frozen_device`, in eval mode and without grad, placed like the policy: under
    FSDP2 sharded over the processes (`shard_frozen`), else left where it loaded."""
    if sharding_kind(accelerator) == "fsdp2":
        return shard_frozen(model, accelerator.device.type, offload_params())
    return model.eval().requires_grad_(False)


def forward_calls(model, count: int) -> int:
    """How many forward calls this process makes with `model` to make `count` of its own: where `model` is
    FSDP2-sharded, each forward all-gathers, a collective that every process must join, so the most any process
    makes (asking is itself a collective: every process asks); otherwise `count`. The caller makes the extra calls
    on any input and drops their output."""
    if not is_sharded(model):
        return count
    import torch
    import torch.distributed as dist

    cuda = next(model.parameters()).device_mesh.device_type == "cuda"  # NCCL reduces device tensors only
    most = torch.tensor([count], device=torch.device("cuda", torch.cuda.current_device()) if cuda else "cpu")
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return int(most.item())


@contextmanager
def gradient_sync(model, sync: bool):
    """FSDP2's `no_sync`: within the block, backward keeps each layer's gradient unsharded and local (`sync`
    False) or reduce-scatters it over processes (`sync` True, the default state)."""
    model.set_requires_gradient_sync(sync)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def clip_grad_norm(model, max_norm: float) -> float:
    """The global gradient norm of a sharded model (every shard's squares summed over processes: a collective),
    and the gradients scaled down to `max_norm` where it is larger, as torch.nn.utils.clip_grad_norm_ does."""
    import torch
    from torch.distributed.tensor import DTensor

    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, 2.0, False, None)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def local_grads(model) -> list:
    """The gradients this process holds of `model`'s parameters: whole tensors, or under FSDP2 its shards (the
    local tensors of the DTensor gradients)."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [g.to_local() if isinstance(g, DTensor) else g for g in grads]


def check_supported(kind: str) -> None:
    """Raise ShardingError before any weights are loaded when tidyrl cannot run under `kind` (from
    `sharding_kind`) at all. What a run's settings cannot do under FSDP2 its loop checks
    (`tidyrl.loops.run.setup.check_sharding`)."""
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
            "fsdp_version: 2 in the accelerate config (examples/accelerate/fsdp.yaml); accelerate before 1.6 knows "
            "no fsdp_version and always launches FSDP1: upgrade it (pip install -U accelerate)."
        )


def is_sharded(model) -> bool:
    """True when some of the model's modules are FSDP2-sharded (`fully_shard`)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def is_root_sharded(model) -> bool:
    """True when `model` itself is an FSDP2 module (what `shard` makes): the cheap test for each micro-batch."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


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
    """The full state dict of a sharded model on the host (a collective: call it in every process; the main
    process gets the tensors, the others an empty dict), or None for a model that is not sharded (save it as it
    is)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model = accelerator.unwrap_model(model)
    if not is_sharded(model):
        return None
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_parameters(state: dict):
    """(name, tensor) for every entry of a state dict, each FSDP2 shard (a DTensor) all-gathered on its own
    as it is reached: a consumer that copies each tensor away before taking the next (the vLLM engine's weight
    sync) never holds more than one parameter in full on a process, where `full_weights` would gather them all.
    A collective under FSDP: every process must walk the same state dict in the same order."""
    from torch.distributed.tensor import DTensor

    for name, tensor in state.items():
        tensor = tensor.detach()
        yield name, tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


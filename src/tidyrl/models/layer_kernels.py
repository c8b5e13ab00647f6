"""The trained model's decoder layers compiled on CUDA (`torch.compile`): the update's forward and backward pass in
fewer, fused kernels, the same maths to bf16 rounding.

Why: at the sizes RL post-training runs on one GPU the update waits on the host's kernel launches more than on the
GPU. On an H200 the model's own forward and backward of Qwen2.5-0.5B's update (8 micro-batches of 16 x ~273
tokens) launched 28 967 kernels a rollout, ~150 per layer and micro-batch, where the matmuls are 21: the RMSNorms,
rotary embedding, residual adds, casts and silu(gate) * up each run as a few elementwise kernels both ways, and the
GPU was busy 385 ms of the update's 853 (`bench_vs_trl.py --profile`, docs/benchmarking.md). Compiled, inductor fuses
those parts into a few Triton kernels a layer each way; the matmuls and attention stay cuBLAS's and cuDNN's. Measured
on that H200 (`bench_vs_trl.py --libraries tidyrl,tidyrl-eager-layers`): the update 0.568 s a rollout against
0.859 s, its peak 10 230 MiB against 12 027 (the fused backward keeps fewer intermediates), 102.7 episodes/s against
79.4. Not taken: Liger Kernel's RMSNorm, SwiGLU and rotary embedding on the model instance (update 0.837 s against
0.861 in the same call).

Each layer is compiled with dynamic shapes: every layer of the model and every width shares one compilation per
grad mode (layers differ only in their parameters, which dynamo takes as inputs), about 20 s once per run on that
GPU. Applied once per model, in place, on its first one-pass forward (`prepare`), where it is safe and pays:
- a causal LM of a declared family on the fast path (`families.on_fast_path`) on CUDA whose parameters train (the
  policy, not a frozen reference or teacher: their no-grad scoring measured no faster compiled), alone or inside DDP;
- not under LoRA (peft's wrappers), FSDP2 (sharded parameters), gradient checkpointing (checkpoints around the
  layers), `models.recompute` (it swaps the norms' forwards on every call) or train.exact_gradients (the model's own
  forward, the same kernels on any split).
If compiling fails (a missing compiler, an op dynamo cannot trace), the model's own layers run instead, with a
warning (`give_up`). `kernels.layer_kernels: none` keeps the model's own layers from the start (`models.kernels`).
"""

from __future__ import annotations

import warnings

DEVICES = ("cuda",)
_APPLIED = "_tidyrl_layer_kernels"


def prepare(model, exact: bool = False) -> str:
    """Compile `model`'s decoder layers (a model about to run its one-pass forward) once, in place, where the
    module's docstring says (`exact`: the model is marked for train.exact_gradients, `models.forward.exact_forward`);
    returns the mode the model runs: its choice `kernels_of(model).layer_kernels`, "none" where it does not apply."""
    from tidyrl.models.kernels import kernels_of

    inner = _inner(model)
    done = getattr(inner, _APPLIED, None)
    if done is not None:
        return done
    mode = kernels_of(inner).layer_kernels if not exact and _applies(model, inner) else "none"
    if mode != "none":
        for layer in inner.model.layers:
            layer.compile(dynamic=True)
    setattr(inner, _APPLIED, mode)
    return mode


def give_up(model, err: BaseException) -> bool:
    """After `model`'s forward raised `err`: where its layers were compiled here and `err` is torch.compile's own
    failure, the layers go back to the model's own (for the rest of the run), with a warning, and True (run the forward
    again); else False (the error is the caller's)."""
    import torch._dynamo.exc as dynamo_errors

    inner = _inner(model)
    if getattr(inner, _APPLIED, "none") == "none" or not isinstance(err, dynamo_errors.TorchDynamoException):
        return False
    for layer in inner.model.layers:
        layer._compiled_call_impl = None  # (what nn.Module.compile set: its __call__ runs the module's own again)
    setattr(inner, _APPLIED, "none")
    why = " ".join(line.strip() for line in str(err).splitlines() if line.strip() and "TORCHDYNAMO_VERBOSE" not in line)
    warnings.warn(f"tidyrl: compiling the decoder layers failed ({type(err).__name__}: {why[:300]}); training goes on "
                  "with the model's own layers (kernels.layer_kernels=none skips the attempt)", stacklevel=2)
    return True


def _inner(model):
    from tidyrl.models.sharding import base_of, ddp_inner

    return base_of(ddp_inner(model))


def _applies(model, inner) -> bool:
    from tidyrl.models.families import family_of, on_fast_path
    from tidyrl.models.loading import activation_checkpointing_on
    from tidyrl.models.kernels import kernels_of
    from tidyrl.models.sharding import ddp_inner, is_sharded

    weight = next(inner.parameters(), None)
    # (not yet measured on a mixture of experts, whose routing a compiled graph would have to keep dynamic)
    name = type(inner).__name__
    return (on_fast_path(inner.config, name) and not family_of(inner.config, name).moe and ddp_inner(model) is inner and weight is not None
            and weight.device.type in DEVICES and any(p.requires_grad for p in inner.parameters())
            and not is_sharded(inner) and not activation_checkpointing_on(inner) and not kernels_of(inner).recompute)

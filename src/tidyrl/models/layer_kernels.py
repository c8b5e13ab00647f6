"""The trained model's decoder layers compiled on CUDA (`torch.compile`): the update's forward and backward pass in
fewer, fused kernels, the same maths to bf16 rounding.

Why: at the sizes RL post-training runs on one GPU the update waits on the host's kernel launches more than on the
GPU: per layer and micro-batch the model's own forward and backward launch many times more kernels than its
matmuls, as the RMSNorms, rotary embedding, residual adds, casts and silu(gate) * up each run as a few elementwise
kernels both ways (`bench_vs_trl.py --profile`). Compiled, inductor fuses those parts into a few Triton kernels a
layer each way; the matmuls and attention stay cuBLAS's and cuDNN's, and the fused backward keeps fewer
intermediates (`bench_vs_trl.py --libraries tidyrl,tidyrl-eager-layers`; the figures and Liger Kernel's, which is
not taken, are in docs/benchmarking.md, "The trained model's decoder layers compiled").

Each layer is compiled with dynamic shapes: every layer of the model and every width shares one compilation per grad
mode (layers differ only in their parameters, which dynamo takes as inputs), once per run. Applied once per model,
in place, on its first one-pass forward (`prepare`), where it is safe and pays:
- a causal LM of a declared family on the fast path (`families.on_fast_path`) on CUDA whose parameters train (the
  policy, not a frozen reference or teacher: their no-grad scoring measured no faster compiled), alone or inside
  DDP;
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

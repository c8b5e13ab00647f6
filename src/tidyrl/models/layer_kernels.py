"""Fewer, fused kernels in the model's own forward and backward pass on CUDA (the one-pass layout of
`models.forward`): the same maths, the elementwise parts of each decoder layer in fewer kernels.

Why: at the sizes RL post-training runs on one GPU (Qwen2.5-0.5B/1.5B, update micro-batches of 16 x ~270 tokens)
the update waits on the host's kernel launches as much as on the GPU: the model's own Llama layer runs its RMSNorms
(~7 elementwise kernels each way), rotary embedding (~10) and silu(gate) * up (2-4) as separate kernels, ~155 per
layer forward and backward, where the matmuls are 7. Two ways to run those parts in fewer kernels, chosen by
`TIDYRL_LAYER_KERNELS`:
- `liger`: Liger Kernel's Triton RMSNorm, SwiGLU MLP and rotary embedding (forward and backward each one kernel),
  applied to the model instance (`pip install liger-kernel`; its output layer is left alone: `models.chunked_head`
  applies it). Its rotary embedding replaces the function of the model's `transformers` modeling module, which
  every model of that family in the process then calls (on CUDA tensors only).
- `compile`: each decoder layer `torch.compile`d with dynamic shapes (inductor fuses the elementwise parts of its
  forward and backward into Triton kernels; every layer and width shares one compilation per grad mode: a training
  run compiles about four graphs, on a CPU run of the tiny model 4, in ~20 s on 2 cores).
- `none` (the default): the model's own modules.
Each one equals the model's own forward to bf16 rounding (tests/test_cuda.py). Applied once per model, in place, on
its first one-pass forward (`prepare`), to plain causal LMs of `chunked_head.PLAIN_CAUSAL_LMS` on CUDA, not sharded
and without LoRA adapters; anything else runs the model's own modules.
"""

from __future__ import annotations

import os

MODES = ("none", "liger", "compile")
DEVICES = ("cuda",)
_APPLIED = "_tidyrl_layer_kernels"


def chosen() -> str:
    """The mode TIDYRL_LAYER_KERNELS names (default `none`); another value is an error that lists the modes."""
    mode = os.environ.get("TIDYRL_LAYER_KERNELS", "none").strip().lower() or "none"
    if mode not in MODES:
        raise ValueError(f"TIDYRL_LAYER_KERNELS={mode!r}: expected one of {', '.join(MODES)} "
                         "(models/layer_kernels.py says what each does)")
    return mode


def prepare(model) -> str:
    """Apply the chosen mode to `model` (a policy, reference or teacher about to run its one-pass forward) once, in
    place, where it applies; returns the mode the model runs ("none" where it does not apply)."""
    from tidyrl.models.chunked_head import PLAIN_CAUSAL_LMS
    from tidyrl.models.llama_decode import base_of
    from tidyrl.models.sharding import ddp_inner, is_sharded

    peft_or_model = ddp_inner(model)
    inner = base_of(peft_or_model)
    done = getattr(inner, _APPLIED, None)
    if done is not None:
        return done
    mode = chosen()
    weight = next(inner.parameters(), None)
    if (mode == "none" or type(inner).__name__ not in PLAIN_CAUSAL_LMS or peft_or_model is not inner
            or weight is None or weight.device.type not in DEVICES or is_sharded(inner)):
        mode = "none"
    elif mode == "liger":
        _liger(inner)
    else:
        for layer in inner.model.layers:
            layer.compile(dynamic=True)
    setattr(inner, _APPLIED, mode)
    return mode


def _liger(model) -> None:
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as err:
        raise ImportError("TIDYRL_LAYER_KERNELS=liger needs Liger Kernel: pip install liger-kernel") from err
    import importlib

    # Liger replaces the norm and MLP classes of the model's modeling module (for models built later) as well as the
    # instance's: the classes are put back, so that only this instance changes. Its rotary embedding is the
    # module's function, which the instance's attention calls by name: that one stays replaced.
    module = importlib.import_module(type(model).__module__)
    classes = {name: value for name, value in vars(module).items() if name.endswith(("RMSNorm", "MLP"))}
    try:
        # (not its fused output layer and loss: that would replace the causal LM's forward, which the chunked
        # output layer runs with its head passing its input through)
        _apply_liger_kernel_to_instance(model=model, rope=True, swiglu=True, rms_norm=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False)
    finally:
        for name, value in classes.items():
            setattr(module, name, value)

"""Count the ops a fixed-shape decoding unit runs per token (what a CUDA graph replays), with and without the fused
kernels of tidyrl.models.fused_decode, on a Qwen2.5-0.5B-shaped model (24 layers, 14 query / 2 key-value heads,
bf16; narrow, so that it runs on a CPU). On a GPU each op is about one kernel, and at a 0.5B model's size a decode
step's time is mostly their count (docs/benchmarking.md, "Fused decoding kernels ...": the decode profile).

    python benchmarks/count_decode_ops.py                          # the unfused step (no Triton needed)
    TRITON_INTERPRET=1 python benchmarks/count_decode_ops.py       # both, the fused kernels in Triton's interpreter

Every aten op dispatched inside the unit is counted but views and allocations (no kernel), and each fused
kernel as one; what runs inside a fused call (the interpreter's own tensor moves, a wrapper's allocations) is
not the GPU's and is left out.
"""

from __future__ import annotations

import os
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from tidyrl.models import fused_decode, generation, lean_decode

NO_KERNEL = {"view", "reshape", "_unsafe_view", "expand", "t", "transpose", "slice", "select", "alias", "detach",
             "unsqueeze", "squeeze", "split", "chunk", "split_with_sizes", "permute", "as_strided", "narrow", "empty",
             "empty_like", "new_empty", "set_"}


def count(fused: bool) -> Counter:
    units: list[Counter] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            if name not in NO_KERNEL and not (fused and self.inside_triton):
                units[-1][name] += 1
            return func(*args, **(kwargs or {}))

    record = Record()
    record.inside_triton = False

    class Counted(generation.Replayed):
        def __call__(self):
            units.append(Counter())
            with record:
                return super().__call__()

    def kernel(name, real):
        def call(*args, **kwargs):
            if units:  # (the first token's draw runs before any unit)
                units[-1][f"triton {name}"] += 1
            record.inside_triton = True
            try:
                return real(*args, **kwargs)
            finally:
                record.inside_triton = False
        return call

    saved = (generation.Replayed, fused_decode.wanted, fused_decode.draw_wanted, fused_decode.add_rms_norm,
             fused_decode.rope_and_cache, fused_decode.draw, fused_decode.silu_and_mul, fused_decode.rope_cache_attend)
    generation.Replayed = Counted
    fused_decode.wanted = lambda device, dtype, head_dim, on: fused
    fused_decode.draw_wanted = lambda logits, on: fused
    fused_decode.add_rms_norm = kernel("add_rms_norm", saved[3])
    fused_decode.rope_and_cache = kernel("rope_and_cache", saved[4])
    fused_decode.draw = kernel("draw", saved[5])
    fused_decode.silu_and_mul = kernel("silu_and_mul", saved[6])
    fused_decode.rope_cache_attend = kernel("rope_cache_attend", saved[7])
    try:
        lean_decode._STEPS.clear()
        torch.manual_seed(0)
        config = Qwen2Config(vocab_size=512, hidden_size=224, intermediate_size=448, num_hidden_layers=24,
                             num_attention_heads=14, num_key_value_heads=2, pad_token_id=0, eos_token_id=2)
        model = Qwen2ForCausalLM(config).eval().to(torch.bfloat16)
        generation.generate(model, [[5, 6, 7]] * 4, sample_keys=[1, 2, 3, 4], max_new_tokens=3, eos_ids=[2],
                            pad_id=0, batch_size=4, static_cache=True)
    finally:
        (generation.Replayed, fused_decode.wanted, fused_decode.draw_wanted, fused_decode.add_rms_norm,
         fused_decode.rope_and_cache, fused_decode.draw, fused_decode.silu_and_mul,
         fused_decode.rope_cache_attend) = saved
        lean_decode._STEPS.clear()
    return units[-1]


def main() -> None:
    lean_decode.COPY_MAX_BYTES = 0  # the model's own weights, as for a 0.5B model (past the copies' limit)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" and fused_decode._kernels() is not None
    for fused in (False, True) if interpreted else (False,):
        ops = count(fused)
        print(f"{'fused' if fused else 'unfused'}: {sum(ops.values())} ops per token "
              f"({sum(ops.values()) / 24:.1f} per layer, sampling included); most frequent: "
              + ", ".join(f"{name} {n}" for name, n in ops.most_common(8)))
    if not interpreted:
        print("(the fused count needs Triton, run by its interpreter: TRITON_INTERPRET=1)")


if __name__ == "__main__":
    main()

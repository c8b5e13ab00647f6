"""What the training forward keeps for its backward pass, in bytes, on a CPU: the model's own forward with its whole
logits, with the output layer in chunks (models.chunked_head), and with the norms and MLP products recomputed too
(models.recompute). On CUDA these tensors, with the logits' gradient as backward starts, are most of the update's
peak above the weights and optimizer state (`bench_vs_trl.py --libraries tidyrl-memtrace` lists them on a GPU);
here they are counted without one.

    python benchmarks/count_saved_bytes.py                       # Qwen2.5-0.5B's shape, 2 of its 24 layers
    python benchmarks/count_saved_bytes.py --layers 1 --rows 2 --hidden 64 --vocab 512   # a quick look

Counted: every tensor autograd saves during one forward of an update micro-batch (bf16, `rows` x (prompt +
completion) positions), each storage once; per layer from the difference between the model's layers, and the rest
(embedding, final norm, output layer) apart. The whole-logits path also writes the logits' gradient (the size of
the logits) as backward starts, added to its figure as "+ gradient" (the chunked head has a vocabulary slice instead).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from shapes import add_shape_arguments, qwen2_config  # noqa: E402

from tidyrl.models import chunked_head, forward, recompute  # noqa: E402
from tidyrl.models.kernels import Kernels, attach  # noqa: E402


def saved_bytes(fn, model=None) -> tuple[object, int]:
    """fn() under a hook that records every tensor autograd saves for backward: (its result, the bytes of their
    distinct storages, `model`'s weights left out where it is given). Also used by bench_update, bench_recompute and
    tests/test_memory_plan.py."""
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()} if model is not None else set()
    return result, sum(n for ptr, n in storages.items() if ptr not in weights)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(parser, hidden=896, intermediate=4864, layers=2, heads=14, vocab=151936)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=17)
    parser.add_argument("--completion", type=int, default=256)
    parser.add_argument("--model-layers", type=int, default=24, help="the full model's layers, for the total")
    args = parser.parse_args()
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    config = qwen2_config(args, max_position_embeddings=4096)
    g = torch.Generator().manual_seed(1)
    batch = (torch.randint(3, args.vocab, (args.rows, args.prompt), generator=g),
             torch.ones(args.rows, args.prompt, dtype=torch.long),
             torch.randint(3, args.vocab, (args.rows, args.completion), generator=g),
             torch.ones(args.rows, args.completion))
    logits = args.rows * (args.completion + 1) * args.vocab * 2
    forward.LAYOUTS["cpu"] = ("onepass",)  # the model's own forward, as on CUDA
    variants = (("whole logits", (), ()), ("chunked head", ("cpu",), ()),
                ("chunked head + recompute", ("cpu",), ("cpu",)))
    print(f"Qwen2-shaped, hidden {args.hidden}, {args.layers} + embedding/head; micro-batch {args.rows} x "
          f"{args.prompt + args.completion} positions, bf16; MiB kept for backward")
    for name, head_devices, recompute_devices in variants:
        chunked_head.HEAD_DEVICES, recompute.RECOMPUTE_DEVICES = head_devices, recompute_devices
        totals = []
        for layers in (args.layers, args.layers - 1) if args.layers > 1 else (args.layers,):
            config.num_hidden_layers = layers
            # (the recompute on, off by default: its variant sets its devices)
            model = attach(Qwen2ForCausalLM(config).to(torch.bfloat16).train(), Kernels(recompute=True))
            run = functools.partial(forward.completion_logprobs, model, *batch, 1.0, with_entropy=True)
            totals.append(saved_bytes(run, model)[1])
            del model, run
        per_layer = totals[0] - totals[1] if len(totals) > 1 else totals[0] / max(args.layers, 1)
        rest = totals[0] - args.layers * per_layer
        full = rest + args.model_layers * per_layer
        gradient = logits if not head_devices else 0
        print(f"  {name:26} per layer {per_layer / 2**20:8.1f}, rest {rest / 2**20:8.1f}; "
              f"{args.model_layers} layers: {full / 2**20:8.1f}"
              + (f" + gradient {gradient / 2**20:.1f}" if gradient else ""), flush=True)


if __name__ == "__main__":
    main()

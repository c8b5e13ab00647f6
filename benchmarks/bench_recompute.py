"""What the recomputed norms and MLP products (models.recompute) cost an update pass, against keeping their
intermediates: the autograd functions tidyrl runs, beside `torch.utils.checkpoint` around the same parts (the
alternative they replace). One forward and backward of an update micro-batch through `forward.completion_logprobs`
(the model's own forward), bf16, per mode: milliseconds per pass, the bytes kept for backward, and per recomputed part
the time above keeping everything.

    python benchmarks/bench_recompute.py                          # CPU, Qwen2.5-0.5B's 24 layers at width 64:
                                                                  # small kernels, the host's cost laid bare
    python benchmarks/bench_recompute.py --device cuda --hidden 896 --intermediate 4864 --rows 16   # 0.5B's layers

On a 2-core CPU the checkpoints cost 0.32 ms a part, the functions 0.044 ms (models/recompute.py). All modes
give the same log-probs and gradients (checked here: the script fails where a second pass of the kept mode repeats
the first exactly and another mode does not; on CUDA, whose attention and embedding backward add with atomics in no
fixed order, it prints each mode's largest difference beside the kept mode's own).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from count_saved_bytes import saved_bytes  # noqa: E402
from shapes import add_shape_arguments, qwen2_config  # noqa: E402

from tidyrl.models import forward, recompute  # noqa: E402
from tidyrl.models.kernels import Kernels, attach  # noqa: E402

MODES = ("kept", "checkpoint", "functions")


def build(args):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(qwen2_config(args)).to(device=args.device, dtype=torch.bfloat16).train()


def batch(args):
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, args.vocab, (args.rows, args.prompt), generator=g)
    completion = torch.randint(3, args.vocab, (args.rows, args.completion), generator=g)
    tensors = (prompt, torch.ones_like(prompt), completion, torch.ones_like(completion))
    return tuple(t.to(args.device) for t in tensors)


def one_pass(model, inputs):
    """Log-probs, every gradient, and the bytes kept for backward (beyond the weights) of one forward and backward."""
    model.zero_grad(set_to_none=True)
    (logprobs, _), kept = saved_bytes(lambda: forward.completion_logprobs(model, *inputs, 1.0), model)
    logprobs.float().sum().backward()
    return logprobs.detach(), [p.grad for p in model.parameters()], kept


def difference(one, other) -> float:
    """The largest absolute difference between two passes' log-probs and gradients."""
    pairs = [(one[0], other[0]), *zip(one[1], other[1])]
    return max((a.float() - b.float()).abs().max().item() for a, b in pairs)


def set_mode(mode: str, saved: dict) -> None:
    """The mode's parts (for a model that carries kernels.recompute: true; the modes set its devices)."""
    recompute.RECOMPUTE_DEVICES = saved["devices"] if mode == "kept" else ("cpu", "cuda")
    recompute.LLAMA_NORMS = saved["norms"] if mode == "functions" else ()  # (checkpoint: every part a checkpoint)
    recompute.SILU_ACTIVATIONS = saved["silu"] if mode == "functions" else ()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    add_shape_arguments(parser, hidden=64, intermediate=96, layers=24, heads=4, vocab=512)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=17)
    parser.add_argument("--completion", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    forward.LAYOUTS[args.device] = ("onepass",)  # the model's own forward, where the recompute applies
    saved = {"devices": ("cuda",) if args.device != "cuda" else (), "norms": recompute.LLAMA_NORMS,
             "silu": recompute.SILU_ACTIVATIONS}
    model, inputs = attach(build(args), Kernels(recompute=True)), batch(args)  # (off by default)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    results, times = {}, {mode: [] for mode in MODES}
    for mode in MODES:  # (one warm-up pass each, and the numbers compared)
        set_mode(mode, saved)
        results[mode] = one_pass(model, inputs)
    set_mode("functions", saved)
    parts = len(recompute._cheap_parts(model))
    set_mode("kept", saved)
    again = one_pass(model, inputs)  # (CUDA's attention and embedding backward add in no fixed order)
    noise = difference(again, results["kept"])
    differences = {mode: difference(results[mode], results["kept"]) for mode in MODES[1:]}
    if noise == 0 and any(differences.values()):
        sys.exit(f"log-probs or gradients differ from the kept intermediates' on a device that repeats them exactly: "
                 f"{differences}")
    for _ in range(args.repeats):  # modes interleaved, so that a slow moment of the machine hits each alike
        for mode in MODES:
            set_mode(mode, saved)
            sync()
            start = time.perf_counter()
            one_pass(model, inputs)
            sync()
            times[mode].append(time.perf_counter() - start)
    print(f"{args.layers} layers, hidden {args.hidden}, MLP {args.intermediate}, {args.rows} x "
          f"{args.prompt + args.completion} positions, bf16 on {args.device}; {parts} parts recomputed; "
          f"median of {args.repeats}; " + ("the same log-probs and gradients in every mode" if noise == 0 else
          f"log-probs and gradients as far from the kept ones as the kept ones from themselves in a second pass "
          f"({noise:.3g}): " + ", ".join(f"{mode} {d:.3g}" for mode, d in differences.items())))
    kept = statistics.median(times["kept"])
    for mode in MODES:
        median = statistics.median(times[mode])
        extra = "" if mode == "kept" else f", {1e3 * (median - kept) / parts:+.3f} ms per part"
        print(f"  {mode:<11} {1e3 * median:8.2f} ms per pass, {results[mode][2] / 2**20:8.2f} MiB kept for "
              f"backward{extra}")


if __name__ == "__main__":
    main()

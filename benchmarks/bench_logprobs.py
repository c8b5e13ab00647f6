"""Token log-probs of low-precision logits, forward and backward: tidyrl.models.ops against autograd's own loop.

    python benchmarks/bench_logprobs.py                                  # 16 x 256 tokens, 151 936-token vocabulary
    python benchmarks/bench_logprobs.py --rows 16 --tokens 256 --vocab 151936 --device cuda --repeats 5

The training pass turns bf16 logits (rows x tokens x vocabulary, one micro-batch's completions) into float32
log-probs one row at a time. Differentiated by autograd, that loop keeps a float32 copy of every row for the
backward pass (twice the logits) and gives each row a backward that builds a zero tensor of the whole batch's shape
(rows^2 x tokens x vocabulary of memory traffic). `tidyrl.models.ops.gather_logprobs` writes the same arithmetic out
(`_LowPrecisionLogprobs`). Prints, for both, the median seconds of forward and backward, the bytes kept for backward,
and checks that log-probs and gradients are equal bit for bit. Alternates the two; medians of --repeats.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tidyrl.models.ops import gather_logprobs


def autograd_rows(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The loop as autograd differentiates it: each row upcast, l[id] - logsumexp(l), stacked."""
    rows = []
    for i in range(logits.shape[0]):
        row = logits[i].float()
        rows.append(row.gather(-1, ids[i].unsqueeze(-1)).squeeze(-1) - torch.logsumexp(row, dim=-1))
    return torch.stack(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(args.rows, args.tokens, args.vocab, generator=gen).to(args.device, getattr(torch, args.dtype))
    ids = torch.randint(0, args.vocab, (args.rows, args.tokens), generator=gen).to(args.device)
    weights = torch.randn(args.rows, args.tokens, generator=gen).to(args.device)

    def sync():
        if logits.device.type == "cuda":
            torch.cuda.synchronize()

    def step(fn):
        leaf = logits.detach().requires_grad_(True)
        kept: dict[int, int] = {}

        def pack(t):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        sync()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = fn(leaf, ids)
        sync()
        t1 = time.perf_counter()
        (out * weights).sum().backward()
        sync()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, sum(kept.values()), out.detach(), leaf.grad

    fns = {"tidyrl.models.ops": gather_logprobs, "autograd loop": autograd_rows}
    results = {name: step(fn) for name, fn in fns.items()}  # warm-up, and the outputs compared below
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for _ in range(args.repeats):
        for name, fn in fns.items():
            times[name].append(step(fn)[:2])
    print(f"{args.rows} rows x {args.tokens} tokens x {args.vocab} vocabulary, {args.dtype} logits "
          f"({logits.numel() * logits.element_size() / 2**20:.0f} MiB) on {args.device}, median of {args.repeats}")
    totals = {}
    for name in fns:
        fwd = statistics.median(t[0] for t in times[name])
        bwd = statistics.median(t[1] for t in times[name])
        totals[name] = statistics.median(t[0] + t[1] for t in times[name])
        print(f"  {name:13s}  forward {1000 * fwd:8.1f} ms  backward {1000 * bwd:8.1f} ms  "
              f"total {1000 * totals[name]:8.1f} ms  kept for backward {results[name][2] / 2**20:8.1f} MiB")
    ours, theirs = results["tidyrl.models.ops"], results["autograd loop"]
    same = torch.equal(ours[3], theirs[3]) and torch.equal(ours[4], theirs[4])
    print(f"  speed-up {totals['autograd loop'] / totals['tidyrl.models.ops']:.2f}x; kept for backward "
          f"{ours[2] / theirs[2]:.2f}x; log-probs and gradients bit-identical: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()

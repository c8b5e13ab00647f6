"""What carrying a mixture of experts' routes costs (rollout routing replay), measured side by side on one model:

    generate      the built-in engine's sampling of a rollout, without and with recording its routes
    score         the trainer's no-grad scoring of that rollout, its own routing against the routes replayed
    update        one micro-batch's forward and backward, the same two ways
    bytes         the routes the rollout carries (int16, per token, MoE layer and chosen expert) against its token
                  ids and log-probs

    python benchmarks/bench_routes.py                      # a small Qwen3-MoE on the CPU (~1 min)
    python benchmarks/bench_routes.py --hidden 256 --layers 4 --experts 16 --k 4 --repeats 5

Each timing is the median of `--repeats`, the two ways interleaved.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args()


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main():
    args = parse_args()
    from tidyrl.models.forward import completion_logprobs
    from tidyrl.models.generation import generate
    from tidyrl.models.routing import replaying
    from tidyrl.models.sequences import left_pad
    from tidyrl.models.tiny import build_tiny_moe

    vocab = 512
    model = build_tiny_moe("qwen3_moe", vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=4,
                           num_experts=args.experts, experts_per_token=args.k, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt_tokens,), generator=g).tolist() for _ in range(args.prompts)]
    prompts = [p for p in prompts for _ in range(args.samples)]
    keys = list(range(len(prompts)))
    settings = dict(sample_keys=keys, max_new_tokens=args.new_tokens, eos_ids=[2], pad_id=0, batch_size=len(prompts),
                    return_logprobs=True)
    plain, recorded = [], []
    for _ in range(args.repeats):  # interleaved
        plain += timed(lambda: generate(model, prompts, **settings), 1)
        recorded += timed(lambda: generate(model, prompts, return_routes=True, **settings), 1)
    ids, mask, _, logprobs, prompt_routes, completion_routes = generate(model, prompts, return_routes=True, **settings)
    p_ids, p_mask = left_pad(prompts, 0)
    routes = torch.cat([prompt_routes, completion_routes], 1)

    def score(with_routes: bool):
        with torch.no_grad(), replaying(model, routes if with_routes else None) as routing:
            completion_logprobs(model, p_ids, p_mask, ids, mask, 1.0, routing=routing)

    def update(with_routes: bool):
        model.train()
        rows = slice(0, args.samples * 2)
        with replaying(model, routes[rows] if with_routes else None) as routing:
            lp, _ = completion_logprobs(model, p_ids[rows], p_mask[rows], ids[rows], mask[rows], 1.0, routing=routing)
        lp.sum().backward()
        model.zero_grad(set_to_none=True)
        model.eval()

    figures = {"generate": (plain, recorded)}
    for name, fn in (("score", score), ("update", update)):
        own, replayed = [], []
        fn(True)  # warm-up
        for _ in range(args.repeats):
            own += timed(lambda: fn(False), 1)
            replayed += timed(lambda: fn(True), 1)
        figures[name] = (own, replayed)
    tokens = int(mask.sum()) + int(p_mask.sum())
    print(f"Qwen3-MoE h {args.hidden}, {args.layers} MoE layers, {args.experts} experts, top-{args.k}; "
          f"{len(prompts)} episodes of {args.prompt_tokens} + {args.new_tokens} tokens; median of {args.repeats}")
    print(f"{'phase':10} {'without s':>10} {'with routes s':>14} {'ratio':>7}")
    for name, (a, b) in figures.items():
        a, b = statistics.median(a), statistics.median(b)
        print(f"{name:10} {a:10.3f} {b:14.3f} {b / a:7.3f}")
    route_bytes = routes.numel() * routes.element_size()
    other = ids.numel() * ids.element_size() + logprobs.numel() * logprobs.element_size() + \
        p_ids.numel() * p_ids.element_size()
    print(f"bytes      routes {route_bytes} ({2 * args.layers * args.k} a position), token ids + log-probs {other}, "
          f"routes / those {route_bytes / other:.2f} ({tokens} real tokens)")


if __name__ == "__main__":
    main()

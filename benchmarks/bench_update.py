"""Time one training micro-batch (forward + backward of the completions' log-probs) on the benchmark workloads'
models, with tidyrl's lean Llama pass (tidyrl.models.lean_forward) and with the generic path through the model's own
forward (distinct prompts once, completions on their keys and values, in two passes).

    python benchmarks/bench_update.py --workload tiny --repeats 20
    python benchmarks/bench_update.py --workload small --repeats 5

The micro-batch is the training loop's: micro_batch_size rows, the k samples of a prompt side by side, every
completion max_new_tokens long (as in bench_vs_trl.py), in training mode. Prints, for both paths, the median
seconds of the forward and of the backward, the bytes autograd keeps for backward (every saved tensor's
storage counted once: the activation memory of a micro-batch), and checks that both give the same log-probs
and gradients. Alternates the two paths so that machine drift hits both alike; medians of --repeats.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_vs_trl import in_process_setup, prompt_texts  # noqa: E402
from count_saved_bytes import saved_bytes  # noqa: E402

from tidyrl.models.forward import completion_logprobs  # noqa: E402
from tidyrl.models.sequences import left_pad  # noqa: E402
from tidyrl.rollouts import Rollout  # noqa: E402


def main() -> None:
    args, w, tok, model = in_process_setup(__doc__, default_repeats=20)
    model.train()
    m, k, T = w["micro_batch"], w["k"], w["max_new_tokens"]
    texts = prompt_texts(max(1, m // k))
    rows = [tok(t)["input_ids"] for t in texts for _ in range(k)][:m]
    ids, mask = left_pad(rows, tok.pad_token_id)
    gen = torch.Generator().manual_seed(0)
    completions = torch.randint(4, len(tok), (len(rows), T), generator=gen)
    batch = Rollout(ids, mask, completions, torch.ones(len(rows), T), torch.ones(len(rows), dtype=torch.bool))
    weights = torch.randn(len(rows), T, generator=gen)  # a loss that reads every log-prob

    def step(lean: bool):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        logprobs, saved = saved_bytes(lambda: completion_logprobs(model, *batch.sequences, 1.0, fast_path=lean)[0])
        t1 = time.perf_counter()
        (logprobs * weights).sum().backward()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, saved, logprobs.detach(), [p.grad.clone() for p in model.parameters()]

    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    results = {lean: step(lean) for lean in (True, False)}  # warm-up, and the outputs compared below
    for _ in range(args.repeats):
        for lean in (True, False):
            times[lean].append(step(lean)[:2])
    lp_diff = (results[True][3] - results[False][3]).abs().max().item()
    grad_diff = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()
                    for a, b in zip(results[True][4], results[False][4]))
    n_prompts = len(set(map(tuple, rows)))
    print(f"{args.workload}: micro-batch of {len(rows)} rows ({n_prompts} prompts x {k} samples) x {T} tokens, "
          f"{args.threads} threads, median of {args.repeats}")
    medians = {}
    for lean in (True, False):
        fwd = statistics.median(t[0] for t in times[lean])
        bwd = statistics.median(t[1] for t in times[lean])
        medians[lean] = statistics.median(t[0] + t[1] for t in times[lean])
        print(f"  {'lean pass' if lean else 'HF forward':10s}  forward {1000 * fwd:7.1f} ms  backward {1000 * bwd:7.1f} ms"
              f"  total {1000 * medians[lean]:7.1f} ms  saved for backward {results[lean][2] / 2**20:7.1f} MiB")
    print(f"  speed-up {medians[False] / medians[True]:.2f}x; saved-tensor memory "
          f"{results[True][2] / results[False][2]:.2f}x; max |log-prob difference| {lp_diff:.1e}; "
          f"max gradient difference (relative to the tensor's largest) {grad_diff:.1e}")


if __name__ == "__main__":
    main()

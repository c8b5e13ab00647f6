"""Time tidyrl's generation on the benchmark workloads' models, with the lean Llama decode step on and off.

    python benchmarks/bench_decode.py --workload tiny --repeats 5

Prints the seconds per `generate` call (all P*k sequences at once, every completion max_new_tokens long,
as in bench_vs_trl.py) and per decoding step for both paths, and checks that they produce the same
completions. Alternates the two paths so that machine drift hits both alike; medians of --repeats.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_vs_trl import in_process_setup, prompt_texts  # noqa: E402

from tidyrl.models.generation import generate, sample_seed  # noqa: E402


def main() -> None:
    args, w, tok, model = in_process_setup(__doc__, default_repeats=5)
    model.eval()
    texts = prompt_texts(w["prompts"])
    prompts = [tok(t)["input_ids"] for t in texts for _ in range(w["k"])]
    T = w["max_new_tokens"]
    kw = dict(sample_keys=[sample_seed(0, 0, i) for i in range(len(prompts))], max_new_tokens=T,
              min_new_tokens=T, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id, batch_size=len(prompts),
              return_logprobs=True)
    times: dict[bool, list[float]] = {True: [], False: []}
    outputs = {}
    for lean in (True, False):  # warm-up
        outputs[lean] = generate(model, prompts, fast_path=lean, **kw)
    for _ in range(args.repeats):
        for lean in (True, False):
            start = time.perf_counter()
            generate(model, prompts, fast_path=lean, **kw)
            times[lean].append(time.perf_counter() - start)
    same = torch.equal(outputs[True][0], outputs[False][0])
    lp_diff = (outputs[True][3] - outputs[False][3]).abs().max().item()
    print(f"{args.workload}: {len(prompts)} sequences x {T} tokens, {args.threads} threads, median of {args.repeats}")
    for lean in (True, False):
        med = statistics.median(times[lean])
        print(f"  {'lean step' if lean else 'HF forward':10s}  {med:.4f} s per generate, {1000 * med / T:.2f} ms per step")
    print(f"  speed-up {statistics.median(times[False]) / statistics.median(times[True]):.2f}x; "
          f"same completions: {same}; max |log-prob difference| {lp_diff:.2e}")


if __name__ == "__main__":
    main()

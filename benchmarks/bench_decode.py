"""Time tidyrl's generation on the benchmark workloads' models: the lean Llama decode step (and on CUDA in bf16, the
same step without its fused kernels, `lean-unfused`, and with SDPA over the whole cache instead of the attention
kernel that reads only the positions written, `lean-sdpa`) against the model's own forward.

    python benchmarks/bench_decode.py --workload tiny --repeats 5
    python benchmarks/bench_decode.py --workload small --lora 8     # a LoRA adapter on every projection (peft)
    python benchmarks/bench_decode.py --workload qwen0.5b --device cuda --dtype bfloat16 --repeats 3 --profile 16
                                # on a GPU; --profile N: one profiled generate of N tokens, its top kernels

Prints the seconds per `generate` call (all P*k sequences at once, every completion max_new_tokens long,
as in bench_vs_trl.py) and per decoding step for each path, and whether they produce the HF forward's
completions (in bf16 a rounding flip changes a row). Alternates the paths so that machine drift hits all alike;
medians of --repeats.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_vs_trl import in_process_setup, prompt_texts  # noqa: E402

from tidyrl.models import fused_decode  # noqa: E402
from tidyrl.models.generation import generate
from tidyrl.models.sequences import sample_seed  # noqa: E402
from tidyrl.models.kernels import Kernels, attach  # noqa: E402


def main() -> None:
    args, w, tok, model = in_process_setup(__doc__, default_repeats=5, extra_args=_arguments)
    model.to(device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None)
    if args.lora:
        model = with_lora(model, args.lora)
    model.eval()
    prompts, kw = generation_inputs(w, tok)
    T = w["max_new_tokens"]
    # lean: the shipped step (on CUDA in bf16, with tidyrl.models.fused_decode's kernels); lean-unfused: the same
    # step without them (where they would serve); lean-sdpa: with them but the attention SDPA over the whole
    # capacity (kernels.decode_attention: sdpa); hf: the model's own forward.
    fused = fused_decode.wanted(torch.device(args.device), next(model.parameters()).dtype, model.config.head_dim
                                if getattr(model.config, "head_dim", None) else
                                model.config.hidden_size // model.config.num_attention_heads, on=True)
    paths = ["lean"] + (["lean-unfused", "lean-sdpa"] if fused else []) + ["hf"]
    times: dict[str, list[float]] = {path: [] for path in paths}
    outputs = {path: run(model, prompts, path, kw) for path in paths}  # warm-up
    for _ in range(args.repeats):
        for path in paths:
            start = time.perf_counter()
            run(model, prompts, path, kw)
            times[path].append(time.perf_counter() - start)
    lora = f", LoRA rank {args.lora}" if args.lora else ""
    print(f"{args.workload}{lora}: {len(prompts)} sequences x {T} tokens, {args.threads} threads, median of "
          f"{args.repeats}")
    for path in paths:
        med = statistics.median(times[path])
        same = torch.equal(outputs[path][0], outputs["hf"][0])
        lp_diff = (outputs[path][3] - outputs["hf"][3]).abs().max().item()
        print(f"  {path:12s}  {med:.4f} s per generate, {1000 * med / T:.2f} ms per step, "
              f"{statistics.median(times['hf']) / med:.2f}x the HF forward; same completions as it: {same}, "
              f"max |log-prob difference| {lp_diff:.2e}")
    given_up = fused_decode.failure()
    if given_up:
        print(f"  the fused decoding kernels failed here and were given up: the `lean` and `lean-sdpa` runs after "
              f"the failure decoded without them; {given_up}")
    if args.profile:
        profile(model, prompts, dict(kw, max_new_tokens=args.profile, min_new_tokens=args.profile), args.device)


def generation_inputs(w: dict, tok) -> tuple[list, dict]:
    """The workload's prompts (each k times) and `generate`'s keyword arguments: every completion max_new_tokens
    long, keyed as a rollout's samples, with log-probs."""
    prompts = [tok(t)["input_ids"] for t in prompt_texts(w["prompts"]) for _ in range(w["k"])]
    T = w["max_new_tokens"]
    return prompts, dict(sample_keys=[sample_seed(0, 0, i) for i in range(len(prompts))], max_new_tokens=T,
                         min_new_tokens=T, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id,
                         batch_size=len(prompts), return_logprobs=True)


def run(model, prompts, path: str, kw: dict):
    """One `generate` on `path`, the model given that path's choice of kernels. Another choice rebuilds the model's
    decode step (it is chosen when the step is built; no weight copies for models past COPY_MAX_BYTES, so this costs
    milliseconds)."""
    attach(model, Kernels(fused_decode=path != "lean-unfused", decode_attention="sdpa" if path == "lean-sdpa"
                          else "kernel"))
    return generate(model, prompts, fast_path=path != "hf", **kw)


def _arguments(parser) -> None:
    parser.add_argument("--lora", type=int, default=0, metavar="RANK", help="wrap the model in a peft LoRA adapter "
                        "of this rank")
    parser.add_argument("--device", default="cpu", help="where the model generates (cpu, cuda)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="the weights' dtype")
    parser.add_argument("--profile", type=int, default=0, metavar="TOKENS",
                        help="then profile one lean generate of TOKENS new tokens: wall and device time, top kernels")


def profile(model, prompts, kw: dict, device: str) -> None:
    """One profiled lean `generate` (after an unprofiled one of the same length, so that graphs are captured)."""
    import torch.profiler as tp

    cuda = torch.device(device).type == "cuda"
    generate(model, prompts, fast_path=True, **kw)
    activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if cuda else [])
    with tp.profile(activities=activities) as prof:
        start = time.perf_counter()
        generate(model, prompts, fast_path=True, **kw)
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr) > 0 and (not cuda or e.device_type.name == "CUDA")]
    total = sum(getattr(e, attr) for e in events)
    print(f"  profile: {kw['max_new_tokens']} tokens, wall {1e3 * wall:.1f} ms, device {total / 1e3:.1f} ms in "
          f"{sum(e.count for e in events)} kernels ({1e3 * wall / kw['max_new_tokens']:.2f} ms per step)")
    for e in sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:15]:
        print(f"      {getattr(e, attr) / max(total, 1e-9):6.1%} {getattr(e, attr) / 1e3:8.2f} ms {e.count:6d} x  "
              f"{e.key[:110]}")


def with_lora(model, rank: int):
    """`model` under a LoRA adapter of `rank` on every projection (lora_alpha = 2 rank), its B drawn at random so
    that the adapter changes every output (freshly initialised B is zero)."""
    import peft

    target = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=target))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=g))
    return model


if __name__ == "__main__":
    main()

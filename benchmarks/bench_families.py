"""Time each declared model family (tidyrl.models.families) on the fast path against the model's own forward, at one
shape: decoding (tidyrl's `generate`, the lean step against the model's forward and cache) and one update
micro-batch (forward + backward of the completions' log-probs, the lean pass against the model's own passes).

    python benchmarks/bench_families.py --workload tiny --repeats 5
    python benchmarks/bench_families.py --workload tiny --families qwen3,gemma3 --device cuda --dtype bfloat16
    python benchmarks/bench_families.py --model runs/gemma3/model --set k=4 --repeats 3   # a real model's folder

Every family's model has the workload's shape (hidden size, layers, heads, MLP width, the character vocabulary) and
random weights (seed 0); what differs is the family's layout: Qwen2's q/k/v biases, Qwen3's and Gemma 3's q/k
norms, Gemma 3's sandwich norms, (1 + w) norms, scaled embeddings, tanh GELU and its sliding window on three
layers of four, Mistral's window on every layer, OLMo 2's post-norms and whole-projection q/k norms, Phi-3's fused
projections; Qwen3-MoE's and OLMoE's mixtures of experts (8 experts, 2 a token), whose blocks the fast path calls
as the model's own modules. The windows (16 positions) are shorter than the rows (a prompt and 32 new tokens), so
they mask.
Prints per family the milliseconds per decoding step and the update micro-batch's seconds on both paths and their
ratio (the model's own time / the fast path's), and whether both paths drew the same completions. Alternates the
paths so that machine drift hits all alike; medians of --repeats.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_decode import generation_inputs  # noqa: E402
from bench_vs_trl import in_process_setup  # noqa: E402

from tidyrl.models import families  # noqa: E402
from tidyrl.models.forward import completion_logprobs  # noqa: E402
from tidyrl.models.generation import generate
from tidyrl.models.sequences import left_pad  # noqa: E402

WINDOW = 16
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3", "olmo2", "phi3", "qwen3_moe", "olmoe")


def family_model(name: str, w: dict, tok):
    """A random model of family `name` with the workload's shape (see the module docstring)."""
    import transformers

    heads = w["heads"]
    common = dict(vocab_size=len(tok), hidden_size=w["hidden"], intermediate_size=w["intermediate"],
                  num_hidden_layers=w["layers"], num_attention_heads=heads,
                  num_key_value_heads=w.get("kv_heads") or heads,
                  max_position_embeddings=1024, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, tie_word_embeddings=w.get("tied", False))
    layers = w["layers"]
    extra, classes = {
        "llama": ({}, ("LlamaConfig", "LlamaForCausalLM")),
        "qwen2": ({}, ("Qwen2Config", "Qwen2ForCausalLM")),
        "qwen3": ({"head_dim": w["hidden"] // heads}, ("Qwen3Config", "Qwen3ForCausalLM")),
        "mistral": ({"sliding_window": WINDOW}, ("MistralConfig", "MistralForCausalLM")),
        "gemma3": ({"head_dim": w["hidden"] // heads, "query_pre_attn_scalar": w["hidden"] // heads,
                    "sliding_window": WINDOW,
                    "layer_types": [families.FULL if (i + 1) % 4 == 0 else families.SLIDING for i in range(layers)]},
                   ("Gemma3TextConfig", "Gemma3ForCausalLM")),
        "olmo2": ({}, ("Olmo2Config", "Olmo2ForCausalLM")),
        "phi3": ({}, ("Phi3Config", "Phi3ForCausalLM")),
        # 8 experts, 2 a token, each a quarter of the dense MLP's width: the model's own block on the fast path too
        "qwen3_moe": ({"head_dim": w["hidden"] // heads, "num_experts": 8, "num_experts_per_tok": 2,
                       "moe_intermediate_size": w["intermediate"] // 4}, ("Qwen3MoeConfig", "Qwen3MoeForCausalLM")),
        "olmoe": ({"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": w["intermediate"] // 4},
                  ("OlmoeConfig", "OlmoeForCausalLM")),
    }[name]
    torch.manual_seed(0)
    config = getattr(transformers, classes[0])(**{**common, **extra})
    config._attn_implementation = "sdpa"
    return getattr(transformers, classes[1])(config).eval()


def main() -> None:
    args, w, tok, _ = in_process_setup(__doc__, default_repeats=5, extra_args=_arguments)
    names = [args.model] if args.model else args.families.split(",") if args.families else list(FAMILIES)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.model:  # the workload's prompts in the model's own tokens
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
    prompts, kw = generation_inputs(w, tok)
    T = w["max_new_tokens"]
    print(f"{args.workload}: {len(prompts)} sequences x {T} tokens (update: {min(w['micro_batch'], len(prompts))} "
          f"rows), {args.threads} threads, {args.device}{', ' + args.dtype if args.dtype else ''}, median of "
          f"{args.repeats}; own = the model's own forward, ratio = own / fast")
    print(f"  {'family':8s} {'path':30s} {'decode ms/step fast':>20s} {'own':>8s} {'ratio':>6s}   "
          f"{'update s fast':>13s} {'own':>8s} {'ratio':>6s}  same completions")
    for name in names:
        model = (_load(name) if args.model else family_model(name, w, tok)).to(device=args.device, dtype=dtype)
        path = families.path_description(model.config, type(model).__name__)
        name = families.family_of(model.config, type(model).__name__).name if args.model else name
        decode = {fast: [] for fast in (True, False)}
        update = {fast: [] for fast in (True, False)}
        outputs = {fast: generate(model, prompts, fast_path=fast, **kw) for fast in (True, False)}  # warm-up
        ids, mask = left_pad(prompts, tok.pad_token_id)
        rows = slice(0, min(w["micro_batch"], len(prompts)))
        batch = (ids[rows], mask[rows], outputs[True][0][rows], outputs[True][1][rows])
        model.train()
        for fast in (True, False):  # warm-up
            _update(model, batch, fast)
        for _ in range(args.repeats):
            for fast in (True, False):
                model.eval()
                start = time.perf_counter()
                generate(model, prompts, fast_path=fast, **kw)
                _sync(args.device)
                decode[fast].append(time.perf_counter() - start)
                model.train()
                start = time.perf_counter()
                _update(model, batch, fast)
                _sync(args.device)
                update[fast].append(time.perf_counter() - start)
        model.eval()
        d = {fast: statistics.median(v) for fast, v in decode.items()}
        u = {fast: statistics.median(v) for fast, v in update.items()}
        same = torch.equal(outputs[True][0], outputs[False][0])
        print(f"  {name:8s} {path[:30]:30s} {1e3 * d[True] / T:20.2f} {1e3 * d[False] / T:8.2f} "
              f"{d[False] / d[True]:5.2f}x   {u[True]:13.4f} {u[False]:8.4f} {u[False] / u[True]:5.2f}x  {same}")


def _load(folder: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _update(model, batch, fast: bool) -> None:
    """One update micro-batch: the completions' log-probs, forward and backward."""
    model.zero_grad(set_to_none=True)
    logprobs, _ = completion_logprobs(model, *batch, temperature=1.0, fast_path=fast)
    (logprobs * batch[3].to(logprobs.device)).sum().backward()


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _arguments(parser) -> None:
    parser.add_argument("--model", default="", help="a model folder to time instead of the families' tiny models")
    parser.add_argument("--families", default="", help=f"comma-separated, of {', '.join(FAMILIES)} (default: all)")
    parser.add_argument("--device", default="cpu", help="where the models run (cpu, cuda)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="the weights' dtype")


if __name__ == "__main__":
    main()

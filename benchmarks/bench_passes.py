"""Scoring and update passes side by side, in one process: which layout of the training forward is fastest on a device.

    python benchmarks/bench_passes.py --device cuda --workload qwen0.5b --repeats 5 [--profile]   # a GPU
    python benchmarks/bench_passes.py --trace --workload qwen0.5b        # op by op, on the meta device (no GPU)
    python benchmarks/bench_passes.py --workload tiny --repeats 3        # this CPU
    python benchmarks/bench_passes.py --device cuda --workload qwen0.5b --prompt-width 512   # long shared prompts

One micro-batch of the workload (micro_batch rows: the k samples of a prompt side by side, every completion
max_new_tokens long, as bench_vs_trl.py's runs) through four passes that compute the same log-probs:

- `lean`     tidyrl's lean Llama pass (models.lean_forward: distinct prompts once, one pass through the layers);
- `shared`   tidyrl's generic path: the model's forward twice (distinct prompts, then the completions on their
             keys and values indexed per row: models.forward._shared_prompt_logits);
- `onepass`  tidyrl's one-pass path: the model's forward over [prompt, completion] with logits_to_keep and
             tidyrl's 4D mask and positions, then tidyrl.ops (what `completion_logprobs` runs where neither applies);
- `trl`      TRL 1.16's way: the model's forward with the 2D mask and logits_to_keep, logits sliced and divided by
             the temperature, a row-wise log-softmax (trl's selective_log_softmax) and entropy_from_logits.

For each: `score`, the no-grad pass of one scoring chunk (eval mode), and `update`, forward (with entropy) and
backward of one training micro-batch (train mode); median seconds over --repeats (the device synchronised around
each), peak device memory of the update, and the largest log-prob difference from `onepass`. --widths N adds the
cost of a new shape: each pass on N new prompt widths, the first call on each (cold) and the second (warm), with
torch's order of attention kernels (on Hopper: cuDNN's first, which plans each new shape) and with the
memory-efficient kernel first. Per rollout, the
loops run R / micro_batch of each (printed as `x rollout`). --profile adds, per pass, one profiled score and update:
device time against wall time (a pass whose device time is far below its wall time waits on the host), the
attention kernels torch chose, and the top kernels with their share of the pass's device time.

--trace records every aten op of one score and one update (forward and backward) with TorchDispatchMode on the meta
device (the same code path CUDA takes: no CPU-only branch applies), and prints per pass: ops dispatched, matrix
products by dtype (GFLOP), attention ops, index/gather/scatter ops and the bytes they write, vocabulary-sized
tensors written, float32 tensors as large as a weight matrix on a bf16 model, and host reads.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from bench_vs_trl import WORKLOADS, prompt_texts, set_workload, parse_overrides  # noqa: E402

from tidyrl.models import devices as tidy_devices  # noqa: E402
from tidyrl.models import forward as tidy_forward  # noqa: E402
from tidyrl.models.sequences import left_pad  # noqa: E402
from tidyrl.models.kernels import attach, kernels_of  # noqa: E402
from tidyrl.rollouts.record import Rollout  # noqa: E402

PASSES = ("lean", "shared", "onepass", "onepass-rows", "onepass-exact", "trl")


def build_model(w: dict, device: str, dtype: torch.dtype):
    """The workload's Llama (random init, seed 0), built directly on `device` (no host copy of a large model)."""
    from tidyrl.models.tiny import build_char_tokenizer, build_tiny_llama

    tok = build_char_tokenizer(chat_template=None)
    with torch.device(device):
        model = build_tiny_llama(w.get("vocab", len(tok)), hidden_size=w["hidden"], num_layers=w["layers"],
                                 num_heads=w["heads"], num_kv_heads=w.get("kv_heads"),
                                 intermediate_size=w["intermediate"], max_position_embeddings=1024, seed=0,
                                 bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id, tie_word_embeddings=w.get("tied", False))
    return tok, model.to(dtype)


def micro_batch(w: dict, tok) -> Rollout:
    m, k, T = w["micro_batch"], w["k"], w["max_new_tokens"]
    texts = prompt_texts(max(1, -(-m // k)))
    rows = [tok(t)["input_ids"] for t in texts for _ in range(k)][:m]
    ids, mask = left_pad(rows, tok.pad_token_id)
    gen = torch.Generator().manual_seed(0)
    completions = torch.randint(4, len(tok), (len(rows), T), generator=gen)
    return Rollout(ids, mask, completions, torch.ones(len(rows), T), torch.zeros(len(rows), dtype=torch.bool))


def batch_of_width(w: dict, tok, width: int, seed: int) -> Rollout:
    """A micro-batch like `micro_batch`'s whose prompts are all `width` tokens (BOS + random ids): a new shape of every
    attention call for each new width, as the chunks of a real run have."""
    m, k, T = w["micro_batch"], w["k"], w["max_new_tokens"]
    gen = torch.Generator().manual_seed(seed)
    prompts = [[tok.bos_token_id] + torch.randint(4, len(tok), (width - 1,), generator=gen).tolist()
               for _ in range(max(1, -(-m // k)))]
    ids, mask = left_pad([p for p in prompts for _ in range(k)][:m], tok.pad_token_id)
    completions = torch.randint(4, len(tok), (len(ids), T), generator=gen)
    return Rollout(ids, mask, completions, torch.ones(len(ids), T), torch.zeros(len(ids), dtype=torch.bool))


def attention(name: str):
    """`torch`: torch's own order of SDPA kernels (on Hopper cuDNN's first); `efficient`: the memory-efficient kernel
    first (then flash, cuDNN, math: the order only, nothing enabled that was not)."""
    if name == "torch":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    enabled = [(SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled()),
               (SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled()),
               (SDPBackend.CUDNN_ATTENTION, torch.backends.cuda.cudnn_sdp_enabled()),
               (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled())]
    return sdpa_kernel([b for b, on in enabled if on], set_priority=True)


def widths_table(args, w, tok, model, device) -> None:
    """Each pass on --widths new prompt widths (a shape never seen: cold) and then again on each (warm), with torch's
    order of attention kernels and with the memory-efficient kernel first: medians over the widths, ms."""
    print(f"\n-- new shapes: {args.widths} new prompt widths per pass and attention order; cold = first call on a new "
          f"width, warm = the same again (ms, medians); attention 'torch' = torch's kernel order (Hopper: cuDNN "
          f"first), 'efficient' = the memory-efficient kernel first")
    print(f"{'pass':14}{'attention':>10}{'score cold':>12}{'score warm':>12}{'update cold':>13}{'update warm':>13}")
    next_width = 20
    gen = torch.Generator().manual_seed(2)
    weights = torch.randn(len(micro_batch(w, tok)), w["max_new_tokens"], generator=gen).to(device)
    for name in args.passes:
        for order in ("torch", "efficient"):
            cold = {"score": [], "update": []}
            warm = {"score": [], "update": []}
            with attention(order):
                for i in range(args.widths):
                    batch = batch_of_width(w, tok, next_width, seed=next_width)
                    next_width += 1
                    for phase, fn in (("score", lambda: score(name, model, batch)),
                                      ("update", lambda: update(name, model, batch, weights))):
                        cold[phase].append(timed(fn, device)[0])
                        warm[phase].append(timed(fn, device)[0])
            model.zero_grad(set_to_none=True)
            med = {f"{k}_{p}": 1e3 * statistics.median(d[p]) for k, d in (("cold", cold), ("warm", warm))
                   for p in ("score", "update")}
            print(f"{name:14}{order:>10}{med['cold_score']:12.1f}{med['warm_score']:12.1f}{med['cold_update']:13.1f}"
                  f"{med['warm_update']:13.1f}", flush=True)


def _trl_functions():
    """trl's selective_log_softmax and entropy_from_logits where trl is installed, else the same code (TRL 1.16)."""
    try:
        from trl.trainer.utils import entropy_from_logits, selective_log_softmax
        return selective_log_softmax, entropy_from_logits
    except Exception:  # noqa: BLE001 - trl absent or changed: its 1.16 code
        def selective_log_softmax(logits, index):
            if logits.dtype in (torch.float32, torch.float64):
                selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
                lse = torch.stack([torch.logsumexp(lg, dim=-1) for lg in logits])
                return selected - lse
            out = []
            for row_logits, row_labels in zip(logits, index):
                row_logps = F.log_softmax(row_logits, dim=-1)
                out.append(row_logps.gather(dim=-1, index=row_labels.unsqueeze(-1)).squeeze(-1))
            return torch.stack(out)

        def entropy_from_logits(logits, chunk_size: int = 128):
            original_shape = logits.shape[:-1]
            flat = logits.reshape(-1, logits.shape[-1])
            out = []
            for chunk in flat.split(chunk_size, dim=0):
                logps = F.log_softmax(chunk, dim=-1)
                out.append(-(torch.exp(logps) * logps).sum(-1))
            return torch.cat(out).reshape(original_shape)

        return selective_log_softmax, entropy_from_logits


@contextlib.contextmanager
def layout(name: str, device):
    """tidyrl's forward with only layout `name` on `device` (models.forward.LAYOUTS; the one-pass is the fallback)."""
    kind = torch.device(device).type
    had, before = kind in tidy_forward.LAYOUTS, tidy_forward.LAYOUTS.get(kind)
    tidy_forward.LAYOUTS[kind] = (name,)
    share = tidy_forward.LEAN_FROM_SHARE.pop(kind, None)  # (no lean pass put first for long repeated prompts)
    try:
        yield
    finally:
        if had:
            tidy_forward.LAYOUTS[kind] = before
        else:
            del tidy_forward.LAYOUTS[kind]
        if share is not None:
            tidy_forward.LEAN_FROM_SHARE[kind] = share


def run_pass(name: str, model, batch: Rollout, with_entropy: bool):
    """(log-probs (B, Tc), entropy or None) of `batch` by pass `name`."""
    if name == "onepass-rows":  # the one-pass forward with the row-by-row log-probs, not the fused kernels
        chosen = kernels_of(model)
        attach(model, dataclasses.replace(chosen, fused_logprobs=False))
        try:
            return run_pass("onepass", model, batch, with_entropy)
        finally:
            attach(model, chosen)
    if name == "onepass-exact":  # the one-pass forward on rows of their own width (no WIDTH_MULTIPLE padding)
        kind = model.lm_head.weight.device.type
        multiple = tidy_devices.WIDTH_MULTIPLE.pop(kind, None)
        try:
            return run_pass("onepass", model, batch, with_entropy)
        finally:
            if multiple is not None:
                tidy_devices.WIDTH_MULTIPLE[kind] = multiple
    if name in ("lean", "shared", "onepass"):
        with layout(name, model.lm_head.weight.device):
            return tidy_forward.completion_logprobs(model, *batch.sequences, 1.0, with_entropy=with_entropy)
    selective_log_softmax, entropy_from_logits = _trl_functions()
    device = model.lm_head.weight.device
    p_ids, p_mask, c_ids, c_mask = batch.sequences
    ids = torch.cat([p_ids, c_ids], 1).to(device)
    mask = torch.cat([p_mask, c_mask.long()], 1).to(device)
    if device.type == "meta":  # transformers reads a 2D mask on the host: on meta, the finished 4D mask instead
        mask = tidy_forward.model_mask(model, mask, mask.shape[1])
    tc = c_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=tc + 1).logits
    logits = logits[:, :-1, :][:, -tc:, :] / 1.0
    logps = selective_log_softmax(logits, ids[:, -tc:])
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = entropy_from_logits(logits)
    return logps, entropy


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def score(name, model, batch):
    model.eval()
    with torch.no_grad():
        return run_pass(name, model, batch, with_entropy=False)[0]


def update(name, model, batch, weights):
    model.train()
    model.zero_grad(set_to_none=True)
    logprobs, _ = run_pass(name, model, batch, with_entropy=True)
    (logprobs * weights).sum().backward()
    return logprobs.detach()


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


def profile_pass(fn, device) -> dict:
    """One profiled call of `fn`: wall and device time, attention ops, top kernels."""
    import torch.profiler as tp

    cuda = torch.device(device).type == "cuda"
    activities = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if cuda else [])
    sync(device)
    with tp.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = time.perf_counter() - t0
    events = prof.key_averages()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    kernels = [e for e in events if getattr(e, attr) > 0 and (not cuda or e.device_type.name == "CUDA")]
    total = sum(getattr(e, attr) for e in kernels)
    attention = {e.key: e.count for e in events if "scaled_dot_product" in e.key or e.key.startswith("aten::_flash")
                 or e.key.startswith("aten::_efficient") or e.key.startswith("aten::_cudnn_attention")}
    syncs = {e.key: e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                          "aten::_local_scalar_dense", "aten::nonzero", "cudaMemcpy")}
    top = sorted(kernels, key=lambda e: getattr(e, attr), reverse=True)[:8]
    return {"wall_ms": wall * 1e3, "device_ms": total / 1e3, "kernels": sum(e.count for e in kernels),
            "attention": attention, "syncs": syncs,
            "top": [(getattr(e, attr) / max(total, 1e-9), getattr(e, attr) / 1e3, e.count, e.key) for e in top]}


# ------------------------------------------------------------------------------------------------- the trace
class _Recorder(torch.utils._python_dispatch.TorchDispatchMode):
    """Every aten op dispatched, with its outputs' shapes and dtypes."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, list[tuple[tuple, torch.dtype]], tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]
        ins = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        self.ops.append((str(func.overloadpacket.__name__), [(tuple(o.shape), o.dtype) for o in outs], ins))
        return out


# Ops whose output is a view of their input: they write nothing.
VIEWS = {"t", "view", "_unsafe_view", "select", "slice", "expand", "transpose", "permute", "split", "split_with_sizes",
         "unsqueeze", "squeeze", "as_strided", "alias", "detach", "unbind", "narrow", "_reshape_alias", "reshape",
         "view_as", "unflatten", "flatten", "chunk", "_unsafe_split", "numpy_T", "lift_fresh", "diagonal"}


def _bytes(shape, dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def summarise_trace(ops, vocab: int, weight_numel: int, model_dtype: torch.dtype) -> dict:
    counts = Counter(name for name, _, _ in ops)
    ops = [op for op in ops if op[0] not in VIEWS]  # what follows counts what is written
    flops: dict[str, float] = defaultdict(float)
    for name, outs, ins in ops:
        if name in ("mm", "addmm", "bmm", "baddbmm") and outs and len(ins) >= 2:
            a = ins[-2]
            flops[str(outs[0][1]).replace("torch.", "")] += 2 * torch.Size(outs[0][0]).numel() * a[-1] / 1e9
    vocab_writes = [(name, shape, dtype) for name, outs, _ in ops for shape, dtype in outs
                    if len(shape) >= 2 and shape[-1] == vocab and torch.Size(shape).numel() > vocab]
    index_ops = Counter()
    index_bytes = 0
    for name, outs, _ in ops:
        if name in ("index_select", "index_add", "index_add_", "gather", "scatter", "scatter_add", "scatter_add_",
                    "index", "index_put", "index_put_", "index_copy", "index_copy_", "embedding",
                    "embedding_dense_backward"):
            index_ops[name] += 1
            index_bytes += sum(_bytes(s, d) for s, d in outs)
    big_f32 = Counter(name for name, outs, _ in ops for shape, dtype in outs
                      if model_dtype != torch.float32 and dtype == torch.float32
                      and torch.Size(shape).numel() >= weight_numel and (not shape or shape[-1] != vocab))
    attention = Counter(name for name, _, _ in ops if "attention" in name or "softmax" in name)
    host = Counter(name for name, _, _ in ops if name in ("_local_scalar_dense", "nonzero", "item", "unique_dim",
                                                          "_unique2"))
    return {"ops": sum(counts.values()), "matmul_gflop": dict(flops), "attention": dict(attention),
            "index": dict(index_ops), "index_mib": index_bytes / 2**20,
            "vocab_tensors": Counter(f"{n} {str(d).replace('torch.', '')}" for n, _, d in vocab_writes),
            "vocab_mib": sum(_bytes(s, d) for _, s, d in vocab_writes) / 2**20,
            "float32_weight_sized": dict(big_f32), "host_reads": dict(host)}


class _AutocastTakesMeta:
    """transformers < 5 computes its rotary embedding under `torch.autocast(device_type=x.device.type,
    enabled=False)`, which torch refuses for the meta device ("unsupported scalarType"); disabled autocast is the
    same on any device type, so the trace maps meta to cpu there (as tests/test_host_syncs.py does)."""

    def __enter__(self):
        self.real = real = torch.autocast
        torch.autocast = lambda device_type, *a, **kw: real("cpu" if device_type == "meta" else device_type, *a, **kw)

    def __exit__(self, *exc):
        torch.autocast = self.real


def trace(args, w) -> None:
    with _AutocastTakesMeta():
        _trace(args, w)


def _trace(args, w) -> None:
    tok, model = build_model(w, "meta", getattr(torch, w.get("dtype", "float32")))
    batch = micro_batch(w, tok)
    weights = torch.ones(batch.completion_ids.shape, device="meta")
    V, hidden = model.config.vocab_size, model.config.hidden_size
    weight_numel = hidden * hidden
    print(f"trace (meta device, {w.get('dtype', 'float32')}): {len(batch)} rows x {w['max_new_tokens']} tokens, "
          f"vocabulary {V}; 'float32 weight-sized' = float32 outputs of >= hidden^2 = {weight_numel} elements "
          f"(not vocabulary-sized). Attention: meta has no fused kernel, so SDPA shows its math decomposition here; "
          f"which kernel CUDA picks is --profile's line on a GPU")
    for name in args.passes:
        for phase in ("score", "update"):
            rec = _Recorder()
            try:
                with rec:
                    if phase == "score":
                        score(name, model, batch)
                    else:
                        update(name, model, batch, weights)
            except Exception as err:  # noqa: BLE001 - a pass that cannot run on meta says so and the rest go on
                print(f"  {name:8s} {phase:6s}: could not run on meta ({type(err).__name__}: {str(err)[:120]})")
                continue
            s = summarise_trace(rec.ops, V, weight_numel, next(model.parameters()).dtype)
            gflop = ", ".join(f"{d} {g:.0f}" for d, g in sorted(s["matmul_gflop"].items()))
            print(f"  {name:8s} {phase:6s}: {s['ops']:5d} ops; matmul GFLOP {gflop}; attention {s['attention']}")
            print(f"  {'':15s} index ops {s['index']} ({s['index_mib']:.0f} MiB written); vocabulary-sized "
                  f"{dict(s['vocab_tensors'])} ({s['vocab_mib']:.0f} MiB); float32 weight-sized "
                  f"{s['float32_weight_sized'] or 'none'}; host reads {s['host_reads'] or 'none'}")


# ------------------------------------------------------------------------------------------------- the timings
def measure(args, w) -> None:
    device = args.device
    dtype = getattr(torch, args.dtype or w.get("dtype", "float32"))
    tok, model = build_model(w, device, dtype)
    batch = batch_of_width(w, tok, args.prompt_width, seed=0) if args.prompt_width else micro_batch(w, tok)
    gen = torch.Generator().manual_seed(1)
    weights = torch.randn(batch.completion_ids.shape, generator=gen).to(device)
    per_rollout = w["prompts"] * w["k"] // len(batch)
    cuda = torch.device(device).type == "cuda"
    times: dict[str, dict[str, list[float]]] = {n: {"score": [], "update": []} for n in args.passes}
    peak, logprobs = {}, {}
    for name in args.passes:  # warm-up; outputs kept for the comparison
        logprobs[name] = score(name, model, batch).float()
        update(name, model, batch, weights)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            update(name, model, batch, weights)
            sync(device)
            peak[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
    model.zero_grad(set_to_none=True)
    for _ in range(args.repeats):
        for name in args.passes:  # alternating: drift hits every pass alike
            times[name]["score"].append(timed(lambda: score(name, model, batch), device)[0])
            times[name]["update"].append(timed(lambda: update(name, model, batch, weights), device)[0])
    model.zero_grad(set_to_none=True)
    ref = logprobs.get("onepass", next(iter(logprobs.values())))
    print(f"\n== {args.workload} on {device} ({torch.cuda.get_device_name() if cuda else 'CPU'}), {dtype}: micro-batch "
          f"of {len(batch)} rows x {w['max_new_tokens']} tokens, prompts {batch.prompt_ids.shape[1]} wide; "
          f"median of {args.repeats}; x rollout = x {per_rollout} ==")
    print(f"{'pass':14}{'score ms':>10}{'x rollout s':>13}{'update ms':>11}{'x rollout s':>13}"
          f"{'update peak MiB':>17}{'max |dlogp|':>13}")
    for name in args.passes:
        s, u = (statistics.median(times[name][p]) for p in ("score", "update"))
        diff = (logprobs[name] - ref).abs().max().item()
        print(f"{name:14}{1e3 * s:10.1f}{s * per_rollout:13.3f}{1e3 * u:11.1f}{u * per_rollout:13.3f}"
              f"{peak.get(name, float('nan')):17.0f}{diff:13.2e}", flush=True)
    if args.widths:
        widths_table(args, w, tok, model, device)
    if args.profile:
        for name in args.passes:
            for phase, fn in (("score", lambda: score(name, model, batch)),
                              ("update", lambda: update(name, model, batch, weights))):
                p = profile_pass(fn, device)
                print(f"  profile {name} {phase}: wall {p['wall_ms']:.1f} ms, device {p['device_ms']:.1f} ms in "
                      f"{p['kernels']} kernels; attention {p['attention'] or 'none'}; host syncs {p['syncs'] or 'none'}")
                for share, ms, count, key in p["top"]:
                    print(f"      {share:6.1%} {ms:8.2f} ms {count:5d} x  {key[:100]}")
        model.zero_grad(set_to_none=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", choices=list(WORKLOADS), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="the weights' dtype (default: the workload's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--passes", default=",".join(PASSES), help=f"a subset of {', '.join(PASSES)}")
    parser.add_argument("--profile", action="store_true", help="profile one score and one update per pass")
    parser.add_argument("--widths", type=int, default=0,
                        help="also time each pass on this many new prompt widths, cold and warm, with torch's order "
                             "of attention kernels and with the memory-efficient kernel first")
    parser.add_argument("--prompt-width", type=int, default=0,
                        help="prompts of this many tokens (random ids) instead of the benchmark's 8-30 characters: "
                             "where running each prompt once (lean, shared) starts to pay")
    parser.add_argument("--trace", action="store_true", help="op-by-op trace on the meta device instead of timings")
    parser.add_argument("--set", dest="overrides", default="", metavar="KEY=VALUE,...")
    args = parser.parse_args(argv)
    args.passes = [p.strip() for p in args.passes.split(",") if p.strip()]
    if unknown := set(args.passes) - set(PASSES):
        parser.error(f"unknown passes {sorted(unknown)}: choose from {', '.join(PASSES)}")
    torch.set_num_threads(args.threads)
    w = set_workload(args.workload, parse_overrides(args.overrides, parser), parser)
    if args.trace:
        trace(args, w)
    else:
        measure(args, w)


if __name__ == "__main__":
    main()

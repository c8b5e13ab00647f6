"""What a LoRA policy's weight sync costs, adapter only against merged, on the vLLM engines (needs vLLM).

    python benchmarks/bench_lora_sync.py                  # two tiny Llamas, LoRA r = 16 on every linear layer
    python benchmarks/bench_lora_sync.py --rank 1 --syncs 10

For each model: the in-process `vllm` engine started once for each way (adapter only: vLLM's LoRA support, the
adapter written and loaded as a LoRA request of its version; merged: the whole model with the adapter folded in,
`reload_weights`), then `--syncs` syncs after moving the adapter, each timed (best and median seconds) with the
bytes it sent; and the `vllm-server` engine's side of a sync (what it writes into server.sync_dir for the servers
to read: `write_adapter` against `write_weights`), bytes and seconds, without a server (the servers' reload is
not timed here: tests/test_vllm.py runs it against a real one).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

MODELS = {"1M": dict(hidden_size=128, num_layers=4, num_heads=2),
          "20M": dict(hidden_size=512, num_layers=6, num_heads=8)}


def policy_of(model_dir, rank: int):
    import peft
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    return peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"))


def move(policy, step: int) -> None:
    """An optimizer step's worth of change: every adapter weight moved a little."""
    import torch

    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.add_(1e-3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(step)))


def timed(sync, policy, syncs: int) -> list[float]:
    seconds = []
    for i in range(syncs):
        move(policy, i)
        start = time.perf_counter()
        sync(policy)
        seconds.append(time.perf_counter() - start)
    return seconds


def row(model: str, engine: str, way: str, size: int, seconds: list[float]) -> str:
    return (f"| {model} | {engine} | {way} | {size / 1e6:.3f} MB | {min(seconds) * 1e3:.1f} ms | "
            f"{statistics.median(seconds) * 1e3:.1f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--syncs", type=int, default=5)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()

    from tidyrl.engines import base
    from tidyrl.engines.server import write_adapter, write_weights
    from tidyrl.engines.vllm import VLLMEngine
    from tidyrl.models.tiny import save_tiny_model

    print("| model | engine | sync | bytes per sync | best | median |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models:
            model_dir = save_tiny_model(os.path.join(tmp, name), **MODELS[name])
            policy = policy_of(model_dir, args.rank)
            for way in ("adapter", "merged"):
                base.ADAPTER_SYNC = way == "adapter"
                plan = base.lora_sync_plan(policy)
                assert plan.mode == way, plan
                engine = VLLMEngine(str(model_dir), dtype="float32", seed=0, max_model_len=128, kv_cache_gb=1,
                                    gpu_memory_utilization=0.5, enforce_eager=True, device="cpu", lora=plan)
                engine.sync(policy)  # the first sync (an adapter's first load) is not timed
                seconds = timed(engine.sync, policy, args.syncs)
                print(row(name, "vllm", way, engine.sync_bytes, seconds), flush=True)
                del engine
            sync_dir = os.path.join(tmp, f"{name}-sync")
            sizes = {}

            def adapter(p, v=iter(range(1, 10**6))):
                sizes["adapter"] = write_adapter(p, sync_dir, next(v))[1]

            def merged(p, v=iter(range(10**6, 2 * 10**6))):
                folder = write_weights(p, sync_dir, next(v))
                sizes["merged"] = os.path.getsize(os.path.join(folder, "model.safetensors"))

            for way, write in (("adapter", adapter), ("merged", merged)):
                seconds = timed(write, policy, args.syncs)
                print(row(name, "vllm-server (write)", way, sizes[way], seconds), flush=True)


if __name__ == "__main__":
    main()

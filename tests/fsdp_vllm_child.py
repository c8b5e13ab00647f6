"""Run by tests/test_vllm.py under torchrun (2 gloo processes on CPU): a vLLM engine in each process synced from
a real FSDP2-sharded tiny Llama. Checks that each parameter is gathered on its own (never the whole model) and
that the engine then samples with the policy's weights. Writes a JSON report per rank."""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from tidyrl.engines import SamplingSettings
from tidyrl.engines.vllm import VLLMEngine
from tidyrl.models.ops import gather_logprobs
from tidyrl.models.sharding import is_sharded

model_dir, report = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()

plain = AutoModelForCausalLM.from_pretrained(model_dir).eval()
with torch.no_grad():  # an "update": the weights the engine must pick up, the same on both processes
    for p in plain.parameters():
        p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
sharded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
sharded.load_state_dict(plain.state_dict())
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in sharded.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(sharded, mesh=mesh)

gathered = [0]
original = DTensor.full_tensor


def counting(self, *args, **kwargs):
    gathered[0] += 1
    return original(self, *args, **kwargs)


DTensor.full_tensor = counting
engine = VLLMEngine(model_dir, dtype="float32", seed=0, max_model_len=64, kv_cache_gb=1,
                    gpu_memory_utilization=0.5, enforce_eager=True, device="cpu")
engine.sync(sharded)
shards = sum(isinstance(t, DTensor) for t in sharded.state_dict().values())

prompts = [[1, 5 + rank, 6, 7], [1, 9, 10]]
settings = SamplingSettings(max_new_tokens=8, eos_ids=[2], pad_id=0)
ids, mask, _, logprobs = engine.generate(prompts, [10 * rank + 1, 10 * rank + 2], settings)
diff = 0.0
for b, prompt in enumerate(prompts):
    n = int(mask[b].sum())
    sequence = torch.tensor([prompt + ids[b, :n].tolist()])
    with torch.no_grad():
        expected = gather_logprobs(plain(sequence).logits[:, len(prompt) - 1:-1], sequence[:, len(prompt):])[0]
    diff = max(diff, float((logprobs[b, :n] - expected).abs().max()))

with open(f"{report}.{rank}", "w") as f:
    json.dump({"rank": rank, "gathered": gathered[0], "shards": shards, "logprob_diff": diff,
               "still_sharded": is_sharded(sharded) and all(isinstance(p, DTensor) for p in sharded.parameters())},
              f)
dist.destroy_process_group()

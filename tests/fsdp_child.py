"""Run by tests/test_sharding.py under torchrun (2 gloo processes on CPU): generation from a real FSDP2-sharded
tiny Llama, inside and outside `full_weights`, against the same model unsharded. Writes a JSON report."""

import json
import sys

import torch
import torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from tidyrl.models.generation import generate

from tidyrl.models.sequences import sample_seed
from tidyrl.models.sharding import full_weights, is_sharded

model_dir, report = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()

gathers = [0]
original = param_group.foreach_all_gather


def counting(*args, **kwargs):
    gathers[0] += 1
    return original(*args, **kwargs)


param_group.foreach_all_gather = counting

plain = AutoModelForCausalLM.from_pretrained(model_dir).eval()
sharded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in sharded.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(sharded, mesh=mesh)
groups = 1 + len(sharded.model.layers)

prompts = [[1, 5 + rank, 6, 7], [1, 9, 10]] * 2
kwargs = dict(sample_keys=[sample_seed(0, 0, 4 * rank + i) for i in range(4)], max_new_tokens=12,
              min_new_tokens=12, eos_ids=[2], pad_id=0, batch_size=4, return_logprobs=True)
expected = generate(plain, prompts, **kwargs)

gathers[0] = 0
with full_weights(sharded):
    inside = generate(sharded, prompts, **kwargs)
gathers_inside = gathers[0]
resharded = all(type(p).__name__ == "DTensor" for p in sharded.parameters())

gathers[0] = 0
outside = generate(sharded, prompts, **kwargs)
gathers_outside = gathers[0]

# Training still works on the resharded model afterwards (gradients reach every shard).
sharded.train()
loss = sharded(input_ids=torch.tensor(prompts[:1])).logits.square().mean()
loss.backward()
grads = all(p.grad is not None for p in sharded.parameters())

result = {
    "rank": rank, "groups": groups,
    "ids_equal": torch.equal(inside[0], expected[0]) and torch.equal(outside[0], expected[0]),
    "logprob_diff": float((inside[3] - expected[3]).abs().max()),
    "gathers_inside": gathers_inside, "gathers_outside": gathers_outside,
    "resharded": resharded, "is_sharded": is_sharded(sharded), "grads": grads,
}
with open(f"{report}.{rank}", "w") as f:
    json.dump(result, f)
dist.destroy_process_group()

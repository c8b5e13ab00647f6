"""Run by tests/test_server_engine.py under torchrun (2 gloo processes on CPU): the vllm-server engine synced from
a real FSDP2-sharded tiny Llama, as the learner syncs it at lag 0 (on its own thread: every process walks the
parameters, whose all-gathers are collectives; the first writes them) and with rollout.lag (a snapshot gathered on
the learner's thread at a launch, synced later from another thread). Writes a JSON report per rank."""

import json
import sys
import threading

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from tidyrl.engines.server import ServerEngine
from tidyrl.models.sharding import is_sharded
from tidyrl.rollouts.weights import weight_snapshot

model_dir, url, sync_dir, report = sys.argv[1:5]
dist.init_process_group("gloo")
rank = dist.get_rank()


def nudge(model, scale):  # an "update": the same on both processes
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name) + p.numel())))


sharded = AutoModelForCausalLM.from_pretrained(model_dir).eval()
nudge(sharded, 0.05)
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
for layer in sharded.model.layers:
    fully_shard(layer, mesh=mesh)
fully_shard(sharded, mesh=mesh)
engine = ServerEngine([url], sync_dir=sync_dir, sync_timeout_s=60, group=dist.new_group(backend="gloo"))
engine.sync(sharded)  # lag 0: on the learner's thread
first = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sharded.state_dict().items()}

with torch.no_grad():  # the next version (an in-place step on the shards): a snapshot at a launch, synced from a thread
    for p in sharded.parameters():
        p.mul_(1.01)
snapshot = weight_snapshot(sharded)
errors = []


def sync_later():
    try:
        engine.sync(snapshot)
    except Exception as err:  # noqa: BLE001 - reported
        errors.append(repr(err))


thread = threading.Thread(target=sync_later)
thread.start()
thread.join(timeout=120)
second = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sharded.state_dict().items()}
if rank == 0:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in first.items() if "lm_head" not in k}, f"{report}.first.safetensors")
    save_file({k: v.contiguous() for k, v in second.items() if "lm_head" not in k}, f"{report}.second.safetensors")
with open(f"{report}.{rank}", "w") as f:
    json.dump({"rank": rank, "errors": errors, "joined": not thread.is_alive(), "version": engine.version,
               "snapshot_tensors": len(snapshot), "still_sharded": is_sharded(sharded)}, f)
dist.destroy_process_group()

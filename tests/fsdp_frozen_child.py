"""Run by tests/test_fsdp.py under torchrun (2 gloo processes on CPU): frozen scorers sharded as a run shards them
under FSDP2 (`models.sharding.shard_frozen`), scoring shares of different sizes on the two processes, against the
same models unsharded. Writes a JSON report per process."""

import json
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from tidyrl.data.offline import TokenizedSequence
from tidyrl.loops.offline.dpo import sequence_logps_cache
from tidyrl.models.sharding import shard_frozen
from tidyrl.rewards.reward_models import RewardModel

model_dir, reward_dir, report = sys.argv[1], sys.argv[2], sys.argv[3]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)

plain = AutoModelForCausalLM.from_pretrained(model_dir).eval().requires_grad_(False)
sharded = shard_frozen(AutoModelForCausalLM.from_pretrained(model_dir), "cpu")

# 5 chunks of 2 sequences over 2 processes: process 0 scores 3, process 1 scores 2 (and one more forward to join).
sequences = [TokenizedSequence([1] + [3 + (7 * i + j) % 50 for j in range(3 + i % 4)], [0, 0] + [1] * (2 + i % 4))
             for i in range(9)]
def summed(tensor, reduction):
    dist.all_reduce(tensor)
    return tensor


accelerator = SimpleNamespace(num_processes=world, process_index=rank, device=torch.device("cpu"), reduce=summed)
cached_sharded = sequence_logps_cache(accelerator, sharded, sequences, 0, 2)
one = SimpleNamespace(num_processes=1, process_index=0, device=torch.device("cpu"), reduce=lambda t, reduction: t)
cached_plain = sequence_logps_cache(one, plain, sequences, 0, 2)

reward_plain = RewardModel(reward_dir, batch_size=2).load()
reward_sharded = RewardModel(reward_dir, batch_size=2).load()
reward_sharded.model = shard_frozen(reward_sharded.model, "cpu")
# process 0: 5 samples (3 chunks), process 1: 2 samples (1 chunk); then 1 sample against none (the producer's call
# on a process without episodes)
texts = [(f"q{rank}{i}:", "abc"[: 1 + i % 3]) for i in range(5 if rank == 0 else 2)]
scores = reward_sharded([p for p, _ in texts], [c for _, c in texts])
scores += reward_sharded(["x:"], ["y"]) if rank == 0 else reward_sharded([], [])
expected = reward_plain([p for p, _ in texts], [c for _, c in texts]) + (reward_plain(["x:"], ["y"]) if rank == 0 else [])

with open(f"{report}.{rank}", "w") as f:
    json.dump({
        "reference_dtensors": all(isinstance(p, DTensor) for p in sharded.parameters()),
        "reference_local_fraction": sum(p.to_local().numel() for p in sharded.parameters())
        / sum(p.numel() for p in plain.parameters()),
        "logps_diff": float((cached_sharded - cached_plain).abs().max()),
        "reward_dtensors": all(isinstance(p, DTensor) for p in reward_sharded.model.parameters()),
        "scores": len(scores), "expected": len(expected),
        "reward_diff": max(abs(a - b) for a, b in zip(scores, expected)),
    }, f)
dist.destroy_process_group()

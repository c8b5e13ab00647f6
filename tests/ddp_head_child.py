"""Run by tests/test_chunked_head.py under torchrun (2 gloo processes on CPU): two SGD steps of a bf16 tiny Llama
(tied embeddings) inside DDP, each process on its half of a batch, with the chunked head and the recompute (CUDA's,
forced onto the CPU); beside the same model alone on the whole batch in each process, from DDP's weights at each
step. Writes a JSON report per
rank: how many passes took the chunked head, and how far DDP's log-probs and gradients are from the model's alone,
in bf16 units of the latter."""

import copy
import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).parent))
from conftest import bf16_units, completion_batch, llama  # noqa: E402

from tidyrl.models import chunked_head, forward, fused_logprobs, recompute  # noqa: E402
from tidyrl.models.forward import completion_logprobs  # noqa: E402
from tidyrl.models.kernels import Kernels, attach  # noqa: E402

report = sys.argv[1]
dist.init_process_group("gloo")
rank = dist.get_rank()
chunked_head.HEAD_DEVICES = ("cpu",)
recompute.RECOMPUTE_DEVICES = ("cpu",)
forward.LAYOUTS["cpu"] = ("onepass",)
chunked_head.CHUNK_BYTES = 5 * 40 * 2  # 5 positions a chunk at the 40-token vocabulary
fused_logprobs.BLOCK = 16
calls = []
real_head = forward.head_logprobs
forward.head_logprobs = lambda *a, **k: calls.append(a[0].requires_grad) or real_head(*a, **k)



def run() -> dict:
    alone = attach(llama(tie_word_embeddings=True).to(torch.bfloat16), Kernels(recompute=True))  # (off by default)
    ddp = DistributedDataParallel(copy.deepcopy(alone))
    batch, weights = completion_batch(2)
    mine = slice(2 * rank, 2 * rank + 2)  # this process's half of the 4 episodes
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.5)
    lp_units, grad_units = [], []
    for step in range(2):
        alone.load_state_dict(ddp.module.state_dict())  # each step from DDP's weights (its update is what is tested)
        alone.zero_grad()
        lp_all, _ = completion_logprobs(alone, *batch, 0.8)
        (lp_all * weights).sum().div(2).backward()  # the mean over the 2 processes' sums, as DDP averages
        opt_ddp.zero_grad()
        lp, _ = completion_logprobs(ddp, *(t[mine] for t in batch), 0.8)
        (lp * weights[mine]).sum().backward()
        lp_units.append(bf16_units(lp.detach(), lp_all.detach()[mine]))
        grads = {n: p.grad for n, p in alone.named_parameters()}
        grad_units.append(max(bf16_units(p.grad, grads[n.removeprefix("module.")]) for n, p in ddp.named_parameters()))
        opt_ddp.step()
    return {"calls": calls, "lp_units": lp_units, "grad_units": grad_units,
            "restored": not any("forward" in vars(m) for m in ddp.modules())}


Path(f"{report}.{rank}").write_text(json.dumps(run()))
# DDP and its reducer gone with run's frame (and any cycle), and both processes done, before the group goes: a
# reducer destroyed after its group, at the interpreter's exit, aborted a process once under load
gc.collect()
dist.barrier()
dist.destroy_process_group()

"""The memory plan (tidyrl.memory.plan) against the peak a CPU process reaches, per phase and shape.

    python benchmarks/bench_memory_plan.py        # five float32 Llama shapes (the fourth SmolLM2-135M's, the
                                                  # fifth 512-token rows) and three sft shapes (~4 min)
    python benchmarks/bench_memory_plan.py --shape "256 4 8000 4 32 96"      # one shape
    python benchmarks/bench_memory_plan.py --family qwen3 --family gemma3   # the RL shapes in other families
    python benchmarks/bench_memory_plan.py --family gemma3-270m             # Gemma 3 270M's own shape
    python benchmarks/bench_memory_plan.py --sft                            # the first sft shape alone

Each shape "h L V m P C" (hidden size, layers, vocabulary, micro/forward batch, prompt and completion tokens) of
a family (`--family`: llama by default; qwen3 adds q/k norms, gemma3 its sandwich norms, q/k norms, sliding windows
and tied embeddings; gemma3-270m is Gemma 3 270M's own dimensions, 262k vocabulary included, at m P C of 4 64 128)
runs in a fresh process with one thread (Linux: the peak is the process's VmHWM, reset through /proc/self/clear_refs):

- scoring: one forward without grad through tidyrl's scoring path (models.forward.completion_logprobs: on a CPU
  the lean pass), the peak above the weights, against the plan's scoring parts beyond the resident ones (the lean
  pass's largest moment: the layer outputs its loop holds with a layer's working set or the output layer, or the
  logits and the log-softmax's float32 copy);
- update: a second optimizer step (the first one made AdamW's moments, so they are resident as in any step after
  it) over two micro-batches (the second's backward runs with the first's gradients held, as in any step that
  accumulates), the peak above the weights and moments, against the plan's update parts beyond them (gradients,
  activations, logits and their gradient).

- sft update (`--sft "h L V m T"`): the same, through the offline stages' forward (the model's own, m rows of T
  tokens padded as pad_batch pads), against the offline plan's update parts beyond the weights and moments.

The ratio measured / predicted is printed; the target is 0.85-1.15 (docs/memory.md has the figures). What moves it
from machine to machine: which kernels the CPU runs and their scratch buffers.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

MEASURE = r'''
import sys, torch, transformers
from tidyrl.models.forward import completion_logprobs
from tidyrl.memory.plan import MemoryInputs, Scorer, Shape, memory_plan


def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def peak_above(fn):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) starts again from the current RSS
    before = status("VmRSS:")
    fn()
    return status("VmHWM:") - before


torch.manual_seed(0)
h, L, V, m, P, C = (int(x) for x in sys.argv[1:7])
family = sys.argv[7]
dims = dict(hidden_size=h, num_hidden_layers=L, num_attention_heads=max(h // 64, 1),
            num_key_value_heads=max(h // 192, 1), intermediate_size=int(2.75 * h), vocab_size=V)
if family == "gemma3-270m":  # its config.json's dimensions
    dims = dict(hidden_size=640, num_hidden_layers=18, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                intermediate_size=2048, vocab_size=262144, query_pre_attn_scalar=256, sliding_window=512)
if family == "llama":
    cfg = transformers.LlamaConfig(**dims, tie_word_embeddings=False)
elif family == "qwen3":
    cfg = transformers.Qwen3Config(**dims, head_dim=h // dims["num_attention_heads"], tie_word_embeddings=False)
else:  # gemma3, gemma3-270m: tied embeddings, five sliding layers of six
    dims.setdefault("head_dim", h // dims["num_attention_heads"])
    dims.setdefault("query_pre_attn_scalar", dims["head_dim"])
    window = dims.pop("sliding_window", 16)
    cfg = transformers.Gemma3TextConfig(**dims, sliding_window=window, tie_word_embeddings=True)
cfg._attn_implementation = "sdpa"
cfg.architectures = [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}.get(family, "Gemma3ForCausalLM")]
model = transformers.AutoModelForCausalLM.from_config(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
prompt, completion = torch.randint(0, V, (m, P)), torch.randint(0, V, (m, C))
ones = torch.ones_like(prompt), torch.ones_like(completion)


def score():
    with torch.no_grad():
        completion_logprobs(model, prompt, ones[0], completion, ones[1], 1.0)


def step():
    for _ in range(2):  # two micro-batches: the second's backward runs with the first's gradients held
        logprobs, _ = completion_logprobs(model, prompt, ones[0], completion, ones[1], 1.0)
        logprobs.sum().backward()
        del logprobs
    opt.step()
    opt.zero_grad(set_to_none=True)


score()  # the first call of each path allocates once for good (kernels' and the library's first-call state)
scoring = peak_above(score)
step()  # AdamW's moments now exist, as in every step after the first
update = peak_above(step)
shape = Shape.of(cfg.to_dict())  # the scorer: a KL reference of the policy's shape (here the policy itself)
x = MemoryInputs(policy=shape, dtype_bytes=4, prompt_tokens=P, new_tokens=C, generation_batch_size=m,
                 forward_batch_size=m, micro_batch_size=m, episodes_per_process=m, lean_update=True,
                 scorers=(Scorer("reference", shape, 4, True, lean=True),))  # a CPU with fast paths: the lean pass
plan = memory_plan(x)
resident = ("policy_weights", "optimizer_state", "reference_weights")
for name, measured in (("scoring", scoring), ("update", update)):
    parts = plan.phase(name).parts
    print(name, measured, sum(v for k, v in parts.items() if k not in resident))
'''

MEASURE_SFT = r'''
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from tidyrl.data.offline import TokenizedSequence
from tidyrl.loops.offline.loop import pad_batch, target_logprobs
from tidyrl.memory.plan import OfflineInputs, Shape, memory_plan


def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def peak_above(fn):
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = status("VmRSS:")
    fn()
    return status("VmHWM:") - before


torch.manual_seed(0)
h, L, V, m, T = (int(x) for x in sys.argv[1:6])
cfg = LlamaConfig(hidden_size=h, num_hidden_layers=L, num_attention_heads=max(h // 64, 1),
                  num_key_value_heads=max(h // 192, 1), intermediate_size=int(2.75 * h), vocab_size=V,
                  tie_word_embeddings=False, pad_token_id=0)
model = LlamaForCausalLM(cfg)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
batch = pad_batch([TokenizedSequence(torch.randint(1, V, (T,)).tolist(), [0] + [1] * (T - 1)) for _ in range(m)],
                  0, "cpu")


def step():
    for _ in range(2):  # two micro-batches, as in bench's RL update
        logprobs, mask = target_logprobs(model, batch)
        (logprobs * mask).sum().backward()
        del logprobs, mask
    opt.step()
    opt.zero_grad(set_to_none=True)


step()
update = peak_above(step)
parts = memory_plan(OfflineInputs("sft", Shape.of(cfg.to_dict()), 4, T, m)).phase("update").parts
print("update", update, sum(v for k, v in parts.items() if k not in ("policy_weights", "optimizer_state")))
'''

SHAPES = ("256 4 8000 4 32 96", "256 8 2000 8 32 96", "512 2 16000 2 32 160", "576 30 49152 4 64 128",
          "256 4 2000 2 32 480")
"""RL shapes "h L V m P C"; the last one's 512-token rows make the attention's probabilities a quarter of the
update's activations."""
SFT_SHAPES = ("256 4 8000 4 128", "256 8 2000 8 128", "576 30 49152 4 192")
"""sft shapes "h L V m T": the model's own forward over m rows of T tokens (the offline stages' update)."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", help='"h L V m P C"; repeatable (default: five shapes)')
    parser.add_argument("--family", action="append", choices=("llama", "qwen3", "gemma3", "gemma3-270m"),
                        help="the RL shapes' model family (default: llama); repeatable")
    parser.add_argument("--sft", action="append", metavar="SHAPE", nargs="?", const=SFT_SHAPES[0],
                        help=f'an sft update "h L V m T" (alone: {SFT_SHAPES[0]!r}); repeatable')
    args = parser.parse_args()
    if not os.path.exists("/proc/self/clear_refs"):
        sys.exit("bench_memory_plan: resets the peak RSS through /proc/self/clear_refs (Linux only)")
    src = str(Path(__file__).resolve().parent.parent / "src")
    # glibc's malloc keeps freed memory for reuse (and raises its mmap threshold as large blocks are freed), so the
    # RSS would not fall after a phase and the next phase's peak would hide in it: a fixed threshold gives every
    # large tensor its own mapping, returned when freed.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536",
           "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    print(f"{'shape (h L V m P C)':36} {'phase':8} {'measured MiB':>13} {'predicted MiB':>14} {'ratio':>6}")
    runs = []
    if args.shape or args.family or not args.sft:
        for family in args.family or ["llama"]:
            shapes = ["640 18 262144 4 64 128"] if family == "gemma3-270m" else args.shape or SHAPES
            runs += [(MEASURE, shape, family) for shape in shapes]
    if args.sft or not (args.shape or args.family):
        runs += [(MEASURE_SFT, shape, "") for shape in args.sft or SFT_SHAPES]
    for script, shape, family in runs:
        done = subprocess.run([sys.executable, "-c", script, *shape.split(), *([family] if family else [])],
                              capture_output=True, text=True, env=env, check=False)
        if done.returncode:
            sys.exit(done.stderr[-3000:])
        for line in done.stdout.split("\n"):
            if line:
                phase, measured, predicted = line.split()
                measured, predicted = int(measured), int(predicted)
                phase = phase if script is MEASURE else f"sft {phase}"
                label = shape if family in ("", "llama") else f"{family} {shape}"
                print(f"{label:36} {phase:8} {measured / 2**20:13.1f} {predicted / 2**20:14.1f} "
                      f"{measured / predicted:6.2f}", flush=True)


if __name__ == "__main__":
    main()

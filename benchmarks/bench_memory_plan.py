"""The memory plan (tidyrl.memory.plan) against the peak a CPU process reaches, per phase and shape.

    python benchmarks/bench_memory_plan.py        # five float32 Llama shapes (the fourth SmolLM2-135M's, the
                                                  # fifth 512-token rows) and three sft shapes (~4 min)
    python benchmarks/bench_memory_plan.py --shape "256 4 8000 4 32 96"      # one shape
    python benchmarks/bench_memory_plan.py --family qwen3 --family gemma3   # the RL shapes in other families
    python benchmarks/bench_memory_plan.py --family gemma3-270m             # Gemma 3 270M's own shape
    python benchmarks/bench_memory_plan.py --sft                            # the first sft shape alone
    python benchmarks/bench_memory_plan.py --offline            # tidyrl train: sft and dpo in float32, bfloat16,
                                                                # with LoRA, under FSDP2 on 2 processes (~3 min)
    python benchmarks/bench_memory_plan.py --offline bfloat16   # one of them
    python benchmarks/bench_memory_plan.py --smollm2 MODEL      # tidyrl train: GRPO and SFT on SmolLM2-135M-Instruct
                                                                # (MODEL: its folder, examples/smollm2; ~20 min)

Each shape "h L V m P C" (hidden size, layers, vocabulary, micro/forward batch, prompt and completion tokens) of
a family (`--family`: llama by default; qwen3 adds q/k norms, gemma3 its sandwich norms, q/k norms, sliding windows
and tied embeddings; qwen3_moe a mixture of 8 experts of a quarter of the dense MLP's size, 2 per token, in every
layer; gemma3-270m is Gemma 3 270M's own dimensions, 262k vocabulary included, at m P C of 4 64 128)
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

`--offline` and `--smollm2` measure whole runs instead, through the library's own code paths: `tidyrl train` (under
FSDP2 `accelerate launch --config_file examples/accelerate/fsdp.yaml --num_processes 2`, gloo, no GPU) in a process
whose phases are wrapped (RUN: generation `rollouts.making.on_engine`, scoring `rollouts.taking.score_rollout` and
dpo's `reference_logps_cache`, update `loops.rl.learner.optimizer_step` and `OfflineRun._step`): each call's peak
above the RSS at its start, the phase's second call (AdamW's moments made by the first step, the kernels' first
calls done), or for dpo's reference, which scores once before training, a second call after the run's own; under
FSDP2 the larger of the two processes'. Beside it `tidyrl plan CONFIG` (`--num-processes 2 --fsdp`) and the phase's
parts beyond the resident ones (the policy's and reference's weights, AdamW's moments); `resident` is the RSS at
the phase's start above the imports', which also holds the tokenizer, data and runtime (100-150 MiB here).

- `--offline`: a Llama of h L V = 256 4 8 000 (the first sft shape's) with tidyrl's character tokenizer; sft on 32
  examples of 127 and 128 tokens in micro-batches of 4, dpo on 32 such pairs in micro-batches of 2 (4 rows), two
  micro-batches per process and step; float32, bfloat16 (`model_dtype`), LoRA (r 16, every linear layer), FSDP2
  over 2 processes (float32, gradients whole until the step's last micro-batch).
- `--smollm2 MODEL`: examples/smollm2's arithmetic task (prepare.py) in float32; GRPO with a KL reference (0.05,
  so that the reference's scoring runs), 2 rollouts of 2 prompts x 4 samples of up to 32 new tokens, one optimizer
  step each over micro-batches of 4, at the example's temperature 0.7 and at 1.0; SFT on 24 worked answers, 3
  steps of 8 in micro-batches of 4; and the same GRPO with all three batch sizes `auto` under two budgets
  (train.memory_budget 3GiB and 4GiB; AUTO_BUDGETS), the sizes chosen printed below its phases.

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
elif family == "qwen3_moe":  # 8 experts of a quarter of the dense size, 2 per token, every layer sparse
    dims["moe_intermediate_size"] = dims["intermediate_size"] // 4
    cfg = transformers.Qwen3MoeConfig(**dims, head_dim=h // dims["num_attention_heads"], num_experts=8,
                                      num_experts_per_tok=2, tie_word_embeddings=False)
else:  # gemma3, gemma3-270m: tied embeddings, five sliding layers of six
    dims.setdefault("head_dim", h // dims["num_attention_heads"])
    dims.setdefault("query_pre_attn_scalar", dims["head_dim"])
    window = dims.pop("sliding_window", 16)
    cfg = transformers.Gemma3TextConfig(**dims, sliding_window=window, tie_word_embeddings=True)
cfg._attn_implementation = "sdpa"
cfg.architectures = [{"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "qwen3_moe": "Qwen3MoeForCausalLM"}.get(family, "Gemma3ForCausalLM")]
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
                 accumulation_steps=2,  # (the step's two micro-batches)
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
parts = memory_plan(OfflineInputs("sft", Shape.of(cfg.to_dict()), 4, T, m, accumulation_steps=2)).phase("update").parts
print("update", update, sum(v for k, v in parts.items() if k not in ("policy_weights", "optimizer_state")))
'''

RUN = r"""
import gc, json, os, sys

import accelerate, torch, transformers  # noqa: F401  the imports' memory is the baseline of `resident`
from transformers import AutoTokenizer, LlamaForCausalLM  # noqa: F401  (transformers imports them lazily)
try:
    import peft  # noqa: F401  (a LoRA run's)
except ImportError:
    pass
import tidyrl.loops.offline.dpo as dpo
import tidyrl.loops.offline.loop as offline
import tidyrl.loops.rl.learner as learner
import tidyrl.rollouts.making as making
import tidyrl.rollouts.taking as taking
from tidyrl.cli import main


def status(key):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


base, calls = status("VmRSS:"), []


def measured(phase, fn, once=False):
    def run(*args, **kwargs):
        if once:  # a phase the run calls once (dpo's reference): its path warmed by a first call, as a second call is
            fn(*args, **kwargs)
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = status("VmRSS:")
        out = fn(*args, **kwargs)
        calls.append({"phase": phase, "resident": before - base, "peak": status("VmHWM:") - before})
        return out
    return run


making.on_engine = measured("generation", making.on_engine)  # the engine's sync, the generation, the rewards
taking.score_rollout = measured("scoring", taking.score_rollout)  # the old, reference and critic's log-probs
learner.optimizer_step = measured("update", learner.optimizer_step)
dpo.reference_logps_cache = measured("scoring", dpo.reference_logps_cache, once=True)
offline.OfflineRun._step = measured("update", offline.OfflineRun._step)
try:
    code = main(sys.argv[1:])
finally:
    with open(f"{os.environ['BENCH_REPORT']}.{os.environ.get('RANK', '0')}", "w") as f:
        json.dump(calls, f)
sys.exit(code)
"""
"""`tidyrl train` in the process, each phase's calls wrapped: each call's peak above the RSS at its start, and that
RSS above the RSS after the imports (`resident`: the weights and AdamW's moments, with the tokenizer, data and
runtime the plan does not count). A JSON list per process, BENCH_REPORT.RANK."""

OFFLINE_SHAPE = (256, 4, 8000)
"""h L V of the offline stages' runs (`--offline`): the first sft shape's model."""
OFFLINE_VARIANTS = ("float32", "bfloat16", "lora", "fsdp2")
"""What each offline run changes: the model's dtype, a LoRA adapter (r 16 on every linear layer, float32), FSDP2 over
2 gloo processes (float32)."""
FSDP_YAML = Path(__file__).resolve().parent.parent / "examples" / "accelerate" / "fsdp.yaml"
RESIDENT = ("policy_weights", "optimizer_state", "reference_weights")
AUTO_BUDGETS = ("3GiB", "4GiB")
"""`--smollm2`: the train.memory_budget of the two GRPO runs whose batch sizes are all `auto`."""


SHAPES = ("256 4 8000 4 32 96", "256 8 2000 8 32 96", "512 2 16000 2 32 160", "576 30 49152 4 64 128",
          "256 4 2000 2 32 480")
"""RL shapes "h L V m P C"; the last one's 512-token rows make the attention's probabilities a quarter of the
update's activations."""
SFT_SHAPES = ("256 4 8000 4 128", "256 8 2000 8 128", "576 30 49152 4 192")
"""sft shapes "h L V m T": the model's own forward over m rows of T tokens (the offline stages' update)."""


def write_offline(folder: Path) -> tuple[Path, Path, Path]:
    """A float32 Llama of OFFLINE_SHAPE with tidyrl's character tokenizer (its vocabulary the shape's, larger than
    the tokenizer's, as real models' often are) and its data: 32 sft examples and 32 dpo pairs of 128 and 127
    tokens (so that most micro-batches pad). Returns the model folder, the sft and the dpo data."""
    import json
    import random

    from transformers.utils import logging

    from tidyrl.models.tiny import build_char_tokenizer, build_tiny_llama

    logging.disable_progress_bar()
    h, L, V = OFFLINE_SHAPE
    tok = build_char_tokenizer()
    model = build_tiny_llama(V, hidden_size=h, num_layers=L, num_heads=max(h // 64, 1),
                             num_kv_heads=max(h // 192, 1), intermediate_size=int(2.75 * h),
                             max_position_embeddings=256, bos_token_id=tok.bos_token_id,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.save_pretrained(folder / "model")
    tok.save_pretrained(folder / "model")
    rng = random.Random(0)

    def text(n: int) -> str:
        return "".join(rng.choice("abcdefghij ") for _ in range(n))

    def tokens(prompt: str, completion: str) -> int:  # as the stages tokenise a prompt and its completion
        return len(tok(prompt + completion)["input_ids"])

    sft, dpo = [], []
    for k in range(32):
        prompt = text(32)
        target = 128 - k % 2
        completion = text(target - 32)
        while tokens(prompt, completion) + 1 > target:  # (+1: the EOS the stages append)
            completion = completion[:-1]
        sft.append({"prompt": prompt, "completion": completion})
        dpo.append({"prompt": prompt, "chosen": completion, "rejected": text(len(completion))})
    for name, rows in (("sft", sft), ("dpo", dpo)):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder / "model", folder / "sft.jsonl", folder / "dpo.jsonl"


def offline_config(folder: Path, stage: str, variant: str, model: Path, data: Path) -> tuple[Path, int]:
    """The config of an offline run of `variant` (OFFLINE_VARIANTS): micro-batches of 4 rows (dpo: 2 pairs), two per
    process and step; returns its path and its processes."""
    import yaml

    processes = 2 if variant == "fsdp2" else 1
    m = 4 if stage == "sft" else 2
    cfg = {"algorithm": stage, "model": str(model), "seed": 0, "overwrite": True,
           "model_dtype": "bfloat16" if variant == "bfloat16" else "float32",
           "data": {"path": str(data)},
           "train": {"batch_size": 2 * m * processes, "micro_batch_size": m, "dataset_epochs": 1,
                     "learning_rate": 1e-4},
           "log": {"progress_bar": False, "save_every": 0}}
    if variant == "lora":
        cfg["lora"] = {"enabled": True, "r": 16}
    path = folder / f"{stage}-{variant}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path, processes


def write_smollm2(folder: Path, model: Path) -> list[tuple[str, Path]]:
    """The GRPO and SFT configs of the SmolLM2 runs (`--smollm2 MODEL`) and their data (examples/smollm2/prepare.py's
    arithmetic task): GRPO with a KL reference (so that a scoring phase runs), 2 rollouts of 2 prompts x 4 samples
    of up to 32 new tokens, micro-batches of 4, at the example's temperature 0.7 and at 1.0; SFT on 24 of the worked
    answers, 3 steps of 8 examples in micro-batches of 4."""
    import yaml

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "smollm2"))
    from prepare import write_format_task, write_task

    write_task(folder)
    write_format_task(folder)
    (folder / "sft.jsonl").write_text("".join((folder / "boxed" / "sft.jsonl").read_text().splitlines(True)[:24]))
    log = {"progress_bar": False, "save_every": 0}
    grpo = {"algorithm": "grpo", "model": str(model), "seed": 0, "overwrite": True,
            "data": {"path": str(folder / "train.jsonl")},
            "rewards": [{"function": str(Path(__file__).resolve().parent.parent / "examples" / "smollm2"
                                         / "rewards.py") + ":last_number"}],
            "grpo": {"kl_coef": 0.05},
            "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 4, "max_new_tokens": 32,
                        "temperature": 0.7, "generation_batch_size": 8, "forward_batch_size": 4},
            # (no worst-case probe: the phases measured are the run's own, their second calls)
            "train": {"rollouts": 2, "micro_batch_size": 4, "learning_rate": 1e-5, "memory_probe": False},
            "log": log}
    sft = {"algorithm": "sft", "model": str(model), "seed": 0, "overwrite": True,
           "data": {"path": str(folder / "sft.jsonl")},
           "train": {"batch_size": 8, "micro_batch_size": 4, "dataset_epochs": 1, "learning_rate": 2e-5}, "log": log}
    # the same GRPO at temperature 1: the scoring's log-softmax reads the logits as they are, not a scaled copy
    plain = {**grpo, "rollout": {**grpo["rollout"], "temperature": 1.0}}
    # every batch size `auto` under two budgets (the resident weights, moments and reference are ~2.2 GiB)
    auto = [(f"grpo-auto-{budget}", {**grpo, "rollout": {**grpo["rollout"], "generation_batch_size": "auto",
                                                          "forward_batch_size": "auto"},
                                     "train": {**grpo["train"], "micro_batch_size": "auto",
                                               "memory_budget": budget}}) for budget in AUTO_BUDGETS]
    configs = []
    for name, cfg in (("grpo", grpo), ("grpo-temperature-1", plain), ("sft", sft), *auto):
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
        configs.append((name, folder / f"{name}.yaml"))
    return configs


def run_phases(config: Path, processes: int, folder: Path, env: dict) -> tuple[dict, dict]:
    """`tidyrl train config` (under FSDP2 on `processes` gloo processes when more than one) through RUN, and `tidyrl
    plan` of the same (`--num-processes W --fsdp`). Returns (phase -> (measured bytes above the phase's start, the
    largest over the processes, of its second call or its only one; the RSS at that call's start above the
    imports), phase -> its predicted parts)."""
    import json

    cmd = [sys.executable, "-m", "tidyrl", "plan", str(config)]
    done = subprocess.run(cmd + (["--num-processes", str(processes), "--fsdp"] if processes > 1 else []),
                          capture_output=True, text=True, env=env, check=False)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    plan = json.loads(done.stdout)["memory"]["per_process_bytes"]
    wrapper, report = folder / "run.py", folder / f"report-{config.stem}"
    wrapper.write_text(RUN)
    launcher = [sys.executable, str(wrapper)] if processes == 1 else [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP_YAML), "--num_processes",
        str(processes), str(wrapper)]
    done = subprocess.run(launcher + ["train", str(config), f"output_dir={folder / ('run-' + config.stem)}"],
                          capture_output=True, text=True, env={**env, "BENCH_REPORT": str(report)}, check=False)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    reports = [json.loads(Path(f"{report}.{rank}").read_text()) for rank in range(processes)]
    measured = {}
    for phase in plan:
        mine = [[c for c in r if c["phase"] == phase] for r in reports]
        if all(mine):
            picked = [c[1] if len(c) > 1 else c[0] for c in mine]
            measured[phase] = (max(c["peak"] for c in picked), max(c["resident"] for c in picked))
    return measured, plan


def print_phases(label: str, measured: dict, plan: dict) -> None:
    """One line per phase: measured and predicted beyond the resident parts (RESIDENT), their ratio, and the
    resident parts (measured: the RSS at the phase's start above the imports)."""
    for phase, (peak, resident) in measured.items():
        parts = plan[phase]
        predicted = sum(v for k, v in parts.items() if k != "total" and k not in RESIDENT)
        planned_resident = sum(v for k, v in parts.items() if k in RESIDENT)
        print(f"{label:36} {phase:10} {peak / 2**20:13.1f} {predicted / 2**20:14.1f} {peak / predicted:6.2f}"
              f"   resident {resident / 2**20:.0f} / {planned_resident / 2**20:.0f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", action="append", help='"h L V m P C"; repeatable (default: five shapes)')
    parser.add_argument("--family", action="append", choices=("llama", "qwen3", "gemma3", "gemma3-270m", "qwen3_moe"),
                        help="the RL shapes' model family (default: llama); repeatable")
    parser.add_argument("--sft", action="append", metavar="SHAPE", nargs="?", const=SFT_SHAPES[0],
                        help=f'an sft update "h L V m T" (alone: {SFT_SHAPES[0]!r}); repeatable')
    parser.add_argument("--offline", action="append", metavar="VARIANT", nargs="?", choices=OFFLINE_VARIANTS,
                        help=f"sft and dpo runs of tidyrl train: {', '.join(OFFLINE_VARIANTS)} (alone: all four); "
                             "repeatable")
    parser.add_argument("--smollm2", metavar="MODEL",
                        help="GRPO and SFT runs of tidyrl train on this SmolLM2-135M-Instruct folder")
    args = parser.parse_args()
    if not os.path.exists("/proc/self/clear_refs"):
        sys.exit("bench_memory_plan: resets the peak RSS through /proc/self/clear_refs (Linux only)")
    src = str(Path(__file__).resolve().parent.parent / "src")
    # glibc's malloc keeps freed memory for reuse (and raises its mmap threshold as large blocks are freed), so the
    # RSS would not fall after a phase and the next phase's peak would hide in it: a fixed threshold gives every
    # large tensor its own mapping, returned when freed.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536",
           "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    if args.offline or args.smollm2:
        env.update({"CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
        return runs_of_tidyrl_train(args, env)
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


def runs_of_tidyrl_train(args, env: dict) -> None:
    """--offline and --smollm2: each run's phases (run_phases), printed by print_phases."""
    import tempfile

    sys.path.insert(0, env["PYTHONPATH"].split(os.pathsep)[0])
    print(f"{'run':36} {'phase':10} {'measured MiB':>13} {'predicted MiB':>14} {'ratio':>6}   resident MiB "
          "(measured above the imports / planned)")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        if args.offline:
            model, sft, dpo = write_offline(folder)
            variants = OFFLINE_VARIANTS if args.offline == [None] else [v for v in args.offline if v]
            for variant in variants:
                for stage, data in (("sft", sft), ("dpo", dpo)):
                    config, processes = offline_config(folder, stage, variant, model, data)
                    measured, plan = run_phases(config, processes, folder, env)
                    print_phases(f"{stage} {variant} {' '.join(map(str, OFFLINE_SHAPE))}", measured, plan)
        if args.smollm2:
            for name, config in write_smollm2(folder, Path(args.smollm2).resolve()):
                measured, plan = run_phases(config, 1, folder, env)
                print_phases(f"SmolLM2-135M {name}", measured, plan)
                if "auto" in name:
                    import json

                    chosen = json.loads((folder / f"run-{config.stem}" / "plan.json").read_text())["auto_batch_sizes"]
                    print(f"{'':36} auto: " + ", ".join(f"{k}={v}" for k, v in chosen["values"].items())
                          + f" (fits {chosen['fits']})", flush=True)


if __name__ == "__main__":
    main()

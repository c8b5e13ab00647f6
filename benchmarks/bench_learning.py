"""tidyrl vs TRL's GRPOTrainer on a real pretrained model: the same GRPO run in each library, then both final models
scored by the same evaluator on held-out prompts. What each learned, and how fast.

    python benchmarks/bench_learning.py                     # both train and are evaluated: about 16 min on 2 cores
    python benchmarks/bench_learning.py --tidyrl-run runs/smollm2/grpo12 \\
        --reuse-eval before=runs/smollm2/eval-before,tidyrl=runs/smollm2/eval-grpo12   # only TRL trains

The defaults are examples/smollm2's (`python examples/smollm2/prepare.py runs/smollm2` makes the model and prompts):
SmolLM2-135M-Instruct, two-digit arithmetic, the reward `rewards.py:last_number`, the settings of
examples/smollm2/grpo.yaml at --rollouts (default 12). TRL runs in its own environment (--trl-python, default
.venv-trl/bin/python: `python3 -m venv .venv-trl && .venv-trl/bin/pip install torch==2.13.0 && .venv-trl/bin/pip
install -e ".[bench]" transformers==X`, X the transformers of tidyrl's environment, so that both load the model alike).

Prints the greedy held-out accuracy of the starting model and of each library's final model (`tidyrl eval` on
--eval, one completion per prompt, as examples/smollm2/run.sh), each with its 95 % interval, each library's gain
and the difference between the two finals with the intervals of the paired per-prompt differences
(examples/smollm2/compare.py), and each library's training wall time per rollout with the ratio. Everything is
written under --output (report.json; trl/ holds TRL's final model and its timings).

What is the same in both (the rules of benchmarks/bench_vs_trl.py, read from the tidyrl config by `trl_settings`):
- the weights (--model, float32) and the prompts in the same order: tidyrl's prompt stream (data.PromptStream:
  a shuffle of the prompt file by `seed`, rollout i taking stream positions i*P..(i+1)*P-1) is written out in
  that order and TRL reads it unshuffled (shuffle_dataset=False), P prompts per generation; both render them with
  the model's chat template and add no special tokens (the TRL child checks that the token ids are the same);
- the reward function itself (TRL's conversational completions passed to it as their text);
- sampling: temperature, top_p, top_k, max_new_tokens, k samples per prompt; EOS ends a completion in both;
  all P*k sequences generated at once by the model's own `generate` in TRL, by tidyrl's built-in engine;
- the update: all P*k episodes in one optimizer step per rollout, micro-batches of m (TRL:
  per_device_train_batch_size=m, gradient_accumulation_steps=P*k/m), epochs per rollout (num_iterations), the
  token-mean loss over the whole batch (TRL: loss_type "dapo"), clipping epsilon, KL coefficient (beta), advantages
  scaled by the group's standard deviation (scale_rewards "group"), gradient checkpointing as configured (TRL's
  default is on);
- AdamW with the same learning rate, betas, epsilon, weight decay, gradient clipping, and the same schedule
  (transformers' `get_scheduler` in both, the same warm-up steps over the same number of steps);
- threads: each training runs in a fresh process with OMP_NUM_THREADS=MKL_NUM_THREADS=--threads.
What differs: the random streams (the sampled completions, and so the updates, are not the same; the seed is);
tidyrl's engine and training forward are its own (the work the same, the arithmetic's order not). The intervals
are over the held-out prompts of one training run each; how much a run's outcome depends on its random draws is
seen only across runs: --seed N runs both libraries again on another seed (and prompt order).

Wall time per rollout is each library's own clock of its training loop, loading excluded: tidyrl's metrics.jsonl
`time_s` at its last step over the rollouts, TRL's from the start of `train` to its last optimizer step. A
reused tidyrl run (--tidyrl-run) must have been made from the same settings (checked against its config.yaml) and
its time is that run's, measured then: rerun it (leave --tidyrl-run out) to time both under the same load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "smollm2"
LIBRARIES = ("tidyrl", "trl")
NAMES = {"tidyrl": "tidyrl", "trl": "TRL"}
MATCHED = {"algorithm": "grpo", "rollout.engine": "builtin", "rollout.lag": 0, "rollout.min_new_tokens": 0,
           "rollout.dynamic_sampling": False, "train.minibatches_per_epoch": 1, "grpo.loss_aggregation": "token_mean",
           "grpo.policy_loss": "token", "grpo.kl_estimator": "k3", "grpo.mask_truncated": False,
           "grpo.overlong_buffer": 0, "lora.enabled": False}
"""The settings whose TRL counterpart `trl_settings` writes as given here; any other value has none it maps."""
WORK_KEYS = ("model", "model_dtype", "seed", "data.path", "data.prompt_column", "rewards", "rollout", "train",
             "grpo", "lora.enabled")
"""The config keys that define a run's work: a reused tidyrl run must agree with the asked one on all of them."""


def tidyrl_config(args):
    """The tidyrl run's config: --config with --model, --train and --rollouts set, no evaluation inside the run."""
    return load_config_with(args, [])


def load_config_with(args, overrides: list[str]):
    from tidyrl.config import load_config

    return load_config(args.config, [*settings(args), *overrides])


def settings(args) -> list[str]:
    """The overrides of --config that make the asked run (the same for `tidyrl train` and for TRL's settings)."""
    seed = [] if getattr(args, "seed", None) is None else [f"seed={args.seed}"]
    return [f"model={args.model}", f"data.path={args.train}", "data.eval_path=null", f"train.rollouts={args.rollouts}",
            f"output_dir={Path(args.output) / 'tidyrl'}", *seed]


def lookup(cfg, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    return value


def trl_settings(cfg) -> dict:
    """GRPOConfig's arguments for the work of the tidyrl config `cfg` (bench_vs_trl.py's correspondence). Refuses
    a config that uses a setting with no counterpart here (MATCHED)."""
    unmatched = [f"{key}={lookup(cfg, key)!r} (compared: {want!r})" for key, want in MATCHED.items()
                 if lookup(cfg, key) != want]
    if len(cfg.rewards) != 1 or cfg.rewards[0].model or cfg.rewards[0].weight != 1.0 or cfg.rewards[0].normalize:
        unmatched.append("rewards: one function of weight 1, not normalized")
    g, r, t = cfg.grpo, cfg.rollout, cfg.train
    if g.clip_eps_high not in (None, g.clip_eps):
        unmatched.append(f"grpo.clip_eps_high={g.clip_eps_high}")
    if unmatched:
        raise SystemExit("no TRL counterpart for: " + "; ".join(unmatched))
    episodes, m = r.prompts_per_rollout * r.samples_per_prompt, t.micro_batch_size
    if episodes % m:
        raise SystemExit(f"train.micro_batch_size={m} does not divide a rollout's {episodes} episodes")
    steps = t.rollouts * t.epochs_per_rollout
    # tidyrl's warm-up in steps (docs/concepts.md: ceil(warmup_ratio * steps) when a ratio is set)
    warmup = math.ceil(t.warmup_ratio * steps) if t.warmup_ratio else t.warmup_steps
    return dict(
        seed=cfg.seed, use_cpu=True, bf16=False, fp16=False, model_init_kwargs={"dtype": cfg.model_dtype},
        per_device_train_batch_size=m, gradient_accumulation_steps=episodes // m, num_generations=r.samples_per_prompt,
        max_completion_length=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        use_vllm=False, shuffle_dataset=False,  # the prompts come in tidyrl's stream order (stream_rows)
        num_iterations=t.epochs_per_rollout, beta=g.kl_coef, epsilon=g.clip_eps, loss_type="dapo",
        scale_rewards=g.scale_rewards, mask_truncated_completions=False,
        learning_rate=t.learning_rate, lr_scheduler_type=t.lr_scheduler, warmup_steps=warmup,
        weight_decay=t.weight_decay, adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2,
        adam_epsilon=t.adam_epsilon, max_grad_norm=t.max_grad_norm, gradient_checkpointing=t.gradient_checkpointing,
        max_steps=steps, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False,
    )


def stream_rows(cfg) -> list[dict]:
    """The prompt file's rows in the order tidyrl's run takes them: rollout i's P prompts are data.PromptStream's
    positions i*P..(i+1)*P-1 (every prompt of the file kept: data.overlong_prompts must not drop any)."""
    from tidyrl.data import PromptStream

    rows = [json.loads(line) for line in Path(cfg.data.path).read_text().splitlines() if line.strip()]
    stream, P = PromptStream(len(rows), cfg.seed), cfg.rollout.prompts_per_rollout
    return [rows[i] for rollout in range(cfg.train.rollouts) for i in stream.rollout_indices(rollout, P)]


def work_of(config: dict) -> dict:
    """The WORK_KEYS of a config.yaml's mapping, paths resolved."""
    out = {}
    for key in WORK_KEYS:
        value = config
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        out[key] = str(Path(value).resolve()) if key in ("model", "data.path") and value else value
    return out


def check_reused_run(run: Path, cfg) -> None:
    """A run reused with --tidyrl-run must have done the asked work: its config.yaml agrees on WORK_KEYS."""
    import yaml

    from tidyrl.config import config_to_dict

    got, want = work_of(yaml.safe_load((run / "config.yaml").read_text())), work_of(config_to_dict(cfg))
    if differ := [k for k in WORK_KEYS if got[k] != want[k]]:
        raise SystemExit(f"--tidyrl-run {run}: made from other settings than asked ({', '.join(differ)}): "
                         + "; ".join(f"{k}: {got[k]!r} there, {want[k]!r} asked" for k in differ))
    if not (run / "final").is_dir():
        raise SystemExit(f"--tidyrl-run {run}: no final/ model (the run did not finish)")


def tidyrl_timing(run: Path) -> dict:
    """Seconds per rollout from a tidyrl run's metrics.jsonl (its own clock; loading and the held-out evaluation
    after the last step are outside it)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    ends: dict[int, float] = {}
    for row in rows:
        if "rollout" in row and "time_s" in row and "reward_mean" in row:
            ends[row["rollout"]] = row["time_s"]
    times = [ends[r] for r in sorted(ends)]
    return {"rollout_s": [b - a for a, b in zip([0.0, *times], times)],
            "reward_mean": [row["reward_mean"] for row in rows if "reward_mean" in row and "rollout" in row]}


# ---------------------------------------------------------------------------------------------- TRL's process
def child_trl(spec: dict) -> dict:
    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoTokenizer, TrainerCallback

    from tidyrl.data import encode_prompts
    from tidyrl.rewards.functions import load_reward_function

    torch.set_num_threads(spec["threads"])
    function = load_reward_function(spec["reward"], spec["reward_dir"])

    def reward(completions, **kwargs):  # TRL passes chat completions as messages; the function takes their text
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return function(texts, **{k: v for k, v in kwargs.items() if k not in ("prompts", "completion_ids")})

    reward.__name__ = spec["reward"].rpartition(":")[2]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    trainer = trl.GRPOTrainer(model=spec["model"], reward_funcs=reward, processing_class=tokenizer,
                              args=trl.GRPOConfig(output_dir=spec["out"], **spec["trl"]),
                              train_dataset=datasets.Dataset.from_list(spec["rows"]))
    tokenize, firsts = trainer._tokenize_prompts, []

    def tokenize_prompts(prompts):  # the prompt ids TRL generates from, against tidyrl's for the same prompts
        ids, *rest = tokenize(prompts)
        if not firsts:
            firsts.append([list(x) for x in ids] == encode_prompts(prompts, tokenizer))
        return (ids, *rest)

    trainer._tokenize_prompts = tokenize_prompts
    ends: list[float] = []

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a, **kw):
            ends.append(time.perf_counter())

        def on_step_end(self, *a, **kw):
            ends.append(time.perf_counter())

    trainer.add_callback(StepClock())
    trainer.train()
    trainer.save_model(str(Path(spec["out"]) / "final"))
    E = spec["trl"]["num_iterations"]
    step_s = [b - a for a, b in zip(ends, ends[1:])]
    return {"rollout_s": [sum(step_s[i:i + E]) for i in range(0, len(step_s), E)],
            "reward_mean": [row["reward"] for row in trainer.state.log_history if "reward" in row],
            "same_prompt_ids": bool(firsts and firsts[0]),
            "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__}}


# ---------------------------------------------------------------------------------------------- the parent
def child_env(threads: int) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
                HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONWARNINGS="ignore", ACCELERATE_USE_CPU="1")


def run_logged(cmd: list[str], log: Path, env: dict) -> float:
    """Runs `cmd` with its output in `log`; its wall time, or SystemExit with the log's end when it fails."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        done = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (exit {done.returncode}); the end of {log}:\n"
                         + log.read_text()[-3000:])
    return time.perf_counter() - t0


def train_trl(args, cfg, out: Path) -> dict:
    """TRL's run, in --trl-python; reused where out/ holds a finished run of the same spec."""
    spec = {"model": str(Path(cfg.model).resolve()), "trl": trl_settings(cfg), "rows": stream_rows(cfg),
            "reward": cfg.rewards[0].function, "reward_dir": str(Path(args.config).resolve().parent),
            "threads": args.threads, "out": str(out.resolve())}
    out.mkdir(parents=True, exist_ok=True)
    if (out / "result.json").exists() and json.loads((out / "spec.json").read_text()) == spec:
        print(f"TRL: reusing the finished run in {out} (the same settings)", flush=True)
        return json.loads((out / "result.json").read_text())
    (out / "spec.json").write_text(json.dumps(spec))
    print(f"TRL: training {cfg.train.rollouts} rollouts with {args.trl_python} (log: {out / 'train.log'}) ...",
          flush=True)
    run_logged([args.trl_python, __file__, "--child", str(out / "spec.json")], out / "train.log",
               child_env(args.threads))
    return json.loads((out / "result.json").read_text())


def train_tidyrl(args, cfg, out: Path) -> dict:
    if args.tidyrl_run:
        run = Path(args.tidyrl_run)
        check_reused_run(run, cfg)
        print(f"tidyrl: reusing {run} (the same settings; its time is that run's)", flush=True)
    else:
        run = out
        print(f"tidyrl: training {cfg.train.rollouts} rollouts (log: {out}.log) ...", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        run_logged([sys.executable, "-m", "tidyrl", "train", str(args.config), *settings(args)], Path(f"{out}.log"),
                   child_env(args.threads))
    return {**tidyrl_timing(run), "final": str(run / "final")}


def evaluation_of(folder: Path, model: str, eval_path: str) -> bool:
    """Whether `folder` holds `tidyrl eval`'s greedy evaluation of `model` on the prompts of `eval_path`."""
    try:
        made = json.loads((folder / "eval.json").read_text())
    except (OSError, ValueError):
        return False
    prompts = made["data"].rpartition("= ")[2].strip("'")  # "held out: data.eval_path = 'PATH'"
    return (Path(made["model"]).resolve() == Path(model).resolve() and made["settings"]["greedy"]
            and Path(prompts).resolve() == Path(eval_path).resolve() and (folder / "eval_samples.jsonl").exists())


def evaluate(args, name: str, model: str, given: dict) -> Path:
    """`tidyrl eval` of `model` (greedy, --eval's prompts) as run.sh runs it; an earlier evaluation of the same
    model and prompts (--reuse-eval, or one left in --output) is taken as it is (greedy: the same result)."""
    folder = Path(given.get(name, Path(args.output) / f"eval-{name}"))
    if evaluation_of(folder, model, args.eval):
        print(f"eval {name}: taking {folder}", flush=True)
        return folder
    if name in given:
        raise SystemExit(f"--reuse-eval {name}={folder}: not a greedy evaluation of {model} on {args.eval}")
    print(f"eval {name}: tidyrl eval of {model} ...", flush=True)
    run_logged([sys.executable, "-m", "tidyrl", "eval", str(args.config), f"model={args.model}",
                f"data.path={args.train}", f"data.eval_path={args.eval}", "--model", model, "--output-dir",
                str(folder)], Path(f"{folder}.log"), child_env(os.cpu_count() or 1))
    return folder


def report(args, cfg, timings: dict, evals: dict) -> dict:
    sys.path.insert(0, str(EXAMPLE))
    from compare import interval, paired_gain, read_samples

    samples = {name: read_samples(folder) for name, folder in evals.items()}
    made = {name: json.loads((Path(folder) / "eval.json").read_text()) for name, folder in evals.items()}
    accuracy = {name: interval([s["reward"] for s in rows]) for name, rows in samples.items()}
    libs = [lib for lib in LIBRARIES if lib in timings]
    r = cfg.rollout
    print(f"\n== GRPO on {args.model}: {cfg.train.rollouts} rollouts of {r.prompts_per_rollout} prompts x "
          f"{r.samples_per_prompt} samples (temperature {r.temperature}, {r.max_new_tokens} new tokens), "
          f"lr {cfg.train.learning_rate:g}; greedy accuracy on {len(samples['before'])} held-out prompts "
          f"({args.eval}), 95 % intervals ==")
    before = accuracy["before"]
    print(f"{'':16}{'accuracy':>16}{'truncated':>11}{'gain (paired)':>18}{'s / rollout':>13}{'train reward, first -> last third':>36}")
    print(f"{'before':16}{before[0]:>9.3f} ± {before[1]:.3f}{made['before']['truncated_fraction']:>11.3f}")
    out = {"before": {"accuracy": before, "truncated": made["before"]["truncated_fraction"]},
           "versions": timings.get("trl", {}).get("versions", {})}
    for lib in libs:
        acc, gain = accuracy[lib], paired_gain(samples["before"], samples[lib])
        t = timings[lib]
        per_rollout = sum(t["rollout_s"]) / len(t["rollout_s"])
        rw = t["reward_mean"]
        third = max(len(rw) // 3, 1)
        first, last = sum(rw[:third]) / third, sum(rw[-third:]) / third
        print(f"{'after, ' + NAMES[lib]:16}{acc[0]:>9.3f} ± {acc[1]:.3f}{made[lib]['truncated_fraction']:>11.3f}"
              f"{gain[0]:>+11.3f} ± {gain[1]:.3f}{per_rollout:>13.1f}{first:>27.2f} -> {last:.2f}")
        out[lib] = {"accuracy": acc, "truncated": made[lib]["truncated_fraction"], "gain": gain,
                    "s_per_rollout": per_rollout, "rollout_s": t["rollout_s"],
                    "train_reward_first_third": first, "train_reward_last_third": last}
    if len(libs) == 2:
        diff = paired_gain(samples["trl"], samples["tidyrl"])
        ratio = out["trl"]["s_per_rollout"] / out["tidyrl"]["s_per_rollout"]
        print(f"tidyrl - TRL (finals, paired): {diff[0]:+.3f} ± {diff[1]:.3f}")
        print(f"-> tidyrl runs {ratio:.2f}x TRL's rollouts per second")
        out.update(difference=diff, speed_ratio=ratio)
    if "trl" in timings:
        same = timings["trl"]["same_prompt_ids"]
        print(f"TRL's prompt token ids the same as tidyrl's: {'yes' if same else 'NO'}; versions: "
              + ", ".join(f"{k} {v}" for k, v in out["versions"].items()))
        out["same_prompt_ids"] = same
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rollouts", type=int, default=12, help="rollouts (= optimizer steps) of each library")
    parser.add_argument("--model", default="runs/smollm2/model", help="the starting model (a Hugging Face folder)")
    parser.add_argument("--train", default="runs/smollm2/train.jsonl", help="the training prompts (JSONL)")
    parser.add_argument("--eval", default="runs/smollm2/eval.jsonl", help="the held-out prompts (JSONL)")
    parser.add_argument("--config", default=str(EXAMPLE / "grpo.yaml"),
                        help="tidyrl's config; TRL's settings are derived from it (default examples/smollm2/grpo.yaml)")
    parser.add_argument("--libraries", default="tidyrl,trl", help="comma-separated subset of tidyrl,trl")
    parser.add_argument("--output", default="runs/smollm2/vs-trl", help="where the runs, evaluations and report go")
    parser.add_argument("--tidyrl-run", help="a finished tidyrl run of the same settings to take instead of training "
                        "(e.g. runs/smollm2/grpo12; checked against its config.yaml)")
    parser.add_argument("--reuse-eval", default="", metavar="NAME=DIR,...",
                        help="earlier `tidyrl eval` folders of the same models and prompts, NAME one of before, "
                             "tidyrl, trl (e.g. before=runs/smollm2/eval-before)")
    default_trl = ROOT / ".venv-trl" / "bin" / "python"
    parser.add_argument("--trl-python", default=str(default_trl) if default_trl.exists() else sys.executable,
                        help="the Python of TRL's environment (default .venv-trl/bin/python where it exists)")
    parser.add_argument("--seed", type=int, help="both libraries' seed (default: the config's); it also picks tidyrl's "
                        "prompt order, which TRL is given")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each training (default 1)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:  # inside TRL's process
        spec = json.loads(Path(args.child).read_text())
        (Path(spec["out"]) / "result.json").write_text(json.dumps(child_trl(spec)))
        return
    libraries = [x.strip() for x in args.libraries.split(",") if x.strip()]
    if unknown := [x for x in libraries if x not in LIBRARIES]:
        parser.error(f"--libraries: unknown {', '.join(unknown)}; choose from {', '.join(LIBRARIES)}")
    given = dict(item.split("=", 1) for item in args.reuse_eval.split(",") if item.strip())
    if bad := [k for k in given if k not in ("before", *LIBRARIES)]:
        parser.error(f"--reuse-eval: unknown {', '.join(bad)}; names are before, tidyrl, trl")
    cfg = tidyrl_config(args)
    if "trl" in libraries:
        trl_settings(cfg)  # refuses unmatched settings before anything runs
        if not Path(args.trl_python).exists() or subprocess.run([args.trl_python, "-c", "import trl"],
                                                                 capture_output=True).returncode:
            parser.error(f"--trl-python {args.trl_python}: cannot import trl (pip install -e '.[bench]' there)")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    timings, finals = {}, {}
    for lib in libraries:
        t = train_tidyrl(args, cfg, out / "tidyrl") if lib == "tidyrl" else train_trl(args, cfg, out / "trl")
        timings[lib], finals[lib] = t, t.get("final", str(out / "trl" / "final"))
    evals = {"before": evaluate(args, "before", args.model, given)}
    for lib in libraries:
        evals[lib] = evaluate(args, lib, finals[lib], given)
    result = report(args, cfg, timings, evals)
    result["evaluations"] = {k: str(v) for k, v in evals.items()}
    (out / "report.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

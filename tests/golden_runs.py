"""Golden runs: small end-to-end runs of every kind of stage, recorded on one commit and replayed by
tests/test_golden.py, so that a refactor that changes one number is caught.

Each run builds its own tiny model and data from seeds (no downloads) and calls only the public API
(`tidyrl.train`), so the runs do not depend on where the code behind it lives. What is recorded per run
(tests/golden/<name>.json and <name>.safetensors):
- every metrics.jsonl row, minus the wall-clock fields (time_s and time/*);
- the samples.jsonl rows;
- the final weights, in full (float32; the models are tiny).

Record again only on purpose (a change of behaviour that is meant): `python scripts/record_golden.py`.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"


def _jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _words_file(folder: Path) -> Path:
    words = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon", "mango", "peach", "olive", "grape"]
    return _jsonl(folder / "prompts.jsonl", [{"prompt": f"{w}:", "word": w} for w in words])


def _policy(folder: Path, seed: int = 0) -> Path:
    from tidyrl.models.tiny import save_tiny_model

    return save_tiny_model(folder / "policy", seed=seed, hidden_size=32, num_layers=2, num_heads=2)


def demo(folder: Path) -> dict:
    """The built-in demo's config and model (GRPO, M = 2), 3 rollouts."""
    from tidyrl.demo import prepare_demo

    import yaml

    cfg = yaml.safe_load(prepare_demo(folder).read_text())
    cfg["train"]["rollouts"] = 3
    cfg["log"]["progress_bar"] = False
    return cfg


def grpo_dynamic(folder: Path) -> dict:
    """GRPO with DAPO's parts (dynamic sampling, clip-higher, the overlong buffer), a KL in the loss
    against a reference, E = 2, M = 2, and held-out evaluation (sampled) during training."""
    return {
        "algorithm": "grpo", "model": str(_policy(folder)), "output_dir": str(folder / "run"), "seed": 5,
        "data": {"path": str(_words_file(folder)), "eval_fraction": 0.25},
        "rewards": [{"function": "tidyrl.demo:anagram_reward", "weight": 1.0}],
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 4, "max_new_tokens": 8, "dynamic_sampling": True,
                    "max_sampling_rounds": 2, "generation_batch_size": 3, "forward_batch_size": 5},
        "train": {"rollouts": 3, "epochs_per_rollout": 2, "minibatches_per_epoch": 2, "micro_batch_size": 2,
                  "learning_rate": 5e-3, "warmup_steps": 1},
        "grpo": {"kl_coef": 0.05, "clip_eps_high": 0.28, "overlong_buffer": 2, "overlong_penalty": 0.2,
                 "loss_aggregation": "constant"},
        "log": {"progress_bar": False, "eval_every": 4, "eval_decoding": "sampled", "samples_per_rollout": 3},
    }


def ppo_reward_model(folder: Path) -> dict:
    """PPO: a reward model with its own tokenizer beside a reward function, a critic from the policy, the KL in
    the reward, E = 2, M = 2."""
    from tidyrl.models.tiny import save_tiny_reward_model

    rm = save_tiny_reward_model(folder / "rm", seed=4)
    policy = _policy(folder)
    return {
        "algorithm": "ppo", "model": str(policy), "output_dir": str(folder / "run"), "seed": 2,
        "data": {"path": str(_words_file(folder))},
        "rewards": [{"model": str(rm), "weight": 1.0}, {"function": "tidyrl.demo:anagram_reward", "weight": 0.5}],
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 2, "max_new_tokens": 6, "forward_batch_size": 3},
        "train": {"rollouts": 3, "epochs_per_rollout": 2, "minibatches_per_epoch": 2, "micro_batch_size": 1,
                  "learning_rate": 1e-3, "lr_scheduler": "linear", "warmup_steps": 2},
        "critic": {"model": str(policy), "learning_rate": 3e-3, "lr_scheduler": "cosine"},
        "ppo": {"kl_coef": 0.05},
        "log": {"progress_bar": False, "samples_per_rollout": 4},
    }


def reinforce_pp(folder: Path) -> dict:
    """REINFORCE++: the KL in the reward, a normalised reward beside a plain one, truncated importance sampling
    against recomputed trainer log-probs (behaviour_logprobs: sampler, tis_cap set), E = 1, M = 2."""
    return {
        "algorithm": "reinforce_pp", "model": str(_policy(folder)), "output_dir": str(folder / "run"), "seed": 7,
        "data": {"path": str(_words_file(folder))},
        "rewards": [{"function": "tidyrl.demo:anagram_reward", "weight": 1.0, "normalize": True},
                    {"function": "tidyrl.demo:anagram_reward", "name": "plain", "weight": 0.3}],
        "rollout": {"prompts_per_rollout": 3, "samples_per_prompt": 2, "max_new_tokens": 5, "tis_cap": 2.0},
        "train": {"rollouts": 3, "minibatches_per_epoch": 2, "micro_batch_size": 3, "learning_rate": 4e-3},
        "reinforce_pp": {"kl_coef": 0.02},
        "log": {"progress_bar": False},
    }


def rloo_gspo(folder: Path) -> dict:
    """RLOO with GSPO's sequence-level ratio, E = 2, one mini-batch per epoch (the in-update importance weights
    of the rollout's first step)."""
    return {
        "algorithm": "rloo", "model": str(_policy(folder, seed=1)), "output_dir": str(folder / "run"), "seed": 3,
        "data": {"path": str(_words_file(folder))},
        "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 3, "max_new_tokens": 5, "tis_cap": 1.5},
        "train": {"rollouts": 3, "epochs_per_rollout": 2, "micro_batch_size": 2, "learning_rate": 4e-3},
        "rloo": {"policy_loss": "sequence", "clip_eps": 0.01, "kl_coef": 0.02},
        "log": {"progress_bar": False},
    }


HINT_ENVIRONMENT = '''
from tidyrl.environments import EnvReply


class Hint:
    """A calculator-like tool environment: the model's first turn is answered with a tool message that holds the
    answer; its second turn ends the episode, rewarded by the answer's characters it holds, less its length."""

    def __init__(self, row, seed):
        self.answer = str(row["answer"])

    def step(self, turn, messages):
        if len(messages) <= 2:
            return EnvReply(message={"role": "tool", "content": f"= {self.answer}"}, reward=0.0)
        held = sum(ch in turn for ch in self.answer) / len(self.answer)
        return EnvReply(reward=held - 0.05 * len(turn), done=True)
'''


def multiturn_calculator(folder: Path) -> dict:
    """GRPO against a two-turn tool environment (model turn, tool message, model turn; the environment's reward)
    on a random tiny chat model: model and environment tokens, the action mask, keyed turns."""
    from tidyrl.models.tiny import save_tiny_model

    (folder / "hint.py").write_text(HINT_ENVIRONMENT)
    model = save_tiny_model(folder / "policy", hidden_size=64, num_layers=2, seed=0)
    problems = [(a, b) for a in range(4) for b in range(3)]
    tasks = _jsonl(folder / "tasks.jsonl", [{"prompt": [{"role": "user", "content": f"{a}+{b}"}],
                                              "answer": str(a + b)} for a, b in problems])
    return {
        "algorithm": "grpo", "model": str(model), "output_dir": str(folder / "run"), "seed": 0,
        "data": {"path": str(tasks)},
        "environment": {"factory": str(folder / "hint.py") + ":Hint", "max_turns": 2, "max_turn_tokens": 6},
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 4, "max_new_tokens": 36},
        "train": {"rollouts": 3, "micro_batch_size": 4, "learning_rate": 2e-3, "warmup_steps": 1},
        "log": {"progress_bar": False, "samples_per_rollout": 2},
    }


def sft(folder: Path) -> dict:
    """SFT on conversations (completion-only loss), 2 epochs."""
    rows = [{"messages": [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)}]}
            for a in range(3) for b in range(3)]
    return {
        "algorithm": "sft", "model": str(_policy(folder)), "output_dir": str(folder / "run"), "seed": 3,
        "data": {"path": str(_jsonl(folder / "sft.jsonl", rows))},
        "train": {"batch_size": 4, "micro_batch_size": 2, "dataset_epochs": 2.0, "learning_rate": 1e-2,
                  "warmup_steps": 1},
        "log": {"progress_bar": False},
    }


def dpo(folder: Path) -> dict:
    """DPO (sigmoid) on preference pairs, 2 epochs, the reference scored once."""
    letters = string.ascii_lowercase
    rows = [{"prompt": f"{letters[i]}:", "chosen": letters[i] * 2, "rejected": letters[(i + 7) % 26] * 3}
            for i in range(8)]
    return {
        "algorithm": "dpo", "model": str(_policy(folder)), "output_dir": str(folder / "run"), "seed": 1,
        "data": {"path": str(_jsonl(folder / "pairs.jsonl", rows))},
        "train": {"batch_size": 4, "micro_batch_size": 2, "dataset_epochs": 2.0, "learning_rate": 1e-2},
        "log": {"progress_bar": False},
    }


def eval_command(folder: Path) -> dict:
    """`tidyrl eval` (tidyrl.evaluate): sampled completions of every prompt, scored by two reward functions; one
    more evaluation, greedy, is run beside it by `run_golden`."""
    return {
        "algorithm": "grpo", "model": str(_policy(folder, seed=2)), "output_dir": str(folder / "run"), "seed": 4,
        "data": {"path": str(_words_file(folder))},
        "rewards": [{"function": "tidyrl.demo:anagram_reward", "weight": 0.7, "normalize": True},
                    {"function": "tidyrl.demo:anagram_reward", "name": "plain"}],
        "rollout": {"samples_per_prompt": 3, "max_new_tokens": 7, "generation_batch_size": 5, "top_k": 20},
        "train": {"rollouts": 1},
    }


RUNS = {f.__name__: f for f in (demo, grpo_dynamic, ppo_reward_model, reinforce_pp, rloo_gspo,
                                 multiturn_calculator, sft, dpo, eval_command)}


def is_clock(key: str) -> bool:
    """Wall-clock fields (and rates over them): the only ones that differ between two runs of the same config."""
    return key == "time_s" or key.startswith("time/") or key.endswith("_per_s")


def run_golden(name: str, folder: Path) -> dict:
    """Run golden run `name` in `folder`; returns {"metrics": rows without clocks, "samples": rows,
    "weights": {name: tensor} of final/}."""
    from safetensors.torch import load_file

    import tidyrl

    folder.mkdir(parents=True, exist_ok=True)
    cfg = RUNS[name](folder)
    if name == "eval_command":  # eval.json (clocks aside) as its rows, eval_samples.jsonl as its samples
        from tidyrl.evaluate import evaluate

        rows, samples = [], []
        for greedy in (False, True):
            result = evaluate(cfg, greedy=greedy, num_prompts=5, output_dir=folder / f"eval-{greedy}", quiet=True)
            # (what produced it: versions and paths, which differ between machines and folders)
            rows.append({k: v for k, v in result.summary.items() if k not in ("time", "model", "data", "produced_by")})
            samples += result.samples
        return {"metrics": rows, "samples": samples, "weights": {}}
    result = tidyrl.train(cfg)
    out = Path(cfg["output_dir"])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    samples = out / "samples.jsonl"
    weights = {}
    for path in sorted(Path(result.final_dir).glob("*.safetensors")):
        weights.update(load_file(path))
    return {"metrics": [{k: v for k, v in row.items() if not is_clock(k)} for row in rows],
            "samples": [json.loads(line) for line in samples.read_text().splitlines()] if samples.exists() else [],
            "weights": weights}


def environment() -> dict:
    """What decides the last bits of a run: the processor, torch and transformers. Recorded beside the golden
    values; where it matches, the replay must be bit-identical."""
    import platform

    import torch
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "torch": torch.__version__, "transformers": transformers.__version__,
            "threads": torch.get_num_threads()}

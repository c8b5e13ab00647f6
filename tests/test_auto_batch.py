"""`auto` batch sizes (memory.rl.resolve_auto): the largest value each knob may take whose phase of the memory plan
fits the budget less the margin, checked against the plan of the same config at fixed sizes; written into plan.json
and config.yaml, printed, kept on resume and recomputed (and said so) on another budget; refused where it could
change the weights (train.exact_gradients' micro-batch), and shown not to change them where it cannot."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import read_jsonl

KNOBS = ("rollout.generation_batch_size", "rollout.forward_batch_size", "train.micro_batch_size")


def test_candidates_are_divisors_or_the_fewest_equal_chunks():
    from tidyrl.memory.rl import candidates

    assert candidates("train.micro_batch_size", 12, False) == [12, 6, 4, 3, 2, 1]  # must divide R/(M*W)
    assert candidates("rollout.forward_batch_size", 7, True) == [7, 1]  # exact gradients: divisors of the share
    # otherwise ceil(7 / n) for n = 1..7: one chunk of 7, two of <= 4, three of <= 3, ...
    assert candidates("rollout.forward_batch_size", 7, False) == [7, 4, 3, 2, 1]
    assert candidates("rollout.generation_batch_size", 1, False) == [1]


@pytest.fixture(scope="module")
def auto_yaml(tmp_path_factory, tiny_model_dir):
    folder = tmp_path_factory.mktemp("auto")
    words = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon"]
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{w}:", "word": w}) + "\n" for w in words))
    cfg = {"algorithm": "grpo", "model": str(tiny_model_dir), "seed": 1, "data": {"path": str(folder / "prompts.jsonl")},
           "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
           # a KL reference: the scoring phase is planned (it is what forward_batch_size sets)
           "grpo": {"kl_coef": 0.05},
           "rollout": {"prompts_per_rollout": 4, "samples_per_prompt": 2, "max_new_tokens": 48,
                       "forward_batch_size": "auto", "generation_batch_size": "auto"},
           "train": {"rollouts": 2, "micro_batch_size": "auto", "learning_rate": 1e-3},
           "log": {"progress_bar": False, "save_every": 1}}
    path = folder / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def planned_at(config, sizes: dict, budget: str = "64GiB") -> dict:
    """`tidyrl plan` of `config` with each knob fixed: {phase: predicted bytes}."""
    from tidyrl.config import load_config
    from tidyrl.loops.stage_plan import stage_plan

    cfg = load_config(config, [f"{k}={v}" for k, v in sizes.items()])
    plan, _ = stage_plan(cfg, str(config.parent), 1, budget, None)
    return {phase: part["total"] for phase, part in plan["memory"]["per_process_bytes"].items()}


def auto_plan(config, budget: str, *overrides: str) -> tuple[dict, list[str]]:
    from tidyrl.config import load_config
    from tidyrl.loops.stage_plan import stage_plan

    cfg = load_config(config, list(overrides))
    return stage_plan(cfg, str(config.parent), 1, budget, None)


@pytest.mark.parametrize("budget", ["1.6MiB", "3MiB", "64MiB"])
def test_auto_takes_the_largest_size_whose_phase_fits_the_budget_less_the_margin(auto_yaml, budget):
    from tidyrl.memory.plan import parse_size
    from tidyrl.memory.rl import AUTO_KNOBS, AUTO_MARGIN, candidates

    plan, notes = auto_plan(auto_yaml, budget)
    chosen = plan["auto_batch_sizes"]["values"]
    usable = parse_size(budget) * (1 - AUTO_MARGIN)
    share = {"train.micro_batch_size": 8, "rollout.forward_batch_size": 8, "rollout.generation_batch_size": 8}
    for knob in KNOBS:  # each process: 8 episodes a rollout, all in the one mini-batch
        options = candidates(knob, share[knob], False)
        value = chosen[knob]
        assert value in options
        at = planned_at(auto_yaml, {**{k: 1 for k in KNOBS}, knob: value})
        assert at[AUTO_KNOBS[knob]] <= usable or value == 1  # it fits
        larger = [o for o in options if o > value]
        if larger:  # and the next larger one does not
            assert planned_at(auto_yaml, {**{k: 1 for k in KNOBS}, knob: larger[-1]})[AUTO_KNOBS[knob]] > usable
    # the plan then made is the plan of those sizes, and the run's first words say what was chosen
    assert planned_at(auto_yaml, chosen) == {p: v["total"] for p, v in plan["memory"]["per_process_bytes"].items()}
    line = next(n for n in notes if n.startswith("auto batch sizes: "))
    assert all(f"{k}={chosen[k]}" in line for k in KNOBS) and f"--memory {budget}" in line


def test_the_budgets_choose_differently(auto_yaml):
    small = auto_plan(auto_yaml, "1.6MiB")[0]["auto_batch_sizes"]["values"]
    large = auto_plan(auto_yaml, "64MiB")[0]["auto_batch_sizes"]["values"]
    assert large == {k: 8 for k in KNOBS}  # everything at once
    assert small["train.micro_batch_size"] < 8


def test_every_process_takes_the_sizes_of_the_smallest_budget_among_them(auto_yaml):
    from tidyrl.config import load_config
    from tidyrl.loops.rl.inputs import check_rl_inputs

    def chosen(smallest):
        cfg = load_config(auto_yaml, ["train.memory_budget=64MiB"])
        return check_rl_inputs(cfg, str(auto_yaml.parent), 1, smallest=smallest).auto

    alone, least = chosen(None), chosen(lambda budget: 1677722)  # another process has 1.6 MiB only
    assert alone["budget_bytes"] == 64 * 2**20 and least["budget_bytes"] == 1677722
    assert least["values"] == auto_plan(auto_yaml, "1677722")[0]["auto_batch_sizes"]["values"] != alone["values"]


def test_auto_is_refused_where_it_could_change_the_weights_or_has_no_plan(auto_yaml, tmp_path):
    from tidyrl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="auto with train.exact_gradients"):
        load_config(auto_yaml, ["train.exact_gradients=true"])
    with pytest.raises(ConfigError, match="must be an integer or auto"):
        load_config(auto_yaml, ["train.micro_batch_size=most"])
    with pytest.raises(ConfigError, match="train.memory_budget: '3 gigs' is not a memory size"):
        from tidyrl.loops.stage_plan import stage_plan

        stage_plan(load_config(auto_yaml, ["train.memory_budget=3 gigs"]), str(auto_yaml.parent), 1, None, None)


def train_auto(config, out, *overrides):
    from tidyrl.api import train

    return train(config, [f"output_dir={out}", *overrides])


def test_a_run_writes_its_choice_keeps_it_on_resume_and_recomputes_it_on_another_budget(auto_yaml, tmp_path,
                                                                                         capsys):
    out = tmp_path / "run"
    train_auto(auto_yaml, out, "train.memory_budget=1.6MiB")
    first = capsys.readouterr().out
    chosen = json.loads((out / "plan.json").read_text())["auto_batch_sizes"]
    assert f"auto batch sizes: rollout.generation_batch_size={chosen['values']['rollout.generation_batch_size']}" \
        in first
    saved = yaml.safe_load((out / "config.yaml").read_text())  # the resolved sizes, not `auto`
    assert [saved["rollout"]["generation_batch_size"], saved["rollout"]["forward_batch_size"],
            saved["train"]["micro_batch_size"]] == [chosen["values"][k] for k in KNOBS]
    # resumed from step 1 on the same budget: the same sizes, kept
    (out / "final").rename(tmp_path / "final-1")
    kept = tmp_path / "kept"
    import shutil

    shutil.copytree(out, kept)
    for path in (kept / "checkpoint-2",):
        shutil.rmtree(path, ignore_errors=True)
    rows = read_jsonl(kept / "metrics.jsonl")
    (kept / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:1]))
    train_auto(auto_yaml, kept, "train.memory_budget=1.6MiB", "resume_from=latest")
    said = capsys.readouterr().out
    again = json.loads((kept / "plan.json").read_text())["auto_batch_sizes"]
    assert again["values"] == chosen["values"] and "kept from the run it resumes" in said
    # the same resume on a larger budget: recomputed, and said with the sizes it had
    shutil.rmtree(kept)
    shutil.copytree(out, kept)
    shutil.rmtree(kept / "checkpoint-2", ignore_errors=True)
    (kept / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:1]))
    train_auto(auto_yaml, kept, "train.memory_budget=64MiB", "resume_from=latest")
    said = capsys.readouterr().out
    recomputed = json.loads((kept / "plan.json").read_text())["auto_batch_sizes"]
    assert recomputed["values"] == {k: 8 for k in KNOBS}
    assert "recomputed for 1 process(es) and train.memory_budget 64MiB (the run it resumes had 1 and " \
           "train.memory_budget 1.6MiB: " in said
    # micro-batching changes no number of the plan: the same steps, episodes and learning rates
    assert [(r["step"], r["episodes"], r["lr"]) for r in read_jsonl(kept / "metrics.jsonl")] == \
        [(r["step"], r["episodes"], r["lr"]) for r in rows]


def test_with_exact_gradients_the_auto_chunk_sizes_change_no_weight(auto_yaml, tmp_path):
    from safetensors.torch import load_file

    from tidyrl.memory.rl import AUTO_MARGIN

    exact = ("train.exact_gradients=true", "train.micro_batch_size=1")
    at_8 = planned_at(auto_yaml, {"rollout.generation_batch_size": 8, "rollout.forward_batch_size": 8,
                                  "train.micro_batch_size": 1, "train.exact_gradients": "true"})
    tight = at_8["update"]  # the update fits exactly; scoring 8 at a time does not fit with the margin
    assert at_8["scoring"] > tight * (1 - AUTO_MARGIN)
    finals, chosen = [], []
    for budget in (str(tight), "64Mi"):
        out = tmp_path / budget
        result = train_auto(auto_yaml, out, *exact, f"train.memory_budget={budget}B")
        chosen.append(json.loads((out / "plan.json").read_text())["auto_batch_sizes"]["values"])
        finals.append(load_file(result.final_dir / "model.safetensors"))
    assert chosen[0]["rollout.forward_batch_size"] < chosen[1]["rollout.forward_batch_size"] == 8, chosen
    assert 8 % chosen[0]["rollout.forward_batch_size"] == 0  # a divisor of each process's episodes
    assert all((finals[0][k] == finals[1][k]).all() for k in finals[0])  # other chunks, the same weights bit for bit

"""Config: YAML <-> typed dataclasses, overrides, unknown keys, types, validation (DESIGN.md §4)."""

import dataclasses
import re

import pytest
import yaml

from tidyrl.config import (
    Config,
    ConfigError,
    RewardConfig,
    apply_overrides,
    config_base_dir,
    config_from_dict,
    config_to_dict,
    load_config,
    save_config,
    validate,
)


def exact_match(prompts, completions, **kwargs):
    return [1.0 for _ in completions]


def minimal() -> dict:
    """The smallest valid config."""
    return {
        "model": "tiny-model",
        "data": {"path": "prompts.jsonl"},
        "rewards": [{"function": "my_rewards.py:exact_match"}],
        "train": {"rollouts": 10},
    }


def problems(fn, *args) -> list[str]:
    with pytest.raises(ConfigError) as info:
        fn(*args)
    return info.value.problems


def test_minimal_config_fills_defaults():
    cfg = load_config(minimal())
    assert cfg.algorithm == "grpo"
    assert cfg.rollout.prompts_per_rollout == 16
    assert cfg.train.rollouts == 10 and cfg.train.dataset_epochs is None
    assert cfg.rewards == [RewardConfig(function="my_rewards.py:exact_match")]


def test_yaml_round_trip(tmp_path):
    data = minimal()
    data.update(algorithm="rloo", seed=3, tokenizer="tok")
    data["rewards"].append({"function": "pkg.mod:length", "weight": -0.5, "name": "length"})
    data["rollout"] = {"prompts_per_rollout": 8, "samples_per_prompt": 2, "temperature": 0.7}
    data["train"] = {"dataset_epochs": 1.5, "drop_last": True, "learning_rate": 3e-6, "lr_scheduler": "linear"}
    data["rloo"] = {"kl_coef": 0.05, "clip_eps_high": 0.28}
    cfg = load_config(data)
    path = tmp_path / "run" / "config.yaml"
    save_config(cfg, path)
    assert load_config(path) == cfg
    written = yaml.safe_load(path.read_text())
    assert list(written) == [f.name for f in dataclasses.fields(Config)]
    assert list(written["train"])[:3] == ["rollouts", "dataset_epochs", "drop_last"]


def test_yaml_file_with_yaml11_float(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "model: m\ndata: {path: p.jsonl}\nrewards: [{function: 'r.py:f'}]\n"
        "train:\n  rollouts: 5\n  learning_rate: 1e-5\n"  # YAML 1.1 reads 1e-5 as a string
        "log:\n"  # an empty section keeps its defaults
    )
    cfg = load_config(path)
    assert cfg.train.learning_rate == 1e-5 and isinstance(cfg.train.learning_rate, float)
    assert cfg.log.keep_last == 2
    assert config_base_dir(path) == str(tmp_path)
    assert config_base_dir(minimal()) is None
    assert config_base_dir(cfg) is None


def test_missing_or_malformed_file(tmp_path):
    assert "not found" in problems(load_config, tmp_path / "nope.yaml")[0]
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    assert "must hold a mapping" in problems(load_config, tmp_path / "list.yaml")[0]


def test_overrides():
    cfg = load_config(minimal(), [
        "seed=7",
        "train.learning_rate=1e-5",
        "rollout.temperature=0.5",
        "train.drop_last=true",
        "tokenizer=null",
        "rewards.0.weight=2",
        "rewards.1.function=pkg.mod:other",  # index == len appends
        "train.rollouts=null",
        "train.dataset_epochs=2",
        "grpo.scale_rewards=none",
        "data.path=data/a=b.jsonl",  # only the first '=' splits
    ])
    assert cfg.seed == 7
    assert cfg.train.learning_rate == 1e-5
    assert cfg.rollout.temperature == 0.5
    assert cfg.train.drop_last is True
    assert cfg.tokenizer is None
    assert cfg.rewards[0].weight == 2.0 and isinstance(cfg.rewards[0].weight, float)
    assert cfg.rewards[1] == RewardConfig(function="pkg.mod:other")
    assert cfg.train.rollouts is None and cfg.train.dataset_epochs == 2.0
    assert cfg.grpo.scale_rewards == "none"
    assert cfg.data.path == "data/a=b.jsonl"


def test_overrides_create_missing_sections_and_copy_the_input():
    data = {"model": "m"}
    out = apply_overrides(data, ["data.path=p.jsonl", "rewards.0.function=r.py:f", "train.rollouts=3"])
    assert out == {"model": "m", "data": {"path": "p.jsonl"}, "rewards": [{"function": "r.py:f"}],
                   "train": {"rollouts": 3}}
    assert data == {"model": "m"}


def test_malformed_overrides():
    assert "key=value" in problems(apply_overrides, {}, ["foo"])[0]
    assert "key=value" in problems(apply_overrides, {}, ["train..rollouts=3"])[0]
    assert "index from 0 to 1" in problems(apply_overrides, minimal(), ["rewards.5.weight=1"])[0]
    assert "seed is a value, not a section" in problems(apply_overrides, {"seed": 0}, ["seed.x=1"])[0]


def test_unknown_keys_suggest_the_nearest_valid_key():
    data = minimal()
    data["rollout"] = {"prompts_per_rolout": 8}
    data["learning_rate"] = 1e-5
    data["prompts_per_rollout"] = 8
    data["trian"] = {}
    data["train"]["kl_coef"] = 0.1
    found = problems(config_from_dict, data)
    assert found == [  # in the order of the input
        "unknown key `train.kl_coef`; did you mean `grpo.kl_coef` or `rloo.kl_coef` or `ppo.kl_coef` or "
        "`reinforce_pp.kl_coef` or `distill.kl_coef`?",
        "unknown key `rollout.prompts_per_rolout`; did you mean `rollout.prompts_per_rollout`?",
        "unknown key `learning_rate`; did you mean `train.learning_rate` or `critic.learning_rate`?",
        "unknown key `prompts_per_rollout`; did you mean `rollout.prompts_per_rollout`?",
        "unknown key `trian`; did you mean `train`?",
    ]


def test_unknown_key_inside_a_reward():
    data = minimal()
    data["rewards"][0]["wieght"] = 2
    assert problems(config_from_dict, data) == ["unknown key `rewards.0.wieght`; did you mean `rewards.0.weight`?"]


def test_type_errors_name_the_key_the_type_and_the_value():
    data = minimal()
    data["seed"] = 1.5
    data["overwrite"] = 1
    data["model"] = 3
    data["train"].update(micro_batch_size=True, learning_rate="fast", rollouts="8")
    data["log"] = 5
    found = problems(config_from_dict, data)
    assert found == [  # in the order of the input
        "model must be a string, got 3 (int)",
        "train.rollouts must be an integer, got '8' (str)",
        "train.micro_batch_size must be an integer or auto, got True (bool)",
        "train.learning_rate must be a number, got 'fast' (str)",
        "seed must be an integer, got 1.5 (float)",
        "overwrite must be true or false, got 1 (int)",
        "log must be a mapping of keys, got 5",
    ]
    bad_rewards = dict(minimal(), rewards={"function": "r.py:f"})
    assert problems(config_from_dict, bad_rewards) == ["rewards must be a list, got {'function': 'r.py:f'}"]
    bad_reward = dict(minimal(), rewards=["r.py:f"])
    assert problems(config_from_dict, bad_reward) == ["rewards.0 must be a mapping of keys, got 'r.py:f'"]


def test_numbers_are_coerced_to_the_annotated_type():
    data = minimal()
    data["train"].update(learning_rate=1, warmup_ratio="0.25")
    data["grpo"] = {"clip_eps_high": None}
    cfg = config_from_dict(data)
    assert cfg.train.learning_rate == 1.0 and isinstance(cfg.train.learning_rate, float)
    assert cfg.train.warmup_ratio == 0.25
    assert cfg.grpo.clip_eps_high is None


def test_validate_reports_every_problem_with_its_key():
    data = minimal()
    data.update(algorithm="ppo2", resume_from="  ")
    data["rewards"] = [{"model": " "}, {}, {"function": "no_colon", "weight": float("inf")}]
    data["rollout"] = {"samples_per_prompt": 1, "top_p": 0, "min_new_tokens": 100}
    data["train"].update(dataset_epochs=1.0, warmup_steps=2, warmup_ratio=0.1, lr_scheduler="cosine_typo")
    data["log"] = {"log_every": 0}
    found = problems(load_config, data)
    keys = [p.split(":")[0] for p in found]
    assert keys == [
        "algorithm", "resume_from", "rewards.0.model", "rewards.1", "rewards.2.function", "rewards.2.weight",
        "rollout.min_new_tokens", "rollout.top_p", "train", "train.warmup_steps",
        "train.lr_scheduler", "log.log_every",
    ]
    text = "\n".join(found)
    assert "set the reward model folder" in text
    assert "'ppo2' is not one of grpo, rloo" in text
    assert "exactly one of train.rollouts and train.dataset_epochs" in text
    assert "use one of linear, cosine," in text


def test_validate_the_algorithm_section():
    data = minimal()
    data["grpo"] = {"clip_eps": 0, "clip_eps_high": -1, "loss_aggregation": "sum", "kl_coef": -0.1,
                    "kl_estimator": "k4", "scale_rewards": "std"}
    data["rloo"] = {"kl_estimator": "k9"}  # not the active algorithm: not checked
    keys = [p.split(":")[0] for p in problems(load_config, data)]
    assert keys == ["grpo.clip_eps", "grpo.clip_eps_high", "grpo.loss_aggregation", "grpo.kl_coef",
                    "grpo.kl_estimator", "grpo.scale_rewards"]


def test_validate_schedulers():
    ok = load_config(minimal(), ["train.lr_scheduler=constant_with_warmup"])
    assert ok.train.lr_scheduler == "constant_with_warmup"
    found = problems(load_config, minimal(), ["train.lr_scheduler=reduce_lr_on_plateau"])
    assert found[0].startswith("train.lr_scheduler: 'reduce_lr_on_plateau' is not supported because it steps on")


def test_validate_catches_wrong_types_in_a_hand_built_config():
    cfg = load_config(minimal())
    cfg.train.micro_batch_size = "8"
    assert problems(validate, cfg) == ["train.micro_batch_size must be an integer or auto, got '8' (str)"]


def test_empty_config_says_what_is_missing():
    keys = [p.split(":")[0] for p in problems(load_config, {})]
    assert keys == ["model", "data.path", "rewards", "train"]


def test_callable_reward_function_from_python():
    data = minimal()
    data["rewards"] = [{"function": exact_match, "weight": 0.5}]
    cfg = load_config(data)
    assert cfg.rewards[0].function is exact_match
    assert config_to_dict(cfg)["rewards"][0] == {
        "function": f"{__name__}:exact_match", "model": None, "weight": 0.5, "name": None, "normalize": False,
        "max_length": None, "kwargs": {},
    }
    not_callable = dict(minimal(), rewards=[{"function": 42}])
    assert problems(load_config, not_callable) == [
        "rewards.0.function: must be a 'module:function' string or a callable, got int"
    ]


def test_load_config_from_a_config_copies_it():
    original = load_config(minimal())
    copy = load_config(original, ["train.rollouts=20"])
    assert copy.train.rollouts == 20 and original.train.rollouts == 10
    copy.rollout.temperature = 0.1
    assert original.rollout.temperature == 1.0
    assert load_config(original) == original


# --- offline stages (sft, reward, dpo) --------------------------------------


def offline(algorithm: str, **train) -> dict:
    return {"algorithm": algorithm, "model": "tiny-model", "data": {"path": "data.jsonl"},
            "train": {"batch_size": 8, "max_steps": 10, **train}}


def test_offline_stages_need_no_rewards_and_no_rollout():
    for algorithm in ("sft", "reward", "dpo"):
        cfg = load_config(offline(algorithm))
        assert cfg.rewards == [] and cfg.train.batch_size == 8 and cfg.train.max_steps == 10
    cfg = load_config(offline("dpo"), ["dpo.beta=0.3", "dpo.loss_type=ipo", "data.chosen_column=good"])
    assert (cfg.dpo.beta, cfg.dpo.loss_type, cfg.data.chosen_column) == (0.3, "ipo", "good")


def test_offline_stages_reject_rl_only_settings_with_the_fix():
    data = offline("sft", rollouts=3, epochs_per_rollout=2, dataset_epochs=1.0)
    data["train"].pop("batch_size")
    data["rewards"] = [{"function": "r.py:f"}]
    data["rollout"] = {"samples_per_prompt": 8}
    found = problems(load_config, data)
    assert [p.split(":")[0] for p in found] == [
        "rewards", "rollout", "train.rollouts", "train.epochs_per_rollout", "train.batch_size", "train",
    ]
    text = "\n".join(found)
    assert "rewards: not used by algorithm sft (it trains on data.path); remove the section" in text
    assert "set exactly one of train.max_steps and train.dataset_epochs" in text
    assert "train.batch_size: set the global number of examples per optimizer step, e.g. 32" in text


def test_offline_stage_options_are_checked():
    data = offline("sft")
    data["sft"] = {"packing": True, "loss_aggregation": "sequence_mean"}
    assert [p.split(":")[0] for p in problems(load_config, data)] == ["sft.packing", "sft.loss_aggregation"]
    data = offline("dpo")
    data["dpo"] = {"beta": 0, "loss_type": "ipo", "label_smoothing": 0.1}
    assert [p.split(":")[0] for p in problems(load_config, data)] == ["dpo.beta", "dpo.label_smoothing"]
    data = offline("dpo")
    data["dpo"] = {"loss_type": "hinge"}
    assert problems(load_config, data) == ["dpo.loss_type: 'hinge' is not one of sigmoid, ipo, robust, simpo, orpo"]
    data["dpo"] = {"loss_type": "simpo", "simpo_gamma": -1, "orpo_lambda": float("nan"), "label_smoothing": 0.1}
    assert [p.split(":")[0] for p in problems(load_config, data)] == [
        "dpo.simpo_gamma", "dpo.orpo_lambda", "dpo.label_smoothing"]
    data = offline("reward")
    data["data"].update(max_length=1, rejected_column="")
    data["log"] = {"save_every": 5, "report_to": [], "eval_every": 2}  # checkpoints and trackers: as RL stages
    assert [p.split(":")[0] for p in problems(load_config, data)] == [
        "data.rejected_column", "data.max_length", "log.eval_every"]
    data = offline("sft")
    data["data"].update(eval_path="held.jsonl", eval_fraction=0.1)
    data["log"] = {"best_metric": "loss"}
    assert [p.split(":")[0] for p in problems(load_config, data)] == ["data.eval_fraction", "log.best_metric"]
    data["data"].update(eval_path=None, eval_fraction=1.0)
    assert [p.split(":")[0] for p in problems(load_config, data)] == ["data.eval_fraction", "log.best_metric"]
    data["data"].update(eval_fraction=0.25)
    data["log"] = {"best_metric": "eval/loss", "eval_every": 3}
    assert load_config(data).data.eval_fraction == 0.25


def test_evaluation_keys_are_checked_for_every_stage():
    data = minimal()
    data["data"]["eval_fraction"] = 0.1
    data["log"] = {"eval_every": 2, "eval_decoding": "beam", "best_metric": "eval/loss"}
    found = problems(load_config, data)
    assert [p.split(":")[0] for p in found] == ["log.best_metric", "log.eval_decoding"]
    assert "eval/reward_mean" in found[0]
    data["log"] = {"eval_every": 2, "eval_decoding": "sampled", "best_metric": "eval/reward/my_reward"}
    assert load_config(data).log.eval_decoding == "sampled"
    data = offline("sft")
    data["data"]["eval_path"] = "held.jsonl"
    data["log"] = {"best_metric": "eval/accuracy"}
    assert problems(load_config, data) == ["log.best_metric: 'eval/accuracy' is not an eval metric of sft; choose "
                                           "one of eval/loss"]


def test_rl_stages_reject_offline_sizes():
    data = minimal()
    data["train"].update(batch_size=8, max_steps=3)
    found = problems(load_config, data)
    assert [p.split(":")[0] for p in found] == ["train.batch_size", "train.max_steps"]
    assert "only for sft, reward, dpo and kto" in found[0]


def test_groups_of_one_are_refused_only_where_a_baseline_needs_the_group():
    data = minimal()
    data["rollout"] = {"samples_per_prompt": 1}
    assert [p.split(":")[0] for p in problems(load_config, data)] == ["rollout.samples_per_prompt"]  # grpo
    for algorithm in ("ppo", "reinforce_pp"):
        assert load_config(dict(data, algorithm=algorithm)).rollout.samples_per_prompt == 1
    assert problems(load_config, dict(data, algorithm="reinforce_pp_baseline"))[0].startswith(
        "rollout.samples_per_prompt: must be >= 2 for reinforce_pp_baseline")


def test_known_scheduler_names_are_transformers_own_and_validate_without_importing_it():
    """LR_SCHEDULERS (validated without importing transformers.trainer_utils, which takes seconds) is exactly
    the installed transformers' scheduler list minus the unsupported ones."""
    import subprocess
    import sys

    from tidyrl.config import LR_SCHEDULERS, supported_schedulers

    assert list(LR_SCHEDULERS) == supported_schedulers()
    code = ("import sys, tidyrl.config as c; c.load_config({'model': 'm', 'data': {'path': 'p.jsonl'}, "
            "'rewards': [{'function': 'tidyrl.demo:anagram_reward'}], 'train': {'rollouts': 10}}, "
            "['train.lr_scheduler=cosine']); "
            "print('transformers.trainer_utils' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _field_docstring(cls, name: str) -> str:
    """The docstring written under field `name` of config class `cls` (or of the base class that declares it)."""
    import ast
    import inspect
    import textwrap

    for klass in cls.__mro__:
        if not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and node.target.id == name and isinstance(after, ast.Expr):
                return after.value.value
    raise AssertionError(f"{cls.__name__}.{name} has no docstring")


def test_each_choice_list_has_one_owner_that_the_checks_and_the_reference_read():
    """Every option with a list of values: the config refuses a value outside it with the list (the check reads the
    owner's list), and the field's docstring, which docs/config-reference.md is generated from, names each value."""
    from tidyrl.algorithms import choices, table
    from tidyrl.config import (ALGORITHMS, WEIGHT_SYNC_ROUTES, DPOConfig, GRPOConfig, KernelsConfig, PPOConfig,
                               RLOOConfig, RolloutConfig, ServerConfig, SFTConfig)

    owned = [  # (section, key, its data, the owner's list)
        (GRPOConfig, "grpo.loss_aggregation", {}, choices.LOSS_AGGREGATIONS),
        (GRPOConfig, "grpo.kl_estimator", {}, choices.KL_ESTIMATORS),
        (RLOOConfig, "rloo.kl_estimator", {"algorithm": "rloo"}, choices.KL_ESTIMATORS),
        (PPOConfig, "ppo.kl_estimator", {"algorithm": "ppo"}, choices.KL_ESTIMATORS),
        (GRPOConfig, "grpo.scale_rewards", {}, choices.GRPO_SCALES),
        (GRPOConfig, "grpo.policy_loss", {}, table.POLICY_LOSSES),
        (SFTConfig, "sft.loss_aggregation", None, choices.SFT_LOSS_AGGREGATIONS),
        (DPOConfig, "dpo.loss_type", None, choices.DPO_LOSS_TYPES + choices.REFERENCE_FREE_LOSS_TYPES),
        (ServerConfig, "server.weight_sync", {}, WEIGHT_SYNC_ROUTES),
        (KernelsConfig, "kernels.decode_attention", {}, choices.DECODE_ATTENTIONS),
        (KernelsConfig, "kernels.layer_kernels", {}, choices.LAYER_KERNEL_MODES),
    ]
    for section, key, extra, values in owned:
        doc = _field_docstring(section, key.split(".")[1])
        assert set(values) <= set(re.findall(r"[\w-]+", doc)), (key, values, doc)
        data = offline(key.split(".")[0]) if extra is None else dict(minimal(), **extra)
        found = problems(load_config, data, [f"{key}=no_such_value"])
        assert found == [f"{key}: 'no_such_value' is not one of {', '.join(values)}"
                         + (", or null (the algorithm's own)" if key.endswith("policy_loss") else "")], found
    # The algorithms and the engines: the docstring names the owner's table, and the reference page lists the values
    # from that table.
    from pathlib import Path

    from tidyrl.engines import ENGINES
    from tidyrl.models.families import FAMILIES

    page = (Path(__file__).resolve().parent.parent / "docs" / "config-reference.md").read_text(encoding="utf-8")
    for section, key, owner, values in [(Config, "algorithm", "tidyrl.algorithms.table.ALGORITHMS", ALGORITHMS),
                                        (RolloutConfig, "rollout.engine", "tidyrl.engines.ENGINES", ENGINES),
                                        (Config, "model_fast_paths", "tidyrl.models.families.FAMILIES",
                                         [f.name for f in FAMILIES])]:
        assert owner in _field_docstring(section, key.split(".")[-1]), key
        row = next(line for line in page.splitlines() if line.startswith(f"| `{key}` |"))
        assert all(f"`{v}`" in row for v in values), (key, row)


def test_the_kernels_section_is_the_models_choice_of_kernels_key_for_key():
    """config.kernels and tidyrl.models.kernels.Kernels (what the models carry): the same keys in the same order,
    the same types and defaults, so that a default config is the models' default choice; a section converts."""
    import typing

    from tidyrl.config import KernelsConfig
    from tidyrl.models.kernels import OVERRIDES, Kernels

    section = typing.get_type_hints(KernelsConfig)
    assert section == typing.get_type_hints(Kernels) and list(section) == list(OVERRIDES)
    assert dataclasses.asdict(KernelsConfig()) == dataclasses.asdict(Kernels())
    chosen = load_config(minimal(), ["kernels.chunked_head=false", "kernels.decode_attention=sdpa"]).kernels
    assert Kernels.of(chosen) == Kernels(chunked_head=False, decode_attention="sdpa")
    assert config_to_dict(load_config(minimal()))["kernels"] == dataclasses.asdict(Kernels())


def test_kernel_keys_are_typed_and_checked_naming_the_key():
    assert problems(load_config, minimal(), ["kernels.recompute=1"]) == [
        "kernels.recompute must be true or false, got 1 (int)"]
    assert problems(load_config, offline("sft"), ["kernels.decode_attention=flash"]) == [
        "kernels.decode_attention: 'flash' is not one of kernel, sdpa"]
    assert problems(load_config, minimal(), ["kernels.chunkedhead=false"]) == [
        "unknown key `kernels.chunkedhead`; did you mean `kernels.chunked_head`?"]


def test_a_label_smoothing_is_refused_for_the_loss_types_that_take_none():
    from tidyrl.algorithms.choices import DPO_LOSS_TYPES, LABEL_SMOOTHING_LOSS_TYPES

    for loss_type in DPO_LOSS_TYPES:
        data = offline("dpo")
        data["dpo"] = {"loss_type": loss_type, "label_smoothing": 0.1}
        if loss_type in LABEL_SMOOTHING_LOSS_TYPES:
            assert load_config(data).dpo.label_smoothing == 0.1
        else:
            assert problems(load_config, data) == [
                f"dpo.label_smoothing: only with dpo.loss_type=sigmoid or robust; set it to 0 for {loss_type}"]


def test_an_optional_list_of_names_is_read_as_a_list_of_names():
    cfg = load_config({"algorithm": "grpo", "model": "m", "data": {"path": "p.jsonl"},
                       "rewards": [{"function": "tidyrl.demo:anagram_reward"}], "train": {"rollouts": 1},
                       "lora": {"enabled": True, "target_modules": ["q_proj", "v_proj"],
                                "target_parameters": ["experts.gate_up_proj"]}})
    assert cfg.lora.target_modules == ["q_proj", "v_proj"] and cfg.lora.target_parameters == ["experts.gate_up_proj"]
    with pytest.raises(ConfigError, match=r"lora.target_modules.0 must be a string"):
        load_config({"algorithm": "grpo", "model": "m", "data": {"path": "p.jsonl"}, "train": {"rollouts": 1},
                     "rewards": [{"function": "tidyrl.demo:anagram_reward"}], "lora": {"target_modules": [3]}})

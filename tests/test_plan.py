"""The batch plan on hand-worked numbers (DESIGN.md §2, §5)."""

import subprocess
import sys

import pytest

from tidyrl.config import Config, RolloutConfig, TrainConfig
from tidyrl.plan import Plan, PlanError, epochs_done, make_plan, plan_from_config

# (P, k, E, M, m, W, rollouts) -> (R, E*M, accumulation, total steps, total episodes,
#                                 R/M, R/(M*W), R/W), each worked by hand.
GRID = [
    # R = 16*4 = 64; E*M = 8; accumulation = 64/(4*2*2) = 4; 10*8 = 80 steps; 10*64 = 640 episodes.
    ((16, 4, 2, 4, 2, 2, 10), (64, 8, 4, 80, 640, 16, 8, 32)),
    # The smallest run: one prompt, two samples, one step.
    ((1, 2, 1, 1, 1, 1, 1), (2, 1, 2, 1, 2, 2, 2, 2)),
    # The docs/concepts.md example: R = 32; accumulation = 32/(2*1*4) = 4; 13*4 = 52 steps.
    ((8, 4, 2, 2, 4, 1, 13), (32, 4, 4, 52, 416, 16, 16, 32)),
    # One episode per process per mini-batch: accumulation = 64/(8*8*1) = 1.
    ((8, 8, 1, 8, 1, 8, 3), (64, 8, 1, 24, 192, 8, 1, 8)),
    # R = 30; R/M = 10; per process 5 = one micro-batch of 5; 7*9 = 63 steps.
    ((6, 5, 3, 3, 5, 2, 7), (30, 9, 1, 63, 210, 10, 5, 15)),
    # R = 24; M = 1; per process 24/4 = 6 = 2 micro-batches of 3.
    ((12, 2, 4, 1, 3, 4, 2), (24, 4, 2, 8, 48, 24, 6, 6)),
    # R = 512; R/M = 128 = 16 micro-batches of 8; 100*4 = 400 steps.
    ((32, 16, 1, 4, 8, 1, 100), (512, 4, 16, 400, 51200, 128, 128, 512)),
]


@pytest.mark.parametrize("sizes, expected", GRID)
def test_valid_sizes_give_exact_numbers(sizes, expected):
    P, k, E, M, m, W, rollouts = sizes
    R, steps_per_rollout, accumulation, total_steps, total_episodes, per_mb, per_mb_pp, per_rollout_pp = expected
    plan = make_plan(
        prompts_per_rollout=P,
        samples_per_prompt=k,
        epochs_per_rollout=E,
        minibatches_per_epoch=M,
        micro_batch_size=m,
        world_size=W,
        rollouts=rollouts,
    )
    assert plan == Plan(
        world_size=W,
        prompts_per_rollout=P,
        samples_per_prompt=k,
        episodes_per_rollout=R,
        epochs_per_rollout=E,
        minibatches_per_epoch=M,
        optimizer_steps_per_rollout=steps_per_rollout,
        micro_batch_size=m,
        gradient_accumulation_steps=accumulation,
        rollouts=rollouts,
        total_optimizer_steps=total_steps,
        total_episodes=total_episodes,
        warmup_steps=0,
        num_prompts=None,
        episodes_per_minibatch=per_mb,
        episodes_per_minibatch_per_process=per_mb_pp,
        episodes_per_rollout_per_process=per_rollout_pp,
    )
    # The split always covers the mini-batch exactly.
    assert plan.gradient_accumulation_steps * m * W == plan.episodes_per_minibatch


@pytest.mark.parametrize("m, W", [(1, 1), (8, 1), (2, 2), (1, 4), (4, 4), (2, 8)])
def test_memory_knobs_and_processes_never_change_the_totals(m, W):
    plan = make_plan(
        prompts_per_rollout=16, samples_per_prompt=4, epochs_per_rollout=2, minibatches_per_epoch=2,
        micro_batch_size=m, world_size=W, dataset_epochs=1, num_prompts=100, warmup_ratio=0.1,
    )
    # rollouts = ceil(100/16) = 7; steps = 7*2*2 = 28; warmup = ceil(2.8) = 3.
    assert (plan.rollouts, plan.total_optimizer_steps, plan.total_episodes, plan.warmup_steps) == (7, 28, 448, 3)
    assert plan.drawn == "448 episodes"
    assert plan.gradient_accumulation_steps == 64 // (2 * W * m)


def _epochs_plan(**kw):
    sizes = dict(samples_per_prompt=2, micro_batch_size=1)
    sizes.update(kw)
    return make_plan(**sizes)


def test_dataset_epochs_round_up_or_down_with_drop_last():
    # 1 epoch of N=10 prompts, P=4: 10/4 = 2.5 rollouts.
    assert _epochs_plan(prompts_per_rollout=4, dataset_epochs=1.0, num_prompts=10).rollouts == 3
    assert _epochs_plan(prompts_per_rollout=4, dataset_epochs=1.0, num_prompts=10, drop_last=True).rollouts == 2
    # Whole numbers are not rounded either way: 2 * 100 / 8 = 25.
    for drop_last in (False, True):
        plan = _epochs_plan(prompts_per_rollout=8, dataset_epochs=2, num_prompts=100, drop_last=drop_last)
        assert plan.rollouts == 25
        assert plan.num_prompts == 100


def test_dataset_epochs_are_exact_decimals():
    # 0.1 * 30 / 1 = 3 exactly.
    assert _epochs_plan(prompts_per_rollout=1, dataset_epochs=0.1, num_prompts=30).rollouts == 3
    # In floats 1.1 * 50 = 55.00000000000001, which would round up to 56.
    assert _epochs_plan(prompts_per_rollout=1, dataset_epochs=1.1, num_prompts=50).rollouts == 55


def test_warmup_ratio_rounds_up_exactly():
    # 25 steps (25 rollouts of E*M = 1); 0.1 * 25 = 2.5 -> 3.
    plan = _epochs_plan(prompts_per_rollout=1, rollouts=25, warmup_ratio=0.1)
    assert (plan.total_optimizer_steps, plan.warmup_steps) == (25, 3)
    # In floats 0.07 * 100 = 7.000000000000001, which would round up to 8.
    assert _epochs_plan(prompts_per_rollout=1, rollouts=100, warmup_ratio=0.07).warmup_steps == 7
    # warmup_steps is used as given, up to the total.
    assert _epochs_plan(prompts_per_rollout=1, rollouts=25, warmup_steps=25).warmup_steps == 25


def _error(**kw) -> str:
    sizes = dict(prompts_per_rollout=16, samples_per_prompt=4, micro_batch_size=1, rollouts=10)
    sizes.update(kw)
    with pytest.raises(PlanError) as info:
        make_plan(**sizes)
    return str(info.value)


def test_minibatches_that_do_not_divide_the_rollout():
    message = _error(minibatches_per_epoch=3)
    assert "train.minibatches_per_epoch=3 does not divide the R = P*k = 16*4 = 64 episodes" in message
    assert "rollout.prompts_per_rollout" in message and "rollout.samples_per_prompt" in message
    assert "valid values: 1, 2, 4, 8, 16, 32, 64" in message


def test_processes_that_do_not_divide_the_minibatch():
    # R/M = 64/8 = 8 episodes per mini-batch; 16 processes would each get half an episode.
    message = _error(minibatches_per_epoch=8, world_size=16)
    assert "--num-processes=16" in message and "R/M = 64/8 = 8" in message
    assert "valid process counts: 1, 2, 4, 8" in message
    # 16 processes work with M dividing 64/16 = 4.
    assert "valid train.minibatches_per_epoch: 1, 2, 4" in message
    # 3 processes cannot split 64 episodes at all.
    message = _error(world_size=3)
    assert "valid process counts: 1, 2, 4, 8, 16, 32, 64" in message
    assert "no train.minibatches_per_epoch works with 3 processes" in message


def test_micro_batch_that_does_not_divide_the_per_process_minibatch():
    message = _error(minibatches_per_epoch=4, world_size=2, micro_batch_size=3)
    assert "train.micro_batch_size=3 does not divide the R/(M*W) = 64/(4*2) = 8 episodes" in message
    assert "valid values: 1, 2, 4, 8" in message


def test_length_of_training_problems():
    assert "exactly one of train.rollouts and train.dataset_epochs" in _error(rollouts=None)
    assert "exactly one of train.rollouts and train.dataset_epochs" in _error(dataset_epochs=1.0, num_prompts=5)
    assert "prompt set size" in _error(rollouts=None, dataset_epochs=1.0)
    # floor(0.5 * 5 / 16) = 0 rollouts.
    message = _error(rollouts=None, dataset_epochs=0.5, num_prompts=5, drop_last=True)
    assert "floor(0.5*5/16) = 0 rollouts" in message
    assert "train.dataset_epochs" in message and "rollout.prompts_per_rollout" in message


def test_sizes_must_be_positive_integers():
    assert "train.micro_batch_size must be an integer >= 1, got True" in _error(micro_batch_size=True)
    assert "rollout.samples_per_prompt must be an integer >= 1, got 0" in _error(samples_per_prompt=0)
    assert "rollout.prompts_per_rollout must be an integer >= 1, got 2.0" in _error(prompts_per_rollout=2.0)
    assert "--num-processes" in _error(world_size=0)
    assert "train.rollouts: must be an integer >= 1" in _error(rollouts=0)
    assert "train.dataset_epochs: must be a number > 0" in _error(rollouts=None, dataset_epochs=0, num_prompts=5)


def test_warmup_problems():
    assert "not both" in _error(warmup_steps=2, warmup_ratio=0.1)
    assert "train.warmup_ratio: must be a number in [0, 1)" in _error(warmup_ratio=1.0)
    # 10 rollouts * 1 * 1 = 10 steps.
    message = _error(warmup_steps=11)
    assert "train.warmup_steps=11 exceeds the 10 optimizer steps" in message
    assert "valid values: 0 to 10" in message


def test_all_problems_are_reported_at_once():
    with pytest.raises(PlanError) as info:
        make_plan(prompts_per_rollout=16, samples_per_prompt=4, minibatches_per_epoch=3, micro_batch_size=1,
                  rollouts=10, warmup_steps=31)
    assert len(info.value.problems) == 2
    assert "train.minibatches_per_epoch=3" in info.value.problems[0]
    assert "train.warmup_steps=31 exceeds the 30 optimizer steps" in info.value.problems[1]


PLAN_JSON_KEYS = [  # DESIGN.md §5, in its order
    "world_size", "prompts_per_rollout", "samples_per_prompt", "episodes_per_rollout",
    "epochs_per_rollout", "minibatches_per_epoch", "optimizer_steps_per_rollout", "micro_batch_size",
    "gradient_accumulation_steps", "rollouts", "total_optimizer_steps", "total_episodes", "warmup_steps",
]


def test_to_dict_starts_with_the_plan_json_keys():
    plan = make_plan(prompts_per_rollout=4, samples_per_prompt=2, micro_batch_size=2, rollouts=3, num_prompts=9)
    d = plan.to_dict()
    assert list(d)[: len(PLAN_JSON_KEYS)] == PLAN_JSON_KEYS
    assert list(d)[len(PLAN_JSON_KEYS):] == [
        "num_prompts", "episodes_per_minibatch", "episodes_per_minibatch_per_process",
        "episodes_per_rollout_per_process",
    ]
    assert d["total_episodes"] == 24 and d["num_prompts"] == 9


def test_plan_from_config():
    cfg = Config(
        rollout=RolloutConfig(prompts_per_rollout=8, samples_per_prompt=4),
        train=TrainConfig(dataset_epochs=1.0, epochs_per_rollout=2, minibatches_per_epoch=2, micro_batch_size=4,
                          warmup_ratio=0.1),
    )
    plan = plan_from_config(cfg, num_prompts=100, world_size=2)
    # ceil(100/8) = 13 rollouts, 13*2*2 = 52 steps, warmup ceil(5.2) = 6, accumulation 32/(2*2*4) = 2.
    assert (plan.rollouts, plan.total_optimizer_steps, plan.warmup_steps) == (13, 52, 6)
    assert (plan.world_size, plan.gradient_accumulation_steps) == (2, 2)


def test_epochs_done():
    plan = make_plan(prompts_per_rollout=4, samples_per_prompt=2, micro_batch_size=1, dataset_epochs=1,
                     num_prompts=10)
    assert epochs_done(plan, 0) == 0.0
    assert epochs_done(plan, 3) == pytest.approx(1.2)  # 3 * 4 / 10
    unknown = make_plan(prompts_per_rollout=4, samples_per_prompt=2, micro_batch_size=1, rollouts=3)
    assert epochs_done(unknown, 3) is None


def test_plan_module_imports_no_torch():
    code = "import sys, tidyrl.plan; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


# --- offline stages (sft, reward, dpo) --------------------------------------


def test_offline_plan_numbers():
    from tidyrl.plan import OfflinePlan, make_offline_plan, offline_epochs_done

    # N = 30, B = 8, 1.5 epochs: ceil(45 / 8) = 6 steps, 48 examples (1.6 epochs); W = 2, m = 2: 8/(2*2) = 2.
    plan = make_offline_plan(batch_size=8, micro_batch_size=2, world_size=2, dataset_epochs=1.5, num_examples=30,
                             warmup_ratio=0.1)
    assert isinstance(plan, OfflinePlan)
    assert plan.to_dict() == {
        "world_size": 2, "batch_size": 8, "micro_batch_size": 2, "gradient_accumulation_steps": 2,
        "total_optimizer_steps": 6, "total_examples": 48, "warmup_steps": 1, "num_examples": 30,
        "dataset_epochs": 1.6, "examples_per_process": 4,
    }
    assert make_offline_plan(batch_size=8, micro_batch_size=2, dataset_epochs=1.5, num_examples=30,
                             drop_last=True).total_optimizer_steps == 5  # floor(45 / 8)
    assert offline_epochs_done(plan, 3) == pytest.approx(0.8)
    steps = make_offline_plan(batch_size=4, micro_batch_size=4, max_steps=7)
    assert (steps.total_optimizer_steps, steps.total_examples, steps.dataset_epochs) == (7, 28, None)
    assert offline_epochs_done(steps, 3) is None


def test_offline_plan_exact_decimals_and_invariance():
    from tidyrl.plan import make_offline_plan

    # 0.1 epochs of 30 examples at B = 1 is 3 steps, not 4 (0.1 * 30 in floats is 3.0000000000000004).
    assert make_offline_plan(batch_size=1, micro_batch_size=1, dataset_epochs=0.1,
                             num_examples=30).total_optimizer_steps == 3
    base = make_offline_plan(batch_size=12, micro_batch_size=12, dataset_epochs=2.0, num_examples=50)
    for m, W in ((1, 1), (3, 2), (2, 3), (1, 4)):
        other = make_offline_plan(batch_size=12, micro_batch_size=m, world_size=W, dataset_epochs=2.0,
                                  num_examples=50)
        assert (other.total_optimizer_steps, other.total_examples) == (base.total_optimizer_steps, 108)
        assert other.gradient_accumulation_steps * m * W == 12


def test_offline_plan_problems_name_keys_and_valid_values():
    from tidyrl.plan import make_offline_plan

    with pytest.raises(PlanError) as info:
        make_offline_plan(batch_size=12, micro_batch_size=5, world_size=2, max_steps=3)
    assert info.value.problems == [
        "train.micro_batch_size=5 does not divide the B/W = 12/2 = 6 examples each process handles per optimizer "
        "step (train.batch_size=12, --num-processes=2); valid values: 1, 2, 3, 6"
    ]
    with pytest.raises(PlanError, match=r"--num-processes=2 \(world size\) does not divide train.batch_size=9; "
                                        r"valid process counts: 1, 3, 9"):
        make_offline_plan(batch_size=9, micro_batch_size=1, world_size=2, max_steps=3)
    with pytest.raises(PlanError) as info:
        make_offline_plan(batch_size=4, micro_batch_size=1, max_steps=2, dataset_epochs=1.0, num_examples=4,
                          warmup_steps=1, warmup_ratio=0.5)
    assert [p.split(":")[0] for p in info.value.problems] == ["train", "train.warmup_steps"]  # length and warmup
    assert all(" set " in p for p in info.value.problems)
    with pytest.raises(PlanError, match=r"gives floor\(0.5\*3/4\) = 0 optimizer steps"):
        make_offline_plan(batch_size=4, micro_batch_size=1, dataset_epochs=0.5, num_examples=3, drop_last=True)
    with pytest.raises(PlanError, match="needs the dataset size N"):
        make_offline_plan(batch_size=4, micro_batch_size=1, dataset_epochs=1.0)
    with pytest.raises(PlanError, match=r"warmup_steps=9 exceeds the 2 optimizer steps"):
        make_offline_plan(batch_size=4, micro_batch_size=1, max_steps=2, warmup_steps=9)
    with pytest.raises(PlanError, match="train.batch_size must be an integer >= 1"):
        make_offline_plan(batch_size=0, micro_batch_size=1, max_steps=2)


def test_offline_plan_from_config():
    from tidyrl.config import load_config
    from tidyrl.plan import offline_plan_from_config

    cfg = load_config({"algorithm": "dpo", "model": "m", "data": {"path": "p.jsonl"},
                       "train": {"batch_size": 16, "micro_batch_size": 4, "dataset_epochs": 1.0, "warmup_ratio": 0.25}})
    plan = offline_plan_from_config(cfg, num_examples=100, world_size=2)
    # ceil(100 / 16) = 7 steps, warmup ceil(1.75) = 2, accumulation 16 / (2 * 4) = 2.
    assert (plan.total_optimizer_steps, plan.warmup_steps, plan.gradient_accumulation_steps) == (7, 2, 2)
    assert plan.total_examples == 112 and plan.drawn == "112 examples"  # what `tidyrl train` says it drew


def test_plan_from_config_of_an_offline_stage_is_the_offline_plan():
    from tidyrl.config import load_config
    from tidyrl.plan import OfflinePlan

    cfg = load_config({"algorithm": "sft", "model": "m", "data": {"path": "p.jsonl"},
                       "train": {"batch_size": 10, "micro_batch_size": 5, "dataset_epochs": 2.0}})
    plan = plan_from_config(cfg, num_prompts=31)  # what `tidyrl plan` calls
    assert isinstance(plan, OfflinePlan) and plan.total_optimizer_steps == 7  # ceil(62 / 10)

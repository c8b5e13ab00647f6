"""Property-based checks of the batch plan (DESIGN.md §2) over random sizes and process counts: every total
adds up, or a PlanError names the problem. Never another exception, never a silent rounding."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from tidyrl.plan import PlanError, make_offline_plan, make_plan  # noqa: E402

size = st.integers(min_value=1, max_value=48)
bad_size = st.one_of(st.integers(max_value=0), st.floats(allow_nan=True), st.booleans(), st.none(), st.text(max_size=2))
epochs = st.decimals(min_value="0.01", max_value="8", places=2).map(float)


@st.composite
def plan_sizes(draw):
    kwargs = dict(prompts_per_rollout=draw(size), samples_per_prompt=draw(st.integers(1, 16)),
                  epochs_per_rollout=draw(st.integers(1, 4)), minibatches_per_epoch=draw(st.integers(1, 16)),
                  micro_batch_size=draw(st.integers(1, 16)), world_size=draw(st.integers(1, 8)),
                  drop_last=draw(st.booleans()))
    if draw(st.booleans()):
        kwargs["rollouts"] = draw(st.integers(1, 200))
    else:
        kwargs["dataset_epochs"], kwargs["num_prompts"] = draw(epochs), draw(st.integers(1, 500))
    if draw(st.booleans()):
        kwargs["warmup_steps"] = draw(st.integers(0, 400))
    else:
        kwargs["warmup_ratio"] = draw(st.decimals(min_value="0", max_value="0.99", places=2).map(float))
    return kwargs


@settings(max_examples=400, deadline=None)
@given(plan_sizes())
def test_every_total_adds_up_or_the_plan_is_refused(kwargs):
    P, k = kwargs["prompts_per_rollout"], kwargs["samples_per_prompt"]
    E, M = kwargs["epochs_per_rollout"], kwargs["minibatches_per_epoch"]
    m, W = kwargs["micro_batch_size"], kwargs["world_size"]
    R = P * k
    if "rollouts" in kwargs:
        rollouts = kwargs["rollouts"]
    else:  # DESIGN §2: ceil (floor with drop_last) of dataset_epochs * N / P, on the decimal as written
        exact = Fraction(str(kwargs["dataset_epochs"])) * kwargs["num_prompts"] / P
        rollouts = math.floor(exact) if kwargs["drop_last"] else math.ceil(exact)
    total = rollouts * E * M
    warmup = kwargs.get("warmup_steps", 0)
    if kwargs.get("warmup_ratio", 0) > 0:
        warmup = math.ceil(Fraction(str(kwargs["warmup_ratio"])) * total)
    divides = R % M == 0 and (R // M) % W == 0 and (R // (M * W)) % m == 0
    valid = divides and rollouts >= 1 and warmup <= total
    try:
        plan = make_plan(**kwargs)
    except PlanError as err:
        assert not valid, f"a valid plan was refused: {err}"
        assert err.problems and all(isinstance(p, str) and p for p in err.problems)
        if not divides:  # the message names the size that does not divide and lists the valid values
            assert "does not divide" in str(err) and "valid" in str(err)
        return
    assert valid, f"an invalid plan was accepted: {kwargs}"
    assert plan.episodes_per_rollout == R
    assert plan.rollouts == rollouts
    assert plan.optimizer_steps_per_rollout == E * M
    assert plan.total_optimizer_steps == total
    assert plan.total_episodes == rollouts * R
    assert plan.gradient_accumulation_steps * M * W * m == R  # accumulation is exact, never rounded
    assert plan.warmup_steps == warmup <= total
    assert plan.episodes_per_minibatch * M == R and plan.episodes_per_minibatch_per_process * W * M == R


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["prompts_per_rollout", "samples_per_prompt", "epochs_per_rollout", "minibatches_per_epoch",
                        "micro_batch_size", "world_size", "rollouts"]), bad_size)
def test_a_size_that_is_not_a_positive_integer_is_named(key, value):
    kwargs = dict(prompts_per_rollout=4, samples_per_prompt=2, micro_batch_size=2, rollouts=3)
    kwargs[key] = value
    if key == "rollouts" and value is None:  # then neither rollouts nor dataset_epochs is set
        with pytest.raises(PlanError, match="set exactly one of train.rollouts and train.dataset_epochs"):
            make_plan(**kwargs)
        return
    with pytest.raises(PlanError, match="must be an integer >= 1"):
        make_plan(**kwargs)


@settings(max_examples=300, deadline=None)
@given(batch=st.integers(1, 64), micro=st.integers(1, 16), world=st.integers(1, 8), steps=st.integers(1, 300),
       examples=st.integers(1, 1000), epochs_=epochs, by_steps=st.booleans(), drop_last=st.booleans())
def test_offline_plans_add_up_or_are_refused(batch, micro, world, steps, examples, epochs_, by_steps, drop_last):
    kwargs = dict(batch_size=batch, micro_batch_size=micro, world_size=world, num_examples=examples,
                  drop_last=drop_last)
    kwargs.update(max_steps=steps) if by_steps else kwargs.update(dataset_epochs=epochs_)
    if not by_steps:  # ceil (floor with drop_last) of dataset_epochs * N / B, on the decimal as written
        exact = Fraction(str(epochs_)) * examples / batch
        steps = math.floor(exact) if drop_last else math.ceil(exact)
    valid = batch % (world * micro) == 0 and steps >= 1
    try:
        plan = make_offline_plan(**kwargs)
    except PlanError as err:
        assert not valid, f"a valid plan was refused: {err}"
        assert err.problems
        return
    assert valid, f"an invalid plan was accepted: {kwargs}"
    assert plan.gradient_accumulation_steps * world * micro == batch  # exact, never rounded
    assert plan.total_optimizer_steps == steps
    assert plan.total_examples == steps * batch

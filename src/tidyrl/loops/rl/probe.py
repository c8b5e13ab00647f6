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

import torch

from tidyrl import liveness
from tidyrl.loops.run.worst_case import figures, later_micro_batch, no_trace
from tidyrl.models import peak_memory
from tidyrl.rollouts.record import Rollout

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


def run_probe(run) -> dict:
    """The probe of `run` (a `loops.rl.learner.RLRun` with its models loaded). Returns plan.json's `memory_probe`:
    per phase its shapes, the measured peak, the plan's figure for it, and the seconds it took. Raises what a phase
    raised (an out-of-memory error: the learner turns it into its message, `loops.run.out_of_memory`)."""
    from tidyrl.models.lean_decode import kept_as_is

    cfg, plan, device, trainee = run.cfg, run.plan, run.accelerator.device, run.trainee
    ro = cfg.rollout
    policy = run.accelerator.unwrap_model(trainee.model)
    vocab = policy.get_input_embeddings().num_embeddings
    longest = max([*run.inputs.prompt_ids, *(run.inputs.eval_prompt_ids or [])], key=len)
    share = plan.episodes_per_rollout_per_process
    g, f, m = min(ro.generation_batch_size, share), min(ro.forward_batch_size, share), plan.micro_batch_size
    planned = {p.name: p for p in run.inputs.memory.phases} if run.inputs.memory is not None else {}
    episode = f"{len(longest)} prompt + {ro.max_new_tokens} completion tokens"
    t0 = time.perf_counter()
    results: dict = {}
    with no_trace([trainee.model, trainee.critic]), kept_as_is(policy):
        if run.engine.capabilities.samples_trained_weights:
            with peak_memory.measured(device) as got:
                _generation(run, policy, made_up_rows(longest, g, vocab))
            results["generation"] = figures(f"{g} sequences of {len(longest)} prompt + {ro.max_new_tokens} new "
                                            "tokens", got[0], planned.get("generation"), False)
        episodes = made_up_rollout(made_up_rows(longest, max(f, m), vocab), ro.max_new_tokens, vocab,
                                   trainee.critic is not None)
        with peak_memory.measured(device) as got:
            scored = _scoring(run, policy, episodes, f)
        results["scoring"] = figures(f"{f} episodes of {episode}", got[0], planned.get("scoring"), False)
        fresh = not trainee.optimizer.state
        with peak_memory.measured(device) as got:
            _update(run, scored.rows(0, m))
        results["update"] = figures(f"{m} episodes of {episode}", got[0], planned.get("update"), fresh)
    return {"phases": results, "seconds": round(time.perf_counter() - t0, 3)}


def _generation(run, policy, prompts: list[list[int]]) -> None:
    from tidyrl.rollouts.making import on_engine

    sampling = run.source.producer.settings.sampling
    # every sequence decodes all of max_new_tokens: no end-of-sequence before it
    settings = replace(sampling, min_new_tokens=run.cfg.rollout.max_new_tokens, batch_size=len(prompts))
    model = policy if run.behaviour is None else run.behaviour
    on_engine(run.engine, model, lambda: run.engine.generate(prompts, list(range(len(prompts))), settings))


def _scoring(run, policy, episodes: Rollout, f: int) -> Rollout:
    """Every model that scores a rollout, on the made-up episodes (in chunks of f), and each reward model on a
    chunk of them: the episodes with their scores (what the update reads)."""
    from tidyrl.rewards.reward_models import RewardModel
    from tidyrl.rollouts.scoring import score_rollout

    column = run.inputs.dataset[run.cfg.data.prompt_column]
    longest = max(column, key=lambda p: len(str(p)))  # (as the data holds it: a teacher of another tokenizer and a
    # reward model render it themselves)
    scored = score_rollout(episodes, replace(run._scorers(policy), chunk_size=f), run.accelerator,
                           prompts=[longest] * len(episodes))
    texts = run.tokenizer.batch_decode(episodes.completion_ids.tolist())
    for reward in run.inputs.reward_fns:
        if isinstance(reward.fn, RewardModel):
            n = min(f, reward.fn.batch_size)
            reward.fn([longest] * n, texts[:n])
    return scored


def _update(run, part: Rollout) -> None:
    """The update on `part` (one micro-batch of made-up episodes), forward and backward, with a later
    micro-batch's company (`worst_case.later_micro_batch`; under FSDP2 with accumulation a first micro-batch runs
    before it, as the step runs it); no collective of the gradients under DDP, no optimizer step."""
    from tidyrl.loops.rl.update import SUMS, _micro_batch
    from tidyrl.loops.run.exact_sums import exact_accumulator
    from tidyrl.loops.run.steps import no_sync
    from tidyrl.models.collectives import Sums
    from tidyrl.models.sharding import is_root_sharded

    trainee, settings, plan, acc = run.trainee, run.update_settings, run.plan, run.accelerator
    trained = [(m, o) for m, o in ((trainee.model, trainee.optimizer), (trainee.critic, trainee.critic_optimizer))
               if m is not None]
    models = [m for m, _ in trained]
    for model in models:
        model.train()
    sharded = any(is_root_sharded(m) for m in models)
    steps = plan.gradient_accumulation_steps
    exact = exact_accumulator(models) if settings.exact_gradients else None  # (its grid: resident in a step)
    in_update_weights = settings.correction.where == "update" and part.is_weights is None
    idx = list(range(len(part)))
    shapes = (f"the worst-case probe: {len(idx)} episodes of {part.prompt_ids.shape[1]} prompt + "
              f"{part.completion_ids.shape[1]} completion tokens")
    with later_micro_batch(trained, steps > 1, sharded):
        for i in range(2 if sharded and steps > 1 else 1):
            last = i == steps - 1
            # (under DDP no collective: its reducer keeps no state of the probe's; FSDP2 syncs as the step would)
            sync = sharded and (exact.micro_batch_sync(last) if exact is not None
                                else settings.sync_each_microbatch or last)
            with liveness.working("update", shapes), no_sync(acc, models, sync):
                _micro_batch(part, idx, 2, 1.0, trainee, settings, acc, Sums(*SUMS), torch.zeros(()), None,
                             in_update_weights)

"""What serving the engine to agents costs: the same episodes made through the OpenAI-compatible endpoint (each
episode an agent that calls the real `openai` client `--calls` times, sending back what it was answered plus a
user message) and by calling the engine directly with the very contexts and sample keys, side by side:

    direct     the built-in engine's generate on each round's contexts (one batch a round)
    endpoint   the same rounds through `rollouts.agents` (HTTP, the clients, batching, the token record)

    python benchmarks/bench_agents.py                          # a tiny model on the CPU (~30 s)
    python benchmarks/bench_agents.py --model runs/smollm2/model --episodes 32 --new-tokens 64

Prints each way's median seconds of `--repeats` (interleaved), the ratio, the overhead per call in milliseconds,
and whether the two made the same tokens (they must: the samples are keyed per (episode, call)).
"""

from __future__ import annotations

import argparse
import statistics
import time


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model folder (default: a tiny byte-level Llama built here)")
    p.add_argument("--episodes", type=int, default=32)
    p.add_argument("--calls", type=int, default=2, help="model calls per episode")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens per call")
    p.add_argument("--repeats", type=int, default=3)
    return p.parse_args()


def main():
    args = parse_args()
    import tempfile

    import openai
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidyrl.engines import SamplingSettings
    from tidyrl.engines.builtin import BuiltinEngine
    from tidyrl.environments import EnvironmentPool
    from tidyrl.rollouts.agents import check_agent, run_agent_episodes
    from tidyrl.rollouts.episodes import EpisodeSettings

    folder = args.model
    if folder is None:
        from tidyrl.models.tiny import save_tiny_model

        folder = save_tiny_model(tempfile.mkdtemp() + "/model", tokenizer="bytes")
    model, tok = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    engine = BuiltinEngine(model)
    http = openai.DefaultHttpxClient()

    def agent(base_url, row):
        client = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0, http_client=http)
        messages = [{"role": "user", "content": row["prompt"]}]
        for _ in range(args.calls):
            reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=args.new_tokens)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        return 0.0

    rows = [{"prompt": f"Tell me about the number {i}."} for i in range(args.episodes)]
    eos = [tok.eos_token_id]
    sampling = SamplingSettings(max_new_tokens=args.calls * (args.new_tokens + 16), eos_ids=eos,
                                pad_id=tok.pad_token_id, batch_size=args.episodes)
    settings = EpisodeSettings(sampling, max_turns=args.calls, max_turn_tokens=args.new_tokens)
    key = lambda i, t: 1000 * i + t  # noqa: E731
    pool = EnvironmentPool(timeout_s=60, workers=args.episodes)
    recorded = []
    generate = engine.generate

    def recording(prompts, keys, s):  # the endpoint's engine calls: their contexts and keys, replayed directly
        recorded.append((list(map(list, prompts)), list(keys), s))
        return generate(prompts, keys, s)

    def through_endpoint():
        engine.generate = recording
        try:
            return run_agent_episodes(check_agent(agent, "bench"), engine, tok, settings, rows,
                                      [r["prompt"] for r in rows], [0] * len(rows), key, pool)
        finally:
            engine.generate = generate

    made = through_endpoint()  # (warm-up; the contexts to replay)
    calls = list(recorded)
    direct_tokens = []

    def direct():
        direct_tokens.clear()
        for prompts, keys, s in calls:
            ids, mask, *_ = generate(prompts, keys, s)
            direct_tokens.extend(ids[r, :int(mask[r].sum())].tolist() for r in range(len(prompts)))

    times = {"direct": [], "endpoint": []}
    for _ in range(args.repeats):
        for name, fn in (("direct", direct), ("endpoint", through_endpoint)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    pool.close()
    sampled = sorted(tuple(c.ids[i:j]) for c in made for i, j in _turns(c.action))
    same = sampled == sorted(map(tuple, direct_tokens))
    n_calls = sum(len(p) for p, _, _ in calls)
    d, e = statistics.median(times["direct"]), statistics.median(times["endpoint"])
    print(f"model {folder}, {args.episodes} episodes x {args.calls} calls of up to {args.new_tokens} tokens "
          f"({n_calls} calls in {len(calls)} engine batches), median of {args.repeats}")
    print(f"direct      {d:.3f} s")
    print(f"endpoint    {e:.3f} s")
    print(f"ratio       {e / d:.2f}x (endpoint / direct)")
    print(f"overhead    {1000 * (e - d) / n_calls:.2f} ms a call")
    print(f"same tokens {same}")


def _turns(action):
    """(start, stop) of each run of 1s in `action`: a call's sampled tokens."""
    runs, start = [], None
    for i, a in enumerate(list(action) + [0]):
        if a and start is None:
            start = i
        elif not a and start is not None:
            runs.append((start, i))
            start = None
    return runs


if __name__ == "__main__":
    main()

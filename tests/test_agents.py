"""Agents trained unchanged: the OpenAI-compatible endpoint (the real `openai` client against it), an episode
assembled from the sampled tokens (never re-tokenised) across tool calls, edited histories as new segments, a
crashing, hanging or over-long agent ending its episode and never the run, batching-independent samples, resume."""

from __future__ import annotations

import json
import re
import textwrap

import pytest
import torch
from conftest import read_jsonl

import tidyrl
from tidyrl.engines import SamplingSettings
from tidyrl.engines.builtin import CAPABILITIES
from tidyrl.environments import EnvironmentPool
from tidyrl.models.tiny import IM_END, build_bytes_tokenizer, save_tiny_model
from tidyrl.rollouts.agents import agent_reward, check_agent, new_message_ids, run_agent_episodes, template_message
from tidyrl.rollouts.endpoint import ApiError, Endpoint
from tidyrl.rollouts.episodes import EpisodeSettings, as_episodes

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]

AGENTS = textwrap.dedent('''
    import json, time
    import openai

    TOOLS = %s

    def solve(base_url, row, seed):
        """A calculator agent: the model may call multiply; its answer is right when it holds the product."""
        client = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0)
        messages = [{"role": "user", "content": row["prompt"]}]
        for _ in range(4):
            reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                                   stream=row.get("stream", False))
            if row.get("stream"):
                content, calls = "", {}
                for chunk in reply:
                    for choice in chunk.choices:
                        content += choice.delta.content or ""
                        for call in choice.delta.tool_calls or ():
                            calls[call.index] = call
                message = {"role": "assistant", "content": content or None}
                if calls:
                    message["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                        "name": c.function.name, "arguments": c.function.arguments}} for c in calls.values()]
            else:
                message = reply.choices[0].message.model_dump(exclude_none=True)
            messages.append(message)
            if not message.get("tool_calls"):
                return float(str(row["answer"]) in (message.get("content") or ""))
            if row.get("edit"):  # an agent that rewrites its history: the model's turn becomes a summary
                messages[-1] = {"role": "assistant", "content": "I called the tool."}
            for call in message["tool_calls"]:
                args = json.loads(call["function"]["arguments"])
                messages.append({"role": "tool", "tool_call_id": call["id"],
                                 "content": json.dumps({"result": args["a"] * args["b"]})})
        return 0.0

    def crashes(base_url, row):
        if row["answer"] == 12:
            raise ValueError("the agent broke on " + row["prompt"])
        return solve(base_url, row, 0)

    def hangs(base_url, row):
        if row["answer"] == 12:
            time.sleep(4)
        return solve(base_url, row, 0)

    def terms(base_url, row):
        return {"right": solve(base_url, row, 0), "format": 0.25}

    def needs(base_url, budget):
        return 0.0

    def chat(base_url, prompt):
        """Two calls without tools: the prompt, then "go on"; 1.0 when the second answer holds an 'a'."""
        client = openai.OpenAI(base_url=base_url, api_key="-", max_retries=0)
        messages = [{"role": "user", "content": prompt}]
        for _ in range(2):
            reply = client.chat.completions.create(model="policy", messages=messages, max_tokens=4)
            messages += [reply.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "go on"}]
        return float("a" in (messages[-2].get("content") or ""))
''' % json.dumps(TOOLS))


@pytest.fixture(scope="module")
def tok():
    return build_bytes_tokenizer()


class ScriptedEngine:
    """An engine that answers a question with a multiply tool call, then a tool result with its number, each turn
    ended by <|im_end|>, with log-probs keyed by the sample key; it records every call (context, sampled, key)."""

    name = "scripted"
    capabilities = CAPABILITIES

    def __init__(self, tok):
        self.tok, self.calls, self.batches = tok, [], []

    def sync(self, policy) -> float:
        return 0.0

    def release(self) -> None:
        pass

    def turn(self, context: str) -> str:
        result = re.findall(r'\{"result": (\d+)\}', context)
        if result:
            return f"The answer is {result[-1]}."
        a, b = re.findall(r"What is (\d+) times (\d+)\?", context)[-1]
        return '<tool_call>\n{"name": "multiply", "arguments": {"a": %s, "b": %s}}\n</tool_call>' % (a, b)

    def generate(self, prompts, sample_keys, settings):
        rows = []
        for prompt, key in zip(prompts, sample_keys):
            ids = self.tok(self.turn(self.tok.decode(prompt)), add_special_tokens=False)["input_ids"]
            ids = (ids + [self.tok.eos_token_id])[:settings.max_new_tokens]
            logprobs = [-((key + j) % 1000 + 1) / 1000 for j in range(len(ids))]
            self.calls.append((list(prompt), ids, logprobs, key))
            rows.append((ids, logprobs, ids[-1] != self.tok.eos_token_id))
        self.batches.append(len(prompts))
        width = max(len(r[0]) for r in rows)
        ids = torch.full((len(rows), width), settings.pad_id)
        mask, logprobs = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
        for i, (row, lp, _) in enumerate(rows):
            ids[i, :len(row)], mask[i, :len(row)], logprobs[i, :len(row)] = torch.tensor(row), 1, torch.tensor(lp)
        return ids, mask, torch.tensor([r[2] for r in rows]), logprobs


@pytest.fixture
def patient(monkeypatch):
    """A batch goes only when every agent that can run waits (no time window): batch sizes that do not depend on
    how fast a loaded machine runs the agents' threads."""
    from tidyrl.rollouts import agents

    monkeypatch.setattr(agents, "QUIET_S", 30.0)
    monkeypatch.setattr(agents, "MAX_WAIT_S", 30.0)


def settings_of(tok, budget=200, max_turns=4) -> EpisodeSettings:
    sampling = SamplingSettings(max_new_tokens=budget, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id)
    return EpisodeSettings(sampling, max_turns=max_turns, max_turn_tokens=budget)


def agent_module(tmp_path):
    path = tmp_path / "agents.py"
    path.write_text(AGENTS)
    import importlib.util

    spec = importlib.util.spec_from_file_location("test_agents_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows_of(pairs, **extra):
    return [{"prompt": f"What is {a} times {b}?", "answer": a * b, **extra} for a, b in pairs]


def run_round(tok, engine, fn, rows, pool, budget=200, max_turns=4):
    return run_agent_episodes(check_agent(fn, "agent"), engine, tok, settings_of(tok, budget, max_turns), rows,
                              [r["prompt"] for r in rows], [7] * len(rows), lambda i, t: 1000 * i + t, pool)


def test_every_trained_token_is_one_the_engine_sampled_with_its_logprob_across_tool_calls(tok, tmp_path, patient):
    """Three episodes of a tool-calling agent, streamed and not: each row is the first call's prompt, then per
    call the sampled tokens verbatim (action 1, the sampler's log-probs) and the template's text for the tool
    result (action 0); each call's context is the row so far, token for token."""
    agents, engine = agent_module(tmp_path), ScriptedEngine(tok)
    pool = EnvironmentPool(timeout_s=10, workers=4)
    try:
        rows = rows_of([(3, 4), (5, 6)]) + rows_of([(7, 8)], stream=True)
        conversations = run_round(tok, engine, agents.solve, rows, pool)
    finally:
        pool.close()
    episodes = as_episodes(conversations, 200, tok.pad_token_id, multi_turn=True, agent=True)
    assert episodes.rewards["env"].tolist() == [1.0, 1.0, 1.0]
    assert episodes.turns.tolist() == [2.0, 2.0, 2.0] and episodes.segments.tolist() == [1.0, 1.0, 1.0]
    assert engine.batches == [3, 3]  # every running agent waiting: one engine call per round of calls
    for i, c in enumerate(conversations):
        mine = [call for call in engine.calls if call[3] // 1000 == i]
        assert [call[3] for call in mine] == [1000 * i, 1000 * i + 1]  # keyed (episode, call index)
        n = len(c.ids)
        row_ids, action = episodes.completion_ids[i, :n], episodes.action_mask[i, :n].bool()
        assert row_ids[action].tolist() == sum((call[1] for call in mine), [])
        assert episodes.sampled_logprobs[i, :n][action].tolist() == pytest.approx(sum((call[2] for call in mine), []))
        assert (episodes.sampled_logprobs[i, :n][~action] == 0).all()
        for context, sampled, _, _ in mine:  # what the model saw is the row's prefix
            assert context == c.prompt_ids + c.ids[:len(context) - len(c.prompt_ids)]
        prompt = tok.apply_chat_template([{"role": "user", "content": rows[i]["prompt"]}], tools=TOOLS,
                                         tokenize=False, add_generation_prompt=True)
        assert c.prompt_ids == tok(prompt, add_special_tokens=False)["input_ids"]
        a, b = re.findall(r"\d+", rows[i]["prompt"])
        env_text = tok.decode(row_ids[~action].tolist())
        assert env_text == ("\n<|im_start|>user\n<tool_response>\n" + json.dumps({"result": int(a) * int(b)})
                            + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
        assert tok.decode(c.ids) == (
            '<tool_call>\n{"name": "multiply", "arguments": {"a": %s, "b": %s}}\n</tool_call>' % (a, b) + IM_END
            + env_text + f"The answer is {int(a) * int(b)}." + IM_END)


def test_an_agent_that_edits_its_history_starts_a_new_segment_and_the_row_is_its_first(tok, tmp_path):
    agents, engine = agent_module(tmp_path), ScriptedEngine(tok)
    pool = EnvironmentPool(timeout_s=10, workers=4)
    try:
        conversations = run_round(tok, engine, agents.solve, rows_of([(3, 4)], edit=True) + rows_of([(5, 6)]), pool)
    finally:
        pool.close()
    episodes = as_episodes(conversations, 200, tok.pad_token_id, multi_turn=True, agent=True)
    assert episodes.segments.tolist() == [2.0, 1.0] and episodes.turns.tolist() == [2.0, 2.0]
    edited = conversations[0]
    first_call = [call for call in engine.calls if call[3] == 0][0]
    assert edited.ids == first_call[1] and edited.action == [1] * len(first_call[1])  # the first segment alone
    second = [call for call in engine.calls if call[3] == 1][0]  # its own prompt: the edited history rendered
    assert "I called the tool." in tok.decode(second[0])


def test_the_endpoint_speaks_openai_to_the_real_client(tok):
    """GET /models, a completion, the API key as the episode's key, OpenAI's error bodies for an unknown episode
    and a bad request."""
    class Echo:
        def call(self, request):
            if request.get("n") == 3:
                raise ApiError(400, "n must be 1")
            return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "policy",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "logprobs": None,
                                 "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}

    endpoint = Endpoint("policy")
    try:
        endpoint.open("k1", Echo())
        client = openai.OpenAI(base_url=endpoint.base_url("k1"), api_key="-", max_retries=0)
        assert [m.id for m in client.models.list()] == ["policy"]
        reply = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        assert reply.choices[0].message.content == "hi" and reply.usage.total_tokens == 4
        by_key = openai.OpenAI(base_url=f"http://127.0.0.1:{endpoint.port}/v1", api_key="k1", max_retries=0)
        assert by_key.chat.completions.create(model="p", messages=[]).choices[0].finish_reason == "stop"
        with pytest.raises(openai.APIStatusError, match="n must be 1") as err:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}], n=3)
        assert err.value.status_code == 400
        endpoint.shut("k1")
        with pytest.raises(openai.APIStatusError, match="no open episode") as err:
            client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
        assert err.value.status_code == 410
    finally:
        endpoint.close()


def test_new_message_ids_are_the_template_text_after_the_sampled_turn_less_its_stop_token(tok):
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 3, "b": 4}}}
    messages = [{"role": "user", "content": "What is 3 times 4?"}, {"role": "assistant", "content": "", "tool_calls":
                                                                     [call]}]
    tool = {"role": "tool", "content": '{"result": 12}'}
    ids = new_message_ids(tok, messages, [tool], IM_END, TOOLS)
    assert tok.decode(ids) == ("\n<|im_start|>user\n<tool_response>\n{\"result\": 12}\n</tool_response><|im_end|>\n"
                               "<|im_start|>assistant\n")
    # a turn cut by the token limit (no stop token sampled): the template's end of turn comes first
    assert tok.decode(new_message_ids(tok, messages, [tool], "", TOOLS)).startswith("<|im_end|>\n<|im_start|>user")
    # the openai client's form of a message compares equal to tidyrl's own record of it
    sent = {"role": "assistant", "content": None, "tool_calls": [{"id": "call_x", "type": "function", "function": {
        "name": "multiply", "arguments": '{"a": 3, "b": 4}'}}]}
    assert template_message(sent) == messages[1]
    assert agent_reward({"right": 1.0, "format": 0.25}) == 1.25 and agent_reward(None) == 0.0
    with pytest.raises(Exception, match="not numbers"):
        agent_reward({"right": "yes"})


def test_samples_do_not_depend_on_how_calls_were_batched(tok, tmp_path, patient):
    """The same agents one at a time (one worker) and all at once: the same episodes, token for token."""
    agents = agent_module(tmp_path)
    made = []
    for workers in (1, 4):
        engine = ScriptedEngine(tok)
        pool = EnvironmentPool(timeout_s=10, workers=workers)
        try:
            made.append((run_round(tok, engine, agents.solve, rows_of([(3, 4), (5, 6), (7, 8)]), pool), engine))
        finally:
            pool.close()
    (one, engine_one), (all_at_once, engine_all) = made
    assert max(engine_one.batches) == 1 and max(engine_all.batches) == 3
    assert [(c.prompt_ids, c.ids, c.logprobs) for c in one] == [(c.prompt_ids, c.ids, c.logprobs)
                                                                for c in all_at_once]


def test_a_crashing_hanging_or_overlong_agent_ends_its_episode_not_the_round(tok, tmp_path):
    agents = agent_module(tmp_path)
    rows = rows_of([(3, 4), (5, 6)])
    pool = EnvironmentPool(timeout_s=1.0, workers=4)
    try:
        crashed = run_round(tok, ScriptedEngine(tok), agents.crashes, rows, pool)
        hung = run_round(tok, ScriptedEngine(tok), agents.hangs, rows, pool)
        out_of_turns = run_round(tok, ScriptedEngine(tok), agents.solve, rows, pool, max_turns=1)
        out_of_tokens = run_round(tok, ScriptedEngine(tok), agents.solve, rows, pool, budget=40)
        terms = run_round(tok, ScriptedEngine(tok), agents.terms, rows[1:], pool)
    finally:
        pool.close()
    assert "ValueError: the agent broke on What is 3 times 4?" in crashed[0].error
    assert "Traceback" in crashed[0].error and crashed[1].error is None and crashed[1].reward == 1.0
    assert "no call and did not return for 1.0 s" in hung[0].error and hung[1].reward == 1.0
    for c in out_of_turns + out_of_tokens:  # the refused call raised in the agent: truncated, not an error
        assert c.truncated and c.error is None and c.reward == 0.0
    assert out_of_turns[0].turns == 1
    assert terms[0].reward == 1.25
    one_worker = EnvironmentPool(timeout_s=1.0, workers=1)  # the hung agent holds the only worker
    try:
        starved = run_round(tok, ScriptedEngine(tok), agents.hangs, rows, one_worker)
    finally:
        one_worker.close()
    assert "no call and did not return" in starved[0].error and "no free environment worker" in starved[1].error


def test_config_refuses_an_agent_beside_an_environment_and_unknown_arguments(tmp_path, tiny_model_dir, prompt_file):
    from tidyrl.config import ConfigError

    agent_module(tmp_path)
    base = {"algorithm": "grpo", "model": str(tiny_model_dir), "output_dir": str(tmp_path / "out"),
            "data": {"path": str(prompt_file)}, "train": {"rollouts": 1}}
    with pytest.raises(ConfigError, match="environment.factory or environment.agent, not both"):
        tidyrl.train(base | {"environment": {"agent": f"{tmp_path}/agents.py:solve",
                                             "factory": f"{tmp_path}/agents.py:solve"}})
    with pytest.raises(ConfigError, match=r"requires argument\(s\) \['budget'\]"):
        tidyrl.train(base | {"environment": {"agent": f"{tmp_path}/agents.py:needs"}})


@pytest.fixture(scope="module")
def bytes_model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("bytes") / "model", tokenizer="bytes")


def agent_config(model, tmp_path, out, rollouts=2) -> dict:
    rows = rows_of([(3, 4), (5, 6), (7, 8), (9, 2)])
    data = tmp_path / "tasks.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    agent_module(tmp_path)
    return {"algorithm": "grpo", "model": str(model), "output_dir": str(out), "seed": 3, "data": {"path": str(data)},
            "environment": {"agent": f"{tmp_path}/agents.py:solve", "max_turns": 3},
            "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 2, "max_new_tokens": 48},
            "train": {"rollouts": rollouts, "micro_batch_size": 2, "learning_rate": 1e-3},
            "log": {"progress_bar": False, "samples_per_rollout": 4, "save_every": 1}}


def test_grpo_trains_an_agent_and_a_resumed_run_makes_the_same_episodes(bytes_model, tmp_path):
    """The built-in engine behind the endpoint: the run writes the agent's metrics; resumed from its first
    checkpoint, it makes the same episodes and the same weights."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    cfg = agent_config(bytes_model, tmp_path, out)
    tidyrl.train(cfg)
    metrics, samples = read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "samples.jsonl")
    weights = load_file(out / "final" / "model.safetensors")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["agent/segments_mean"] == 1.0 and m["env/error_fraction"] == 0.0 and m["turns_mean"] >= 1
               for m in metrics)
    assert len(samples) == 8 and all(s["prompt"].startswith("What is") for s in samples)
    tidyrl.train(cfg, ["resume_from=" + str(out / "checkpoint-1")])
    timing = ("time_s", "time/generate_s", "time/reward_s", "time/score_s", "time/update_s")
    drop = lambda rs: [{k: v for k, v in r.items() if k not in timing} for r in rs]  # noqa: E731
    assert drop(read_jsonl(out / "metrics.jsonl")) == drop(metrics)
    assert read_jsonl(out / "samples.jsonl") == samples
    resumed = load_file(out / "final" / "model.safetensors")
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)


def test_a_crashing_agent_s_traceback_is_in_samples_and_the_run_goes_on(bytes_model, tmp_path, capsys):
    out = tmp_path / "run"
    cfg = agent_config(bytes_model, tmp_path, out, rollouts=1)
    cfg["environment"] |= {"agent": f"{tmp_path}/agents.py:crashes", "error_reward": -1.0}
    cfg["log"]["samples_per_rollout"] = 1
    cfg["rollout"]["prompts_per_rollout"] = 4  # every row: (3, 4)'s agent raises
    tidyrl.train(cfg)
    failed = [s for s in read_jsonl(out / "samples.jsonl") if "error" in s]
    assert failed and all(s["prompt"] == "What is 3 times 4?" and s["reward"] == -1.0 for s in failed)
    first, _, trace = failed[0]["error"].partition("\n")
    assert first == "agent: raised ValueError: the agent broke on What is 3 times 4? (episode of prompt " \
                    "'What is 3 times 4?')"
    assert trace.startswith("Traceback (most recent call last):") and 'in crashes' in trace
    said = capsys.readouterr().out
    assert "ended on an environment error, e.g. agent: raised ValueError" in said and "Traceback" not in said
    assert read_jsonl(out / "metrics.jsonl")[0]["env/error_fraction"] > 0


def test_tools_that_the_chat_template_would_drop_are_refused(tiny_model_and_tokenizer, tmp_path):
    """The character tokenizer's template has no tool section: a call with tools is answered 400 (the agent's
    openai client raises; its episode fails with that message), never served as if the model saw them."""
    agents = agent_module(tmp_path)
    _, char_tok = tiny_model_and_tokenizer
    pool = EnvironmentPool(timeout_s=10, workers=2)
    try:
        made = run_round(char_tok, ScriptedEngine(char_tok), agents.solve, rows_of([(3, 4)]), pool)
    finally:
        pool.close()
    assert "the model's chat template ignores `tools` (no tool section)" in made[0].error and made[0].turns == 0


def test_a_lagged_agent_run_makes_its_rollouts_ahead_and_resumes_exactly(bytes_model, tmp_path):
    """rollout.lag = 1: the agents of rollout 2 run on the lag's thread, beside the update, through the same
    endpoint; the checkpoint holds the rollout made ahead, and the resumed run ends as the uninterrupted one."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    cfg = agent_config(bytes_model, tmp_path, out, rollouts=3)
    cfg["rollout"]["lag"] = 1
    tidyrl.train(cfg)
    metrics, samples = read_jsonl(out / "metrics.jsonl"), read_jsonl(out / "samples.jsonl")
    weights = load_file(out / "final" / "model.safetensors")
    assert [m["step"] for m in metrics] == [1, 2, 3] and all(m["env/error_fraction"] == 0.0 for m in metrics)
    tidyrl.train(cfg, ["resume_from=" + str(out / "checkpoint-1")])
    assert read_jsonl(out / "samples.jsonl") == samples
    resumed = load_file(out / "final" / "model.safetensors")
    assert all(torch.equal(weights[k], resumed[k]) for k in weights)

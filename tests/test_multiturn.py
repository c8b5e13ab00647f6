"""Multi-turn rollouts: the trajectory is the exact token sequence (no re-tokenisation), environment tokens carry
no loss, keyed conversations replay, a failing environment ends its episode and never the run, tools."""

from __future__ import annotations

import importlib
import json
import textwrap

import pytest
import torch
from conftest import read_jsonl

import tidyrl
from tidyrl.environments import EnvironmentPool, EnvReply, ToolEnvironment, parse_tool_calls
from tidyrl.engines import SamplingSettings
from tidyrl.engines.builtin import BuiltinEngine
from tidyrl.rollouts.episodes import (Conversation, EpisodeSettings, as_episodes, build_environments,
                                      environment_message_ids, run_episodes)

ENVS = textwrap.dedent('''
    import time
    from tidyrl.environments import EnvReply

    class Counter:
        """Three model turns; each turn holding the letter 'a' earns 1."""
        def __init__(self, row, seed):
            self.word, self.turns, self.seed = row["word"], 0, seed

        def step(self, turn, messages):
            self.turns += 1
            reward = 1.0 if "a" in turn else 0.0
            if self.turns >= 3:
                return EnvReply(reward=reward, done=True)
            return EnvReply(message={"role": "user", "content": "again " + self.word}, reward=reward)

    class Broken:
        def __init__(self, row, seed):
            self.word = row["word"]
            if self.word == "date":
                raise RuntimeError("cannot build")

        def step(self, turn, messages):
            if self.word == "fig":
                raise ValueError("boom")
            if self.word == "kiwi":
                time.sleep(3)
            if self.word == "lime":
                return "not a reply"
            return EnvReply(reward=0.5, done=True)
''')


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "envs.py"
    path.write_text(ENVS)
    return path


def load_class(path, name):
    from tidyrl.rewards import load_reward_function

    return load_reward_function(f"{path}:{name}")


def test_conversations_become_padded_tensors_row_by_row():
    """as_episodes: each conversation's ids, log-probs and action flags at its first positions, the pad after, the
    mask 1 where written (an empty conversation and one at the full budget included)."""
    convs = [Conversation(ids=[5, 6, 7], action=[1, 0, 1], logprobs=[-0.5, 0.0, -1.25], reward=1.0, turns=2),
             Conversation(ids=[], truncated=False, error="constructor failed", reward=-1.0),
             Conversation(ids=[9, 8, 7, 6], action=[1, 1, 1, 1], logprobs=[-0.1, -0.2, -0.3, -0.4], truncated=True,
                          turns=1)]
    e = as_episodes(convs, 4, pad_id=0, multi_turn=True)
    assert e.completion_ids.tolist() == [[5, 6, 7, 0], [0, 0, 0, 0], [9, 8, 7, 6]]
    assert e.completion_mask.tolist() == [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert e.action_mask.tolist() == [[1, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    assert torch.equal(e.sampled_logprobs, torch.tensor([[-0.5, 0.0, -1.25, 0.0], [0.0] * 4, [-0.1, -0.2, -0.3, -0.4]]))
    assert e.completion_ids.dtype == torch.long and e.completion_mask.dtype == e.sampled_logprobs.dtype == torch.float32
    assert e.truncated.tolist() == [False, False, True] and e.rewards["env"].tolist() == [1.0, -1.0, 0.0]
    assert e.turns.tolist() == [2.0, 0.0, 1.0] and e.env_errors.tolist() == [0.0, 1.0, 0.0]
    single = as_episodes(convs[:1], 5, pad_id=3, multi_turn=False)
    assert single.completion_ids.tolist() == [[5, 6, 7, 3, 3]] and single.action_mask is None
    with pytest.raises(RuntimeError):  # a conversation past the budget is a bug upstream, never cut silently
        as_episodes(convs, 3, pad_id=0, multi_turn=False)


def test_an_environment_message_is_the_template_text_after_the_models_turn(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    messages = [{"role": "user", "content": "apple:"}]
    prompt = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    turn = tok("elppa", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # as sampled: EOS ends it
    text = tok.decode(turn, skip_special_tokens=True)
    messages = messages + [{"role": "assistant", "content": text}]
    reply = {"role": "user", "content": "again"}
    extra = environment_message_ids(tok, messages, text, tok.decode(turn, skip_special_tokens=False), reply)
    assert tok.decode(extra) == "\n<user>again\n<assistant>"
    # Prompt + the model's tokens + the message's: the template's text of the whole conversation, with the
    # model's own EOS where it stopped; nothing before the message was re-encoded.
    rendered = tok.apply_chat_template(messages + [reply], tokenize=False, add_generation_prompt=True)
    assert tok.decode(prompt + turn + extra, skip_special_tokens=False) == \
        rendered.replace("elppa\n", "elppa" + tok.eos_token + "\n")


def test_conversations_alternate_keep_the_budget_and_replay_from_their_keys(tiny_model_and_tokenizer, env_file):
    model, tok = tiny_model_and_tokenizer
    Counter = load_class(env_file, "Counter")
    words = ["apple", "fig", "kiwi"]
    messages = [[{"role": "user", "content": w + ":"}] for w in words]
    prompts = [tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for m in messages]
    pool = EnvironmentPool(timeout_s=10)

    def run(budget):
        envs = build_environments(Counter, [{"word": w} for w in words], [1, 2, 3], pool)
        settings = EpisodeSettings(SamplingSettings(max_new_tokens=budget, eos_ids=[tok.eos_token_id],
                                                    pad_id=tok.pad_token_id, batch_size=8),
                                   max_turns=3, max_turn_tokens=4)
        return run_episodes(BuiltinEngine(model), tok, prompts, settings, sample_key=lambda i, t: 100 * i + t,
                            environments=envs, messages=messages, pool=pool, env_names=["Counter"] * 3)

    first, again = run(120), run(120)
    for c, d in zip(first, again):
        assert (c.ids, c.action, c.reward, c.turns) == (d.ids, d.action, d.reward, d.turns)  # keyed: same
        assert len(c.ids) == len(c.action) == len(c.logprobs) <= 120 and c.turns == 3 and not c.truncated
        # The environment's tokens are exactly its messages (rendered), between the model's turns.
        env_text = tok.decode([t for t, a in zip(c.ids, c.action) if a == 0])
        assert env_text.count("<user>again ") == 2
        model_turns = [m["content"] for m in c.messages if m["role"] == "assistant"]
        assert c.reward == sum("a" in turn for turn in model_turns)
        assert all(lp == 0.0 for lp, a in zip(c.logprobs, c.action) if a == 0)
        assert any(lp < 0 for lp, a in zip(c.logprobs, c.action) if a == 1)
    short = run(10)  # the budget bounds model and environment tokens together
    assert all(len(c.ids) <= 10 and c.truncated and c.turns < 3 for c in short)
    pool.close()


def multiturn_config(model_dir, prompt_file, out, factory, **environment):
    return {
        "algorithm": "grpo", "model": str(model_dir), "output_dir": str(out), "seed": 2,
        "data": {"path": str(prompt_file)},
        "environment": {"factory": factory, "max_turns": 3, "max_turn_tokens": 4, **environment},
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 3, "max_new_tokens": 100},
        "train": {"rollouts": 2, "epochs_per_rollout": 2, "micro_batch_size": 3, "learning_rate": 1e-2},
        "log": {"progress_bar": False, "samples_per_rollout": 6},
    }


def test_a_grpo_run_trains_on_model_tokens_only(tiny_model_dir, prompt_file, env_file, tmp_path, monkeypatch):
    from tidyrl.loops.rl import update as rl_update

    seen = []
    real = rl_update.loss_mask

    def spy(completion_mask, truncated, action_mask, mask_truncated):
        mask = real(completion_mask, truncated, action_mask, mask_truncated)
        if action_mask is not None:
            seen.append((mask, completion_mask, action_mask))
        return mask

    monkeypatch.setattr(rl_update, "loss_mask", spy)
    result = tidyrl.train(multiturn_config(tiny_model_dir, prompt_file, tmp_path / "run", f"{env_file}:Counter"))
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert len(rows) == result.plan.total_optimizer_steps == 4
    for row in rows:
        assert row["turns_mean"] == 3.0 and row["env/error_fraction"] == 0.0
        assert row["tokens/env_mean"] > 0 and row["tokens/model_mean"] > 0
        assert row["reward_mean"] == pytest.approx(row["reward/env"])
    # The loss covered exactly the model's tokens: the environment's were in the sequence, not in the loss.
    assert seen and all(torch.equal(mask, completion_mask * action_mask) for mask, completion_mask, action_mask in seen)
    assert any(bool(((completion_mask > 0) & (action_mask == 0)).any()) for _, completion_mask, action_mask in seen)
    samples = read_jsonl(result.output_dir / "samples.jsonl")
    assert "<user>again" in samples[0]["completion"] and samples[0]["rewards"]["env"] is not None

    # A resumed run replays the same conversations.
    cfg = multiturn_config(tiny_model_dir, prompt_file, tmp_path / "saved", f"{env_file}:Counter")
    cfg["log"]["save_every"] = 1
    tidyrl.train(cfg)
    tidyrl.train(cfg, ["resume_from=" + str(tmp_path / "saved" / "checkpoint-3")])
    timing = ("time_s", "time/generate_s", "time/reward_s", "time/score_s", "time/update_s")
    drop = lambda rs: [{k: v for k, v in r.items() if k not in timing} for r in rs]  # noqa: E731
    assert drop(read_jsonl(tmp_path / "saved" / "metrics.jsonl")) == drop(rows)


def test_a_failing_environment_ends_its_episode_not_the_run(tiny_model_dir, prompt_file, env_file, tmp_path,
                                                             capsys):
    cfg = multiturn_config(tiny_model_dir, prompt_file, tmp_path / "run", f"{env_file}:Broken", timeout_s=1,
                           error_reward=-1.0)
    cfg["rollout"]["prompts_per_rollout"] = 5
    cfg["train"]["rollouts"] = 2
    result = tidyrl.train(cfg)
    printed = capsys.readouterr().out
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert len(rows) == result.plan.total_optimizer_steps
    samples = read_jsonl(result.output_dir / "samples.jsonl")
    by_word = {}
    for s in samples:
        by_word.setdefault(s["prompt"], set()).add(s["rewards"]["env"])
    for word in ("fig:", "kiwi:", "lime:", "date:"):
        if word in by_word:
            assert by_word[word] == {-1.0}, word  # raised, timed out, wrong type, constructor failed
    assert any(w in by_word for w in ("fig:", "kiwi:", "lime:", "date:"))
    assert any(r["env/error_fraction"] > 0 for r in rows)
    assert "ended on an environment error" in printed and "(episode of prompt '" in printed
    for word in ("apple:", "pear:", "plum:"):
        if word in by_word:
            assert by_word[word] == {0.5}


def test_evaluation_during_training_runs_the_environment_too(tiny_model_dir, prompt_file, env_file, tmp_path):
    """The held-out prompts take the one rollout path: episodes with the environment, keyed (seed, EVAL_SLOT,
    "e.t"), their reward the environment's (weight 1) plus the functions'. Counter pays 1 for each of its three
    turns holding an 'a': eval/reward/env is a mean of such counts, and eval/reward_mean equals it here (no
    reward functions)."""
    cfg = multiturn_config(tiny_model_dir, prompt_file, tmp_path / "run", f"{env_file}:Counter")
    cfg["data"]["eval_fraction"] = 0.2
    cfg["log"].update({"eval_every": 2, "eval_decoding": "sampled"})
    result = tidyrl.train(cfg)
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    evaluated = [r for r in rows if "eval/reward_mean" in r]
    assert [r["step"] for r in evaluated] == [2, 4]
    for row in evaluated:
        assert row["eval/reward_mean"] == pytest.approx(row["eval/reward/env"])
        assert 0.0 <= row["eval/reward/env"] <= 3.0 and row["eval/completion_length_mean"] > 0
        # 2 held-out prompts x 3 samples of Counter's three turns: a mean of integers over 6 episodes
        assert (row["eval/reward/env"] * 6) == pytest.approx(round(row["eval/reward/env"] * 6))
    again = tidyrl.train({**cfg, "output_dir": str(tmp_path / "again")})  # keyed: the same evaluations
    assert [r["eval/reward_mean"] for r in read_jsonl(again.output_dir / "metrics.jsonl") if "eval/reward_mean" in r] \
        == [r["eval/reward_mean"] for r in evaluated]


def test_environment_settings_are_checked_before_any_model_loads(tiny_model_dir, tmp_path, prompt_file):
    from tidyrl.config import ConfigError, load_config
    from tidyrl.rewards import RewardError

    with pytest.raises(ConfigError, match="environment.max_turns: must be >= 1.*\n.*environment.max_error_fraction"):
        load_config({"algorithm": "ppo", "model": "m", "data": {"path": "p.jsonl", "eval_fraction": 0.1},
                     "train": {"rollouts": 1},
                     "environment": {"factory": "envs.py:Counter", "max_turns": 0, "max_error_fraction": 1.5}})
    with pytest.raises(RewardError, match="environment.factory"):
        tidyrl.train(multiturn_config(tiny_model_dir, prompt_file, tmp_path / "out",
                                      f"{tmp_path / 'missing.py'}:Counter"))
    assert not (tmp_path / "out").exists()


class Calculator(ToolEnvironment):
    @staticmethod
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first number
            b: the second number
        """
        return a + b

    tools = (add,)

    def reward(self, messages):
        return 1.0 if messages[-1]["content"].strip() == str(self.row["answer"]) else 0.0


def test_tool_calls_are_parsed_run_and_answered():
    assert parse_tool_calls('x <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>') == [
        {"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": "{\\"a\\": 1}"}</tool_call>') == [
        {"name": "add", "arguments": {"a": 1}}]
    assert parse_tool_calls("<tool_call>{oops}</tool_call>")[0]["error"].startswith("the tool call is not JSON")
    assert parse_tool_calls("no call") == []
    env = Calculator({"answer": 5}, seed=0)
    reply = env.step('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>', [])
    assert reply.message == {"role": "tool", "content": json.dumps({"name": "add", "result": 5})} and not reply.done
    unknown = env.step('<tool_call>{"name": "mul", "arguments": {}}</tool_call>', [])
    assert "unknown tool 'mul'" in unknown.message["content"]
    bad_args = env.step('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', [])
    assert "TypeError" in bad_args.message["content"]
    # A call opened and never closed (cut by max_turn_tokens, say) is a malformed call, answered: not the answer.
    assert parse_tool_calls('<tool_call>{"name": "add", "argu') == [
        {"error": 'a <tool_call> is not closed with </tool_call>; write the whole call: '
                  '<tool_call>{"name": ..., "arguments": {...}}</tool_call>'}]
    cut = env.step('<tool_call>{"name": "add", "argu', [])
    assert not cut.done and "is not closed" in cut.message["content"] and cut.message["role"] == "tool"
    final = env.step("5", [{"role": "assistant", "content": "5"}])
    assert final == EnvReply(reward=1.0, done=True)

    class Insisting(Calculator):
        no_call = "remind"

    reminded = Insisting({"answer": 5}, seed=0).step("I think 5", [])
    assert reminded == EnvReply(message={"role": "user", "content": "Call one of the tools: add."})
    schema = Calculator.tool_schemas()[0]
    assert schema["function"]["name"] == "add" and set(schema["function"]["parameters"]["properties"]) == {"a", "b"}


@pytest.mark.slow
def test_the_calculator_example_learns(tmp_path):
    """examples/multiturn/run.sh at full size: GRPO against the calculator raises the share of correct final
    answers beyond the noise (3 standard errors of the two means, binomial, 64 episodes a rollout)."""
    import math
    import os
    import subprocess
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "multiturn" / "run.sh"
    done = subprocess.run(["bash", str(example), str(tmp_path / "work")], capture_output=True, text=True,
                          timeout=900, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    assert done.returncode == 0, done.stderr[-3000:]
    rewards = [r["reward/env"] for r in read_jsonl(tmp_path / "work" / "grpo" / "metrics.jsonl")]
    first, last = rewards[:3], rewards[-10:]
    p1, p2 = sum(first) / len(first), sum(last) / len(last)
    se = math.sqrt(p1 * (1 - p1) / (64 * len(first)) + p2 * (1 - p2) / (64 * len(last)))
    assert p2 - p1 > 3 * max(se, 0.01), (first, last)


def test_a_tool_environment_on_a_template_without_tools_is_refused(tiny_model_dir, prompt_file, tmp_path):
    from tidyrl.config import ConfigError

    path = tmp_path / "tool_env.py"
    path.write_text(textwrap.dedent('''
        from tidyrl.environments import ToolEnvironment

        def add(a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: the first number
                b: the second number
            """
            return a + b

        class Calc(ToolEnvironment):
            tools = (add,)
    '''))
    with pytest.raises(ConfigError, match=r"offers tools \(add\), but the model's chat template ignores `tools`"):
        tidyrl.train(multiturn_config(tiny_model_dir, prompt_file, tmp_path / "out", f"{path}:Calc"))
    assert not (tmp_path / "out").exists()


def test_gae_and_returns_run_over_the_models_tokens_only():
    from tidyrl.algorithms import ppo

    # Tokens 0, 1 and 4 are the model's; 2, 3 are an environment message; 5 is padding.
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])
    rewards = torch.tensor([[0.1, 0.2, 9.0, 9.0, 1.0, 9.0]])  # the environment's slots hold junk: never read
    values = torch.tensor([[0.5, 0.4, 7.0, 7.0, 0.3, 7.0]])
    adv, ret = ppo.over_actions(lambda r, v, m: ppo.gae(r, v, m, 0.9, 0.8), mask, rewards, values)
    a_c, r_c = ppo.gae(torch.tensor([[0.1, 0.2, 1.0]]), torch.tensor([[0.5, 0.4, 0.3]]), torch.ones(1, 3), 0.9, 0.8)
    assert torch.allclose(adv, torch.tensor([[a_c[0, 0], a_c[0, 1], 0, 0, a_c[0, 2], 0]]))
    assert torch.allclose(ret, torch.tensor([[r_c[0, 0], r_c[0, 1], 0, 0, r_c[0, 2], 0]]))
    # By hand, gamma = 0.9, lam = 0.8: delta_2 = 1.0 - 0.3 = 0.7; delta_1 = 0.2 + 0.9 * 0.3 - 0.4 = 0.07;
    # A_1 = 0.07 + 0.72 * 0.7 = 0.574 (the next action after token 1 is token 4, across the environment's).
    assert float(adv[0, 1]) == pytest.approx(0.574)
    returns = ppo.over_actions(lambda r, m: ppo.discounted_returns(r, m, 1.0), mask, rewards)
    assert torch.allclose(returns, torch.tensor([[1.3, 1.2, 0.0, 0.0, 1.0, 0.0]]))
    contiguous = torch.tensor([[1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])  # no environment tokens: the plain recursion
    assert torch.equal(ppo.over_actions(lambda r, m: ppo.discounted_returns(r, m, 1.0), contiguous, rewards),
                       ppo.discounted_returns(rewards, contiguous, 1.0))


@pytest.mark.parametrize("algorithm", ["ppo", "reinforce_pp"])
def test_ppo_and_reinforce_pp_train_on_conversations(algorithm, tiny_model_dir, prompt_file, env_file, tmp_path):
    cfg = multiturn_config(tiny_model_dir, prompt_file, tmp_path / algorithm, f"{env_file}:Counter")
    cfg["algorithm"] = algorithm
    result = tidyrl.train(cfg)
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert len(rows) == result.plan.total_optimizer_steps
    assert all(r["turns_mean"] == 3.0 and r["tokens/env_mean"] > 0 for r in rows)
    assert any(r["grad_norm"] > 0 for r in rows)  # (a rollout whose rewards all tie has no gradient)
    if algorithm == "ppo":
        assert all(r["value_loss"] > 0 for r in rows) and (result.final_dir / "critic").is_dir()


OPENENV = textwrap.dedent('''
    from dataclasses import dataclass

    from tidyrl.environments import OpenEnvEnvironment

    # An environment written to OpenEnv's interface (openenv-core's server-side Environment: reset() and
    # step(action) return observations that carry reward and done), without openenv-core installed.
    @dataclass
    class GuessAction:
        guess: str

    @dataclass
    class GuessObservation:
        hint: str
        reward: float = 0.0
        done: bool = False

    @dataclass
    class StepResult:  # what an OpenEnv client returns
        observation: GuessObservation
        reward: float = 0.0
        done: bool = False

    class GuessEnvironment:
        def __init__(self, target, as_client):
            self.target, self.as_client, self.tries = target, as_client, 0

        def reset(self):
            return GuessObservation(hint="guess a letter")

        def step(self, action):
            self.tries += 1
            hit = self.target in action.guess
            obs = GuessObservation(hint="yes" if hit else "no", reward=1.0 if hit else 0.0, done=hit or self.tries >= 2)
            return StepResult(obs, obs.reward, obs.done) if self.as_client else obs

    class Guess(OpenEnvEnvironment):
        def make_env(self, row, seed):
            return GuessEnvironment(row["word"][0], as_client=len(row["word"]) % 2 == 0)

        def to_action(self, turn):
            return GuessAction(guess=turn)

        def to_message(self, observation):
            return observation.hint
''')


def test_an_openenv_environment_runs_through_the_adapter(tiny_model_dir, prompt_file, tmp_path):
    path = tmp_path / "openenv_envs.py"
    path.write_text(OPENENV)
    Guess = load_class(path, "Guess")
    env = Guess({"word": "fig"}, seed=0)  # a server-style environment: observations carry reward and done
    assert env.first_observation.hint == "guess a letter"
    assert env.step("xyz", []) == EnvReply(message={"role": "user", "content": "no"}, reward=0.0)
    assert env.step("f", []) == EnvReply(reward=1.0, done=True)
    client = Guess({"word": "kiwi"}, seed=0)  # a client-style environment: StepResult(observation, reward, done)
    assert client.step("k!", []) == EnvReply(reward=1.0, done=True)
    result = tidyrl.train(multiturn_config(tiny_model_dir, prompt_file, tmp_path / "run", f"{path}:Guess"))
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert all(r["env/error_fraction"] == 0.0 and 1.0 <= r["turns_mean"] <= 2.0 for r in rows)


LIFE_CYCLE = textwrap.dedent('''
    import os
    import threading

    from tidyrl.environments import EnvReply, ToolEnvironment

    EVENTS = []
    LOCK = threading.Lock()


    class Session:
        """Ends after `turns` model turns (1 for 'fig', else 2); 'kiwi' fails in step, 'lime' in close."""

        def __init__(self, row, seed):
            self.word = row["word"]
            with LOCK:
                EVENTS.append(("open", self.word))

        def step(self, turn, messages):
            with LOCK:
                EVENTS.append(("step", self.word))
            if self.word == "kiwi":
                raise ConnectionError("lost the session")
            done = self.word == "fig" or len(messages) >= 4
            return EnvReply(reward=1.0, done=True) if done else EnvReply(message={"role": "user", "content": "more"})

        def close(self):
            with LOCK:
                EVENTS.append(("close", self.word))
            if self.word == "lime":
                raise OSError("the socket was already gone")


    class Files(ToolEnvironment):
        """A tool environment whose episode holds a file open (its tools would read it)."""

        OPENED = []

        def __init__(self, row, seed):
            super().__init__(row, seed)
            self.handle = open(os.devnull)
            Files.OPENED.append(self.handle)

        def close(self):
            self.handle.close()
''')


def test_each_environment_is_closed_once_when_its_episode_ends(tiny_model_and_tokenizer, tmp_path):
    """An episode's end (done, out of turns, failed) closes its environment at once, in the pool, once; what
    close() raises is recorded, not raised."""
    model, tok = tiny_model_and_tokenizer
    path = tmp_path / "life.py"
    path.write_text(LIFE_CYCLE)
    Session = load_class(path, "Session")
    events = importlib.import_module(Session.__module__).EVENTS
    words = ["fig", "pear", "kiwi", "lime"]
    messages = [[{"role": "user", "content": w + ":"}] for w in words]
    prompts = [tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for m in messages]
    pool = EnvironmentPool(timeout_s=10)
    envs = build_environments(Session, [{"word": w} for w in words], [1, 2, 3, 4], pool)
    settings = EpisodeSettings(SamplingSettings(max_new_tokens=60, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id),
                               max_turns=3, max_turn_tokens=4)
    done = run_episodes(BuiltinEngine(model), tok, prompts, settings, sample_key=lambda i, t: 7 * i + t,
                        environments=envs, messages=messages, pool=pool, env_names=["Session"] * 4)
    pool.close()
    closes = [w for kind, w in events if kind == "close"]
    assert sorted(closes) == sorted(words)  # every one, once
    # fig ended (done) and kiwi failed in turn 1: both closed before anyone's second step.
    second_steps = [i for i, e in enumerate(events) if e[0] == "step"][4:]
    assert {w for kind, w in events[:second_steps[0]] if kind == "close"} == {"fig", "kiwi"}
    assert done[2].error and "lost the session" in done[2].error
    assert "OSError: the socket was already gone" in done[3].close_error and done[3].error is None
    assert [c.close_error is None for c in done] == [True, True, True, False]


def test_a_tool_environment_releases_what_its_episode_opened(tiny_model_dir, prompt_file, tmp_path):
    path = tmp_path / "life.py"
    path.write_text(LIFE_CYCLE)
    cfg = multiturn_config(tiny_model_dir, prompt_file, tmp_path / "run", f"{path}:Files")
    cfg["train"]["rollouts"] = 1
    tidyrl.train(cfg)
    from tidyrl.rewards import load_reward_function

    opened = load_reward_function(f"{path}:Files", None).OPENED
    assert len(opened) == 6 and all(handle.closed for handle in opened)  # one per episode, each closed


FLAKY = textwrap.dedent('''
    import os

    from tidyrl.environments import EnvReply


    class Flaky:
        """A server's session: refused while the file TIDYRL_TEST_DOWN names exists."""

        def __init__(self, row, seed):
            if os.path.exists(os.environ["TIDYRL_TEST_DOWN"]):
                raise ConnectionError("Server at capacity: 16/16 sessions active")
            self.word = row["word"]

        def step(self, turn, messages):
            return EnvReply(reward=float("a" in turn), done=True)


    def takes_the_server_down(completions, **kwargs):
        if os.environ.get("TIDYRL_TEST_TAKE_DOWN") == "1":
            open(os.environ["TIDYRL_TEST_DOWN"], "w").close()
        return [0.0] * len(completions)
''')


def test_a_run_whose_episodes_all_fail_stops_with_a_checkpoint_that_resumes_exactly(tiny_model_dir, prompt_file,
                                                                                   tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from tidyrl.checkpoint import complete_checkpoints
    from tidyrl.environments import EnvironmentFailure

    path = tmp_path / "flaky.py"
    path.write_text(FLAKY)
    down = tmp_path / "down"
    monkeypatch.setenv("TIDYRL_TEST_DOWN", str(down))

    def config(out):
        cfg = multiturn_config(tiny_model_dir, prompt_file, tmp_path / out, f"{path}:Flaky")
        cfg["rewards"] = [{"function": f"{path}:takes_the_server_down", "weight": 1.0}]
        cfg["train"].update({"rollouts": 2, "epochs_per_rollout": 1})
        return cfg

    whole = tidyrl.train(config("whole"))
    monkeypatch.setenv("TIDYRL_TEST_TAKE_DOWN", "1")  # the first rollout's rewards take the server down
    with pytest.raises(EnvironmentFailure) as err:
        tidyrl.train(config("stopped"))
    message = str(err.value)
    assert "rollout 2: 100% of the episodes ended on an environment error" in message
    assert "environment.max_error_fraction = 0.5" in message and "Server at capacity" in message
    assert "checkpoint-1" in message and "resume_from=latest" in message
    out = tmp_path / "stopped"
    assert [s for s, _ in complete_checkpoints(out)] == [1] and not (out / "final").exists()
    monkeypatch.delenv("TIDYRL_TEST_TAKE_DOWN")
    down.unlink()  # the server is back
    resumed = tidyrl.train(config("stopped"), ["resume_from=latest"])
    a, b = load_file(whole.final_dir / "model.safetensors"), load_file(resumed.final_dir / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_mixture_of_experts_conversation_carries_every_tokens_route_and_replaying_them_scores_its_turns(
        tmp_path, env_file):
    """Multi-turn with routes recorded: the prompt's from the first turn's prefill, each model turn's from its
    decode steps, each environment message's from the next turn's prefill; replayed over [prompt, every token],
    the trainer's log-probs of the model's tokens are the sampler's (to rounding)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidyrl.models.forward import completion_logprobs
    from tidyrl.models.routing import routed
    from tidyrl.models.sequences import left_pad
    from tidyrl.models.tiny import save_tiny_model
    from tidyrl.rollouts.episodes import as_episodes

    folder = save_tiny_model(tmp_path / "moe", hidden_size=32, num_layers=2, num_heads=2, family="qwen3_moe")
    model, tok = AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
    Counter = load_class(env_file, "Counter")
    words = ["apple", "fig"]
    messages = [[{"role": "user", "content": w + ":"}] for w in words]
    prompts = [tok(tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True),
                   add_special_tokens=False)["input_ids"] for m in messages]
    pool = EnvironmentPool(timeout_s=10)
    envs = build_environments(Counter, [{"word": w} for w in words], [1, 2], pool)
    settings = EpisodeSettings(SamplingSettings(max_new_tokens=200, eos_ids=[tok.eos_token_id], pad_id=tok.pad_token_id,
                                                batch_size=8, record_routes=True), max_turns=3, max_turn_tokens=4)
    conversations = run_episodes(BuiltinEngine(model), tok, prompts, settings, sample_key=lambda i, t: 10 * i + t,
                                 environments=envs, messages=messages, pool=pool, env_names=["Counter"] * 2)
    for c, p in zip(conversations, prompts):
        assert c.turns == 3 and len(c.prompt_routes) == len(p)
    episodes = as_episodes(conversations, 200, tok.pad_token_id, multi_turn=True)
    p_ids, p_mask = left_pad(prompts, tok.pad_token_id)
    routes = torch.cat([episodes.prompt_routes, episodes.completion_routes], 1).long()
    for b, c in enumerate(conversations):  # every token routed but the last one sampled (never fed back)
        routed_positions = (episodes.completion_routes[b] >= 0).all(-1).all(-1)
        assert routed_positions[: len(c.ids) - 1].all() and not routed_positions[len(c.ids) - 1:].any()
    with torch.no_grad(), routed(model, routes) as state:
        trainer, _ = completion_logprobs(model, p_ids, p_mask, episodes.completion_ids, episodes.completion_mask, 1.0,
                                         routing=state)
    own = (episodes.action_mask > 0) & (episodes.completion_mask > 0)
    assert torch.allclose(trainer[own], episodes.sampled_logprobs[own], atol=1e-5)

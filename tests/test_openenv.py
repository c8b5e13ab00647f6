"""OpenEnvEnvironment against the real thing: an environment written to openenv-core's interface (`Environment`,
`Action` / `Observation` models), served by its own `create_app` + uvicorn on 127.0.0.1 and reached through an
`EnvClient` subclass, driven by multi-turn GRPO; and the same environment in process, without HTTP.

Skipped where openenv-core is not installed (the default test environment: its dependencies are a web stack);
CI runs these in an environment of their own (.ci/run: `pip install -e ".[test,openenv]"`, `pytest -m openenv`).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import free_port, read_jsonl

pytest.importorskip("openenv")
pytestmark = pytest.mark.openenv

import tidyrl  # noqa: E402

GUESS = '''
import os

from openenv.core import EnvClient
from openenv.core.client_types import StepResult
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

from tidyrl.environments import OpenEnvEnvironment


class GuessAction(Action):
    guess: str = Field(..., description="the model's turn")


class GuessObservation(Observation):
    hint: str = Field(default="", description="what the environment says back")


class GuessEnvironment(Environment):
    """Guess a letter of the word 'apple' in three tries."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        self._state = State(episode_id="guess", step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self._state = State(episode_id=episode_id or "guess", step_count=0)
        return GuessObservation(hint="guess a letter", done=False, reward=0.0)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        if any(ch in "aple" for ch in action.guess):
            return GuessObservation(hint="right", done=True, reward=1.0)
        done = self._state.step_count >= 3
        return GuessObservation(hint="no: try a vowel", done=done, reward=0.0)

    @property
    def state(self):
        return self._state


class GuessClient(EnvClient[GuessAction, GuessObservation, State]):
    def _step_payload(self, action):
        return {"guess": action.guess}

    def _parse_result(self, payload):
        data = payload.get("observation", {})
        observation = GuessObservation(hint=data.get("hint", ""), done=payload.get("done", False),
                                       reward=payload.get("reward"))
        return StepResult(observation=observation, reward=payload.get("reward"), done=payload.get("done", False))

    def _parse_state(self, payload):
        return State(**payload)


class Guess(OpenEnvEnvironment):
    """Each episode a session of the server at GUESS_URL (closed when the episode ends)."""

    def make_env(self, row, seed):
        return GuessClient(base_url=os.environ["GUESS_URL"]).sync()

    def to_action(self, turn):
        return GuessAction(guess=turn)

    def to_message(self, observation):
        return observation.hint


class GuessInProcess(Guess):
    """The same environment in this process: no server."""

    def make_env(self, row, seed):
        return GuessEnvironment()
'''


class Server:
    """An OpenEnv server of GuessEnvironment (create_app + uvicorn) on 127.0.0.1, in a thread."""

    def __init__(self, module, port: int, sessions: int):
        import uvicorn
        from openenv.core.env_server.http_server import create_app

        app = create_app(module.GuessEnvironment, module.GuessAction, module.GuessObservation, env_name="guess",
                         max_concurrent_envs=sessions)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the OpenEnv server did not start"
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@pytest.fixture
def guess(tmp_path, monkeypatch):
    """(the environments' file, its module, a free port with GUESS_URL pointing at it)."""
    from tidyrl.rewards import load_reward_function

    path = tmp_path / "guess.py"
    path.write_text(GUESS)
    port = free_port()
    monkeypatch.setenv("GUESS_URL", f"http://127.0.0.1:{port}")
    module = __import__(load_reward_function(f"{path}:Guess", None).__module__)
    return path, module, port


def config(model_dir, prompt_file, out, factory, **train):
    return {
        "algorithm": "grpo", "model": str(model_dir), "output_dir": str(out), "seed": 4,
        "data": {"path": str(prompt_file)},
        "environment": {"factory": factory, "max_turns": 3, "max_turn_tokens": 4, "timeout_s": 20},
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 4, "max_new_tokens": 60},
        "train": {"rollouts": 3, "micro_batch_size": 4, "learning_rate": 1e-2, **train},
        "log": {"progress_bar": False, "samples_per_rollout": 8},
    }


def test_grpo_through_an_openenv_server_closes_every_session(guess, tiny_model_dir, prompt_file, tmp_path):
    """A server with exactly one rollout's sessions (8): every episode of three rollouts gets one, because each
    episode's session is closed when it ends (a session left open would leave rollout 2 a server at capacity)."""
    path, module, port = guess
    server = Server(module, port, sessions=8)
    try:
        result = tidyrl.train(config(tiny_model_dir, prompt_file, tmp_path / "run", f"{path}:Guess"))
    finally:
        server.stop()
    rows = read_jsonl(result.output_dir / "metrics.jsonl")
    assert len(rows) == 3 and all(row["env/error_fraction"] == 0.0 for row in rows)
    assert all(1.0 <= row["turns_mean"] <= 3.0 for row in rows)
    samples = read_jsonl(result.output_dir / "samples.jsonl")
    hinted = [s for s in samples if s["rewards"]["env"] == 0.0]
    assert hinted and all("no: try a vowel" in s["completion"] for s in hinted)  # the server's hints, as tokens


def test_the_in_process_environment_runs_the_same_episodes(guess, tiny_model_dir, prompt_file, tmp_path):
    """The OpenEnv environment without HTTP gives the same run as through the server."""
    path, module, port = guess
    server = Server(module, port, sessions=8)
    try:
        served = tidyrl.train(config(tiny_model_dir, prompt_file, tmp_path / "served", f"{path}:Guess",
                                     rollouts=2))
    finally:
        server.stop()
    local = tidyrl.train(config(tiny_model_dir, prompt_file, tmp_path / "local", f"{path}:GuessInProcess",
                                rollouts=2))
    assert read_jsonl(served.output_dir / "samples.jsonl") == read_jsonl(local.output_dir / "samples.jsonl")


def test_a_server_that_dies_stops_the_run_and_its_checkpoint_resumes(guess, tiny_model_dir, prompt_file, tmp_path,
                                                                     monkeypatch):
    """The server stops after rollout 1: rollout 2's episodes all fail to connect, so the run stops with what to
    check and a checkpoint; with the server back, the resumed run ends as the uninterrupted one (bit for bit)."""
    from safetensors.torch import load_file

    from tidyrl.environments import EnvironmentFailure
    from tidyrl.rollouts import ahead

    path, module, port = guess
    server = Server(module, port, sessions=8)
    try:
        whole = tidyrl.train(config(tiny_model_dir, prompt_file, tmp_path / "whole", f"{path}:Guess"))
        real_make = ahead.make_rollout

        def make_rollout(source, r, version, weights=None):
            if r == 1:
                server.stop()  # the server goes away before rollout 2
            return real_make(source, r, version, weights)

        monkeypatch.setattr(ahead, "make_rollout", make_rollout)
        with pytest.raises(EnvironmentFailure) as err:
            tidyrl.train(config(tiny_model_dir, prompt_file, tmp_path / "cut", f"{path}:Guess"))
        monkeypatch.setattr(ahead, "make_rollout", real_make)
        message = str(err.value)
        assert "rollout 2: 100% of the episodes ended on an environment error" in message
        assert "episodes at once per process" in message and "checkpoint-1" in message
        server = Server(module, port, sessions=8)  # back
        resumed = tidyrl.train(config(tiny_model_dir, prompt_file, tmp_path / "cut", f"{path}:Guess"),
                               ["resume_from=latest"])
    finally:
        server.stop()
    a, b = load_file(whole.final_dir / "model.safetensors"), load_file(resumed.final_dir / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)

"""The adapter that drives an OpenEnv environment (a client of an OpenEnv server) as a tidyrl environment."""

from __future__ import annotations

from tidyrl.environments.base import EnvReply


class OpenEnvEnvironment:
    """An OpenEnv environment (openenv-core's `reset()` / `step(action)`) as a tidyrl environment.

    OpenEnv environments take typed actions and answer with observations; a subclass says how a model turn
    becomes an action and an observation becomes the next message:

        from my_openenv_envs import EchoEnvironment, EchoAction

        class Echo(OpenEnvEnvironment):
            def make_env(self, row, seed):
                return EchoEnvironment()              # in process; or an EnvClient of a running server
            def to_action(self, turn):
                return EchoAction(message=turn)
            def to_message(self, observation):
                return observation.echoed_message

    `step` accepts both forms OpenEnv returns: a client's `StepResult(observation, reward, done)`, or a server
    environment's observation carrying `reward` and `done` itself. The observation of `reset()` is kept as
    `self.first_observation` (the prompt comes from the data row, as for every tidyrl environment). Nothing of
    openenv-core is imported here: it is needed only by the environment classes a subclass builds.
    """

    role = "user"
    """The role of the messages built from observations (`tool` when the environment is a tool)."""

    def __init__(self, row: dict, seed: int):
        self.row, self.seed = row, seed
        self.env = self.make_env(row, seed)
        self.first_observation = _observation_of(self.env.reset())

    def make_env(self, row: dict, seed: int):
        raise NotImplementedError("an OpenEnvEnvironment subclass builds its OpenEnv environment in make_env(row, seed)")

    def to_action(self, turn: str):
        raise NotImplementedError("an OpenEnvEnvironment subclass turns a model turn into an action in to_action(turn)")

    def to_message(self, observation) -> str:
        return str(observation)

    def step(self, turn: str, messages: list[dict]) -> EnvReply:
        result = self.env.step(self.to_action(turn))
        observation = _observation_of(result)
        reward = getattr(result, "reward", None) if hasattr(result, "observation") else getattr(observation, "reward", None)
        done = bool(getattr(result, "done", False) if hasattr(result, "observation") else getattr(observation, "done", False))
        if done:
            return EnvReply(reward=reward, done=True)
        return EnvReply(message={"role": self.role, "content": self.to_message(observation)}, reward=reward)

    def close(self) -> None:
        closer = getattr(self.env, "close", None)
        if callable(closer):
            closer()


def _observation_of(result):
    """The observation of an OpenEnv step or reset result (a client's StepResult holds it; a server's is it)."""
    return result.observation if hasattr(result, "observation") else result

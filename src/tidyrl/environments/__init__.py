"""Environments: what the model talks to between its turns in a multi-turn episode (they never generate).

- `base`: the protocol (`EnvReply`, `check_reply`) and the worker pool that calls environments with a timeout;
- `tools`: `ToolEnvironment`, Python functions offered as tools, and the `<tool_call>` parser;
- `openenv`: `OpenEnvEnvironment`, the adapter for an OpenEnv client.
"""

from tidyrl.environments.base import EnvironmentError_, EnvironmentFailure, EnvironmentPool, EnvReply, check_reply
from tidyrl.environments.openenv import OpenEnvEnvironment
from tidyrl.environments.tools import ToolEnvironment, parse_tool_calls

__all__ = ["EnvReply", "EnvironmentError_", "EnvironmentFailure", "EnvironmentPool", "OpenEnvEnvironment", "ToolEnvironment",
           "check_reply", "parse_tool_calls"]

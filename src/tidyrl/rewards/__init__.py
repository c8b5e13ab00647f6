"""Rewards: what scores an episode.

- `functions`: reward functions named in the YAML (`module:function` or `file.py:function`), how they are
  called, checked and summed (`compute_rewards`);
- `verifiable`: ready-made verifiable rewards (math answers, code tests, formats);
- `reward_models`: sequence-classifier reward models, each with its own tokenizer and chat template.
"""

from tidyrl.rewards.functions import (RewardError, RewardFunction, RewardResult, build_reward_functions,
                                      check_reward_columns, compute_rewards, load_reward_function, with_options)

__all__ = ["RewardError", "RewardFunction", "RewardResult", "build_reward_functions", "check_reward_columns",
           "compute_rewards", "load_reward_function", "with_options"]

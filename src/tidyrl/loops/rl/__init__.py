"""The on-policy RL learner (GRPO, RLOO, PPO, REINFORCE++, CISPO, distillation): the loop (learner.py), its inputs'
checks, advantages and metrics, one optimizer step (update.py) and what its checkpoints carry."""

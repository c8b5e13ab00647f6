"""The memory plan, beside the batch plan: each phase's predicted peak per process from the config and the model's
config.json, before any weight loads (plan.py: the formulas, no torch; rl.py, offline.py: a run's inputs)."""

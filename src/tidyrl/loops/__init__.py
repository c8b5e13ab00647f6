"""The learners, one explicit loop per family: the on-policy RL learner (rl/), the offline stages (offline/: sft,
reward, dpo, kto), and the run machinery they share (run/: accelerator, output folder, steps, checkpoints, stop)."""

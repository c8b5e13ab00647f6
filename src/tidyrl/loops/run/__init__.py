"""The run machinery every learner shares: the accelerator, the output folder and run header (setup.py), the
steps' skeleton, stop signals, resume checks (steps.py), and gradient sums exact over any split (exact_sums.py)."""

"""The run machinery every learner shares: the accelerator, the output folder and run header (setup.py), the
inputs a run's episodes need (inputs.py), the steps' skeleton, stop signals, resume (steps.py), exact sums."""

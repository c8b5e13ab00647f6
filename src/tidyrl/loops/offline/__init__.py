"""The offline stages (sft, reward, dpo, kto): one loop over a data set's examples (loop.py) and each stage's
loss and metrics in its own module."""

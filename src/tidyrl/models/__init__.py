"""Model code, on its own floor: everything that touches a Hugging Face model but knows nothing of rollouts,
losses or training loops.

- `loading`: models and tokenizers from a folder or hub id (errors name the config key), gradient checkpointing;
- `engines`: the generation interface and its two engines, `builtin` and `vllm` (`rollout.engine`);
- `generation`: the built-in engine's keyed sampling loop;
- `forward`: the training forward, log-probs (and values) of completions given as tensors;
- `families`: the model families as declarations (what each layout changes), read by every fast part and the
  memory plan; `lean_layer`: the one decoder-layer function they share;
- `lean_decode`, `lean_forward`: the fast paths for the declared families (one config key, `model_fast_paths`),
  each checked against the model's own forward in the tests.

Nothing here imports `tidyrl.loops` or `tidyrl.rollouts` (tests/test_layers.py keeps it so).
"""

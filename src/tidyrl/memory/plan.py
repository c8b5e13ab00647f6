"""The memory plan: the predicted peak of each phase of an RL run or an offline stage, per process, from numbers
alone. Pure Python, no torch, no files: the shapes come from a model's config (a mapping or an object with the same
attributes), the sizes from the batch plan. `tidyrl plan` prints it and the run checks it before any weights load
(`tidyrl.memory.rl`, `tidyrl.memory.offline`). Every figure is in bytes and broken into named parts;
docs/memory.md gives the formulas with a worked example.

Notation (per process):

    h hidden_size   L num_hidden_layers   q = heads * head_dim   kv = kv_heads * head_dim   i intermediate_size
    V vocab_size    b bytes per weight element (model_dtype)     W processes (FSDP2 divides by W)
    T = longest prompt + max_new_tokens (tokens of a sequence)   C = max_new_tokens + 1 (positions with logits)
    g, f, m = the generation, forward (scoring) and micro batch, each at most the process's episodes per rollout

Parameters of a Llama-layout decoder (Llama, Qwen2/3, Mistral; other causal LMs are estimated with it):

    per layer  = h*q + 2*h*kv + q*h  (+ q + 2*kv biases, Qwen2)  (+ 2*head_dim q/k norms, Qwen3)  + 3*h*i + 2*h
    total      = V*h (embeddings) + L * per layer + h (final norm) + V*h (output layer, unless tied)
                 (a sequence classifier's head is num_labels*h instead of V*h)
    LoRA       = r * (in + out) per adapted linear layer (every one of q,k,v,o,gate,up,down by default), float32
    MoE        a mixture-of-experts layer (Qwen3-MoE, OLMoE: the S sparse layers of `Shape.sparse_layers`) has E
               experts of size i_e and a router in place of the dense MLP: E * (3*h*i_e + h); each token is sent
               to k experts, and keeps for the backward pass, per expert, its gathered input and weighted output
               and the expert's 4*i_e (k * (2*h + 4*i_e)), with the router's logits and float32 softmax (2*E), in
               place of the dense MLP's 4*i; without grad its working set is k * (2*h + 3*i_e) + 2*E; LoRA's
               gate/up/down names adapt no expert (the experts are stacked parameters, not linear layers)

Phases (each = what stays resident across the run + what the phase adds):

    resident     policy weights P*b (/W under FSDP2); optimizer state: AdamW's two moments, 2 * trainable bytes
                 (/W); frozen models: the KL reference, reward models and a teacher /W under FSDP2 like the
                 policy (a teacher of another tokenizer whole on every process); a critic's weights and its
                 optimizer state like the policy's
    generation   FSDP2: the full weights gathered for the call, P*b (a copy beside the shard); KV cache
                 2*L*kv*T*g*b; the last position's logits and float32 probabilities g*V*(b + 4); vLLM in-process: its
                 reservation
    scoring      per scorer, the largest of its forward's moments: a layer's, the hidden states in and out of it
                 2*f*T*h*b and its working set f*T*(h + max(2*q + 2*kv, 3*i))*b (no grad: one layer's intermediates
                 alive at a time); the output layer's, the hidden states and logits f*C*V*b; and, the forward
                 returned and its hidden states gone, the logits and the log-softmax's float32 copies, f*C*V*4 for
                 float32 logits (logsumexp's shifted copy of the whole batch), 2*C*V*4 for bf16/fp16 (a sequence at
                 a time: its upcast and logsumexp's shifted copy of that), and at a temperature other than 1 the
                 logits divided by it, another f*C*V*b (all but the chunked output layer, which divides in place);
                 a value or reward head has no logits; FSDP2, a sharded scorer (each group's all-gather output kept
                 until the next group's all-gather, beside the parameters copied out of it): R + 2*l gathered in a
                 layer's moment (the root group: embeddings, final norm, head, R = (P - L * per layer) * b, and a
                 layer's parameters and all-gather output, l = per layer * b), R + l in the output layer's, and at
                 the first layer's all-gather the root group twice with it, 2*R + l beside the embeddings' output
                 f*T*h*b; none once the forward has returned (the root group resharded). That is the model's own
                 forward (CUDA, model_fast_paths off, train.exact_gradients, FSDP2, other layouts); a Llama-layout
                 scorer on a CPU runs the lean pass (models.lean_forward), whose local names hold one layer's
                 outputs until the next layer rebinds them, the last layer's until the output layer has run: f*T*k*b
                 held, k = h + 2*i + 4*q + 5*kv + 2*head_dim (x, gate and up, q/k/v fused and roped, the keys/values
                 with their prompt's, the two attention outputs and their concatenation, rope's cos and sin; q + 2*kv
                 in place of 2*q + 3*kv where the linear weights exceed 32 MiB and q/k/v run apart) and the attention
                 masks, then the largest of: a layer's norm output and SwiGLU's two products f*T*(h + 2*i)*b, or
                 the norm output and the scores, their masked float32 sum and softmax f*H*Q*K*(b + 8) of the larger
                 attention call (prompts P x P, completions (C - 2) x (T - 1); while f*H*Q*K*4 <= 32 MiB, else
                 torch's fused kernel); the output layer's input, its norm and logits f*C*(2*h + V)*b; or, the pass
                 returned, the logits and the log-softmax's copies (and the temperature's) as above
    update       gradients trainable bytes (/W; FSDP2 without train.sync_each_microbatch and with accumulation:
                 whole until the last micro-batch); activations: the lean pass (MemoryInputs.lean_update) m*T*L*a*b
                 and per layer its attention's probabilities, m*H*Q*K*4 (+ b below float32: their cast) for each
                 call of float32 probabilities <= 32 MiB (prompts P x P, completions (C - 2) x (T - 1)), else the
                 fused kernel's mask cast from boolean, m*Q*K*b; elsewhere the model's own forward, as the offline
                 stages' below with r = m, and per layer SDPA's mask cast from boolean, m*T*T*b (gradient
                 checkpointing: the layer inputs and one layer recomputed); logits and their gradient 2*m*C*V*b and the
                 log-softmax's float32 copies, 2*m*C*V*4 for float32 logits (the gather's and logsumexp's
                 gradients before they sum), 3*C*V*4 for bf16/fp16 (a sequence at a time: the previous one's float32
                 gradient still bound beside the next's upcast and its difference or exponential; the forward holds
                 two) (the chunked output layer on CUDA: two chunks of at most 256 MiB); FSDP2: two layers' gathered
                 weights; a critic's gradients and activations beside the policy's; where a step accumulates
                 micro-batches (full fine-tuning), a later micro-batch's fresh gradient of the vocabulary's weights
                 beside the accumulated one, V*h*b, and with tied embeddings the output layer's held until the
                 embeddings' is made and summed, 3*V*h*b at the backward's end, less the activations and logits
                 gone by then (at least V*h*b)

with a = 2*n*h + 3*q + 2*kv + 4*i (+ q + kv with q/k norms), the elements one token keeps per layer for the
backward pass (each of the layer's n hidden-size norms' input and output: n = 2, Gemma 3's sandwich n = 4; the
attention's q, k, v and output and o_proj's input; the MLP's gate, up, act(gate) and product; a q/k norm's
normalised input), n and the q/k norms read from the model's family declaration (models.families).

Offline stages (sft, reward, dpo, kto; `OfflineInputs`): T = the longest sequence a micro-batch holds, every
position with logits (C = T), r = the rows of a micro-batch: m for sft and kto, 2m for reward and dpo (a pair's
chosen and rejected sides in one forward). No generation; no chunked output layer (the stages read the model's
whole logits).

    update       as RL's with m -> r, C -> T: weights, AdamW state, gradients, logits; the activations of the
                 model's own forward r*T*(L*e + h*(4 + 2*b)) and SDPA's masks L*r*T*T*b, with e = 2*h*(4 + 2*b) + (3*q + 2*kv + 4*i)*b bytes
                 per layer (each RMSNorm keeps its input upcast to float32 and its normalised input and output;
                 the final norm once; gradient checkpointing: r*T*(L*h*b + e + h*(4 + 2*b))); a reward model's
                 score head: r*T*num_labels*b instead of logits (LoRA: its head trained in full); kto: its
                 reference resident (dpo's is freed once its log-probs are cached); accumulating, the fresh
                 gradients as RL's
    scoring      the frozen reference's no-grad forward (dpo but its reference-free losses: 2m rows before the
                 first step, without AdamW state; kto: m rows, every step's z0 beside AdamW state, the longest
                 mismatched pair's tokens); with LoRA the policy with its adapter off, no second copy

The weights, gradients, optimizer state and KV cache are exact byte counts of the tensors; activations and logits
are the model's saved tensors by the formula above (tests/test_memory_plan.py counts them), which the kernels'
scratch and the allocator move by some percent (benchmarks/bench_memory_plan.py measures the peaks on a CPU).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Mapping, Optional

from tidyrl.models.families import family_of

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "auto": 4}
"""Bytes per element of each model_dtype (`auto` counted as float32: the largest a checkpoint usually holds)."""
CHUNK_BYTES = 256 * 2**20
"""The chunked output layer's largest chunk of logits (models.chunked_head.CHUNK_BYTES)."""
LEAN_COPY_MAX_BYTES = 32 * 2**20
"""The most bytes of linear weights for which the lean pass runs q/k/v as one product (lean_decode.COPY_MAX_BYTES)."""
MATH_ATTENTION_MAX_BYTES = 32 * 2**20
"""The largest float32 probabilities of one attention call that the lean pass computes as matmul-softmax-matmul on a
CPU (lean_forward.MATH_ATTENTION_MAX_BYTES); above it torch's fused kernel, which never holds them all."""
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str) -> int:
    """'24GiB' -> 25769803776 bytes; units B, KB/MB/GB/TB (powers of 1000) and KiB/MiB/GiB/TiB (of 1024)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = match and match.group(2).lower()
    if not match or unit not in _UNITS:
        raise ValueError(f"{text!r} is not a memory size; write e.g. 24GiB, 80GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[unit])


def gib(n: int) -> str:
    """Bytes as GiB with two decimals (MiB below 1 GiB, bytes below 1 MiB): how the plan's messages print sizes."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"


def _read(config, *names, default=None):
    for name in names:
        value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
        if value is not None:
            return value
    return default


@dataclass(frozen=True)
class Shape:
    """The numbers of a model's config that set its memory."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    qk_norm_projection: bool = False
    """The q/k norms are over the whole projection (OLMo 2, OLMoE: q + kv weights), not per head (2 head_dim)."""
    norms: int = 2
    """Hidden-size RMSNorms per decoder layer (Gemma 3's sandwich: 4)."""
    num_labels: int = 0
    """A sequence classifier's labels (its head is num_labels*h); 0 = a causal LM (its head is V*h)."""
    experts: int = 0
    """A mixture-of-experts layer's experts E (0: a dense model)."""
    experts_per_token: int = 0
    """The experts k each token is sent to."""
    expert_size: int = 0
    """Each expert's intermediate size i_e."""
    sparse_layers: int = 0
    """The decoder layers S whose MLP is a mixture of experts (the other L - S are dense, of size i)."""

    @classmethod
    def of(cls, config, classifier: bool = False) -> "Shape":
        """The shape of a model config (a transformers config or a mapping of its keys); ValueError when a key the
        formulas need is missing."""
        hidden = _read(config, "hidden_size", "n_embd", "d_model")
        layers = _read(config, "num_hidden_layers", "n_layer", "num_layers")
        heads = _read(config, "num_attention_heads", "n_head")
        vocab = _read(config, "vocab_size")
        if None in (hidden, layers, heads, vocab):
            raise ValueError("the model config has no hidden_size, num_hidden_layers, num_attention_heads or "
                             "vocab_size; its memory cannot be planned")
        family = family_of(config)  # (None for an architecture without a declaration: read from the config alone)
        moe = _moe_shape(config, layers) if family is not None and family.moe else {}
        return cls(**moe, hidden=hidden, layers=layers, heads=heads,
                   kv_heads=_read(config, "num_key_value_heads", default=heads),
                   head_dim=_read(config, "head_dim", default=hidden // heads),
                   intermediate=_read(config, "intermediate_size", "n_inner", default=4 * hidden),
                   vocab=vocab, tied=bool(_read(config, "tie_word_embeddings", default=True)),
                   qkv_bias=(family is not None and family.qkv_bias) or bool(_read(config, "attention_bias",
                                                                                    default=False)),
                   qk_norm=family is not None and family.qk_norm is not None,
                   qk_norm_projection=family is not None and family.qk_norm == "projection",
                   norms=len(family.norms) if family is not None else 2,
                   num_labels=_read(config, "num_labels", default=1) if classifier else 0)

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    def _attention_parameters(self) -> int:
        """A layer's attention and its two norms (and q/k norms, biases)."""
        h, q, kv = self.hidden, self.q, self.kv
        return (h * q + 2 * h * kv + q * h + (q + 2 * kv if self.qkv_bias else 0)
                + ((q + kv if self.qk_norm_projection else 2 * self.head_dim) if self.qk_norm else 0) + 2 * h)

    def _mlp_parameters(self, sparse: bool) -> int:
        """A dense MLP's 3 h i, or a mixture of experts' E experts of 3 h i_e and its router's E h."""
        h = self.hidden
        return self.experts * (3 * h * self.expert_size + h) if sparse else 3 * h * self.intermediate

    def layer_parameters(self) -> int:
        """The parameters of the largest decoder layer (a sparse one where the model has them)."""
        return self._attention_parameters() + self._mlp_parameters(self.sparse_layers > 0)

    def parameters(self) -> int:
        h, V, L, S = self.hidden, self.vocab, self.layers, self.sparse_layers
        head = self.num_labels * h if self.num_labels else (0 if self.tied else V * h)
        layers = L * self._attention_parameters() + (L - S) * self._mlp_parameters(False) + \
            S * self._mlp_parameters(True)
        return V * h + layers + h + head

    def mlp_saved_elements(self) -> int:
        """Elements one token keeps for the backward pass in all the layers' MLPs: a dense one's gate, up,
        act(gate) and product, 4 i; a mixture of experts' per expert it is sent to its gathered input and its
        weighted output (2 h) and the expert's 4 i_e, with the router's logits and float32 softmax (2 E)."""
        S = self.sparse_layers
        sparse = self.experts_per_token * (2 * self.hidden + 4 * self.expert_size) + 2 * self.experts
        return (self.layers - S) * 4 * self.intermediate + S * sparse

    def mlp_working_elements(self) -> int:
        """Elements per token of the largest MLP's working set without grad beyond its input: a dense one's gate,
        up and product, 3 i; a mixture of experts', per expert it is sent to, its gathered input, gate and up,
        product and weighted output, k (2 h + 3 i_e), and the router's logits and softmax, 2 E."""
        return max(3 * self.intermediate if self.sparse_layers < self.layers else 0, self.expert_working_elements())

    def expert_working_elements(self) -> int:
        """A mixture of experts' part of `mlp_working_elements`, k (2 h + 3 i_e) + 2 E (0 for a dense model)."""
        if not self.sparse_layers:
            return 0
        return self.experts_per_token * (2 * self.hidden + 3 * self.expert_size) + 2 * self.experts

    def lora_parameters(self, r: int, targets: Optional[tuple] = None) -> int:
        """r*(in + out) per adapted linear layer of every decoder layer (`targets`: their names; None = all)."""
        h, q, kv, i = self.hidden, self.q, self.kv, self.intermediate
        sides = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h), "gate_proj": (h, i),
                 "up_proj": (h, i), "down_proj": (i, h)}
        # (a mixture of experts' MLP has no gate_proj, up_proj or down_proj linear layer: its experts are stacked
        # parameters, which those names do not adapt)
        per_layer = {name: r * (a + b) for name, (a, b) in sides.items() if targets is None or name in targets}
        mlp = sum(v for name, v in per_layer.items() if name in ("gate_proj", "up_proj", "down_proj"))
        return self.layers * sum(per_layer.values()) - self.sparse_layers * mlp

    def linear_weight_elements(self) -> int:
        """Elements of every nn.Linear weight (the decoder layers' projections and the output layer, tied or not):
        what decides whether the lean pass fuses q/k/v."""
        h, q, kv, i = self.hidden, self.q, self.kv, self.intermediate
        return self.layers * (2 * h * q + 2 * h * kv) + (self.layers - self.sparse_layers) * 3 * h * i + \
            self.vocab * h

    def working_elements(self) -> int:
        """Elements per token of one layer's largest set of live intermediates without grad: the norm's output with
        the attention's q, k, v and output (h + 2q + 2kv), or with the MLP's gate, up and product (h + 3i)."""
        return self.hidden + max(2 * self.q + 2 * self.kv, self.mlp_working_elements())

    def activation_elements(self) -> int:
        """a: elements one token keeps per layer for the backward pass, the layers' mean (see the module docstring;
        a mixture of experts' MLP as `mlp_saved_elements`)."""
        return self.attention_saved_elements() + self.mlp_saved_elements() // self.layers

    def attention_saved_elements(self) -> int:
        """Elements one token keeps per layer beside the MLP's: the norms' input and output, the attention's q, k, v
        and output and o_proj's input, a q/k norm's normalised input."""
        return 2 * self.norms * self.hidden + 3 * self.q + 2 * self.kv + (self.q + self.kv if self.qk_norm else 0)


@dataclass(frozen=True)
class Scorer:
    """A model that scores rollouts without grad (reference, teacher, reward model): its shape and bytes per
    element. `logits`: it reads log-probs over the vocabulary (reference, teacher), not a scalar head."""

    name: str
    shape: Shape
    dtype_bytes: int
    logits: bool
    sharded: bool = True
    """Under FSDP2 sharded like the policy and gathered a shard group at a time in each forward (the KL reference,
    reward models, a teacher); False: whole on every process (a teacher of another tokenizer)."""
    lean: bool = False
    """Scores through tidyrl's lean pass (models.lean_forward: a Llama layout on a CPU, model_fast_paths on, not
    train.exact_gradients; not while FSDP2 shards it), not the model's own forward."""


@dataclass(frozen=True)
class MemoryInputs:
    """Everything the memory plan reads (per process unless said)."""

    policy: Shape
    dtype_bytes: int
    prompt_tokens: int
    """The longest prompt, in tokens."""
    new_tokens: int
    generation_batch_size: int
    forward_batch_size: int
    micro_batch_size: int
    episodes_per_process: int
    """Episodes per rollout per process: no chunk holds more."""
    world_size: int = 1
    fsdp: bool = False
    lora_r: int = 0
    lora_targets: Optional[tuple] = None
    gradient_checkpointing: bool = False
    sync_each_microbatch: bool = False
    accumulation_steps: int = 1
    chunked_head: bool = False
    """The output layer applied in chunks (CUDA, bf16/fp16, a plain causal LM; not under FSDP2)."""
    lean_prefill: bool = False
    """The built-in engine prefills with tidyrl's decode step (models.lean_decode: a declared family with
    model_fast_paths on, not train.exact_gradients), whose attention over each prompt holds its scores whole."""
    lean_update: bool = False
    """The policy's update runs tidyrl's lean pass (models.lean_forward: a Llama layout on a CPU, model_fast_paths
    on, not train.exact_gradients, one process, no LoRA adapter, no gradient checkpointing), not the model's own
    forward: their attention keeps different tensors for the backward pass."""
    scorers: tuple = ()
    critic: Optional[Shape] = None
    engine_reserve: int = 0
    """Bytes the generation engine reserves for itself (vLLM in-process: gpu_memory_utilization * device)."""
    temperature: float = 1.0
    """rollout.temperature: the log-prob scorers divide their logits by it where it is not 1, a copy of them."""


@dataclass(frozen=True)
class Phase:
    name: str
    parts: dict = field(default_factory=dict)
    """part -> bytes."""

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass(frozen=True)
class MemoryPlan:
    phases: tuple
    """Phase records: generation, scoring (when a model scores rollouts), update."""

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def to_dict(self) -> dict:
        """plan.json's `memory`: per phase its total and parts in bytes, and the largest phase."""
        return {"per_process_bytes": {p.name: {"total": p.total, **p.parts} for p in self.phases},
                "peak_phase": self.peak.name, "peak_bytes": self.peak.total}


def _moe_shape(config, layers: int) -> dict:
    """A mixture-of-experts config's experts, k, expert size and sparse layers (Qwen3-MoE: every layer not in
    `mlp_only_layers` whose index + 1 is a multiple of `decoder_sparse_step`; OLMoE: every layer)."""
    experts = _read(config, "num_experts", "num_local_experts", default=0)
    if not experts:
        return {}
    only = set(_read(config, "mlp_only_layers", default=()) or ())
    step = _read(config, "decoder_sparse_step", default=1) or 1
    sparse = sum(1 for i in range(layers) if i not in only and (i + 1) % step == 0)
    return {"experts": experts, "experts_per_token": _read(config, "num_experts_per_tok"),
            "expert_size": _read(config, "moe_intermediate_size", "intermediate_size"), "sparse_layers": sparse}


def _div(n: int, w: int) -> int:
    return -(-n // w)


def _resident(x: MemoryInputs) -> dict:
    s, b, W = x.policy, x.dtype_bytes, (x.world_size if x.fsdp else 1)
    parts = {"policy_weights": _div(s.parameters() * b, W)}
    trainable = _trainable_bytes(x)
    parts["optimizer_state"] = _div(2 * trainable, W)
    if x.critic is not None:
        critic = x.critic.parameters() * b
        parts["critic_weights"] = _div(critic, W)
        parts["critic_optimizer_state"] = _div(2 * critic, W)
    for scorer in x.scorers:
        parts[f"{scorer.name}_weights"] = _div(scorer.shape.parameters() * scorer.dtype_bytes,
                                               W if scorer.sharded else 1)
    return parts


def _trainable_bytes(x: MemoryInputs) -> int:
    if x.lora_r:
        return 4 * x.policy.lora_parameters(x.lora_r, x.lora_targets)  # adapters kept in float32 (peft)
    return x.policy.parameters() * x.dtype_bytes


def _logits(rows: int, positions: int, vocab: int, b: int, chunked: bool, both_sides: bool,
            scaled: bool = False) -> dict:
    """The output layer's logits (and in the update their gradient) and the log-softmax's float32 working copies:
    float32 logits go through logsumexp whole (its shifted copy is the logits' size; in the backward the gather's
    and logsumexp's gradients are two more before they sum); lower precisions are upcast a sequence at a time
    (models.ops): the forward holds a sequence's upcast and logsumexp's shifted copy of it, two sequences' float32
    logits, the backward three (the previous sequence's float32 gradient, still bound until the next is made,
    beside the next's upcast and its difference or exponential). `scaled`: the logits divided by a temperature
    other than 1 before the log-softmax (models.forward.completion_logprobs), a copy in their dtype beside them
    (the chunked output layer divides each chunk in place)."""
    whole = rows * positions * vocab * b
    if chunked:
        return {"logit_chunks": (2 if both_sides else 1) * min(CHUNK_BYTES, whole)}
    parts = {"logits": (2 if both_sides else 1) * whole, **({"scaled_logits": whole} if scaled else {})}
    if b >= 4:
        parts["logsumexp_temporaries"] = (2 if both_sides else 1) * whole
    else:
        parts["logsoftmax_one_sequence"] = (3 if both_sides else 2) * positions * vocab * 4
    return parts


def _activations(s: Shape, rows: int, T: int, b: int) -> int:
    """What the lean pass's backward keeps of rows x T tokens besides the attention's probabilities: rows T L a b."""
    return rows * T * (s.layers * s.attention_saved_elements() + s.mlp_saved_elements()) * b


def _own_forward_activations(s: Shape, rows: int, T: int, b: int, checkpointing: bool) -> int:
    """What the backward pass keeps of rows x T tokens through the model's own forward (the offline stages', and RL's
    where the lean pass does not run), in bytes: per layer each of its n hidden-size RMSNorms' input upcast to float32
    and normalised input and output, h (4 + 2b) n times (n = Shape.norms),
    and the attention's and MLP's (3q + 2kv + 4i) b; the final norm's h (4 + 2b) once. With gradient checkpointing
    the L layer inputs and one layer recomputed."""
    attention = s.norms * s.hidden * (4 + 2 * b) + (3 * s.q + 2 * s.kv) * b
    layer = attention + _div(s.mlp_saved_elements(), s.layers) * b  # (the largest layer's, recomputed)
    kept = (s.layers * s.hidden * b + layer) if checkpointing else s.layers * attention + s.mlp_saved_elements() * b
    return rows * T * (kept + s.hidden * (4 + 2 * b))


def _own_attention(b: int, rows: int, T: int) -> int:
    """Bytes one layer's attention keeps for the backward pass beyond the q, k, v and output that `a` and `e` count,
    in the model's own forward (SDPA, transformers' default): its (rows, 1, T, T) mask, boolean as given and cast to
    the queries' dtype by each layer's call, rows T T b (a CPU batch without padding passes no mask: less)."""
    return rows * T * T * b


def _lean_attention(s: Shape, b: int, rows: int, P: int, T: int, C: int) -> int:
    """Bytes one layer's attention keeps for the backward pass in the lean pass, beyond what `a` counts, over its
    two calls (prompts P x P, completions (C - 2) x (T - 1)): matmul attention (float32 probabilities of at most
    32 MiB) the softmax's float32 output, and below float32 its cast to b that the second matmul reads, rows H Q K
    (4 + b) (4 in float32: the cast is the same tensor); torch's fused kernel its mask, cast from boolean to the
    queries' dtype in each call, rows Q K b."""
    total = 0
    for queries, keys in ((P, P), (C - 2, T - 1)):
        n = rows * s.heads * queries * keys
        total += n * (4 + (b if b < 4 else 0)) if n * 4 <= MATH_ATTENTION_MAX_BYTES else rows * queries * keys * b
    return total


def _generation(x: MemoryInputs, resident: dict) -> Phase:
    s, b = x.policy, x.dtype_bytes
    g, T = min(x.generation_batch_size, x.episodes_per_process), x.prompt_tokens + x.new_tokens
    parts = dict(resident)
    if x.fsdp and x.world_size > 1:
        # a full copy: FSDP2 all-gathers into unsharded parameters of their own and keeps each process's shard
        # beside them (measured: benchmarks/bench_fsdp_memory.py)
        parts["gathered_weights"] = s.parameters() * b
    parts["kv_cache"] = 2 * s.layers * s.kv * T * g * b
    parts["sampling_logits"] = g * s.vocab * (b + 4)
    if x.lean_prefill:
        # the decode step's prefill (lean_decode.DecodeStep.prefill), every prompt counted as distinct: a layer's
        # scores, their masked sum and its float32 softmax, g H P P (b + 8), beside the additive mask g P P b
        P = x.prompt_tokens
        parts["prefill_attention"] = g * P * P * (s.heads * (b + 8) + b)
    if x.engine_reserve:
        parts["engine_reserve"] = x.engine_reserve
    return Phase("generation", parts)


def _scoring(x: MemoryInputs, resident: dict) -> Optional[Phase]:
    f, T, C = min(x.forward_batch_size, x.episodes_per_process), x.prompt_tokens + x.new_tokens, x.new_tokens + 1
    best = None
    gathering = x.fsdp and x.world_size > 1
    scaled = x.temperature != 1.0  # (the log-prob scorers score at the rollout's temperature)
    models = [(sc.name, sc.shape, sc.dtype_bytes, sc.logits, sc.sharded and gathering,
               sc.lean and sc.logits and not (sc.sharded and gathering) and C >= 3) for sc in x.scorers]
    if x.critic is not None:
        models.append(("critic", x.critic, x.dtype_bytes, False, False, False))
    for name, shape, b, logits, gathered, lean in models:
        if lean:  # (completions of at most one read token take the model's own forward)
            work = _lean_forward(name, shape, b, f, x.prompt_tokens, T, C, scaled)
        else:
            work = _no_grad_forward(name, shape, b, f, T, C if logits else 0, x.chunked_head and b < 4, gathered,
                                    scaled)
        if best is None or sum(work.values()) > sum(best.values()):
            best = work
    return None if best is None else Phase("scoring", {**resident, **best})


def _no_grad_forward(name: str, shape: Shape, b: int, f: int, T: int, C: int, chunked: bool, gathered: bool,
                     scaled: bool = False) -> dict:
    """What one forward without grad of f sequences of T tokens adds, at the largest of its moments: a layer's (the
    hidden states in and out of it, and its working set); the output layer's (the hidden states and the logits at
    C positions; the chunked output layer: a chunk of them); and, the model's forward returned and its hidden
    states gone, the logits with the log-softmax's working copies (`_logits`; `scaled`: and the logits divided by
    the temperature). C = 0: a scalar head, no logits.

    `gathered`: FSDP2 shards the scorer, a group per decoder layer (l = its parameters' bytes) and the root group
    (embeddings, final norm, head: R bytes). Each forward all-gathers a group into a buffer, copies the parameters
    out of it and keeps the buffer until the next group's all-gather has run (torch's FSDPParamGroup.
    wait_for_unshard): a layer runs with R + 2l gathered (the root group, its parameters and its buffer), the output
    layer with R + l (the last layer's buffer), and the first layer's all-gather finds the root group twice, 2R + l
    beside the embeddings' output f T h b. The root group is resharded and the last buffer freed when the forward
    returns, before the log-softmax runs."""
    hidden = {f"{name}_hidden_states": 2 * f * T * shape.hidden * b}
    layer = {**hidden, f"{name}_layer_working_set": f * T * shape.working_elements() * b}
    moments = [layer]
    head = {}
    if C and chunked:  # the log-probs of each chunk are made beside the hidden states
        head = {**hidden, **{f"{name}_{k}": v for k, v in _logits(f, C, shape.vocab, b, True, False).items()}}
    elif C:
        head = {**hidden, f"{name}_logits": f * C * shape.vocab * b}
        moments.append({f"{name}_{k}": v for k, v in _logits(f, C, shape.vocab, b, False, False, scaled).items()})
    if head:
        moments.append(head)
    if gathered:
        root = (shape.parameters() - shape.layers * shape.layer_parameters()) * b
        one = shape.layer_parameters() * b
        layer[f"{name}_gathered_weights"] = root + 2 * one
        if head:
            head[f"{name}_gathered_weights"] = root + one
        moments.append({f"{name}_hidden_states": f * T * shape.hidden * b, f"{name}_gathered_weights": 2 * root + one})
    return max(moments, key=lambda parts: sum(parts.values()))


def _lean_forward(name: str, s: Shape, b: int, f: int, P: int, T: int, C: int, scaled: bool = False) -> dict:
    """What the lean pass (models.lean_forward) adds without grad for f sequences of P prompt and T tokens, C
    positions with logits: the largest of its three moments. Its loop's local names keep one layer's outputs alive
    until the next layer rebinds them, and the last layer's until the output layer has run (f*T*k*b, see the module
    docstring); with them a layer's norm output and SwiGLU's two products or the attention's scores (the previous
    layer's gate and up still held), or the output layer's input, its norm and logits. Once the pass returns only
    its logits remain, with the log-softmax's working copies (as the model's own forward; `scaled`: and the logits
    divided by the temperature)."""
    h, q, kv, i, D = s.hidden, s.q, s.kv, s.intermediate, s.head_dim
    # q/k/v as one product and roped as one (q + 2kv, then q + kv), or three products roped apart (q + 2kv)
    projections = 2 * q + 3 * kv if s.linear_weight_elements() * b <= LEAN_COPY_MAX_BYTES else q + 2 * kv
    # a dense MLP's gate and up (a mixture of experts' block keeps nothing of its own once it returns)
    gate_up = 2 * i if s.sparse_layers < s.layers else 0
    held = {f"{name}_held_layer": f * T * (h + gate_up + projections + 2 * kv + 2 * q + 2 * D) * b}
    scores, masks = 0, 0
    for queries, keys in ((P, P), (C - 2, T - 1)):  # the prompts' attention call, the completions'
        n = f * s.heads * queries * keys
        math = n * 4 <= MATH_ATTENTION_MAX_BYTES  # matmul-softmax-matmul: additive float32 masks, all scores held
        masks += f * queries * keys * (4 if math else 1)
        # the scores (b), their float32 sum with the mask, and its softmax (float32): b + 8 bytes each
        scores = max(scores, n * (b + 8) if math else 0)
    held[f"{name}_attention_masks"] = masks
    mlp = max(gate_up, s.expert_working_elements())  # SwiGLU's two products, or the experts' working set
    layer = {**held, f"{name}_layer_working_set": f * T * h * b + max(f * T * mlp * b, scores)}
    head = {**held, f"{name}_head_input": 2 * f * C * h * b, f"{name}_logits": f * C * s.vocab * b}
    returned = {f"{name}_{k}": v for k, v in _logits(f, C, s.vocab, b, False, False, scaled).items()}
    return max((layer, head, returned), key=lambda parts: sum(parts.values()))


def _fresh_gradients(s: Shape, parts: dict, b: int, accumulating: bool) -> dict:
    """A backward that adds into gradients an earlier micro-batch left (`accumulating`) makes each parameter's
    gradient fresh beside its accumulated one before adding it; the largest are the vocabulary's, V*h*b: the output
    layer's made first, while the activations are alive, the embeddings' last. Tied, the output layer's is held
    until the embeddings' is made and the two summed, three V*h*b at the backward's end, when the activations
    (`parts`' activations, attention and logits, counted already) are gone. Full fine-tuning only: LoRA trains
    neither."""
    if not accumulating:
        return {}
    one = s.vocab * s.hidden * b
    alive = sum(v for k, v in parts.items() if k in _BACKWARD_ALIVE)
    return {"fresh_gradients": max(one, 3 * one - alive) if s.tied and not s.num_labels else one}


_BACKWARD_ALIVE = frozenset({"activations", "attention", "logits", "logsumexp_temporaries",
                             "logsoftmax_one_sequence", "logit_chunks", "score_logits"})


def _update(x: MemoryInputs, resident: dict) -> Phase:
    s, b = x.policy, x.dtype_bytes
    m, T, C = min(x.micro_batch_size, x.episodes_per_process), x.prompt_tokens + x.new_tokens, x.new_tokens + 1
    W = x.world_size if x.fsdp else 1
    whole_grads = x.fsdp and not x.sync_each_microbatch and x.accumulation_steps > 1
    parts = dict(resident)
    parts["gradients"] = _trainable_bytes(x) if whole_grads else _div(_trainable_bytes(x), W)
    if x.fsdp and W > 1:
        parts["gathered_layers"] = 2 * s.layer_parameters() * b
    # the lean pass reads completions of at least two tokens (C >= 3); shorter ones take the model's own forward, as
    # do the changes `_fix` tries that wrap the policy (several processes, LoRA, gradient checkpointing)
    if x.lean_update and x.world_size == 1 and not x.lora_r and not x.gradient_checkpointing and C >= 3:
        parts["activations"] = _activations(s, m, T, b)
        parts["attention"] = s.layers * _lean_attention(s, b, m, x.prompt_tokens, T, C)
    else:  # gradient checkpointing: the one layer recomputed holds its attention's tensors
        parts["activations"] = _own_forward_activations(s, m, T, b, x.gradient_checkpointing)
        parts["attention"] = (1 if x.gradient_checkpointing else s.layers) * _own_attention(b, m, T)
    parts.update(_logits(m, C, s.vocab, b, x.chunked_head and not x.fsdp, True))
    parts.update(_fresh_gradients(s, parts, b, x.accumulation_steps > 1 and not x.lora_r))
    if x.critic is not None:  # the critic's own forward (models.forward.completion_values)
        c = x.critic
        parts["critic_gradients"] = (c.parameters() * b if whole_grads else _div(c.parameters() * b, W))
        parts["critic_activations"] = _own_forward_activations(c, m, T, b, x.gradient_checkpointing)
        parts["critic_attention"] = (1 if x.gradient_checkpointing else c.layers) * _own_attention(b, m, T)
    return Phase("update", parts)


def memory_plan(x) -> MemoryPlan:
    """The predicted peak of each phase, per process, of an RL run (MemoryInputs: see the module docstring) or of
    an offline stage (OfflineInputs)."""
    if isinstance(x, OfflineInputs):
        return _offline_plan(x)
    resident = _resident(x)
    phases = [_generation(x, resident), _scoring(x, resident), _update(x, resident)]
    return MemoryPlan(tuple(p for p in phases if p is not None))


OFFLINE_ROWS = {"sft": 1, "kto": 1, "reward": 2, "dpo": 2}
"""Sequences per example in one forward: a pair's chosen and rejected sides run side by side (reward, dpo)."""


@dataclass(frozen=True)
class OfflineInputs:
    """Everything the memory plan of an offline stage (sft, reward, dpo, kto) reads, per process.

    Rows of a micro-batch: m for sft and kto, 2m for reward and dpo. Phases: `update` (one micro-batch's forward
    and backward, as RL's update with C = T: every position has logits; a reward model's score head has num_labels
    outputs per position instead of V), and `scoring` where a frozen reference scores the data (dpo's DPO-style
    losses: 2m sequences per forward, once before training, the reference freed before the update and AdamW's
    moments not made yet; kto: m per forward, the examples once and every step's mismatched pairs for z0 under the
    policy and the reference, which stays for the whole run). Held-out evaluation is a no-grad forward of a
    micro-batch beside the resident parts: less than the update, not a phase of its own."""

    stage: str
    """sft, reward, dpo or kto."""
    policy: Shape
    """The trained model (reward: the sequence classifier, num_labels outputs)."""
    dtype_bytes: int
    tokens: int
    """T: the longest sequence a micro-batch holds (after data.max_length's cut; sft.packing: the longest row)."""
    micro_batch_size: int
    """m: examples (reward, dpo: pairs) per forward."""
    world_size: int = 1
    fsdp: bool = False
    lora_r: int = 0
    lora_targets: Optional[tuple] = None
    gradient_checkpointing: bool = False
    sync_each_microbatch: bool = False
    accumulation_steps: int = 1
    reference: bool = False
    """A frozen reference scores the data (dpo but its reference-free losses; kto); with LoRA it is the policy with
    its adapter off (no second copy of the weights)."""
    reference_tokens: int = 0
    """The longest sequence the reference scores where longer than T (kto's mismatched pairs: a prompt of one
    example and the completion of another); 0: T."""

    @property
    def rows(self) -> int:
        return OFFLINE_ROWS[self.stage] * self.micro_batch_size


def _offline_trainable_bytes(x: OfflineInputs) -> int:
    s = x.policy
    if not x.lora_r:
        return s.parameters() * x.dtype_bytes
    # adapters in float32 (peft); a reward model's new score head is trained in full (peft's modules_to_save)
    return 4 * s.lora_parameters(x.lora_r, x.lora_targets) + s.num_labels * s.hidden * x.dtype_bytes


def _offline_plan(x: OfflineInputs) -> MemoryPlan:
    s, b, T = x.policy, x.dtype_bytes, x.tokens
    W = x.world_size if x.fsdp else 1
    gathering = x.fsdp and x.world_size > 1
    trainable = _offline_trainable_bytes(x)
    # (a LoRA reward model keeps the original score head beside the trained copy)
    weights = {"policy_weights": _div((s.parameters() + (s.num_labels * s.hidden if x.lora_r else 0)) * b, W)}
    state = {"optimizer_state": _div(2 * trainable, W)}
    reference = {"reference_weights": _div(s.parameters() * b, W)} if x.reference and not x.lora_r else {}
    phases = []
    if x.reference:
        f = x.micro_batch_size * (2 if x.stage == "dpo" else 1)
        work = _no_grad_forward("reference", s, b, f, max(x.reference_tokens, T), max(x.reference_tokens, T), False,
                                gathering)
        # dpo scores before the first step (no AdamW moments yet); kto's z0 every step, beside them
        phases.append(Phase("scoring", {**weights, **({} if x.stage == "dpo" else state), **reference, **work}))
    parts = {**weights, **state, **({} if x.stage == "dpo" else reference)}  # dpo's reference is gone by now
    whole_grads = x.fsdp and not x.sync_each_microbatch and x.accumulation_steps > 1
    parts["gradients"] = trainable if whole_grads else _div(trainable, W)
    if gathering:
        parts["gathered_layers"] = 2 * s.layer_parameters() * b
    parts["activations"] = _own_forward_activations(s, x.rows, T, b, x.gradient_checkpointing)
    parts["attention"] = (1 if x.gradient_checkpointing else s.layers) * _own_attention(b, x.rows, T)
    if s.num_labels:  # the score head's outputs at every position (pooled at the last): no vocabulary
        parts["score_logits"] = x.rows * T * s.num_labels * b
    else:
        parts.update(_logits(x.rows, T, s.vocab, b, False, True))
    parts.update(_fresh_gradients(s, parts, b, x.accumulation_steps > 1 and not x.lora_r))
    phases.append(Phase("update", parts))
    return MemoryPlan(tuple(phases))


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def _fix(x, phase: str, budget: int, per_minibatch: int, max_processes: int) -> str:
    """The smallest change that brings `phase` under `budget`, by name and value, or what to try when none does."""
    def fits(y) -> bool:  # (a change may remove the phase: LoRA's reference is the policy itself)
        return all(p.total <= budget for p in memory_plan(y).phases if p.name == phase)

    offline = isinstance(x, OfflineInputs)
    if phase == "generation":
        g = next((v for v in range(min(x.generation_batch_size, x.episodes_per_process) - 1, 0, -1)
                  if fits(replace(x, generation_batch_size=v))), None)
        if g:
            return f"lower rollout.generation_batch_size to {g}"
    elif phase == "scoring" and not offline:
        f = next((v for v in range(min(x.forward_batch_size, x.episodes_per_process) - 1, 0, -1)
                  if fits(replace(x, forward_batch_size=v))), None)
        if f:
            return f"lower rollout.forward_batch_size to {f}"
    else:  # the update; offline also the reference's scoring, which runs in chunks of a micro-batch
        m = next((v for v in reversed(_divisors(per_minibatch)) if v < x.micro_batch_size
                  and fits(replace(x, micro_batch_size=v, accumulation_steps=per_minibatch // v))), None)
        if m:
            return f"lower train.micro_batch_size to {m}"
        if phase == "update" and not x.gradient_checkpointing and fits(replace(x, gradient_checkpointing=True)):
            return "set train.gradient_checkpointing=true"
        if phase == "update" and not x.gradient_checkpointing and fits(
                replace(x, gradient_checkpointing=True, micro_batch_size=1, accumulation_steps=per_minibatch)):
            return "set train.gradient_checkpointing=true and train.micro_batch_size=1"
    lora = replace(x, lora_r=16) if offline else replace(x, lora_r=16, scorers=tuple(s for s in x.scorers
                                                                                     if s.name != "reference"))
    if not x.lora_r and fits(lora):  # with LoRA the reference is the policy with its adapter off
        return "train a LoRA adapter (lora.enabled=true, r=16)"
    for w in (2, 4, 8, 16, 32, 64):
        if w > x.world_size and w <= max_processes and fits(replace(x, world_size=w, fsdp=True)):
            return f"shard over {w} processes with FSDP2 (examples/accelerate/fsdp.yaml)"
    return ("no single change found: combine LoRA, gradient checkpointing, smaller batches and FSDP2 over more "
            "processes, or use a smaller model or model_dtype=bfloat16")


def fit_problems(x, budget: int, *, per_minibatch: int, max_processes: int = 64) -> list:
    """One line per phase of `x` (MemoryInputs or OfflineInputs) that would not fit in `budget` bytes: by how much
    and the smallest change that makes it fit. `per_minibatch`: the episodes (offline: the examples) a process
    handles per mini-batch (optimizer step), which micro_batch_size must divide."""
    problems = []
    for p in memory_plan(x).phases:
        if p.total > budget:
            top = sorted(p.parts.items(), key=lambda kv: -kv[1])[:3]
            problems.append(f"the {p.name} phase needs {gib(p.total)} per process, {gib(p.total - budget)} more "
                            f"than the {gib(budget)} it has (largest: "
                            + ", ".join(f"{k} {gib(v)}" for k, v in top)
                            + f"); {_fix(x, p.name, budget, per_minibatch, max_processes)}")
    return problems

"""Model families as declarations: what each decoder-layer layout changes, written once, read by every fast part
(the built-in engine's lean prefill and decode step, the lean scoring/update pass, the chunked output layer, the
recomputed norms, the compiled layers) and by the memory plan. Pure data and config reading: no torch.

A family differs from Llama's layer (Touvron et al. 2023; see `models.lean_layer` for the maths) in a few named
ways, each a field of `Family`:
- `norm`: the RMSNorm's form. CAST_THEN_WEIGHT: w * (x / rms(x)), normalised in float32 and cast back before the
  weight (Llama's); WEIGHT_THEN_CAST: the weight applied in float32, then cast (OLMo 2); ONE_PLUS_WEIGHT: (1 + w)
  applied in float32, then cast (Gemma 3, whose norm weights start at zero).
- `norms`: which of the four places around attention and the MLP hold a norm, by the decoder layer's child name:
  before attention ("attention_in"), on its output before the residual add ("attention_out"), before the MLP
  ("mlp_in"), on its output ("mlp_out"). Llama normalises before each (pre-norm); Gemma 3 on both sides
  (sandwich); OLMo 2 after each (post-norm).
- `qk_norm`: an RMSNorm of the queries and keys before rope: per head over the head dimension ("head": Qwen3,
  Gemma 3) or over the whole projection ("projection": OLMo 2).
- `embedding_scale`: the embeddings multiplied by sqrt(hidden size) (Gemma 3's scaled embedding module).
- `fused_projections`: q/k/v as one linear layer `qkv_proj` and gate/up as one `gate_up_proj` (Phi-3).
- sliding windows: read from the config (`windows`): a layer of type "sliding_attention" in `layer_types`, or
  every layer where the family's windows are global (Mistral, Phi-3), attends to its `sliding_window` last
  positions (itself included), as transformers' mask does (masking_utils.sliding_window_overlay: key index
  > query index - window).
- `moe`: the MLP of some layers is a mixture of experts (Qwen3-MoE, OLMoE), called as the model's own module (its
  router and experts, exact by construction: routing is per token) while the rest of the layer is the fast path's.

Every config attribute a family's layer reads, or accepts at any value because the fast path reads it from the
model's own modules (the rotary module's rope scalings, a projection's bias), is listed in `COMMON_ATTRIBUTES` or
the family's `attributes`; an attribute outside them, or one whose value a `rules` entry refuses, sends the model
to its own forward, with the attribute named (`fast_path_refusal`): never a fast path with different numbers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

# Attributes every declared family's config carries and the fast path handles at any value: shapes, token ids,
# the rope (computed by the model's own rotary module, every scaling it has), and what only the model's loading or
# generation reads. `attention_dropout` is checked where a pass trains (`dropout_refusal`).
COMMON_ATTRIBUTES = frozenset({
    "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id", "head_dim", "hidden_act",
    "hidden_size", "initializer_range", "intermediate_size", "max_position_embeddings", "mlp_bias",
    "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "rms_norm_eps", "rope_parameters",
    "rope_scaling", "rope_theta", "tie_word_embeddings", "use_cache", "vocab_size",
    # what transformers' own PretrainedConfig carries (and hub files add): read by loading and generation only
    "_name_or_path", "architectures", "chunk_size_feed_forward", "dtype", "torch_dtype", "id2label", "label2id",
    "is_encoder_decoder", "model_type", "output_attentions", "output_hidden_states", "problem_type", "return_dict",
    "transformers_version", "tokenizer_class", "_attn_implementation_autoset", "use_return_dict",
    "keys_to_ignore_at_inference", "task_specific_params", "prefix", "sep_token_id", "decoder_start_token_id",
    "unk_token_id", "_model_name_or_path", "name_or_path",
})

# The RMSNorm forms (`Family.norm`).
CAST_THEN_WEIGHT, WEIGHT_THEN_CAST, ONE_PLUS_WEIGHT = "cast_then_weight", "weight_then_cast", "one_plus_weight"
# The layer types of `config.layer_types` the fast path computes.
FULL, SLIDING = "full_attention", "sliding_attention"


def _none(value) -> bool:
    return value is None


def _false(value) -> bool:
    return not value


def _one(value) -> bool:
    return value in (None, 1, 1.0)


def _known_layer_types(value) -> bool:
    return value is None or all(t in (FULL, SLIDING) for t in value)


def _whole_rotary(value) -> bool:
    """A rope over the whole head dimension: no `partial_rotary_factor` below 1 in any rope parameters."""
    if not isinstance(value, Mapping):
        return True
    nested = [v for v in value.values() if isinstance(v, Mapping)]
    return all(_one(p.get("partial_rotary_factor")) for p in [value, *nested])


@dataclass(frozen=True)
class Family:
    """One decoder-layer layout (see the module docstring for each field)."""
    name: str
    architectures: tuple[str, ...]
    model_type: str = ""  # the config's `model_type` (where it is not `name`), read where a config has no architectures
    norm: str = CAST_THEN_WEIGHT
    norms: Mapping[str, str] = field(default_factory=lambda: {
        "attention_in": "input_layernorm", "mlp_in": "post_attention_layernorm"})
    qk_norm: Optional[str] = None
    embedding_scale: bool = False
    fused_projections: bool = False
    global_window: bool = False  # `sliding_window` applies to every layer (no `layer_types`)
    moe: bool = False
    qkv_bias: bool = False  # q/k/v always have biases, whatever the config says (Qwen2)
    rope_by_layer_type: bool = False  # one rotary module, called with each layer's type (Gemma 3's local/global)
    extra_layer_children: frozenset = frozenset()  # modules of the layer that compute nothing here (Phi-3's dropouts)
    attributes: frozenset = frozenset()  # accepted at any value, beyond COMMON_ATTRIBUTES
    rules: Mapping[str, Callable[[Any], bool]] = field(default_factory=dict)  # accepted where the rule holds
    dropout: tuple[str, ...] = ("attention_dropout",)  # must be 0 where a pass trains (it applies none)

    def llama_norms(self) -> bool:
        """Llama's norms: its form, before attention and before the MLP (what fused kernels of its norm compute)."""
        return self.norm == CAST_THEN_WEIGHT and set(self.norms) == {"attention_in", "mlp_in"}

    def layer_children(self) -> frozenset:
        """The decoder layer's child modules this layout has."""
        return frozenset({"self_attn", "mlp", *self.norms.values(), *self.extra_layer_children})

    def attention_children(self) -> frozenset:
        projections = ("qkv_proj", "o_proj") if self.fused_projections else ("q_proj", "k_proj", "v_proj", "o_proj")
        return frozenset({*projections, *(("q_norm", "k_norm") if self.qk_norm else ())})

    def mlp_children(self) -> frozenset:
        if self.fused_projections:
            return frozenset({"gate_up_proj", "down_proj", "activation_fn"})
        return frozenset({"gate_proj", "up_proj", "down_proj", "act_fn"})


_WINDOWED = frozenset({"sliding_window", "layer_types", "use_sliding_window", "max_window_layers"})
# What a mixture-of-experts config carries that the model's own MoE block reads (the fast path calls the block).
_MOE = frozenset({"num_experts", "num_experts_per_tok", "norm_topk_prob", "output_router_logits",
                  "router_aux_loss_coef"})

FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaForCausalLM",), rules={"pretraining_tp": _one}),
    Family("qwen2", ("Qwen2ForCausalLM",), qkv_bias=True, attributes=_WINDOWED,
           rules={"layer_types": _known_layer_types}),
    Family("qwen3", ("Qwen3ForCausalLM",), qk_norm="head", attributes=_WINDOWED,
           rules={"layer_types": _known_layer_types}),
    Family("mistral", ("MistralForCausalLM",), global_window=True, attributes=frozenset({"sliding_window"})),
    Family("gemma3", ("Gemma3ForCausalLM",), "gemma3_text", norm=ONE_PLUS_WEIGHT,
           norms={"attention_in": "input_layernorm", "attention_out": "post_attention_layernorm",
                  "mlp_in": "pre_feedforward_layernorm", "mlp_out": "post_feedforward_layernorm"},
           qk_norm="head", embedding_scale=True, rope_by_layer_type=True,
           attributes=frozenset({"sliding_window", "_sliding_window_pattern", "sliding_window_pattern",
                                 "hidden_activation", "query_pre_attn_scalar"}),
           rules={"layer_types": _known_layer_types, "attn_logit_softcapping": _none,
                  "final_logit_softcapping": _none, "use_bidirectional_attention": _false}),
    Family("olmo2", ("Olmo2ForCausalLM",), norm=WEIGHT_THEN_CAST,
           norms={"attention_out": "post_attention_layernorm", "mlp_out": "post_feedforward_layernorm"},
           qk_norm="projection"),
    Family("phi3", ("Phi3ForCausalLM",), fused_projections=True, global_window=True,
           extra_layer_children=frozenset({"resid_attn_dropout", "resid_mlp_dropout"}),
           attributes=frozenset({"sliding_window", "original_max_position_embeddings"}),
           rules={"rope_parameters": _whole_rotary, "partial_rotary_factor": _one},
           dropout=("attention_dropout", "embd_pdrop", "resid_pdrop")),
    Family("qwen3_moe", ("Qwen3MoeForCausalLM",), qk_norm="head", moe=True,
           attributes=_MOE | {"decoder_sparse_step", "mlp_only_layers", "moe_intermediate_size",
                              "num_local_experts", "sliding_window", "max_window_layers"},
           rules={"use_sliding_window": _false}),
    Family("olmoe", ("OlmoeForCausalLM",), qk_norm="projection", moe=True, attributes=_MOE,
           rules={"clip_qkv": _none}),
)
_BY_ARCHITECTURE = {a: f for f in FAMILIES for a in f.architectures}
_BY_MODEL_TYPE = {f.model_type or f.name: f for f in FAMILIES}


def as_mapping(config) -> Mapping[str, Any]:
    """A model config as a mapping: a config.json's dict as it is, a transformers config through `to_dict`, another
    object by its attributes."""
    if isinstance(config, Mapping):
        return config
    to_dict = getattr(config, "to_dict", None)
    return to_dict() if to_dict is not None else vars(config)


def architecture_of(config) -> Optional[str]:
    """The config's first architecture (a transformers config: its class name where `architectures` is unset)."""
    mapping = as_mapping(config)
    architectures = mapping.get("architectures") or ()
    if architectures:
        return architectures[0]
    return None


def family_of(config, architecture: Optional[str] = None) -> Optional[Family]:
    """The declared family of a config (by its architecture, or `architecture` where given; by its model_type where it
    names none), or None."""
    architecture = architecture or architecture_of(config)
    if architecture is None:
        return _BY_MODEL_TYPE.get(as_mapping(config).get("model_type"))
    return _BY_ARCHITECTURE.get(architecture)


def fast_path_refusal(config, architecture: Optional[str] = None) -> Optional[str]:
    """Why a model of this config takes its own forward rather than the fast path ("final_logit_softcapping is
    30.0", "Gemma2ForCausalLM has no family declaration"), or None where the fast path computes it. Reads the config
    only (the modules are checked when the model is there: `models.lean_layer.supports`)."""
    architecture = architecture or architecture_of(config)
    family = family_of(config, architecture)
    if family is None:
        return f"{architecture or 'the model'} has no family declaration"
    mapping = as_mapping(config)
    for key in sorted(mapping):
        value = mapping[key]
        if key in family.rules:
            if not family.rules[key](value):
                return f"{key} is {value!r}, which the {family.name} declaration does not compute"
        elif key not in COMMON_ATTRIBUTES and key not in family.attributes and key not in family.dropout and \
                key not in base_attributes():
            return f"{key} is not declared for {family.name}"
    return None


@functools.lru_cache(maxsize=None)
def base_attributes() -> frozenset:
    """What the installed transformers' PretrainedConfig itself carries, every config alike (in 4.x also generation
    defaults and encoder-decoder switches such as add_cross_attention, which a causal LM's layers never read)."""
    try:
        from transformers import PretrainedConfig
    except ImportError:  # (a config read without transformers: COMMON_ATTRIBUTES alone)
        return frozenset()
    return frozenset(PretrainedConfig().to_dict())


def on_fast_path(config, architecture: Optional[str] = None) -> bool:
    """Whether a model of this config takes the fast path (`fast_path_refusal` is None): its layer is a declared
    family's, and its causal-LM forward is lm_head(the last hidden states) and nothing more."""
    return fast_path_refusal(config, architecture) is None


def path_description(config, architecture: Optional[str] = None) -> str:
    """Which forward a model of this config takes, and why, in the words a run prints and plan.json keeps: "fast
    path (qwen3)", or "its own forward (final_logit_softcapping is 30.0, which ...)"."""
    reason = fast_path_refusal(config, architecture)
    return f"fast path ({family_of(config, architecture).name})" if reason is None else f"its own forward ({reason})"


def dropout_refusal(config, family: Family) -> Optional[str]:
    """Why a training pass must take the model's own forward: a dropout the fast path does not apply, or None."""
    mapping = as_mapping(config)
    for key in family.dropout:
        if mapping.get(key):
            return f"{key} is {mapping[key]} in training"
    return None


def windows(config, family: Family) -> list[Optional[int]]:
    """Each decoder layer's sliding window (positions a query attends to, itself included), None for full
    attention, as the model's own masks apply them."""
    mapping = as_mapping(config)
    n, window = mapping["num_hidden_layers"], mapping.get("sliding_window")
    if family.global_window:
        return [window] * n
    types = mapping.get("layer_types") or [FULL] * n
    return [window if t == SLIDING else None for t in types]


def layer_types(config) -> list[str]:
    """Each decoder layer's type (`config.layer_types`, full attention where the config has none): what selects a
    layer's rope where the rotary module keeps one per type (Gemma 3)."""
    mapping = as_mapping(config)
    return list(mapping.get("layer_types") or [FULL] * mapping["num_hidden_layers"])

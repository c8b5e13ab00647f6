"""Tiny local models for the demo, the tests and the benchmarks.

Nothing here downloads anything: a tokenizer is built with `tokenizers` (character-level by default; with
`tokenizer="bytes"` a byte-level BPE trained on a small generated corpus, with a Qwen2.5-style chat template
that renders tools and tool calls), and a small Llama is initialised from a seed. Both are saved as a standard
Hugging Face folder, so training loads them through the real `from_pretrained` path.
"""

from __future__ import annotations

import functools
import string
from pathlib import Path

from tidyrl.models.families import FAMILIES

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
DEFAULT_ALPHABET = string.ascii_lowercase + string.digits + " .,:;!?+-=*/()'\"\n"

# A minimal chat template (ChatML-like) so message-list prompts work with the tiny tokenizer.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def build_char_tokenizer(alphabet: str = DEFAULT_ALPHABET, chat_template: str | None = CHAT_TEMPLATE):
    """A character-level `PreTrainedTokenizerFast`: one token per character, BOS prepended."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set(alphabet + "<>"))  # <> for the chat template's role tags
    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK] + chars)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


# ------------------------------------------------------------------------------------------- byte-level BPE
# The tokenizer of a tiny model that can write tool calls: every byte (so all printable ASCII, JSON included),
# a few hundred merges learned from a generated corpus, ChatML turns and the Hermes/Qwen2.5 tool convention.
PAD_BYTES, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
"""Added tokens, not special ones (as in Qwen2.5): decoding with skip_special_tokens keeps them, so a model's
decoded turn still holds its `<tool_call>...</tool_call>` for `tidyrl.environments.parse_tool_calls`."""

# Qwen2's pre-tokenizer split: single digits, words with one leading non-letter, runs of punctuation.
_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
          r"\s+(?!\S)|\s+")

# Qwen2.5-Instruct's template (tools in the system turn, <tool_call> JSON in assistant turns, tool results as
# <tool_response> in a user turn, consecutive ones grouped), with a shorter default system message.
TOOLS_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}"
    "{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _bpe_corpus() -> list[str]:
    """The generated text the byte-level BPE learns its merges from: tool-call conversations rendered by the
    template (generic tools, JSON arguments and results), short English sentences and numbers. Fixed, so the
    tokenizer is the same on every machine."""
    import json
    import random

    from jinja2 import Environment

    rng = random.Random(0)
    words = ("the a of to and is in it you that for on with as are this be at or from by what how many which "
             "number result answer value name country capital city add multiply sum product two first second "
             "integer string tool call function user assistant system please compute look up return").split()
    tools = []
    for name, params in [("add", {"a": "integer", "b": "integer"}), ("multiply", {"a": "integer", "b": "integer"}),
                         ("capital", {"country": "string"}), ("lookup", {"key": "string"}),
                         ("get_weather", {"city": "string"}), ("search", {"query": "string"})]:
        tools.append({"type": "function", "function": {
            "name": name, "description": f"The {name} tool.",
            "parameters": {"type": "object", "properties": {p: {"type": t, "description": f"the {p}"}
                                                            for p, t in params.items()},
                           "required": list(params)}}})
    env = Environment()
    env.filters["tojson"] = lambda x: json.dumps(x)
    template = env.from_string(TOOLS_CHAT_TEMPLATE)
    texts = []
    for _ in range(200):
        tool = rng.choice(tools)
        args = {p: (rng.randrange(1000) if spec["type"] == "integer" else
                    "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8))).title())
                for p, spec in tool["function"]["parameters"]["properties"].items()}
        result = rng.randrange(100000) if "a" in args else rng.choice(words).title()
        question = " ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) + "?"
        messages = [{"role": "user", "content": question},
                    {"role": "assistant", "content": "<tool_call>\n" + json.dumps(
                        {"name": tool["function"]["name"], "arguments": args}) + "\n</tool_call>"},
                    {"role": "tool", "content": json.dumps({"name": tool["function"]["name"], "result": result})},
                    {"role": "assistant", "content": str(result)}]
        texts.append(template.render(messages=messages, tools=rng.sample(tools, 2) if rng.random() < 0.5 else None,
                                     add_generation_prompt=False))
    return texts


def build_bytes_tokenizer(num_merges: int = 300, chat_template: str | None = TOOLS_CHAT_TEMPLATE):
    """A byte-level BPE `PreTrainedTokenizerFast` (the ecosystem's default kind, as GPT-2's and Qwen's): the 256
    bytes, then `num_merges` merges learned from `_bpe_corpus()`, then the special tokens (`<|endoftext|>` pads,
    `<|im_end|>` ends a turn and is the EOS, `<|im_start|>` opens one) and the tool tags as added tokens. No BOS,
    as Qwen2.5. Any text round-trips."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    core.decoder = decoders.ByteLevel()
    core.post_processor = processors.ByteLevel(trim_offsets=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + num_merges, initial_alphabet=alphabet,
                                  show_progress=False, min_frequency=2)
    core.train_from_iterator(_bpe_corpus(), trainer=trainer)
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (PAD_BYTES, IM_START, IM_END)])
    core.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TAGS])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=IM_END, pad_token=PAD_BYTES,
                                  additional_special_tokens=[IM_START])
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def build_tiny_llama(vocab_size: int, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     intermediate_size: int | None = None, max_position_embeddings: int = 256, seed: int = 0,
                     bos_token_id: int = 1, eos_token_id: int = 2, pad_token_id: int = 0,
                     num_kv_heads: int | None = None, tie_word_embeddings: bool = False):
    """A randomly initialised `LlamaForCausalLM`, reproducible from `seed` (grouped-query attention with
    `num_kv_heads` < `num_heads`; `vocab_size` may exceed the tokenizer's, as real models' often do)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads or num_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


MOE_FAMILIES = tuple(f.name for f in FAMILIES if f.moe)
"""`build_tiny_moe` and `save_tiny_model(family=...)`: the mixture-of-experts families tidyrl declares."""


def build_tiny_moe(family: str, vocab_size: int, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                   num_experts: int = 4, experts_per_token: int = 2, expert_size: int | None = None,
                   norm_topk_prob: bool = True, max_position_embeddings: int = 256, seed: int = 0,
                   bos_token_id: int = 1, eos_token_id: int = 2, pad_token_id: int = 0,
                   num_kv_heads: int | None = None, tie_word_embeddings: bool = False,
                   router_aux_loss_coef: float = 0.01, output_router_logits: bool = False):
    """A randomly initialised mixture-of-experts causal LM, reproducible from `seed`: `Qwen3MoeForCausalLM`
    (`family="qwen3_moe"`: q/k norms per head, every layer sparse) or `OlmoeForCausalLM` ("olmoe": q/k norms over
    the projection), `num_experts` experts of `expert_size` (default 2 * hidden_size) per layer, the top
    `experts_per_token` chosen per token. The router's auxiliary loss (Switch Transformer's load balancing) is the
    model's own training's where `output_router_logits`, at `router_aux_loss_coef`."""
    import torch
    import transformers

    if family not in MOE_FAMILIES:
        raise ValueError(f"family={family!r}: choose one of {MOE_FAMILIES}")
    size = expert_size or 2 * hidden_size
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                  num_attention_heads=num_heads, num_key_value_heads=num_kv_heads or num_heads,
                  max_position_embeddings=max_position_embeddings, bos_token_id=bos_token_id,
                  eos_token_id=eos_token_id, pad_token_id=pad_token_id, tie_word_embeddings=tie_word_embeddings,
                  num_experts=num_experts, num_experts_per_tok=experts_per_token, norm_topk_prob=norm_topk_prob,
                  router_aux_loss_coef=router_aux_loss_coef, output_router_logits=output_router_logits)
    declared = next(f for f in FAMILIES if f.name == family)
    config = transformers.AutoConfig.for_model(declared.model_type or declared.name, **common, intermediate_size=size)
    if hasattr(config, "moe_intermediate_size"):  # (experts of their own size, every layer sparse)
        config.update(dict(head_dim=hidden_size // num_heads, moe_intermediate_size=size, decoder_sparse_step=1,
                           mlp_only_layers=[]))
    model_class = getattr(transformers, declared.architectures[0])
    torch.manual_seed(seed)
    return model_class(config)


TOKENIZERS = ("chars", "bytes")
"""`save_tiny_model(tokenizer=...)`: "chars" (the default: 59 symbols, a 256-token context, the demo's model)
or "bytes" (a byte-level BPE with tool-calling chat template and a 512-token context: a model that can write
`<tool_call>{json}</tool_call>`)."""


def save_tiny_model(folder: str | Path, *, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, alphabet: str = DEFAULT_ALPHABET,
                    chat_template: str | None = CHAT_TEMPLATE, tokenizer: str = "chars",
                    max_position_embeddings: int | None = None, family: str | None = None) -> Path:
    """Build a tokenizer and a tiny Llama (`family`: or a mixture of experts of `MOE_FAMILIES`, `build_tiny_moe`'s
    defaults) and save both into `folder` (a Hugging Face model folder). With
    `tokenizer="chars"` (default) the character tokenizer of `alphabet` and `chat_template`, a 256-token context;
    with `tokenizer="bytes"` the byte-level BPE of `build_bytes_tokenizer` and its tool-calling template (a
    `chat_template` other than the default replaces it), a 512-token context."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer={tokenizer!r}: choose one of {TOKENIZERS}")
    folder = Path(folder)
    if tokenizer == "bytes":
        tok = build_bytes_tokenizer(chat_template=TOOLS_CHAT_TEMPLATE if chat_template is CHAT_TEMPLATE
                                    else chat_template)
    else:
        tok = build_char_tokenizer(alphabet, chat_template)
    context = max_position_embeddings or (512 if tokenizer == "bytes" else 256)
    build = build_tiny_llama if family is None else functools.partial(build_tiny_moe, family)
    model = build(
        len(tok), hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, seed=seed,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        max_position_embeddings=context,
    )
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


# A reward model's own conventions, deliberately unlike the policy's: another vocabulary order (so the same
# character has other ids), extra tokens, and another chat template.
RM_CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
)


def save_tiny_reward_model(folder: str | Path, *, seed: int = 0, hidden_size: int = 32, num_layers: int = 2,
                           num_heads: int = 2, num_labels: int = 1, pad_token: bool = True,
                           chat_template: str | None = RM_CHAT_TEMPLATE) -> Path:
    """A tiny `LlamaForSequenceClassification` reward model with its own char tokenizer and chat template."""
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    folder = Path(folder)
    tok = build_char_tokenizer(DEFAULT_ALPHABET[::-1] + "[]#", chat_template)
    if not pad_token:
        tok.pad_token = None
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                         max_position_embeddings=256, num_labels=num_labels, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(config)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder

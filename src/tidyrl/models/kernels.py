"""Which of tidyrl's own kernels a model runs: the choice (`Kernels`), carried by the model itself, and the
developer overrides of it in the environment. The one module that reads those variables.

A run takes the choice from its config's `kernels` section; the loading functions (`models.loading`) attach it to
each model they load (`attach`), and each fast part reads it from the model it is handed (`kernels_of`):
- `chunked_head`: `models.chunked_head` (the output layer applied in chunks, CUDA);
- `fused_decode`, `decode_attention`: `models.fused_decode` (the decoding step's Triton kernels, CUDA), read by
  `lean_decode.DecodeStep` and `generation`'s draw;
- `fused_logprobs`: `models.fused_logprobs` (log-probs and entropies in one pass, CUDA), read by
  `models.forward` and handed to `models.ops` and `models.chunked_head` as an argument (they take tensors);
- `layer_kernels`: `models.layer_kernels` (the trained model's decoder layers compiled, CUDA);
- `recompute`: `models.recompute` (norms and MLP products recomputed in the backward pass, CUDA).
None of them changes anything on a CPU.

Why on the model and not an argument of every forward: the choice is a fact of how a run computes with that model,
fixed when it is loaded, and the fast parts are reached from many call sites (scoring, the update, decoding, the
held-out evaluation) that all hold the model. It is set on the transformers model itself, under any peft, DDP or
FSDP2 wrapping (FSDP2 shards in place; peft and DDP wrap), which is where every fast part already looks for the
layers it works on (`_inner`); a deep copy (the behaviour copy of `rollout.lag`) keeps it. A model tidyrl did not
load (a test's, a benchmark's) has the defaults.

Developer overrides (`OVERRIDES`, for benchmarks): a variable set in the environment replaces the value of its key
in every choice attached or defaulted in that process. A run names each in its start line, in plan.json
(`kernel_overrides`) and in its end-of-run summary; config.yaml keeps the configured values. A value that is not
one of the variable's (`override_problems`) stops the run before anything loads. An empty variable counts as unset.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from tidyrl.algorithms.choices import DECODE_ATTENTIONS, LAYER_KERNEL_MODES


@dataclass(frozen=True)
class Kernels:
    """The choice of kernels, one field per `kernels.<key>` of the config (tidyrl.config.KernelsConfig documents
    each; tests/test_config.py checks that the two agree). Defaults: every kernel on, the recompute off."""

    chunked_head: bool = True
    fused_decode: bool = True
    decode_attention: str = "kernel"
    fused_logprobs: bool = True
    layer_kernels: str = "compile"
    recompute: bool = False

    def __post_init__(self):
        problems = [p for name in FIELDS if (p := value_problem(name, getattr(self, name)))]
        if problems:
            raise ValueError("; ".join(f"kernels.{p}" for p in problems))

    @classmethod
    def of(cls, choice: Any) -> "Kernels":
        """`choice` as a Kernels: a Kernels, or any record with its fields (the config's `kernels` section)."""
        if isinstance(choice, cls):
            return choice
        missing = [name for name in FIELDS if not hasattr(choice, name)]
        if missing:
            raise TypeError(f"{type(choice).__name__} is not a choice of kernels: it lacks {', '.join(missing)}")
        return cls(**{name: getattr(choice, name) for name in FIELDS})


FIELDS = tuple(f.name for f in dataclasses.fields(Kernels))
CHOICES = {"decode_attention": DECODE_ATTENTIONS, "layer_kernels": LAYER_KERNEL_MODES}
"""The fields that take a name, and their names; every other field is true or false."""


def value_problem(name: str, value) -> Optional[str]:
    """What is wrong with `value` for the field `name` ("<name>: ..."), or None."""
    if name in CHOICES:
        return None if value in CHOICES[name] else f"{name}: {value!r} is not one of {', '.join(CHOICES[name])}"
    return None if isinstance(value, bool) else f"{name}: must be true or false, got {value!r}"


OVERRIDES = {
    "chunked_head": "TIDYRL_CHUNKED_HEAD",
    "fused_decode": "TIDYRL_FUSED_DECODE",
    "decode_attention": "TIDYRL_DECODE_ATTENTION",
    "fused_logprobs": "TIDYRL_FUSED_LOGPROBS",
    "layer_kernels": "TIDYRL_LAYER_KERNELS",
    "recompute": "TIDYRL_RECOMPUTE",
}
"""field -> the environment variable that overrides it (a developer's switch for benchmarks). A true/false field
takes 1 or 0 (also true/false), a named one its names."""
BOOLEAN_WORDS = {"1": True, "true": True, "0": False, "false": False}


class Override(NamedTuple):
    """One developer override in effect: `kernels.<key>` set to `value` by `variable`=`raw`."""

    key: str
    variable: str
    raw: str
    value: Any

    def describe(self) -> str:
        return f"{self.variable}={self.raw} sets kernels.{self.key} to {shown(self.value)}"


def overrides(environ=None) -> list[Override]:
    """The overrides set in `environ` (default: the process's environment), in field order. A value that is not
    one of its variable's raises ValueError naming the variable, the key and the values it takes."""
    problems = override_problems(environ)
    if problems:
        raise ValueError("; ".join(problems))
    return [o for o in _read(environ) if o.value is not None]


def override_problems(environ=None) -> list[str]:
    """Each override set in `environ` whose value is not one of its variable's, as a sentence: the checks a run
    makes before anything loads (`tidyrl.api.check_parts`)."""
    takes = {name: " or ".join(CHOICES.get(name, ("1", "0"))) for name in FIELDS}
    return [f"{o.variable}={o.raw!r} (a developer override of kernels.{o.key}): expected {takes[o.key]}; unset it "
            f"and set kernels.{o.key} in the config instead" for o in _read(environ) if o.value is None]


def _read(environ) -> list[Override]:
    """Every override variable set (not empty) in `environ`, its value parsed (None where it is not one it takes)."""
    environ = os.environ if environ is None else environ
    found = []
    for name, variable in OVERRIDES.items():
        raw = environ.get(variable, "").strip()
        if not raw:
            continue
        if name in CHOICES:
            value = raw.lower() if raw.lower() in CHOICES[name] else None
        else:
            value = BOOLEAN_WORDS.get(raw.lower())
        found.append(Override(name, variable, raw, value))
    return found


def with_overrides(kernels: Kernels, environ=None) -> Kernels:
    """`kernels` with the developer overrides set in `environ` (default: the process's environment) in place."""
    return dataclasses.replace(kernels, **{o.key: o.value for o in overrides(environ)})


def defaults() -> Kernels:
    """The choice of a model tidyrl did not load: the defaults, with the developer overrides set now."""
    return with_overrides(Kernels())


ATTRIBUTE = "_tidyrl_kernels"


def attach(model, choice: Any = None):
    """Give `model` (a transformers model, under any peft or DDP wrapper) the choice of kernels its fast parts read:
    `choice` (a Kernels, or the config's `kernels` section; None: the defaults) with the developer overrides set
    now. Returns `model`."""
    setattr(_inner(model), ATTRIBUTE, with_overrides(Kernels() if choice is None else Kernels.of(choice)))
    return model


def kernels_of(model) -> Kernels:
    """The choice of kernels `attach` gave `model` (looked up through peft and DDP), or `defaults()`."""
    found = getattr(_inner(model), ATTRIBUTE, None)
    return found if found is not None else defaults()


def _inner(model):
    """The transformers model inside peft's and DDP's wrappers: where every fast part finds its layers."""
    from tidyrl.models.sharding import base_of, ddp_inner

    return base_of(ddp_inner(model))


def shown(value) -> str:
    """A field's value as the YAML config writes it (true/false, or the name)."""
    return str(value).lower() if isinstance(value, bool) else str(value)

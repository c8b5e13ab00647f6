"""Reward functions: load them from the config, call them, combine them.

A reward function scores a batch of completions:

    def exact_match(prompts, completions, completion_ids, answer, **kwargs) -> list[float | None]

It is called with keyword arguments only: `prompts` (the raw prompt of each
sample: a string or a list of chat messages), `completions` (decoded text),
`completion_ids` (token ids), and one list per other dataset column. A
function that takes `**kwargs` receives every column; one with a fixed
signature receives only the arguments it names. It returns one score per
completion; `None` means "this function does not score this sample". The
reward of a sample is the weighted sum over the functions that scored it
(DESIGN §3, step 4).

A reward model (`rewards[i].model`, tidyrl.rewards.reward_models.RewardModel) is called
the same way and scores each sample with its own tokenizer and chat template.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from tidyrl import liveness


class RewardError(RuntimeError):
    """A reward function could not be loaded or returned something unusable."""


# ---------------------------------------------------------------------------
# Loading


@dataclass
class RewardFunction:
    """One configured reward function: its metric name (`reward/<name>`), the callable, its weight."""

    name: str
    fn: Callable
    weight: float
    accepts: Optional[frozenset] = field(default=None, init=False, repr=False, compare=False)
    """Keyword arguments `fn` accepts; None when it takes **kwargs (or cannot be inspected): it gets all."""
    required: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)
    """Keyword arguments `fn` needs (no default)."""
    options: frozenset = field(default=frozenset(), init=False, repr=False, compare=False)
    """Keyword arguments fixed by rewards[i].kwargs (never filled from the data)."""

    def __post_init__(self):
        self.accepts, self.required = keyword_parameters(self.fn)  # once per function, not on every call


def keyword_parameters(fn: Callable) -> tuple[Optional[frozenset], frozenset]:
    """(the keyword arguments `fn` accepts, None when it takes **kwargs or cannot be inspected; those it needs,
    without a default): what a function called by name (a reward function, an agent) is offered and must get."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return None, frozenset()
    accepts = None
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        keyword_kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        accepts = frozenset(p.name for p in parameters if p.kind in keyword_kinds)
    required = frozenset(p.name for p in parameters if p.default is inspect.Parameter.empty
                         and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD))
    return accepts, required


def load_reward_function(
    spec: str | Callable, base_dir: str | None = None, *, key: str = "rewards[i].function"
) -> Callable:
    """Resolve a reward-function spec to a callable.

    `spec` is `package.module:function` (imported), `path/to/file.py:function`
    (loaded from the file; a relative path is looked up in the current
    directory first, then in `base_dir`, the folder of the YAML config), or a
    callable, returned as is. `key` names the config entry in error messages.
    """
    if callable(spec):
        return spec
    if not isinstance(spec, str):
        raise RewardError(f"{key} = {spec!r} must be a string 'module:function' or 'file.py:function', or a callable.")
    target, colon, attribute = spec.rpartition(":")
    if not colon or not target or not attribute:
        raise RewardError(
            f"{key} = {spec!r} must name the function after a colon: "
            "'package.module:function' or 'path/to/file.py:function'."
        )
    if _looks_like_path(target):
        module = _load_module_from_file(target, base_dir, spec, key)
    else:
        module = _import_module(target, spec, key)

    if not hasattr(module, attribute):
        available = _callables_in(module)
        close = difflib.get_close_matches(attribute, available, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise RewardError(
            f"{key} = {spec!r}: module {target!r} has no attribute {attribute!r}. "
            f"Callables available in it: {available or 'none'}.{hint}"
        )
    fn = getattr(module, attribute)
    if not callable(fn):
        raise RewardError(f"{key} = {spec!r}: {attribute!r} is a {type(fn).__name__}, not a callable.")
    return fn


def _looks_like_path(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def _import_module(name: str, spec: str, key: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        if error.name is not None and (name == error.name or name.startswith(error.name + ".")):
            raise RewardError(
                f"{key} = {spec!r}: module {name!r} not found ({error}). Install it or add its folder to "
                "PYTHONPATH, or name a file instead: 'path/to/file.py:function'."
            ) from error
        raise RewardError(f"{key} = {spec!r}: importing module {name!r} failed: {type(error).__name__}: {error}") from error
    except Exception as error:
        raise RewardError(f"{key} = {spec!r}: importing module {name!r} failed: {type(error).__name__}: {error}") from error


def _load_module_from_file(target: str, base_dir: str | None, spec: str, key: str):
    target = os.path.expanduser(target)
    candidates = [target] if os.path.isabs(target) else [os.path.join(os.getcwd(), target)]
    if base_dir is not None and not os.path.isabs(target) and os.path.join(base_dir, target) not in candidates:
        candidates.append(os.path.join(base_dir, target))  # the config file's folder (when not the current one)
    path = next((c for c in candidates if os.path.isfile(c)), None)
    if path is None:
        raise RewardError(f"{key} = {spec!r}: file {target!r} not found; looked at {candidates}.")
    path = os.path.realpath(path)

    # A unique module name per file: two files called rewards.py do not clash,
    # and loading the same file twice reuses the module (shared module state).
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    module_name = f"_tidyrl_reward_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:10]}"
    if module_name in sys.modules:
        return sys.modules[module_name]

    module_spec = importlib.util.spec_from_file_location(module_name, path)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"{key} = {spec!r}: {path!r} cannot be loaded as a Python module (is it a .py file?).")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before running it (dataclasses and pickling look the module up);
    # its folder is on sys.path while it runs, so it can import files next to it.
    sys.modules[module_name] = module
    folder = os.path.dirname(path)
    sys.path.insert(0, folder)
    try:
        module_spec.loader.exec_module(module)
    except BaseException as error:
        del sys.modules[module_name]
        if not isinstance(error, Exception):
            raise
        raise RewardError(f"{key} = {spec!r}: importing {path!r} failed: {type(error).__name__}: {error}") from error
    finally:
        if folder in sys.path:
            sys.path.remove(folder)
    return module


def _callables_in(module) -> list[str]:
    """Public callables of a module, those defined in it first choice."""
    public = {n: v for n, v in vars(module).items() if not n.startswith("_") and callable(v)}
    own = sorted(n for n, v in public.items() if getattr(v, "__module__", None) == module.__name__)
    return own or sorted(public)


def build_reward_functions(reward_cfgs: list, base_dir: str | None = None, *, forward_batch_size: int = 64
                           ) -> list[RewardFunction]:
    """`RewardConfig` entries -> `RewardFunction`s with unique metric names.

    The name is `cfg.name`, else the part after ':' of the spec, else the
    callable's `__name__`; repeated names get `_2`, `_3`, ... in order.
    """
    functions: list[RewardFunction] = []
    used: set[str] = set()
    for i, cfg in enumerate(reward_cfgs):
        if getattr(cfg, "model", None) is not None and cfg.function is not None:
            raise RewardError(f"rewards[{i}] sets both function and model; give one of them per entry.")
        if cfg.function is None and getattr(cfg, "model", None) is None:
            raise RewardError(f"rewards[{i}] sets no function: give rewards[{i}].function = 'module:function' or 'file.py:function'.")
        weight = cfg.weight
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real) or not math.isfinite(weight):
            raise RewardError(f"rewards[{i}].weight = {weight!r} must be a finite number.")
        if cfg.function is None:  # a reward model: its own tokenizer and chat template (tidyrl.rewards.reward_models)
            from tidyrl.rewards.reward_models import RewardModel

            fn = RewardModel(cfg.model, key=f"rewards[{i}].model", batch_size=forward_batch_size,
                             max_length=getattr(cfg, "max_length", None))
        else:
            fn = load_reward_function(cfg.function, base_dir, key=f"rewards[{i}].function")
        options = dict(getattr(cfg, "kwargs", None) or {})

        if cfg.name:
            name = str(cfg.name)
        elif cfg.function is None:
            name = os.path.basename(os.path.normpath(cfg.model)) or "reward_model"
        elif isinstance(cfg.function, str):
            name = cfg.function.rpartition(":")[2]
        else:
            name = getattr(fn, "__name__", None) or type(fn).__name__
            if name.startswith("<"):  # <lambda>
                name = "reward"
        unique, n = name, 1
        while unique in used:
            n += 1
            unique = f"{name}_{n}"
        used.add(unique)
        functions.append(with_options(RewardFunction(name=unique, fn=fn, weight=float(weight)), options, i))
    return functions


def with_options(func: RewardFunction, options: dict, i: int) -> RewardFunction:
    """`func` called with `options` (rewards[i].kwargs) as fixed keyword arguments on every call. An option the
    function does not take is refused here, before any model loads; a data column of the same name does not
    reach the function (the option wins)."""
    if not options:
        return func
    unknown = sorted(o for o in options if func.accepts is not None and o not in func.accepts)
    if unknown:
        raise RewardError(f"rewards[{i}].kwargs: {func.name!r} takes no argument(s) {unknown}; its keyword "
                          f"arguments are {sorted(func.accepts)}.")
    bound = RewardFunction(name=func.name, fn=functools.partial(func.fn, **options), weight=func.weight)
    bound.accepts = None if func.accepts is None else func.accepts - set(options)
    bound.required = func.required - set(options)
    bound.options = frozenset(options)
    return bound


# ---------------------------------------------------------------------------
# Scoring


@dataclass
class RewardResult:
    """Rewards of one batch of N samples."""

    total: list[float]
    """(N,) weighted sum over the functions that scored each sample."""
    per_function: dict[str, list[float | None]]
    """name -> (N,) raw (unweighted) score, None where the function gave none."""

    def means(self) -> dict[str, float | None]:
        """name -> mean raw score over the samples it scored (None if it scored none): `reward/<name>`."""
        means: dict[str, float | None] = {}
        for name, scores in self.per_function.items():
            scored = [s for s in scores if s is not None]
            means[name] = sum(scored) / len(scored) if scored else None
        return means


ARGUMENTS = ("prompts", "completions", "completion_ids")
"""The keyword arguments every reward function is offered besides the dataset columns."""


def compute_rewards(
    funcs: list[RewardFunction],
    *,
    prompts: list,
    completions: list[str],
    completion_ids: list[list[int]],
    columns: dict[str, list],
) -> RewardResult:
    """Call each reward function on the batch and combine: total = sum of weight * score.

    Raises `RewardError` naming the function (and the sample) when a function
    raises, returns the wrong number of scores or a non-finite / non-numeric
    score, and when a sample is scored by no function at all.
    """
    n = len(completions)
    if len(prompts) != n or len(completion_ids) != n:
        raise ValueError(f"prompts ({len(prompts)}), completions ({n}) and completion_ids ({len(completion_ids)}) differ in length")
    for column, values in columns.items():
        if column in ARGUMENTS:
            raise RewardError(
                f"the dataset column {column!r} has the name of a reward-function argument "
                f"({', '.join(ARGUMENTS)}); rename that column in data.path."
            )
        if len(values) != n:
            raise ValueError(f"column {column!r} has {len(values)} values for {n} completions")
    if not funcs:
        raise RewardError("no reward functions: add at least one entry to `rewards` in the config.")

    offered = {"prompts": list(prompts), "completions": list(completions), "completion_ids": list(completion_ids)}
    offered.update({column: list(values) for column, values in columns.items()})

    raws: dict[str, Any] = {}
    awaiting = {}
    for func in funcs:
        kwargs = _kwargs_for(func, offered)
        try:
            raw = func.fn(**kwargs)
        except Exception as error:
            _raise_on_failing_sample(func, kwargs, offered, n, error)
        liveness.mark(f"called reward function {func.name!r}")
        if inspect.isawaitable(raw):  # an `async def` reward (e.g. one that calls a judge over HTTP)
            awaiting[func.name] = raw
        else:
            raws[func.name] = raw
    if awaiting:  # every async reward of the batch at once, on one event loop
        raws.update(_await_all(awaiting))
    per_function: dict[str, list[float | None]] = {func.name: _check_scores(func, raws[func.name], n)
                                                   for func in funcs}

    for j in range(n):
        if all(per_function[func.name][j] is None for func in funcs):
            raise RewardError(
                f"sample {j} ({_sample_text(offered, j)}) got no score: every reward function "
                f"({', '.join(f.name for f in funcs)}) returned None for it. "
                "Make at least one function score every sample."
            )
    import torch

    exact = {name: torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float64)
             for name, values in per_function.items()}  # float64: the Python floats exactly
    return RewardResult(total=weighted_sum(funcs, exact).tolist(), per_function=per_function)


def weighted_sum(funcs: list[RewardFunction], scores: dict, env=None):
    """Each episode's reward: sum over the functions of weight * score, a function's missing score (NaN) counting
    0, plus the environment's reward (`env`, weight 1) in multi-turn episodes. `scores`: name -> (N,) tensor; the
    sum is in their dtype (the rollouts' float32; compute_rewards' float64, which equals the Python sum). The one
    place rewards are combined."""
    import torch

    total = sum(f.weight * torch.nan_to_num(scores[f.name], nan=0.0) for f in funcs)
    return total + env if env is not None else total


def check_reward_columns(funcs: list[RewardFunction], columns: list[str]) -> None:
    """Before any weights load: every argument a reward function needs (no default) is one it will be offered,
    a standard argument or a column of the prompt data. (Functions taking **kwargs name nothing to check.)"""
    for func in funcs:
        missing = sorted(func.required - set(ARGUMENTS) - set(columns))
        if missing:
            raise RewardError(
                f"reward function {func.name!r} requires argument(s) {missing}, which are neither "
                f"{', '.join(ARGUMENTS)} nor columns of data.path (columns: {columns}). "
                "Add the column to the prompt data or give the argument a default."
            )


def _await_all(awaiting: dict[str, Any]) -> dict[str, Any]:
    """Run the async rewards' coroutines concurrently and return their results by name. On a thread of its own
    when this thread already runs an event loop (a notebook); an async reward that raises is reported by name."""
    import asyncio
    import concurrent.futures

    async def gather():
        return await asyncio.gather(*awaiting.values(), return_exceptions=True)

    try:
        asyncio.get_running_loop()
        running = True
    except RuntimeError:  # no running loop here: the usual case
        running = False
    if running:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            results = pool.submit(asyncio.run, gather()).result()
    else:
        results = asyncio.run(gather())
    out = {}
    for name, result in zip(awaiting, results):
        if isinstance(result, BaseException):
            raise RewardError(f"reward function {name!r} (async) raised {type(result).__name__}: {result}") from result
        out[name] = result
    return out


def _kwargs_for(func: RewardFunction, offered: dict[str, list]) -> dict[str, list]:
    """The keyword arguments `func` accepts: all of them with **kwargs, else only those it names."""
    # Fresh lists per function: one function mutating its inputs cannot change another's.
    kwargs = {name: list(values) for name, values in offered.items()
              if (func.accepts is None or name in func.accepts) and name not in func.options}
    missing = sorted(func.required - set(kwargs))
    if missing:
        columns = [c for c in offered if c not in ARGUMENTS]
        raise RewardError(
            f"reward function {func.name!r} requires argument(s) {missing}, which are neither "
            f"{', '.join(ARGUMENTS)} nor dataset columns (columns: {columns}). "
            "Add the column to the prompt data or give the argument a default."
        )
    return kwargs


def _raise_on_failing_sample(
    func: RewardFunction, kwargs: dict[str, list], offered: dict[str, list], n: int, batch_error: Exception
):
    """The function raised on the batch: call it on each sample alone to name the culprit."""
    for j in range(n):
        single = {name: [values[j]] for name, values in kwargs.items()}
        try:
            func.fn(**single)
        except Exception as error:
            raise RewardError(
                f"reward function {func.name!r} raised on sample {j} ({_sample_text(offered, j)}): "
                f"{type(error).__name__}: {error}"
            ) from error
    raise RewardError(
        f"reward function {func.name!r} raised on the batch of {n} samples, but on no sample alone: "
        f"{type(batch_error).__name__}: {batch_error}"
    ) from batch_error


def _check_scores(func: RewardFunction, raw: Any, n: int) -> list[float | None]:
    if hasattr(raw, "ndim") and hasattr(raw, "tolist"):  # numpy array or torch tensor
        if raw.ndim != 1:
            raise RewardError(
                f"reward function {func.name!r} returned an array of shape {tuple(raw.shape)}; "
                f"expected one score per completion (a list or 1-D array of {n})."
            )
        raw = raw.tolist()
    if not isinstance(raw, (list, tuple)):
        raise RewardError(
            f"reward function {func.name!r} returned a {type(raw).__name__}; "
            f"expected a list of {n} scores (float or None), one per completion."
        )
    if len(raw) != n:
        raise RewardError(
            f"reward function {func.name!r} returned the wrong number of scores: expected {n}, got {len(raw)}."
        )
    scores: list[float | None] = []
    for j, value in enumerate(raw):
        if value is None:
            scores.append(None)
            continue
        number = value.item() if getattr(value, "ndim", None) == 0 and hasattr(value, "item") else value
        if isinstance(number, bool) or not isinstance(number, numbers.Real):
            raise RewardError(
                f"reward function {func.name!r} returned {value!r} for sample {j}; "
                "a score must be a number (int or float, not bool) or None."
            )
        number = float(number)
        if not math.isfinite(number):
            raise RewardError(
                f"reward function {func.name!r} returned {value!r} for sample {j}; a score must be finite (not NaN or inf)."
            )
        scores.append(number)
    return scores


def _sample_text(offered: dict[str, list], j: int) -> str:
    return f"prompt: {_short(offered['prompts'][j])}, completion: {_short(offered['completions'][j])}"


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def rewards_before_run(reward_fns: list) -> list[str]:
    """Each reward function's own check before the run (its `before_run(**options)`, e.g. code_tests: can this
    machine sandbox the code, or did the user allow it unsandboxed). It raises to stop the run; the lines it
    returns go to the run's report (printed by `tidyrl plan` and at the start of a run)."""
    lines = []
    for i, func in enumerate(reward_fns):
        fn, options = func.fn, {}
        if isinstance(fn, functools.partial):  # rewards[i].kwargs, bound by with_options
            fn, options = fn.func, dict(fn.keywords)
        check = getattr(fn, "before_run", None)
        if callable(check):
            try:
                line = check(**options)
            except RewardError as err:  # its own errors take one message: say which reward it is
                raise type(err)(f"rewards[{i}] ({func.name}): {err}") from None
            if line:
                lines.append(f"rewards[{i}] ({func.name}): {line}")
    return lines

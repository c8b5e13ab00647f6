"""Shared fixtures: a tiny local model folder (no downloads) and a prompt file."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import warnings
from typing import Optional

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite's training runs are CPU runs, also on a machine with a GPU: their expected numbers, host-memory and
# process checks are the CPU's (accelerate would otherwise put every run on the GPU). Tests of the GPU itself
# (tests/test_cuda.py, marked `cuda`) unset this for their own runs; `ACCELERATE_USE_CPU=0 pytest` runs the rest on
# the GPU too.
os.environ.setdefault("ACCELERATE_USE_CPU", "1")
# Other CPU kernels, for the tests that claim bit-equality between code paths (marked `kernels`): which GEMM or
# vectorised kernel a CPU takes (oneDNN's bf16/fp16 GEMMs where the CPU has native bf16/fp16, AVX-512 or AVX2, the
# number of threads) may decide whether two paths round alike. CI reruns them with TIDYRL_TEST_ONEDNN=0 (torch's
# own GEMMs, not oneDNN's), ATEN_CPU_CAPABILITY=default (no vectorised kernels) and OMP_NUM_THREADS=1, so a claim
# that holds on one kernel only fails in CI, not first on a user's machine.
if os.environ.get("TIDYRL_TEST_ONEDNN") == "0":
    torch.backends.mkldnn.enabled = False


# Deprecations that tidyrl's own calls cause fail the suite (pyproject.toml's filterwarnings has the policy and
# the third-party warnings left). The filters there match the module a warning is attributed to, which is
# tidyrl's only when the deprecated function sets its stacklevel to its caller; transformers' are attributed to
# torch's module-call machinery (a deprecated keyword of a forward) or to the deprecated function itself (a
# property). So each deprecation that passes the filters is also judged by its call stack: it is tidyrl's when the
# frame that called the deprecated function, past torch's module-call machinery and the warning package's
# decorator wrappers, is in tidyrl.
DEPRECATIONS = (DeprecationWarning, PendingDeprecationWarning, FutureWarning)
_CALL_MACHINERY = ("torch.nn.modules.module", "functools", "contextlib", "torch.utils._contextlib")


def _package(frame) -> str:
    return frame.f_globals.get("__name__", "").partition(".")[0]


def caused_by_tidyrl(site) -> bool:
    """Whether a warning issued by a third party at frame `site` (the one that called warnings.warn) is about a
    call tidyrl made: whether the caller of the function that issued it, past torch's module-call machinery and
    the closures of that function's package (decorators' wrappers), is tidyrl. Warnings issued at a tidyrl line
    (tidyrl's own, about its callers, or a C function's that tidyrl called) are judged by whom they are attributed
    to, by the filters: False here."""
    issuer, frame = _package(site), site.f_back
    if issuer == "tidyrl":
        return False
    while frame is not None and (frame.f_globals.get("__name__", "").startswith(_CALL_MACHINERY)
                                 or (_package(frame) == issuer and frame.f_code.co_freevars)):
        frame = frame.f_back
    return frame is not None and _package(frame) == "tidyrl"


def _warning_site():
    """The frame that called warnings.warn, seen from inside the warnings machinery (this module's frames and the
    warnings module's skipped)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") in (__name__, "warnings"):
        frame = frame.f_back
    return frame


_TIDYRL_DEPRECATIONS = pytest.StashKey[list]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Inside pytest's recording of each test's warnings: a deprecation caused by tidyrl's call is raised where
    it is issued, as an error (the others are recorded as pytest records them)."""
    record, caught = warnings._showwarnmsg_impl, item.stash.setdefault(_TIDYRL_DEPRECATIONS, [])

    def judged(message):
        if issubclass(message.category, DEPRECATIONS):
            site = _warning_site()
            if site is not None and caused_by_tidyrl(site):
                caught.append(f"{message.category.__name__}: {message.message}")
                raise message.message
        record(message)

    warnings._showwarnmsg_impl = judged
    try:
        return (yield)
    finally:
        warnings._showwarnmsg_impl = record


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """The test fails also where code between the deprecated call and the test caught the error (`except
    Exception`)."""
    result = yield
    caught = item.stash.get(_TIDYRL_DEPRECATIONS, [])
    if caught:
        pytest.fail("deprecations caused by tidyrl's calls:\n" + "\n".join(caught), pytrace=False)
    return result


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tidyrl.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0, hidden_size=32, num_layers=2,
                           num_heads=2)


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    words = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon", "mango", "peach"]
    with open(path, "w") as f:
        for w in words:
            f.write(json.dumps({"prompt": f"{w}:", "word": w}) + "\n")
    return path


def with_sections(cfg: dict, sections: dict) -> dict:
    """`cfg` with each section updated by the dict in `sections` (a non-dict value replaces the key)."""
    for section, values in sections.items():
        if isinstance(values, dict):
            cfg[section] = {**cfg.get(section, {}), **values}
        else:
            cfg[section] = values
    return cfg


def words_reward(completions, word, **_):
    """The share of each completion's characters found in its prompt's word (`prompt_file`'s `word` column)."""
    return [sum(c in w for c in t) / len(t) if t else 0.0 for t, w in zip(completions, word)]


def grpo_config(model_dir, prompt_file, out, rollouts: int, **sections) -> dict:
    """A small GRPO run of the tiny model on `prompt_file`, rewarded by `words_reward`; `sections` override."""
    cfg = {
        "algorithm": "grpo",
        "model": str(model_dir),
        "output_dir": str(out),
        "data": {"path": str(prompt_file)},
        "rewards": [{"function": words_reward}],
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 4, "max_new_tokens": 5},
        "train": {"rollouts": rollouts, "micro_batch_size": 4, "minibatches_per_epoch": 2, "learning_rate": 1e-3},
        "log": {"progress_bar": False},
    }
    return with_sections(cfg, sections)


def free_port() -> int:
    """A port no other test run holds (two suites at once must not meet on one rendezvous port)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gloo_cpu_env(**extra) -> dict:
    """The environment of a test that runs several processes on CPU with gloo: CUDA hidden, so that on a
    machine with one GPU the test still runs what it means to (two CPU processes), not a CUDA launch."""
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", **extra)


def torchrun_train(config: dict, folder, world: int = 2) -> None:
    """`tidyrl train` on `world` gloo processes under torchrun (the config dict saved as YAML in `folder`)."""
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    path = Path(folder) / "torchrun.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
                           "--master_port", str(free_port()), "-m", "tidyrl", "train", str(path)],
                          env=gloo_cpu_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def read_jsonl(path) -> list[dict]:
    """The rows of a .jsonl file a run wrote."""
    from pathlib import Path

    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def write_jsonl(path, rows: list[dict]):
    from pathlib import Path

    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def expected_lrs(total: int, warmup: int, name: str, lr: float) -> list[float]:
    """The rates transformers.get_scheduler gives over `total` steps, stepped once per step: what every
    stage's metrics.jsonl `lr` column must equal."""
    from transformers import get_scheduler

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = get_scheduler(name, opt, num_warmup_steps=warmup, num_training_steps=total)
    lrs = []
    for _ in range(total):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return lrs


VOCAB = 40  # the vocabulary of the Llama-layout test models below


def llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0, eos_token_id=2)
    config.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**config)).eval()


def qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        pad_token_id=0, eos_token_id=2)).eval()


def mistral():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=1, sliding_window=None,
                                            max_position_embeddings=128, pad_token_id=0, eos_token_id=2)).eval()


def own_completion_logits(model, prompt_ids, prompt_mask, completion_ids, completion_mask) -> torch.Tensor:
    """The model's own forward over [prompt, completion] with the rows' mask and positions (cumsum - 1): logits
    (B, Tc, V), position t predicting completion token t: what the fast paths must reproduce."""
    rows = torch.cat([prompt_ids, completion_ids], dim=1)
    attn = torch.cat([prompt_mask, completion_mask.long()], dim=1)
    out = model(input_ids=rows, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0), use_cache=False)
    return out.logits[:, prompt_ids.shape[1] - 1: -1]


def with_random_norms_and_biases(model):
    """`model` with its RMSNorm weights and linear biases drawn at random: freshly initialised they are ones
    and zeros, under which a pass that skipped a norm weight or misplaced a bias would still match."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.copy_(1 + 0.3 * torch.randn(module.weight.shape, generator=g))
            elif isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.copy_(0.05 * torch.randn(module.bias.shape, generator=g))
    return model


# Tiny random models of every layout tidyrl.models.lean_decode / lean_forward compute, with the features that
# change the maths: grouped-query heads, biases, rope scalings, tied embeddings, eager attention.
_LAYOUTS = {
    "llama-gqa": lambda: llama(),
    "llama-mha-bias": lambda: llama(num_key_value_heads=4, attention_bias=True, mlp_bias=True),
    "llama-linear-rope": lambda: llama(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}),
    "llama3-rope": lambda: llama(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
                                                   "rope_theta": 10000.0}),
    "llama-dynamic-rope": lambda: llama(max_position_embeddings=12,
                                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
    "llama-tied-eager": lambda: llama(tie_word_embeddings=True, attn_implementation="eager"),
    "qwen2": qwen2,
    "mistral": mistral,
}
LLAMA_LAYOUTS = {name: (lambda build=build: with_random_norms_and_biases(build())) for name, build in _LAYOUTS.items()}



def completion_batch(seed: int):
    """Four episodes over the 40-token test vocabulary, as `models.forward.completion_logprobs` takes them: prompts
    left-padded (row 1), completions right-padded (row 2 ends early); and a weight per completion token for a loss.
    Returns ((prompt_ids, prompt_mask, completion_ids, completion_mask), weights)."""
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, VOCAB, (4, 5), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1, :2] = 0
    prompt_ids[1, :2] = 0
    completion_ids = torch.randint(3, VOCAB, (4, 6), generator=g)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[2, 4:] = 0
    return (prompt_ids, prompt_mask, completion_ids, completion_mask), torch.randn(4, 6, generator=g)


def within_bf16_units(got: torch.Tensor, want: torch.Tensor, units: float) -> bool:
    """|got - want| at most `units` bf16 units of `want`'s largest magnitude, everywhere: the gradients of two
    computations whose low-precision products round apart (an element's own ulp is no bound where sums cancel)."""
    return bf16_units(got, want) <= units


def bf16_units(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest |got - want| in bf16 units of `want`'s largest magnitude (see `within_bf16_units`)."""
    scale = want.float().abs().max().clamp(min=1e-30) * torch.finfo(torch.bfloat16).eps
    return float((got.float() - want.float()).abs().max() / scale)


def bf16_grpo_metrics(model_dir, prompt_file, folder, lora: bool = False, kernels: Optional[dict] = None
                      ) -> list[dict]:
    """The metrics rows of a bf16 GRPO run: one rollout of 2 prompts x 4 samples, the KL's reference scored in
    chunks of 4, two epochs of 2 micro-batches (the same samples for both optimizer steps); with `lora`, a rank-4
    adapter on every linear layer but the output layer (the reference: the adapter disabled), at a learning rate
    that moves the model's bf16 outputs in one step (B starts at zero); `kernels`: the config's kernels section."""
    import tidyrl

    result = tidyrl.train({**({"lora": {"enabled": True, "r": 4}} if lora else {}),
        **({"kernels": kernels} if kernels is not None else {}),
        "algorithm": "grpo", "model": str(model_dir), "model_dtype": "bfloat16", "output_dir": str(folder),
        "seed": 0, "data": {"path": str(prompt_file)}, "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 4, "max_new_tokens": 6, "temperature": 0.9,
                    "forward_batch_size": 4},
        "train": {"rollouts": 1, "epochs_per_rollout": 2, "micro_batch_size": 4,
                  **({"learning_rate": 1e-2} if lora else {})},  # (the adapter's first step moves the bf16 outputs)
        "grpo": {"kl_coef": 0.04}, "log": {"progress_bar": False},
    })
    return read_jsonl(result.output_dir / "metrics.jsonl")


def interpreted_triton(monkeypatch, module: str):
    """tidyrl.models.<module>, its Triton kernels run by Triton's interpreter on CPU tensors (where Triton is
    installed: CUDA builds of torch bring it; tests/test_cuda.py runs them compiled on a GPU). Triton reads
    TRITON_INTERPRET when it is imported: None where it was imported before, and the caller reruns itself in a
    process of its own (`rerun_interpreted`)."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("Triton is not installed (it comes with CUDA builds of torch)")
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        return None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernels = importlib.import_module(f"tidyrl.models.{module}")
    kernels._kernels.cache_clear()  # (the caller clears it again after the test: the interpreted kernels go)
    return kernels


def rerun_interpreted(test: str) -> None:
    """Run one test (a pytest node id) in a new process with TRITON_INTERPRET=1 and assert that it passed."""
    import subprocess

    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                          env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-3000:]


@contextlib.contextmanager
def recorded_outputs(keep):
    """Every op dispatched inside the block whose tensor output `keep(func, out)` accepts, appended to the yielded
    list as (func, output shape, output storage pointer): what a pass allocates, counted op by op."""
    from torch.utils._python_dispatch import TorchDispatchMode

    found = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and keep(func, out):
                found.append((func, tuple(out.shape), out.untyped_storage().data_ptr()))
            return out

    with Recorder():
        yield found


def vocabulary_slice_backwards(fn, vocab: int) -> tuple[object, list]:
    """fn() (a loss), then its backward pass, recording every slice_backward whose output is vocabulary-wide: a
    zero-filled copy of logits that a slice of them costs the backward pass. Returns (the loss, those outputs'
    shapes)."""
    loss = fn()
    with recorded_outputs(lambda func, out: func == torch.ops.aten.slice_backward.default
                          and out.shape[-1] == vocab) as found:
        loss.backward()
    return loss, [shape for _, shape, _ in found]


def proc_status_bytes(key: str) -> int:
    """One memory figure of this process from /proc/self/status (Linux), in bytes: "VmRSS:", "VmHWM:", ..."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def load_measuring_host_peak(load):
    """(load(), how far the process's peak RSS rose above its RSS before, in bytes). Linux: writing 5 to
    /proc/self/clear_refs resets the peak (VmHWM) to the current RSS."""
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("resets the peak RSS through /proc/self/clear_refs (Linux)")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = proc_status_bytes("VmRSS:")
    result = load()
    return result, proc_status_bytes("VmHWM:") - before

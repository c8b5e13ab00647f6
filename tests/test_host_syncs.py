"""No host synchronisation inside the loops over micro-batches and scoring chunks.

On a GPU every read of a device value on the host (`.item()`, `float(t)`, `.cpu()`, a data-dependent shape such as
`torch.unique` or `nonzero`) and every blocking host-to-device copy waits until the device has run all the work
queued before it: once per micro-batch that is a stall per micro-batch. Without a GPU the same property is
checked on the "meta" device, which has no data at all, so every such read raises: the update's micro-batch
loop runs with the model on meta and the rollout on the host, as it runs with the model on a GPU.
(tests/test_cuda.py checks the same on a GPU with torch.cuda.set_sync_debug_mode("error").)
"""

from __future__ import annotations

import pytest
import torch
from conftest import with_sections

import tidyrl
from tidyrl.models.devices import to_device
from tidyrl.loops.rl import learner as rl
from tidyrl.models.collectives import Sums


def test_host_tensors_go_to_a_cuda_device_through_pinned_memory_without_waiting(monkeypatch):
    host = torch.arange(6).view(2, 3)
    assert to_device(host, "cpu") is host and to_device(None, "cuda") is None
    calls = []

    class Pinned:
        def to(self, device, non_blocking=False):
            calls.append(("to", device, non_blocking))
            return "on the device"

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: calls.append(("pin", self.shape)) or Pinned())
    assert to_device(host, "cuda") == "on the device"
    assert calls == [("pin", (2, 3)), ("to", torch.device("cuda"), True)]


def test_sums_stay_on_the_device_when_host_numbers_are_added():
    """A host value after a device one is read as a number; moving the sums back to the host would wait."""
    sums = Sums("loss", "value_loss", "tokens")
    sums.add(loss=torch.ones((), device="meta"))
    sums.add(value_loss=torch.zeros(()), tokens=3.0)
    assert sums._values.device.type == "meta"
    host = Sums("loss")
    host.add(loss=torch.tensor(2.5))
    host.add(loss=1.5)
    assert host._values.device.type == "cpu" and host._values.tolist() == [4.0]


@pytest.fixture
def autocast_takes_meta(monkeypatch):
    """transformers < 5 computes its rotary embedding under `torch.autocast(device_type=x.device.type,
    enabled=False)`, which torch refuses for the meta device; disabled autocast is the same on any device type."""
    real = torch.autocast
    monkeypatch.setattr(torch, "autocast", lambda device_type, *a, **kw: real(
        "cpu" if device_type == "meta" else device_type, *a, **kw))


class _LoopDone(Exception):
    pass


class _MetaAccelerator:
    """The run's accelerator with `device` the meta device: where the update puts what it computes."""

    def __init__(self, real):
        self._real = real

    device = torch.device("meta")

    def __getattr__(self, name):
        return getattr(self._real, name)


@pytest.mark.parametrize("case", ["grpo-kl-epochs", "grpo-importance-weights", "rloo-kl-in-reward", "ppo",
                                  "grpo-model-forward", "grpo-cuda-layouts"])
def test_the_update_reads_nothing_back_from_the_device_inside_its_micro_batch_loop(case, tiny_model_dir, prompt_file,
                                                                                   tmp_path, monkeypatch,
                                                                                   autocast_takes_meta):
    """The rollout is generated and scored for real; then the model (and critic) move to the meta device and the
    first optimizer step runs its 3 micro-batches there, up to the step's one reduction of its sums. Any
    `.item()`, `.cpu()`, `nonzero`, `unique` or list index of a device tensor in between raises."""
    sections = {
        "grpo-kl-epochs": {"grpo": {"kl_coef": 0.04}, "train": {"epochs_per_rollout": 2}},
        "grpo-importance-weights": {"rollout": {"tis_cap": 2.0}, "train": {"epochs_per_rollout": 2}},
        "rloo-kl-in-reward": {"algorithm": "rloo", "rloo": {"kl_coef": 0.05}},
        "ppo": {"algorithm": "ppo", "ppo": {"kl_coef": 0.05}},  # the critic: the model's own forward
        "grpo-model-forward": {"grpo": {"kl_coef": 0.04}, "model_fast_paths": False},  # shared-prompt passes
        "grpo-cuda-layouts": {"grpo": {"kl_coef": 0.04}, "train": {"epochs_per_rollout": 2}},  # as on CUDA, below
    }[case]
    if case == "grpo-cuda-layouts":  # the update on meta takes the layouts CUDA takes (models.forward.LAYOUTS)
        from tidyrl.models import forward

        monkeypatch.setitem(forward.LAYOUTS, "meta", forward.layouts_for("cuda"))
    config = with_sections({
        "algorithm": "grpo", "model": str(tiny_model_dir), "output_dir": str(tmp_path / "run"), "seed": 0,
        "data": {"path": str(prompt_file)}, "rewards": [{"function": "tidyrl.demo:anagram_reward"}],
        "rollout": {"prompts_per_rollout": 3, "samples_per_prompt": 4, "max_new_tokens": 6},
        "train": {"rollouts": 1, "micro_batch_size": 4}, "log": {"progress_bar": False},
    }, sections)
    reached = []
    real_step = rl.optimizer_step

    def step_on_meta(rollout, minibatch, step, *, trainee, accelerator, **kw):
        for model in (trainee.model, trainee.critic):
            if model is not None:
                model.to("meta")
        return real_step(rollout, minibatch, step, trainee=trainee, accelerator=_MetaAccelerator(accelerator), **kw)

    def reduced(self, accelerator):
        reached.append({name: self._values.device.type for name in self.names})
        raise _LoopDone

    monkeypatch.setattr(rl, "optimizer_step", step_on_meta)
    monkeypatch.setattr(Sums, "reduced", reduced)
    with pytest.raises(_LoopDone):
        tidyrl.train(config)
    assert len(reached) == 1 and set(reached[0].values()) == {"meta"}  # the sums were kept on the device


def test_scoring_reads_its_chunks_back_only_once_after_the_last(monkeypatch, autocast_takes_meta):
    """`score_logprobs` (old and reference log-probs) runs every chunk on the device and copies the result to
    the host once: the first read of device data comes after the loop over chunks has ended."""
    from conftest import llama
    from test_lean_forward import _batch

    from tidyrl.rollouts import scoring as rollout_module

    real_chunks, finished = rollout_module.chunks, []

    def chunks(seq, size):
        yield from real_chunks(seq, size)
        finished.append(True)

    monkeypatch.setattr(rollout_module, "chunks", chunks)
    batch = _batch()  # 9 rows: chunks of 4, 4 and 1
    with pytest.raises(NotImplementedError, match="meta"):  # the one copy to the host, from the meta device
        rollout_module.score_logprobs(llama().to("meta"), batch, temperature=0.7, chunk_size=4)
    assert finished == [True]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_the_4d_masks_handed_to_the_model_give_what_its_own_masks_give(attention, monkeypatch):
    """Off the CPU the model's forward gets its finished 4D mask (transformers would read the 2D one on the host):
    the same log-probs in one pass and in the shared-prompt passes, and the same critic values, as with the masks
    the model builds itself, for SDPA (boolean) and eager (additive) attention."""
    from conftest import llama
    from test_lean_forward import _batch
    from transformers import LlamaConfig, LlamaForTokenClassification

    from tidyrl.models import forward

    policy = llama(attn_implementation=attention).train()
    torch.manual_seed(0)
    # (eval: the classifier head has dropout, which would differ between any two calls)
    critic = LlamaForTokenClassification(LlamaConfig(**{**policy.config.to_dict(), "num_labels": 1})).eval()
    ndims = []
    for model in (policy, critic):
        model.register_forward_pre_hook(lambda m, args, kw: ndims.append(kw["attention_mask"].dim()), with_kwargs=True)
    for batch in (_batch(), _batch(distinct_prompts=True)):  # two passes (shared prompts), one pass
        read = batch.completion_mask
        outputs = {}
        for devices in (("cpu",), ()):
            monkeypatch.setattr(forward, "HOST_MASK_DEVICES", devices)
            ndims.clear()
            lp, _ = forward.completion_logprobs(policy, *batch.sequences, 0.8, fast_path=False)
            values = forward.completion_values(critic, *batch.sequences)
            outputs[devices] = (lp * read, values * read, sorted(set(ndims)))
        (lp_2d, v_2d, dims_2d), (lp_4d, v_4d, dims_4d) = outputs[("cpu",)], outputs[()]
        assert dims_2d == [2] and dims_4d == [4]
        torch.testing.assert_close(lp_4d, lp_2d, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v_4d, v_2d, atol=1e-5, rtol=1e-5)

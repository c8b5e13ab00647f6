"""Host memory: malloc_trim after an optimizer step (runs on CPU with glibc, never for other devices, only when the
heap holds enough free memory to be worth it, and gives pages back); models loaded for an accelerator go there
without a copy on the host first."""

from __future__ import annotations

import pytest
import torch
from conftest import llama, load_measuring_host_peak, proc_status_bytes

from tidyrl.models.host_memory import _malloc_trim, free_heap_bytes, release_freed_memory


def rss_kib() -> int:
    return proc_status_bytes("VmRSS:") // 1024


@pytest.mark.skipif(_malloc_trim() is None, reason="this C library has no malloc_trim")
def test_trim_runs_on_cpu_only_and_returns_freed_heap_pages():
    assert release_freed_memory(torch.device("meta")) is False
    assert release_freed_memory("cuda") is False
    # Many small tensors live on the heap (below the mmap threshold); freeing all but every 64th leaves the heap
    # pages pinned by the survivors' neighbours until a trim returns the free ones.
    blocks = [torch.ones(4096) for _ in range(20000)]  # 16 KiB each, ~320 MiB
    keep = blocks[::64]
    del blocks
    before = rss_kib()
    assert release_freed_memory(torch.device("cpu"), min_free_bytes=0) is True
    after = rss_kib()
    assert before - after > 100 * 1024, (before, after)  # more than 100 MiB given back
    del keep


@pytest.mark.skipif(free_heap_bytes() is None, reason="this C library has no mallinfo2")
def test_trim_is_skipped_while_too_little_is_free():
    blocks = [torch.ones(4096) for _ in range(20000)]
    keep = blocks[::64]
    del blocks
    free = free_heap_bytes()
    assert free > 250 * 2**20  # ~310 MiB of freed blocks held by malloc
    before = rss_kib()
    assert release_freed_memory("cpu", min_free_bytes=free + 2**30) is False  # not worth it: not run
    assert rss_kib() > before - 10 * 1024  # nothing given back
    assert release_freed_memory("cpu", min_free_bytes=free // 2) is True
    assert rss_kib() < before - 100 * 1024
    del keep


def test_a_model_for_an_accelerator_goes_there_from_the_files_mapping_without_a_host_copy(tmp_path, monkeypatch):
    """`load_causal_lm(device=...)`: on the host, every tensor copied into memory of its own (`in_own_memory`);
    for any other device, moved there as loaded, with no host copy first (which held two of the model on the host
    at once). meta stands for the accelerator here; the CUDA twin is in tests/test_cuda.py."""
    from tidyrl.models import loading

    llama(tie_word_embeddings=True, hidden_size=256, intermediate_size=512, vocab_size=16000).save_pretrained(
        tmp_path / "m")  # ~25 MB in float32
    copied = []
    real = loading.in_own_memory
    monkeypatch.setattr(loading, "in_own_memory", lambda model: copied.append(model) or real(model))

    host = loading.load_causal_lm(str(tmp_path / "m"))
    assert copied == [host] and all(p.device.type == "cpu" and p.data_ptr() % 64 == 0 for p in host.parameters())
    assert loading.load_causal_lm(str(tmp_path / "m"), device="cpu") is copied[-1] and len(copied) == 2

    moved, peak_above = load_measuring_host_peak(lambda: loading.load_causal_lm(str(tmp_path / "m"), device="meta"))
    assert len(copied) == 2, "a model for a device was copied on the host first"
    size = sum(p.numel() * p.element_size() for p in host.parameters())
    assert peak_above < size / 2, (peak_above, size)  # (a move to meta reads nothing; a copy first would add one)
    assert {p.device.type for p in moved.parameters()} == {"meta"}
    # (tied weights stay one Parameter on CUDA, checked there: a move to meta makes new Parameters)
    critic = loading.load_critic(str(tmp_path / "m"), device=torch.device("meta"))
    assert len(copied) == 2 and {p.device.type for p in critic.parameters()} == {"meta"}


def test_stages_load_their_weights_onto_the_accelerator_except_on_a_cpu_and_under_fsdp():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from tidyrl.loops.run.setup import weights_device

    def acc(device, kind=DistributedType.NO, fsdp_version=None):
        return SimpleNamespace(device=torch.device(device), distributed_type=kind,
                               state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=fsdp_version)))

    assert weights_device(acc("cuda:1")) == torch.device("cuda:1")
    assert weights_device(acc("cuda:0", DistributedType.MULTI_GPU)) == torch.device("cuda:0")  # DDP
    assert weights_device(acc("cpu")) is None
    assert weights_device(acc("cpu", DistributedType.MULTI_CPU)) is None
    assert weights_device(acc("cuda:0", DistributedType.FSDP, 2)) is None  # prepare shards from the host copy

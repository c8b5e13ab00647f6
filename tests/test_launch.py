"""Launching more processes on a machine than it has GPUs is refused before anything loads."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tidyrl.loops.run.setup import LaunchError, check_processes_fit_devices, make_accelerator


def test_more_processes_than_gpus_is_refused_with_both_numbers_and_the_fix():
    check_processes_fit_devices(2, 2)
    check_processes_fit_devices(1, 4)
    with pytest.raises(LaunchError) as err:
        check_processes_fit_devices(2, 1)
    message = str(err.value)
    assert "2 processes" in message and "1 CUDA device:" in message
    assert "--nproc_per_node 1" in message and "ACCELERATE_USE_CPU=1" in message


def test_make_accelerator_checks_before_forming_the_process_group(monkeypatch):
    """As torchrun --nproc_per_node 2 on a machine with one GPU: the error comes from tidyrl, not from a CUDA
    call inside accelerate ("invalid device ordinal"); asking for CPU runs the processes on gloo instead."""
    import accelerate
    import torch

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)  # (conftest pins the suite's runs to the CPU)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for key, value in {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "RANK": "1", "LOCAL_RANK": "1"}.items():
        monkeypatch.setenv(key, value)
    built = []  # what accelerate.Accelerator was asked for (a stub: no process group is formed here)
    monkeypatch.setattr(accelerate, "Accelerator",
                        lambda **kwargs: built.append(kwargs) or SimpleNamespace(num_processes=2))
    with pytest.raises(LaunchError, match="2 processes were started on this machine, but it has 1 CUDA device"):
        make_accelerator()
    assert built == []  # refused before accelerate touched a device

    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    make_accelerator()
    assert built == [{"cpu": True}]


def test_a_launched_process_destroys_its_process_group_before_the_interpreter_ends(tmp_path):
    """Left to interpreter finalization, gloo's worker threads free tensors under a dying interpreter and a run
    that trained correctly can die with SIGABRT ("terminate called without an active exception": CI saw it
    once, torch 2.11). atexit handlers run last-registered first: one registered before the accelerator
    exists runs after tidyrl's and sees the group already destroyed, on every process. A DDP model left in a
    reference cycle (with the collector off, nothing else frees it) is collected before the group is destroyed:
    its reducer does not outlive the group."""
    import subprocess
    import sys

    from conftest import free_port, gloo_cpu_env

    script = tmp_path / "child.py"
    script.write_text(
        "import atexit, os\n"
        "import torch.distributed as dist\n"
        "seen = os.path.join(os.path.dirname(__file__), 'alive-at-exit-' + os.environ['RANK'])\n"
        "atexit.register(lambda: open(seen, 'w').write(str(dist.is_initialized())))\n"
        "from tidyrl.loops.run.setup import make_accelerator\n"
        "accelerator = make_accelerator()\n"
        "assert accelerator.num_processes == 2 and dist.is_initialized()\n"
        "import gc, weakref, torch\n"
        "from torch.nn.parallel import DistributedDataParallel\n"
        "gc.disable()\n"
        "ddp = DistributedDataParallel(torch.nn.Linear(2, 2))\n"
        "cycle = [ddp]\n"
        "cycle.append(cycle)\n"
        "ddp_alive = weakref.ref(ddp)\n"
        "del ddp, cycle\n"
        "destroy = dist.destroy_process_group\n"
        "freed = os.path.join(os.path.dirname(__file__), 'ddp-freed-first-' + os.environ['RANK'])\n"
        "def destroy_after_noting(*args, **kwargs):\n"
        "    open(freed, 'w').write(str(ddp_alive() is None))\n"
        "    destroy(*args, **kwargs)\n"
        "dist.destroy_process_group = destroy_after_noting\n"
    )
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(script)], env=gloo_cpu_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert [(tmp_path / f"alive-at-exit-{rank}").read_text() for rank in (0, 1)] == ["False", "False"]
    assert [(tmp_path / f"ddp-freed-first-{rank}").read_text() for rank in (0, 1)] == ["True", "True"]

"""FSDP2 on CPU (gloo, 2 processes): generation gathers the full weights once per call, not per token, and gives
the completions of the unsharded model; the launch checks refuse what tidyrl does not support."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import free_port, gloo_cpu_env

from tidyrl.loops.run.setup import check_sharding
from tidyrl.models.sharding import ShardingError


def test_fsdp2_generation_gathers_once_and_matches_the_unsharded_model(tiny_model_dir, tmp_path):
    report = tmp_path / "report.json"
    child = Path(__file__).with_name("fsdp_child.py")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), str(child), str(tiny_model_dir), str(report)],
                          capture_output=True, text=True, timeout=300, env=gloo_cpu_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank in (0, 1):
        r = json.loads(Path(f"{report}.{rank}").read_text())
        assert r["ids_equal"]  # the same completions as the unsharded model, with and without full_weights
        assert r["logprob_diff"] < 1e-5
        # One all-gather per shard group for the whole call (12 tokens, 1 prefill) ...
        assert r["gathers_inside"] == r["groups"] == 3
        # ... where the model's own forward gathers every group at every step (prefill + 11 decode steps).
        assert r["gathers_outside"] == 12 * r["groups"]
        assert r["resharded"] and r["is_sharded"] and r["grads"]


def cfg(save_every=0, resume_from=None):
    return SimpleNamespace(log=SimpleNamespace(save_every=save_every), resume_from=resume_from,
                           rollout=SimpleNamespace(lag=0, engine="builtin"))


def test_unsupported_sharding_is_refused_with_what_to_use():
    with pytest.raises(ShardingError, match="DeepSpeed is not supported yet.*examples/accelerate/fsdp.yaml"):
        check_sharding("deepspeed", cfg())
    with pytest.raises(ShardingError, match="FSDP1 is not supported.*fsdp_version: 2"):
        check_sharding("fsdp1", cfg())
    check_sharding("fsdp2", cfg(save_every=5, resume_from="latest"))  # sharded checkpoints (tests/test_fsdp.py)
    check_sharding("none", cfg(save_every=5, resume_from="latest"))


def test_the_launch_request_is_read_from_what_accelerate_launch_sets():
    """On a CPU accelerate forms a plain gloo group whatever the config asks: the request is read from the
    variables accelerate launch sets, so that FSDP is applied (fsdp2) or refused (fsdp1, deepspeed), never
    silently replaced by DDP."""
    from tidyrl.models.sharding import launch_sharding

    fsdp = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
    assert launch_sharding({"WORLD_SIZE": "2", **fsdp}) == "fsdp2"
    assert launch_sharding({"WORLD_SIZE": "2", **fsdp, "FSDP_VERSION": "1"}) == "fsdp1"
    assert launch_sharding({"WORLD_SIZE": "2", "ACCELERATE_USE_DEEPSPEED": "true"}) == "deepspeed"
    assert launch_sharding({"WORLD_SIZE": "2"}) == "none"  # torchrun, or accelerate's DDP config
    assert launch_sharding({"WORLD_SIZE": "1", **fsdp}) == "none"  # one process: nothing to shard
    assert launch_sharding({**fsdp}) == "none"


def test_fsdp_settings_tidyrl_would_not_apply_are_refused():
    from tidyrl.models.sharding import check_fsdp_settings

    check_fsdp_settings({"FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP", "ACCELERATE_MIXED_PRECISION": "no"})
    with pytest.raises(ShardingError, match="fsdp_auto_wrap_policy SIZE_BASED_WRAP.*TRANSFORMER_BASED_WRAP"):
        check_fsdp_settings({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP"})
    with pytest.raises(ShardingError, match="fsdp_cpu_ram_efficient_loading.*set it false"):
        check_fsdp_settings({"FSDP_CPU_RAM_EFFICIENT_LOADING": "true"})
    with pytest.raises(ShardingError, match="fsdp_activation_checkpointing.*train.gradient_checkpointing"):
        check_fsdp_settings({"FSDP_ACTIVATION_CHECKPOINTING": "true"})
    with pytest.raises(ShardingError, match="mixed_precision bf16.*model_dtype"):
        check_fsdp_settings({"ACCELERATE_MIXED_PRECISION": "bf16"})


def test_a_run_says_how_its_model_is_distributed():
    from tidyrl.models.sharding import distribution

    assert distribution("fsdp2", 4) == "fsdp2, 4 shards"
    assert distribution("none", 2) == "ddp, 2 processes"
    assert distribution("none", 1) == distribution("fsdp2", 1) == "one process"


def test_sharding_kind_reads_accelerates_distributed_type_then_the_launch(monkeypatch):
    from accelerate.utils import DistributedType

    from tidyrl.models.sharding import sharding_kind

    def acc(kind, version=None):
        return SimpleNamespace(distributed_type=kind,
                               state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=version)))

    for name in ("WORLD_SIZE", "ACCELERATE_USE_FSDP", "FSDP_VERSION", "ACCELERATE_USE_DEEPSPEED"):
        monkeypatch.delenv(name, raising=False)
    assert sharding_kind(acc(DistributedType.FSDP, 2)) == "fsdp2"
    assert sharding_kind(acc(DistributedType.FSDP, 1)) == "fsdp1"
    assert sharding_kind(acc(DistributedType.DEEPSPEED)) == "deepspeed"
    assert sharding_kind(acc(DistributedType.MULTI_CPU)) == "none"
    assert sharding_kind(acc(DistributedType.NO)) == "none"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert sharding_kind(acc(DistributedType.MULTI_CPU)) == "fsdp2"  # tidyrl shards where accelerate would not


@pytest.mark.parametrize("name", ["ddp.yaml", "fsdp.yaml"])
def test_shipped_accelerate_configs_load(name):
    """accelerate's own loader reads them (an unknown or misspelt key would fail here)."""
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(Path(__file__).parents[1] / "examples" / "accelerate" / name))
    if name == "fsdp.yaml":
        assert config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"

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

from tidyrl.loops.common import check_sharding
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
    with pytest.raises(ShardingError, match="log.save_every and resume_from cannot be used under FSDP"):
        check_sharding("fsdp2", cfg(save_every=5, resume_from="latest"))
    check_sharding("fsdp2", cfg())
    check_sharding("none", cfg(save_every=5, resume_from="latest"))


def test_sharding_kind_reads_accelerates_distributed_type():
    from accelerate.utils import DistributedType

    from tidyrl.models.sharding import sharding_kind

    def acc(kind, version=None):
        return SimpleNamespace(distributed_type=kind,
                               state=SimpleNamespace(fsdp_plugin=SimpleNamespace(fsdp_version=version)))

    assert sharding_kind(acc(DistributedType.FSDP, 2)) == "fsdp2"
    assert sharding_kind(acc(DistributedType.FSDP, 1)) == "fsdp1"
    assert sharding_kind(acc(DistributedType.DEEPSPEED)) == "deepspeed"
    assert sharding_kind(acc(DistributedType.MULTI_CPU)) == "none"
    assert sharding_kind(acc(DistributedType.NO)) == "none"


@pytest.mark.parametrize("name", ["ddp.yaml", "fsdp.yaml"])
def test_shipped_accelerate_configs_load(name):
    """accelerate's own loader reads them (an unknown or misspelt key would fail here)."""
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(Path(__file__).parents[1] / "examples" / "accelerate" / name))
    if name == "fsdp.yaml":
        assert config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_state_dict_type"] == "FULL_STATE_DICT"

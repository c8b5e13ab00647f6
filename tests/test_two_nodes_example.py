"""examples/two-nodes: the scripts parse, the config is a valid tidyrl config, and both scripts' trainer side runs
against a stand-in vLLM server (tests/fake_vllm_server.py) on this host: `run.sh trainer`, and `slurm.sbatch` with
`srun` and `scontrol` replaced by local stand-ins (the servers' command recorded instead of run: no vLLM here)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import read_jsonl
from fake_vllm_server import FakeVLLMServer

from tidyrl.config import load_config
from tidyrl.engines import engine_problems
from tidyrl.plan import plan_from_config

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "two-nodes"
bash = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("curl") is None, reason="needs bash and curl")


@bash
@pytest.mark.parametrize("script", ["run.sh", "slurm.sbatch"])
def test_the_scripts_parse(script):
    done = subprocess.run(["bash", "-n", str(EXAMPLE / script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_config_is_valid_apart_from_its_placeholder_servers():
    cfg = load_config(EXAMPLE / "grpo-server.yaml", ['server.urls=["http://host-a:8000", "http://host-a:8001"]',
                                                       "server.sync_dir=/shared/weights-for-servers"])
    assert engine_problems(cfg) == []  # what remains is reaching the servers, checked when a run starts
    assert (cfg.rollout.engine, cfg.rollout.lag, cfg.server.weight_sync) == ("vllm-server", 1, "folder")
    assert cfg.server.urls == ["http://host-a:8000", "http://host-a:8001"]
    assert cfg.data.max_prompt_length + cfg.rollout.max_new_tokens == 2048  # the scripts' --max-model-len
    plan = plan_from_config(cfg, 7000, 1)
    assert plan.total_optimizer_steps == cfg.train.rollouts * cfg.train.minibatches_per_epoch


def tiny_config(folder: Path, prompt_file) -> Path:
    """grpo-server.yaml at the size of the tiny test model, on CPU (the engine, lag and server section kept)."""
    cfg = yaml.safe_load((EXAMPLE / "grpo-server.yaml").read_text())
    cfg.update(model_dtype="float32", seed=1, data={"path": str(prompt_file)},
               rewards=[{"function": "tidyrl.demo:anagram_reward"}], log={"progress_bar": False})
    cfg["rollout"].update(prompts_per_rollout=4, samples_per_prompt=2, max_new_tokens=6, generation_batch_size=4,
                          forward_batch_size=4)
    cfg["train"].update(rollouts=2, minibatches_per_epoch=2, micro_batch_size=2, learning_rate=1e-3, warmup_steps=1,
                        gradient_checkpointing=False)
    path = folder / "tiny-server.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def stand_ins(folder: Path) -> Path:
    """bin/ with `python` (records a vLLM server's command line and environment in servers.log and exits; runs
    anything else with this Python), `srun` (drops its options, runs the command here) and `scontrol` (two nodes,
    both 127.0.0.1)."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    scripts = {
        "python": f"""#!/usr/bin/env bash
case "$*" in *vllm.entrypoints.openai.api_server*)
  echo "VLLM_SERVER_DEV_MODE=$VLLM_SERVER_DEV_MODE VLLM_BATCH_INVARIANT=$VLLM_BATCH_INVARIANT CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES $*" >> "{folder}/servers.log"
  exit 0;;
esac
exec {sys.executable} "$@"
""",
        "srun": """#!/usr/bin/env bash
while [[ "$1" == -* ]]; do [[ "$1" == -w ]] && shift; shift; done
exec "$@"
""",
        "scontrol": "#!/usr/bin/env bash\nprintf '127.0.0.1\\n127.0.0.1\\n'\n",
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755 | stat.S_IXUSR)
    return bin_dir


@bash
def test_both_scripts_train_against_a_server_on_this_host(tiny_model_dir, prompt_file, tmp_path):
    config, bin_dir = tiny_config(tmp_path, prompt_file), stand_ins(tmp_path)
    # (the caller's PYTHONPATH kept after src: a GPU image's packages may come from there)
    paths = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=os.pathsep.join(paths),
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", MODEL=str(tiny_model_dir), CONFIG=str(config),
               SERVER_HOST="127.0.0.1", NUM_SERVERS="1", WAIT_S="30", PYTHON="python")
    with FakeVLLMServer(tiny_model_dir) as server:
        port = server.url.rsplit(":", 1)[1]
        by_hand = subprocess.run(["bash", str(EXAMPLE / "run.sh"), "trainer"], capture_output=True, text=True,
                                 timeout=600, env=dict(env, SHARED=str(tmp_path / "shared-a"), PORT=port))
        assert by_hand.returncode == 0, by_hand.stderr[-4000:]
        assert f"run.sh: http://127.0.0.1:{port} is up" in by_hand.stdout
        slurm = subprocess.run(["bash", str(EXAMPLE / "slurm.sbatch")], capture_output=True, text=True, timeout=600,
                               cwd=tmp_path, env=dict(env, SHARED=str(tmp_path / "shared-b"), PORT=port,
                                                      GPUS_PER_NODE="1", SLURM_JOB_NODELIST="node[1-2]",
                                                      TRAINER_PROCS="2",  # torchrun: 2 processes share the server
                                                      SLURM_JOB_ID="7", SLURM_SUBMIT_DIR=str(ROOT)))
        assert slurm.returncode == 0, slurm.stderr[-4000:]
        reloads = list(server.reloads)
    runs = [tmp_path / "shared-a" / "runs" / "grpo-server", tmp_path / "shared-b" / "runs" / "grpo-server-7"]
    for run in runs:
        rows = read_jsonl(run / "metrics.jsonl")
        assert [r["step"] for r in rows] == [1, 2, 3, 4] and (run / "final" / "model.safetensors").exists()
        assert [r["async/policy_lag"] for r in rows[::2]] == [0, 1]  # rollout.lag: 1
    # the weights went to the servers through SHARED/weights-for-servers, one version per rollout
    assert [Path(p).parent for p in reloads] == [tmp_path / "shared-a" / "weights-for-servers"] * 2 + \
        [tmp_path / "shared-b" / "weights-for-servers"] * 2
    # 1 training process (run.sh) and 2 (slurm.sbatch's torchrun): the same samples, one sync per rollout each
    assert read_jsonl(runs[0] / "samples.jsonl") == read_jsonl(runs[1] / "samples.jsonl")
    # slurm.sbatch's server step: the command docs/engines.md gives, in dev mode, on the node's GPU
    started = (tmp_path / "servers.log").read_text().splitlines()
    assert started == [f"VLLM_SERVER_DEV_MODE=1 VLLM_BATCH_INVARIANT=1 CUDA_VISIBLE_DEVICES=0 "
                       f"-m vllm.entrypoints.openai.api_server --model "
                       f"{tiny_model_dir} --host 0.0.0.0 --port {port} --dtype bfloat16 --max-model-len 2048 "
                       "--tensor-parallel-size 1"]

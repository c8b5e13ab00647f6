"""A fault on one process ends every process within seconds, with that process's message (loops.run.faults): the
watch's rules on an in-memory store, then 2-process gloo runs under DDP (torchrun) and FSDP2 (accelerate launch) in
which process 1 raises, hangs, runs out of memory or is killed while process 0 goes on."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import free_port, gloo_cpu_env, read_jsonl

FSDP_YAML = Path(__file__).resolve().parents[1] / "examples" / "accelerate" / "fsdp.yaml"

# ---------------------------------------------------------------------------------------------------------------
# The watch's rules, on a torch HashStore (the TCP store's interface, in memory)
# ---------------------------------------------------------------------------------------------------------------


class Ended(Exception):
    """What os._exit does in these tests."""


@pytest.fixture
def watch(monkeypatch):
    import torch.distributed as dist

    from tidyrl.loops.run import faults

    def ended(code):
        raise Ended(code)

    monkeypatch.setattr(faults.os, "_exit", ended)
    monkeypatch.setattr(faults, "EXIT_GRACE_S", 0.0)
    store = dist.HashStore()

    def make(rank: int, world: int = 3, watchdog_s: float = 5.0):
        return faults.FaultWatch(store, rank, world, watchdog_s, prefix="run")

    return make


def beat(watch_, when: float, last: str, waiting: bool) -> None:
    watch_.store.set(watch_.key(f"beat/{watch_.rank}"), json.dumps({"beat": 1, "when": when, "last": last,
                                                                    "waiting": waiting}))


def test_the_first_fault_posted_is_the_one_every_process_names(watch, capsys):
    first, second, third = watch(1), watch(2), watch(0)
    first.report(ValueError("reward exploded"))
    assert first.failing
    with pytest.raises(Ended):  # the second failure is the first one's consequence: it ends with the first's words
        second.report(RuntimeError("Connection closed by peer [127.0.0.1]:1234"))
    assert "tidyrl[2]: error: process 1 failed: ValueError: reward exploded. Every process" in capsys.readouterr().err
    with pytest.raises(Ended):  # a process that read it in its beat ends with it too
        third._end_on(third._fault())
    assert "tidyrl[0]: error: process 1 failed: ValueError: reward exploded" in capsys.readouterr().err


def test_a_broken_collective_says_another_process_ended(watch):
    from tidyrl.loops.run.faults import message_of

    text = message_of(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:29579. This is typically"))
    assert text.startswith("RuntimeError: [pair.cc:553] Connection closed by peer")
    assert "another process ended without a word" in text and "launcher's summary" in text
    assert message_of(ValueError("x")) == "ValueError: x"


def test_a_hang_names_the_process_that_is_not_waiting_in_a_collective(watch, capfd, monkeypatch):
    from tidyrl import liveness
    from tidyrl.loops.run import faults

    w0, w1, w2 = watch(0), watch(1), watch(2)
    now = time.time()
    # process 1 stopped first and waits in no collective (a reward function that never returns); process 2 stopped
    # earlier still but waits in a collective (it reached one process 1 never joined)
    beat(w1, now - 9, "generated sequences 3-4 of 4", waiting=False)
    beat(w2, now - 12, "micro-batch 2 of 2 of optimizer step 1", waiting=True)
    monkeypatch.setattr(liveness, "_last", (time.monotonic() - 6, now - 6, "called reward function 'reward'"))
    monkeypatch.setattr(faults, "waiting_for_others", lambda: True)
    with pytest.raises(Ended):
        w0._hang()
    err = capfd.readouterr().err
    assert ("process 1 hangs: it has finished no work for 9 s (train.watchdog_s = 5); the last it finished: "
            "generated sequences 3-4 of 4 (process 0 waits in a collective; process 2 waits in a collective)") in err
    assert "where each thread of this process is:" in err and "in _hang" in err  # its own stacks


def test_where_every_process_waits_the_oldest_work_is_named(watch, capfd, monkeypatch):
    from tidyrl import liveness
    from tidyrl.loops.run import faults

    w0, w1 = watch(0, world=2), watch(1, world=2)
    now = time.time()
    beat(w1, now - 20, "scored episodes 1-4 of 4", waiting=True)
    monkeypatch.setattr(liveness, "_last", (time.monotonic() - 7, now - 7, "optimizer step 3"))
    monkeypatch.setattr(faults, "waiting_for_others", lambda: True)
    with pytest.raises(Ended):
        w0._hang()
    assert "process 1 hangs: it has finished no work for 20 s" in capfd.readouterr().err


def test_a_failing_process_whose_teardown_hangs_ends_with_its_own_fault(watch, capfd):
    w1 = watch(1, world=2)
    w1.report(ValueError("reward exploded"))  # it ends by itself: the others' faults are not its own
    w1._end_on({"kind": "failed", "message": "process 0 failed: something else"})
    with pytest.raises(Ended):  # but watchdog_s later it has not ended: a teardown that waits, ended by its watch
        w1._hang()
    assert "tidyrl[1]: error: process 1 failed: ValueError: reward exploded. Every process" in capfd.readouterr().err


def test_a_silent_process_is_named_and_a_finished_one_is_not(watch, monkeypatch):
    from tidyrl.loops.run import faults

    w0, w1, w2 = watch(0), watch(1), watch(2)
    for w in (w0, w1, w2):
        w._beat()
    w2.stop()  # finished its run: its last beat says so
    clock = [1000.0]
    monkeypatch.setattr(faults.time, "monotonic", lambda: clock[0])
    w0._check_silent()
    w0._beat()
    clock[0] += faults.SILENT_S + 1  # process 1 beats no more; process 0 does
    w0._beat()
    w0._check_silent()
    fault = w0._fault()
    assert fault["kind"] == "silent"
    fault = fault["message"]
    assert fault.startswith(f"process 1 stopped answering {faults.SILENT_S + 1:.0f} s ago, without a word")
    assert "process 2" not in fault


def test_one_process_runs_no_watch():
    from types import SimpleNamespace

    from tidyrl.loops.run.faults import watch_faults

    assert watch_faults(SimpleNamespace(num_processes=1, process_index=0), 900.0) is None


# ---------------------------------------------------------------------------------------------------------------
# Two gloo processes: process 1 fails, process 0 goes on
# ---------------------------------------------------------------------------------------------------------------

FAULTY = '''
import os
calls = 0


def reward(completions, **kw):
    """Process BAD_RANK's BAD_CALL-th call does BAD_MODE; every other call scores the length."""
    global calls
    calls += 1
    if os.environ.get("RANK") == "1" and calls == int(os.environ.get("BAD_CALL", "2")):
        mode = os.environ.get("BAD_MODE", "none")
        if mode == "raise":
            raise ValueError("reward exploded on purpose")
        if mode == "oom":
            import torch
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        if mode == "kill":
            os.kill(os.getpid(), 9)
        if mode == "hang":
            import time
            time.sleep(3600)
    return [len(c) / 10 for c in completions]
'''


@pytest.fixture(scope="module")
def faulty_yaml(tmp_path_factory, tiny_model_dir):
    folder = tmp_path_factory.mktemp("faults")
    (folder / "faulty.py").write_text(FAULTY)
    words = ["apple", "pear", "fig", "kiwi", "lime", "plum", "date", "lemon"]
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{w}:"}) + "\n" for w in words))
    cfg = {"algorithm": "grpo", "model": str(tiny_model_dir), "seed": 1, "data": {"path": str(folder / "prompts.jsonl")},
           "rewards": [{"function": f"{folder / 'faulty.py'}:reward"}],
           "rollout": {"prompts_per_rollout": 4, "samples_per_prompt": 2, "max_new_tokens": 6,
                       "forward_batch_size": 2, "generation_batch_size": 2},
           "train": {"rollouts": 3, "micro_batch_size": 1, "learning_rate": 1e-3, "watchdog_s": 4},
           "log": {"progress_bar": False, "save_every": 1, "keep_last": 3}}
    path = folder / "grpo.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def launch(config: Path, out: Path, mode: str, sharding: str, *overrides: str) -> tuple[subprocess.CompletedProcess,
                                                                                         float]:
    """`tidyrl train` on 2 gloo processes, process 1 doing `mode` at its second reward call (rollout 2). Returns
    the finished launch and its wall time."""
    if sharding == "fsdp2":
        launcher = ["-m", "accelerate.commands.launch", "--config_file", str(FSDP_YAML), "--num_processes", "2",
                    "--main_process_port", str(free_port())]
    else:
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port())]
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, *launcher, "-m", "tidyrl", "train", str(config), f"output_dir={out}",
                           *overrides], capture_output=True, text=True, timeout=300, env=gloo_cpu_env(BAD_MODE=mode))
    return done, time.perf_counter() - t0


def check_nothing_lost_and_resume(config: Path, out: Path, sharding: str) -> None:
    """Rollout 1's step and checkpoint are on disk as written; the run resumes from it and finishes."""
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1]
    assert (out / "checkpoint-1").is_dir() and not list(out.glob(".checkpoint-*"))
    resumed, _ = launch(config, out, "none", sharding, "resume_from=latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.parametrize("sharding", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_a_reward_that_raises_on_one_process_ends_both_with_its_message(faulty_yaml, tmp_path, sharding):
    out = tmp_path / "run"
    done, wall = launch(faulty_yaml, out, "raise", sharding)
    assert done.returncode != 0
    err = done.stderr
    assert "tidyrl: error: reward function 'reward' raised on" in err  # process 1's own words
    assert ("tidyrl[0]: error: process 1 failed: reward function 'reward' raised on" in err
            and "ValueError: reward exploded on purpose" in err)  # process 0 ends with them
    assert wall < 120, wall  # not the collective timeout's 30 minutes
    check_nothing_lost_and_resume(faulty_yaml, out, sharding)


@pytest.mark.parametrize("sharding", ["ddp", pytest.param("fsdp2", marks=pytest.mark.slow)])
def test_a_process_that_hangs_is_named_by_the_watchdog_with_its_stacks(faulty_yaml, tmp_path, sharding):
    out = tmp_path / "run"
    done, wall = launch(faulty_yaml, out, "hang", sharding)
    assert done.returncode != 0
    err = done.stderr
    for rank in (0, 1):  # each process ends with the one verdict
        assert (f"tidyrl[{rank}]: error: process 1 hangs: it has finished no work for" in err
                and "(train.watchdog_s = 4); the last it finished: generated sequences" in err
                and "(process 0 waits in a collective)" in err), err[-3000:]
    assert 'faulty.py", line' in err and "in reward" in err  # process 1's stack: where it hangs
    assert wall < 120, wall
    check_nothing_lost_and_resume(faulty_yaml, out, sharding)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["ddp", "fsdp2"])
def test_a_process_killed_or_out_of_memory_ends_both(faulty_yaml, tmp_path, sharding):
    killed, wall = launch(faulty_yaml, tmp_path / "killed", "kill", sharding)
    assert killed.returncode != 0 and wall < 120, wall
    assert "another process ended without a word" in killed.stderr and "SIGKILL" in killed.stderr
    oom, wall = launch(faulty_yaml, tmp_path / "oom", "oom", sharding)
    assert oom.returncode != 0 and wall < 120, wall
    assert "tidyrl[0]: error: process 1 failed: " in oom.stderr and "OutOfMemoryError" in oom.stderr

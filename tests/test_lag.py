"""rollout.lag: rollouts made ahead, beside training, at a fixed lag.

Which weights make which rollout is fixed by the config: rollout r is generated with the weights after rollout
r - 1 - L's updates. These tests check that schedule by hand, that each rollout really was generated with those
weights (and scored by the learner's, PPO's critic included), that the background thread and the speed of either
side change no number, that a resumed run is the uninterrupted one, and what the lag refuses."""

from __future__ import annotations

from types import SimpleNamespace

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

import golden_runs
import tidyrl
import tidyrl.rollouts.ahead as ahead_module
from tidyrl.config import ConfigError
from tidyrl.rollouts.ahead import RolloutsAhead, behaviour_version, launches_due

CLOCK = ("time_s",)


def rows(path: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in CLOCK and not k.startswith("time/")}
            for line in path.read_text().splitlines()]


def final_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(run / "final" / "model.safetensors")


def same_weights(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def grpo(folder: Path, lag: int, rollouts: int = 3, **log) -> dict:
    """GRPO with DAPO's dynamic sampling, E = M = 2, a KL in the loss, held-out evaluation (golden_runs)."""
    cfg = golden_runs.grpo_dynamic(folder)
    cfg["rollout"]["lag"] = lag
    cfg["train"]["rollouts"] = rollouts
    cfg["log"].update(log)
    return cfg


# ---------------------------------------------------------------------- the schedule, by hand
def test_which_weights_make_which_rollout_by_hand():
    # version v = the learner's weights after v rollouts' updates; rollout r is made with version max(0, r - L)
    assert [behaviour_version(r, 0) for r in range(5)] == [0, 1, 2, 3, 4]
    assert [behaviour_version(r, 1) for r in range(5)] == [0, 0, 1, 2, 3]
    assert [behaviour_version(r, 2) for r in range(5)] == [0, 0, 0, 1, 2]


@pytest.mark.parametrize("lag,expected", [
    (0, [[0], [1], [2], [3], [4]]),
    (1, [[0, 1], [2], [3], [4], []]),
    (2, [[0, 1, 2], [3], [4], [], []]),
])
def test_launches_when_the_learner_starts_each_rollout(lag, expected):
    held, launched = set(), []
    for r in range(5):
        due = launches_due(r, lag, 5, held)
        launched.append(due)
        held |= set(due)
        held.discard(r)  # taken by the learner
    assert launched == expected


def lag_of(monkeypatch, make, snapshot, lag: int, total: int, *, background: bool) -> RolloutsAhead:
    """A lag whose rollouts are `make(r, version, snapshot)` and whose launches copy `snapshot()` (in place of
    `making.make_rollout` and `weights.weight_snapshot`)."""
    monkeypatch.setattr(ahead_module, "make_rollout", lambda source, r, version, weights: make(r, version, weights))
    monkeypatch.setattr(ahead_module, "weight_snapshot", lambda policy: snapshot())
    return RolloutsAhead(SimpleNamespace(policy=None), lag, total, background=background)


def test_the_weights_of_a_launch_are_copied_when_it_is_launched(monkeypatch):
    """A launch made at learner rollout r carries the weights of that moment, even when it is made later."""
    weights = {"w": torch.tensor([0.0])}
    made_with = {}

    def make(r, version, snapshot):
        made_with[r] = float(snapshot["w"])
        return r, version

    ahead = lag_of(monkeypatch, make, lambda: {k: v.clone() for k, v in weights.items()}, 2, 5, background=False)
    for r in range(5):
        ahead.launch_due(r)
        got, _ = ahead.take(r)
        assert got == (r, behaviour_version(r, 2))
        weights["w"] += 1.0  # the learner's updates of rollout r: version r + 1
    assert made_with == {0: 0.0, 1: 0.0, 2: 0.0, 3: 1.0, 4: 2.0}


def test_an_error_while_making_ahead_is_raised_where_the_rollout_is_taken(monkeypatch):
    def make(r, version, snapshot):
        if r == 1:
            raise ValueError("reward exploded")
        return r

    ahead = lag_of(monkeypatch, make, dict, 1, 3, background=True)
    ahead.launch_due(0)
    assert ahead.take(0)[0] == 0
    ahead.launch_due(1)
    with pytest.raises(ValueError, match="reward exploded"):
        ahead.take(1)
    ahead.close()


# ---------------------------------------------------------------------- end to end
@pytest.mark.parametrize("lag", [1, 2])
def test_each_rollout_is_made_by_the_weights_the_lag_names_and_scored_by_the_learners(tmp_path, monkeypatch, lag):
    """PPO (a critic, the KL in the reward), 4 rollouts: the weights that generated rollout r are those of
    checkpoint-(version * E*M) (the starting model for version 0); the critic that scored it is the learner's
    at rollout r (checkpoint-(r * E*M)/critic)."""
    from tidyrl.rollouts import ahead
    from tidyrl.rollouts import scoring

    cfg = golden_runs.ppo_reward_model(tmp_path)
    cfg["rollout"]["lag"] = lag
    cfg["train"]["rollouts"] = 4
    cfg["train"]["memory_probe"] = False  # (its made-up episodes would be scored first: not a rollout's)
    per_rollout = cfg["train"]["epochs_per_rollout"] * cfg["train"]["minibatches_per_epoch"]
    cfg["log"].update({"save_every": per_rollout, "keep_last": 10})
    generated_by, critic_of = {}, []
    make = ahead.make_rollout

    def recording(source, r, version, snapshot):
        generated_by[r] = digest(snapshot)
        return make(source, r, version, snapshot)

    values = scoring.score_values

    def recording_values(critic, tokens, chunk):
        critic_of.append(digest({n: p for n, p in critic.named_parameters()}))
        return values(critic, tokens, chunk)

    monkeypatch.setattr(ahead, "make_rollout", recording)
    monkeypatch.setattr(scoring, "score_values", recording_values)
    tidyrl.train(cfg)

    from safetensors.torch import load_file

    def version_digest(folder: Path, names) -> str:
        tensors = load_file(folder / "model.safetensors")
        return digest({n: tensors[n] for n in names})

    run, start = Path(cfg["output_dir"]), Path(cfg["model"])
    names = None
    for r in range(4):
        v = behaviour_version(r, lag)
        folder = start if v == 0 else run / f"checkpoint-{v * per_rollout}"
        if names is None:
            names = sorted(set(load_file(start / "model.safetensors")))
        expected = version_digest(folder, names)
        assert generated_by[r] == expected, f"rollout {r} (lag {lag}) not made by version {v}"
    for r in range(1, 4):  # the critic of rollout r: the learner's, after r rollouts of updates
        critic = load_file(run / f"checkpoint-{r * per_rollout}" / "critic" / "model.safetensors")
        assert critic_of[r] == digest({n: critic[n] for n in critic}) or critic_of[r] == digest(
            {n: critic[n] for n in sorted(critic)})
    metrics = rows(run / "metrics.jsonl")
    assert [m["async/policy_lag"] for m in metrics[::per_rollout]] == [r - behaviour_version(r, lag) for r in range(4)]


def test_the_background_thread_and_the_speed_of_either_side_change_no_number(tmp_path, monkeypatch):
    """Lag 2: made on the learner's thread when taken; beside training with a slow engine; beside training with
    a slow learner. The same completions, metrics and final weights, bit for bit."""
    from tidyrl.engines.builtin import BuiltinEngine
    from tidyrl.loops.rl import learner as rl

    def run(name, background, slow_engine=0.0, slow_learner=0.0):
        monkeypatch.setattr(ahead_module, "BACKGROUND", background)
        generate, step = BuiltinEngine.generate, rl.optimizer_step

        def slow_generate(self, *args, **kwargs):
            time.sleep(slow_engine)
            return generate(self, *args, **kwargs)

        def slow_step(*args, **kwargs):
            time.sleep(slow_learner)
            return step(*args, **kwargs)

        monkeypatch.setattr(BuiltinEngine, "generate", slow_generate)
        monkeypatch.setattr(rl, "optimizer_step", slow_step)
        folder = tmp_path / name
        folder.mkdir()
        cfg = grpo(folder, lag=2, rollouts=4, samples_per_rollout=8)
        tidyrl.train(cfg)
        monkeypatch.setattr(BuiltinEngine, "generate", generate)
        monkeypatch.setattr(rl, "optimizer_step", step)
        out = Path(cfg["output_dir"])
        return rows(out / "metrics.jsonl"), (out / "samples.jsonl").read_text(), final_weights(out)

    inline = run("inline", False)
    # GRPO's advantages under the lag, by hand from the logged rewards of every episode (samples.jsonl holds all
    # 8 of each rollout): A = (r - mean(group)) / (std(group, unbiased) + 1e-4), whatever weights sampled them.
    groups: dict = {}
    for line in inline[1].splitlines():
        row = json.loads(line)
        groups.setdefault((row["rollout"], row["prompt"]), []).append(row)
    assert sorted({r for r, _ in groups}) == [1, 2, 3, 4] and all(len(g) == 4 for g in groups.values())
    for group in groups.values():
        rewards = [row["reward"] for row in group]
        mean = sum(rewards) / 4
        std = (sum((x - mean) ** 2 for x in rewards) / 3) ** 0.5
        for row in group:
            assert row["advantage"] == pytest.approx((row["reward"] - mean) / (std + 1e-4), rel=1e-5, abs=1e-6)
    for name, kwargs in (("slow-engine", {"slow_engine": 0.05}), ("slow-learner", {"slow_learner": 0.1})):
        metrics, samples, weights = run(name, True, **kwargs)
        assert metrics == inline[0], name
        assert samples == inline[1], name
        assert same_weights(weights, inline[2]), name
    assert [m["async/policy_lag"] for m in inline[0][::4]] == [0, 1, 2, 2]
    plan = json.loads((tmp_path / "inline" / "run" / "plan.json").read_text())
    assert plan["lag"] == 2 and plan["rollouts"] == 4 and plan["total_optimizer_steps"] == 16  # counts: as lag 0


def test_the_lag_changes_the_run_and_only_from_rollout_two(tmp_path, capsys):
    """Rollout 1 is the same at any lag (every lag makes it with the starting weights; the lag's default
    importance-weight cap, 2.0, set at lag 0 too); from rollout 2 on a lagged run samples older weights, which the
    importance weights correct: their mismatch is measured per step."""
    on_policy = tmp_path / "lag0"
    lagged = tmp_path / "lag1"
    on_policy.mkdir()
    lagged.mkdir()
    tidyrl.train(grpo(on_policy, lag=0), ["rollout.tis_cap=2.0"])
    capsys.readouterr()
    tidyrl.train(grpo(lagged, lag=1))
    summary = capsys.readouterr().out  # the wall time split as the learner spent it; the making apart
    assert "time: waiting for rollouts" in summary and "made ahead, beside training (rollout.lag): generate" in summary
    a, b = rows(on_policy / "run" / "metrics.jsonl"), rows(lagged / "run" / "metrics.jsonl")
    first = lambda row: {k: v for k, v in row.items() if not k.startswith("async/")}  # noqa: E731
    assert [first(x) for x in a[:4]] == [first(x) for x in b[:4]]
    assert a[4]["reward_mean"] != b[4]["reward_mean"] or a[4]["loss"] != b[4]["loss"]
    # the learner at rollout 1 IS the sampler (rounding only); at rollout 2 it is one rollout of updates ahead
    assert b[0]["mismatch/logprob_abs_mean"] < 1e-5
    assert b[4]["mismatch/logprob_abs_mean"] > 1e-3
    assert "async/policy_lag" not in a[0]


@pytest.mark.parametrize("stop_after", [3, 4], ids=["inside-a-rollout", "rollout-boundary"])
def test_resume_with_rollouts_made_ahead_is_the_uninterrupted_run(tmp_path, stop_after):
    """Lag 2, a checkpoint every 3 (inside rollout 1) or 4 steps (its end): the run cut there and resumed equals the
    uninterrupted one; the checkpoint holds the rollouts made ahead (not made again: other weights made them)."""
    reference = tmp_path / "reference"
    reference.mkdir()
    tidyrl.train(grpo(reference, lag=2, rollouts=4))
    cut = tmp_path / "cut"
    cut.mkdir()
    cfg = grpo(cut, lag=2, rollouts=4, save_every=stop_after, keep_last=10)
    tidyrl.train(cfg)
    out = Path(cfg["output_dir"])
    # as if killed just after checkpoint-<stop_after>: later checkpoints and the final model never written
    for later in [p for p in out.glob("checkpoint-*") if int(p.name.split("-")[1]) > stop_after] + [out / "final"]:
        shutil.rmtree(later)
    held = torch.load(out / f"checkpoint-{stop_after}" / "trainer_state" / "ahead.pt", weights_only=True)
    assert sorted(held) == [1, 2]  # rollout 0 taken; 1 and 2 made ahead (by the starting weights)
    tidyrl.train(cfg, ["resume_from=latest"])
    assert rows(out / "metrics.jsonl") == rows(reference / "run" / "metrics.jsonl")
    assert (out / "samples.jsonl").read_text() == (reference / "run" / "samples.jsonl").read_text()
    assert same_weights(final_weights(out), final_weights(reference / "run"))


def test_the_lag_is_refused_where_it_cannot_be_corrected(tmp_path):
    cfg = grpo(tmp_path, lag=1)
    with pytest.raises(ConfigError, match=r"rollout\.tis_cap.*0 turns off the importance weights"):
        tidyrl.train(cfg, ["rollout.tis_cap=0"])
    with pytest.raises(ConfigError, match=r"rollout\.behaviour_logprobs.*must be sampler with rollout\.lag = 1"):
        tidyrl.train(cfg, ["rollout.behaviour_logprobs=trainer"])
    with pytest.raises(ConfigError, match=r"rollout\.lag.*must be an integer >= 0"):
        tidyrl.train(cfg, ["rollout.lag=-1"])
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_under_fsdp_the_lag_takes_vllm_servers_and_is_refused_with_an_in_process_engine():
    """The weights a version behind are the servers' under FSDP2 (tests/test_server_engine.py syncs a sharded policy
    at a launch); an in-process engine would need a whole copy on every process."""
    from types import SimpleNamespace

    from tidyrl.config import RolloutConfig
    from tidyrl.loops.run.setup import check_sharding
    from tidyrl.models.sharding import ShardingError

    def cfg(engine, lag=1, top_k=0):
        return SimpleNamespace(log=SimpleNamespace(save_every=0), resume_from=None,
                               rollout=RolloutConfig(lag=lag, engine=engine, top_k=top_k, top_p=1.0))

    for engine in ("builtin", "vllm"):
        with pytest.raises(ShardingError, match=rf"rollout\.lag=1 under FSDP needs rollout\.engine: vllm-server.*"
                                                rf"in-process engine \({engine}\).*rollout\.lag=0"):
            check_sharding("fsdp2", cfg(engine))
        check_sharding("fsdp2", cfg(engine, lag=0))
    check_sharding("fsdp2", cfg("vllm-server"))
    with pytest.raises(ShardingError, match=r"rollout\.lag=1 with top_k/top_p cannot be used under FSDP yet"):
        check_sharding("fsdp2", cfg("vllm-server", top_k=5))


def test_a_rollout_past_the_plan_is_made_when_asked_and_one_never_launched_is_an_error_not_a_hang(monkeypatch):
    ahead = lag_of(monkeypatch, lambda r, version, snapshot: r, dict, 1, 2, background=True)
    ahead.launch_due(2)  # past the run's 2 rollouts (e.g. a test asking for one more): made, no look-ahead
    assert ahead.take(2)[0] == 2
    with pytest.raises(RuntimeError, match="rollout 5 was never launched"):
        ahead.take(4)
    ahead.close()

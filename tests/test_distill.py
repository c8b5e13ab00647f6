"""On-policy distillation (algorithm: distill): the advantages on hand-worked numbers, their policy gradient against
the reverse KL's own gradient, and runs of a tiny student against a tiny teacher."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import read_jsonl, words_reward, write_jsonl

import tidyrl
from tidyrl.algorithms.advantages import reverse_kl_advantages
from tidyrl.algorithms.estimators import ESTIMATORS


def test_each_token_s_advantage_is_its_negative_reverse_kl_to_the_teacher():
    teacher = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -0.3, -4.0]])
    student = torch.tensor([[-1.5, -1.0, -0.5], [-0.2, -1.3, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])  # the first completion's third token: padding
    # log pi_T - log pi_S: 0.5, -1.0, (0); 0.0, 1.0, 5.0
    want = torch.tensor([[0.5, -1.0, 0.0], [0.0, 1.0, 5.0]])
    torch.testing.assert_close(reverse_kl_advantages(teacher, student, mask), want)
    est = ESTIMATORS["reverse_kl"](torch.zeros(2), k=2, mask=mask, teacher=teacher, student=student,
                                   task_reward_weight=0.0, scale_rewards="group")
    assert est.returns is None
    torch.testing.assert_close(est.advantages, want)
    # the k1 estimate of KL(pi_S || pi_T) per student token: mean of log pi_S - log pi_T = -(0.5 - 1 + 0 + 1 + 5) / 5
    assert est.stats == {"distill/reverse_kl": pytest.approx(-1.1)}


def test_task_rewards_add_grpos_group_advantage_to_every_token():
    teacher = torch.tensor([[-1.0, -2.0], [-1.0, -2.0]])
    student = torch.tensor([[-1.5, -1.0], [-1.0, -2.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    est = ESTIMATORS["reverse_kl"](torch.tensor([1.0, 0.0]), k=2, mask=mask, teacher=teacher, student=student,
                                   task_reward_weight=2.0, scale_rewards="group")
    # group of 2: mean 0.5, std (n - 1) 0.7071; A = +-0.5 / (0.7071 + 1e-4) = +-0.70700...; times w = 2
    a = 2 * 0.5 / (math.sqrt(0.5) + 1e-4)
    want = torch.tensor([[0.5 + a, -1.0 + a], [0.0 - a, 0.0]])
    torch.testing.assert_close(est.advantages, want)
    kl_abs, task_abs = 1.5, 3 * a  # |0.5| + |-1.0| + |0|; three tokens of |a|
    assert est.stats["distill/kl_share"] == pytest.approx(kl_abs / (kl_abs + task_abs))
    assert est.stats["distill/reverse_kl"] == pytest.approx(-(0.5 - 1.0 + 0.0) / 3)


def test_the_expected_policy_gradient_is_minus_the_reverse_kls_gradient():
    """At one position with V = 5 tokens, the policy gradient of the advantages, in exact expectation over the
    student's samples, sum_x pi_S(x) A(x) grad log pi_S(x) with A(x) = log pi_T(x) - log pi_S(x) (held constant),
    equals -grad KL(pi_S || pi_T): a step along it lowers the reverse KL."""
    torch.manual_seed(0)
    logits = torch.randn(5, dtype=torch.float64, requires_grad=True)
    teacher = torch.log_softmax(torch.randn(5, dtype=torch.float64), 0)
    log_student = torch.log_softmax(logits, 0)
    advantages = reverse_kl_advantages(teacher[None], log_student.detach()[None], torch.ones(1, 5))[0]
    surrogate = (log_student.detach().exp() * advantages * log_student).sum()  # E_x[A(x) log pi_S(x)], A fixed
    (policy_gradient,) = torch.autograd.grad(surrogate, logits, retain_graph=True)
    kl = (log_student.exp() * (log_student - teacher)).sum()
    (kl_gradient,) = torch.autograd.grad(kl, logits)
    torch.testing.assert_close(policy_gradient, -kl_gradient)
    step = logits.detach() + 0.1 * policy_gradient
    after = torch.log_softmax(step, 0)
    assert float((after.exp() * (after - teacher)).sum()) < float(kl.detach())


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory):
    """The student's own weights with the output layer scaled by 8: a teacher of the same tokenizer with decided
    preferences (a random tiny model's next-token distribution is near uniform), which the student can reach by
    sharpening its own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("teacher") / "model"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(folder)
    return folder


def distill_config(student, teacher, prompt_file, out, **sections) -> dict:
    cfg = {
        "algorithm": "distill", "model": str(student), "output_dir": str(out), "seed": 1,
        "data": {"path": str(prompt_file)}, "teacher": {"model": str(teacher)},
        "rollout": {"prompts_per_rollout": 4, "samples_per_prompt": 8, "max_new_tokens": 6},
        "train": {"rollouts": 16, "micro_batch_size": 32, "learning_rate": 1e-2, "warmup_steps": 0},
        "log": {"progress_bar": False},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def exact_reverse_kl(student_dir, teacher_dir) -> float:
    """KL(pi_S || pi_T) per token, summed over the vocabulary (exact, not sampled), at every position of fixed
    sequences: 10 prompts followed by 6 tokens drawn uniformly from a seeded generator."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidyrl.models.forward import completion_logits
    from tidyrl.models.sequences import left_pad

    tok = AutoTokenizer.from_pretrained(student_dir)
    prompts = [tok(w + ":")["input_ids"] for w in ("apple", "pear", "fig", "kiwi", "lime", "plum", "date",
                                                   "lemon", "mango", "peach")]
    prompt_ids, prompt_mask = left_pad(prompts, tok.pad_token_id)
    completion_ids = torch.randint(3, len(tok), (len(prompts), 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(completion_ids.shape)
    logs = []
    for folder in (student_dir, teacher_dir):
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            logs.append(torch.log_softmax(completion_logits(model, prompt_ids, prompt_mask, completion_ids, mask,
                                                            fast_path=False).float(), -1))
    student, teacher = logs
    return float((student.exp() * (student - teacher)).sum(-1).mean())


def test_a_distill_run_lowers_the_reverse_kl_to_its_teacher(tiny_model_dir, teacher_dir, prompt_file, tmp_path):
    """16 rollouts of pure distillation: the exact reverse KL to the teacher on fixed sequences falls (measured:
    0.298 -> 0.260 on this project's 2-core CPU, 2026-11-27); every step scores the teacher and reports the sampled estimate."""
    result = tidyrl.train(distill_config(tiny_model_dir, teacher_dir, prompt_file, tmp_path / "run"))
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 16 and all(r["time/teacher_s"] > 0 and "distill/reverse_kl" in r for r in rows)
    before, after = exact_reverse_kl(tiny_model_dir, teacher_dir), exact_reverse_kl(result.final_dir, teacher_dir)
    print(f"exact reverse KL: {before:.3f} -> {after:.3f}")
    assert before > 0.2 and after < 0.95 * before, (before, after)
    assert all(r["reward_mean"] == 0.0 for r in rows)  # pure distillation: no task reward
    import json

    plan = json.loads((result.output_dir / "plan.json").read_text())
    assert plan["scoring"] == {"teacher": {"model": str(teacher_dir), "episodes_per_rollout_per_process": 32,
                                           "forward_passes_per_rollout_per_process": 1}}


def test_task_rewards_mix_in_and_are_measured(tiny_model_dir, teacher_dir, prompt_file, tmp_path):
    cfg = distill_config(tiny_model_dir, teacher_dir, prompt_file, tmp_path / "run",
                         rewards=[{"function": words_reward}], distill={"task_reward_weight": 0.5},
                         train={"rollouts": 2, "micro_batch_size": 8}, rollout={"prompts_per_rollout": 2, "samples_per_prompt": 4})
    tidyrl.train(cfg)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(0 < r["distill/kl_share"] < 1 and "reward/words_reward" in r for r in rows)


def echo_reward(completions, word, **_):
    """Repeat the prompt's word: the positions where completion and word hold the same character, over the longer
    of the two lengths (1.0 for the word exactly; a shifted or padded copy earns little)."""
    return [sum(a == b for a, b in zip(t, w)) / max(len(t), len(w)) for t, w in zip(completions, word)]


def trailing_means(curve: list[float], window: int) -> list[float]:
    """Each rollout's mean reward over the last `window` rollouts (fewer at the start)."""
    return [sum(curve[max(0, i + 1 - window): i + 1]) / (i + 1 - max(0, i + 1 - window)) for i in range(len(curve))]


def test_distillation_reaches_its_teachers_reward_in_fewer_rollouts_than_grpo(tiny_model_dir, prompt_file,
                                                                               tmp_path):
    """A teacher that repeats the prompt's word (60 SFT steps of the tiny model on prompt -> word) and a weaker
    student of the same start (30 steps); from that student, 150 rollouts of 32 episodes each, at one learning
    rate and the same sampling: distillation from the teacher (pure: the task reward is measured, not trained on),
    and GRPO on the task reward itself. The distilled student's reward (trailing mean of 10 rollouts) comes within
    0.15 of the teacher's: four fifths of the way from its start (~0.17) to the teacher (~0.90), and far above the
    noise of a 10-rollout mean (rollout-to-rollout std ~0.1, so ~0.03). GRPO's stays at least 0.05 below that
    threshold over all 150 rollouts.

    The student is partly trained: an untrained tiny model puts ~1/V on the teacher's token, and the reverse KL's
    gradient on that token's logit is pi_S times a log-ratio, so from a random start neither run learns much in a
    few hundred rollouts. Run on one thread: a tiny model gains nothing from more, and on a busy machine two spinning
    threads take ten times longer."""
    from tidyrl.evaluate import evaluate

    rollouts, window, margin = 150, 10, 0.15
    sft_file = write_jsonl(tmp_path / "sft.jsonl", [{"prompt": r["prompt"], "completion": r["word"]}
                                                    for r in read_jsonl(prompt_file)])

    def sft(steps: int):
        return tidyrl.train({"algorithm": "sft", "model": str(tiny_model_dir), "seed": 0,
                             "output_dir": str(tmp_path / f"sft{steps}"), "data": {"path": str(sft_file)},
                             "train": {"batch_size": 10, "micro_batch_size": 10, "max_steps": steps,
                                       "learning_rate": 1e-2, "warmup_steps": 0},
                             "log": {"progress_bar": False}}).final_dir

    def rl_config(algorithm: str, student, **sections) -> dict:
        return {"algorithm": algorithm, "model": str(student), "output_dir": str(tmp_path / algorithm), "seed": 1,
                "data": {"path": str(prompt_file)}, "rewards": [{"function": echo_reward}],
                "rollout": {"prompts_per_rollout": 4, "samples_per_prompt": 8, "max_new_tokens": 8},
                "train": {"rollouts": rollouts, "micro_batch_size": 32, "learning_rate": 3e-3,
                          "lr_scheduler": "constant", "warmup_steps": 0},
                "log": {"progress_bar": False}, **sections}

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        teacher, student = sft(60), sft(30)
        # The teacher's own reward: 32 samples of each of the 10 prompts, drawn with the runs' sampling settings.
        teacher_reward = evaluate(rl_config("grpo", teacher), num_prompts=None, samples_per_prompt=32,
                                  output_dir=tmp_path / "teacher-eval", quiet=True).summary["reward_mean"]
        curves = {}
        for name, sections in (("distill", {"teacher": {"model": str(teacher)}}), ("grpo", {})):
            tidyrl.train(rl_config(name, student, **sections))
            curves[name] = [r["reward_mean"] for r in read_jsonl(tmp_path / name / "metrics.jsonl")]
    finally:
        torch.set_num_threads(threads)

    threshold = teacher_reward - margin
    smooth = {name: trailing_means(curve, window) for name, curve in curves.items()}
    first = {name: next((i + 1 for i, m in enumerate(s) if m >= threshold), None) for name, s in smooth.items()}
    print(f"\nteacher's reward on the same prompts: {teacher_reward:.3f}; threshold {threshold:.3f}")
    for name, curve in curves.items():
        print(f"{name}: first rollout whose trailing mean of {window} reaches it: {first[name]}")
        for start in range(0, rollouts, 25):
            print(f"  reward, rollouts {start + 1:3d}-{start + 25:3d}: "
                  + " ".join(f"{x:.2f}" for x in curve[start:start + 25]))
        print("  trailing mean at rollouts 10, 20, ...: "
              + " ".join(f"{x:.2f}" for x in smooth[name][window - 1::window]))
    assert teacher_reward >= 0.8
    assert first["distill"] is not None, smooth["distill"]
    assert max(smooth["grpo"]) < threshold - 0.05, smooth["grpo"]


def test_a_teacher_of_another_tokenizer_is_refused_before_any_weights_load(tiny_model_dir, prompt_file, tmp_path,
                                                                         monkeypatch):
    from tidyrl.config import ConfigError
    from tidyrl.models import loading
    from tidyrl.models.tiny import save_tiny_model

    other = save_tiny_model(tmp_path / "bytes", tokenizer="bytes", hidden_size=32, num_layers=1, num_heads=2)
    monkeypatch.setattr(loading, "load_causal_lm", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(ConfigError, match=r"teacher.model: .*another tokenizer than the policy's"):
        tidyrl.train(distill_config(tiny_model_dir, other, prompt_file, tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_distill_settings_are_checked(tiny_model_dir, prompt_file, tmp_path):
    from tidyrl.config import ConfigError, load_config

    base = distill_config(tiny_model_dir, tiny_model_dir, prompt_file, tmp_path / "run")
    with pytest.raises(ConfigError, match="distill.task_reward_weight: 1.0 weighs task rewards, but there are none"):
        load_config({**base, "distill": {"task_reward_weight": 1.0}})
    with pytest.raises(ConfigError, match="teacher.model: algorithm distill needs a teacher"):
        load_config({**base, "teacher": {}})
    with pytest.raises(ConfigError, match="teacher: set teacher.model .* or teacher.url .*, not both"):
        load_config({**base, "teacher": {"model": str(tiny_model_dir), "url": "http://127.0.0.1:8000"}})
    with pytest.raises(ConfigError, match="teacher.url: a server's prompt log-probs are at temperature 1, but "
                                          "rollout.temperature = 0.7"):
        load_config({**base, "teacher": {"url": "http://127.0.0.1:8000"}, "rollout": {"temperature": 0.7}})
    with pytest.raises(ConfigError, match="teacher: only algorithm distill has a teacher; grpo takes none"):
        load_config({**base, "algorithm": "grpo", "rewards": [{"function": "tidyrl.demo:anagram_reward"}]})


@pytest.mark.slow
def test_distill_on_two_processes_matches_one_with_a_lag_and_resumes_exactly(tiny_model_dir, teacher_dir,
                                                                            prompt_file, tmp_path):
    """Distillation with a task reward mixed in and rollout.lag = 1 (rollouts made ahead by older weights, their
    student log-probs the sampler's): 2 gloo processes give the 1-process run's completions and weights (to
    float rounding, as tests/test_multiprocess.py states it), and a resume from a checkpoint inside a rollout
    ends bit for bit as the uninterrupted run."""
    import shutil

    from conftest import torchrun_train
    from safetensors.torch import load_file

    cfg = distill_config(tiny_model_dir, teacher_dir, prompt_file, tmp_path / "one",
                         rewards=[{"function": "tidyrl.demo:anagram_reward"}], distill={"task_reward_weight": 0.5},
                         rollout={"prompts_per_rollout": 2, "samples_per_prompt": 4, "lag": 1},
                         train={"rollouts": 3, "micro_batch_size": 2, "minibatches_per_epoch": 2},
                         log={"save_every": 3, "keep_last": 5, "samples_per_rollout": 8})
    one = tidyrl.train(cfg)
    torchrun_train({**cfg, "output_dir": str(tmp_path / "two")}, tmp_path, world=2)
    first, second = (read_jsonl(tmp_path / d / "samples.jsonl") for d in ("one", "two"))
    assert [s["completion"] for s in first] == [s["completion"] for s in second]
    w1, w2 = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("one", "two"))
    # float rounding (other chunk shapes, another summation order) moves parameters by ~1e-5 at lr 1e-2 (measured
    # 1.4e-5); a real mistake (a per-process normaliser, a teacher scored on the wrong share) by ~lr per step
    assert max(float((w1[k] - w2[k]).abs().max()) for k in w1) < 1e-4
    rows = read_jsonl(one.output_dir / "metrics.jsonl")
    assert [r["async/policy_lag"] for r in rows[::2]] == [0, 1, 1]
    shutil.copytree(one.final_dir, tmp_path / "uninterrupted")
    tidyrl.train(cfg, ["resume_from=" + str(one.output_dir / "checkpoint-3")])  # inside rollout 2
    resumed = load_file(one.final_dir / "model.safetensors")
    assert all(torch.equal(resumed[k], w1[k]) for k in w1)
    clock = ("time", "mismatch/")
    assert [{k: v for k, v in r.items() if not k.startswith(clock)} for r in read_jsonl(one.output_dir / "metrics.jsonl")
            ] == [{k: v for k, v in r.items() if not k.startswith(clock)} for r in rows]


def test_a_teacher_served_by_vllm_scores_as_the_same_model_loaded_locally(tiny_model_dir, teacher_dir, prompt_file,
                                                                         tmp_path):
    """teacher.url: each episode's tokens sent as a prompt, the teacher's log-probs read back (vLLM's prompt_logprobs,
    here from tests/fake_vllm_server.py serving the teacher): the same numbers as the teacher loaded locally, so
    the same run; a server of another tokenizer is refused before any weights load."""
    from fake_vllm_server import FakeVLLMServer

    from tidyrl.config import ConfigError
    from tidyrl.models.tiny import save_tiny_model

    local = tidyrl.train(distill_config(tiny_model_dir, teacher_dir, prompt_file, tmp_path / "local",
                                        train={"rollouts": 2}))
    server = FakeVLLMServer(teacher_dir)
    try:
        cfg = distill_config(tiny_model_dir, teacher_dir, prompt_file, tmp_path / "served", train={"rollouts": 2})
        served = tidyrl.train({**cfg, "teacher": {"url": server.url}})
    finally:
        server.stop()
    a, b = (read_jsonl(r.output_dir / "metrics.jsonl") for r in (local, served))
    assert [r["distill/reverse_kl"] for r in a] == pytest.approx([r["distill/reverse_kl"] for r in b], abs=1e-5)
    assert read_jsonl(local.output_dir / "samples.jsonl")[0]["completion"] == \
        read_jsonl(served.output_dir / "samples.jsonl")[0]["completion"]
    other = FakeVLLMServer(save_tiny_model(tmp_path / "bytes", tokenizer="bytes", hidden_size=32, num_layers=1,
                                           num_heads=2))
    try:
        with pytest.raises(ConfigError, match=r"teacher.url = .* another tokenizer than the policy's"):
            cfg = distill_config(tiny_model_dir, teacher_dir, prompt_file, tmp_path / "refused")
            tidyrl.train({**cfg, "teacher": {"url": other.url}})
    finally:
        other.stop()
    assert not (tmp_path / "refused").exists()


def test_spreading_a_teacher_tokens_value_over_its_characters_matches_a_character_by_character_reference():
    from tidyrl.rollouts.teacher import spread_by_characters

    # text "abcdefg": teacher tokens "ab" "cde" "fg"; student tokens "a" "bcd" "" (an end of sequence) "efg"
    teacher_spans, values = [(0, 2), (2, 5), (5, 7)], [-1.0, -3.0, -0.5]
    student_spans = [(0, 1), (1, 4), (4, 4), (4, 7)]
    got = spread_by_characters(student_spans, teacher_spans, values)
    per_char = [-0.5, -0.5, -1.0, -1.0, -1.0, -0.25, -0.25]  # each teacher token's value over its characters
    want = [sum(per_char[a:b]) for a, b in student_spans]
    assert got[2] is None and [got[i] for i in (0, 1, 3)] == pytest.approx([want[i] for i in (0, 1, 3)])
    assert got[0] + got[1] + got[3] == pytest.approx(sum(values))  # the whole text's log-prob, conserved


def test_a_teacher_of_another_tokenizer_scores_the_text_and_its_values_map_onto_the_students_tokens(
        tiny_model_dir, prompt_file, tmp_path):
    """The character-tokenizer student, a byte-level teacher (teacher.cross_tokenizer: true): each episode
    re-rendered by the teacher's chat template, scored by the teacher, mapped onto the student's tokens. Checked
    against a brute-force reference: the teacher's model on its own tokens of the same text, each token's
    log-prob spread over its characters, summed over each student token's characters; the student's end of
    sequence gets the teacher's end of sequence. Then a run with it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidyrl.data import encode_prompts
    from tidyrl.models.ops import gather_logprobs
    from tidyrl.models.tiny import save_tiny_model
    from tidyrl.rollouts.teacher import CrossTokenizerTeacher

    teacher_dir = save_tiny_model(tmp_path / "bytes", tokenizer="bytes", hidden_size=32, num_layers=1, num_heads=2)
    s_tok, t_tok = AutoTokenizer.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    eos = s_tok.eos_token_id
    prompts = [[{"role": "user", "content": "fig:"}], "kiwi:"]
    completions = [s_tok("ab c", add_special_tokens=False)["input_ids"] + [eos],  # ended
                   s_tok("lime", add_special_tokens=False)["input_ids"]]  # cut at max_new_tokens
    student = [[-2.0] * len(c) for c in completions]
    cross = CrossTokenizerTeacher(teacher, t_tok, s_tok, [eos], temperature=1.0, chunk_size=1, fast_path=False)
    got = cross.logprobs(prompts, completions, student)
    for prompt, completion, values in zip(prompts, completions, got):
        text = "".join(s_tok.decode([t]) for t in completion if t != eos)
        ended = completion[-1] == eos
        t_prompt = encode_prompts([prompt], t_tok)[0]
        enc = t_tok(text, add_special_tokens=False, return_offsets_mapping=True)
        t_ids = list(enc["input_ids"]) + ([t_tok.eos_token_id] if ended else [])
        sequence = torch.tensor([t_prompt + t_ids])
        with torch.no_grad():
            lp = gather_logprobs(teacher(sequence).logits[:, len(t_prompt) - 1:-1], sequence[:, len(t_prompt):])[0]
        per_char = [0.0] * len(text)
        for (a, b), value in zip(enc["offset_mapping"], lp.tolist()):
            for c in range(a, b):
                per_char[c] += value / (b - a)
        want, at = [], 0
        for t in completion:
            if t == eos:
                want.append(float(lp[-1]))
                continue
            n = len(s_tok.decode([t]))
            want.append(sum(per_char[at: at + n]))
            at += n
        assert values == pytest.approx(want, abs=1e-5)
    cfg = distill_config(tiny_model_dir, teacher_dir, prompt_file, tmp_path / "run", train={"rollouts": 2})
    cfg["teacher"]["cross_tokenizer"] = True
    tidyrl.train(cfg)
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert len(rows) == 2 and all(math.isfinite(r["distill/reverse_kl"]) and r["time/teacher_s"] > 0 for r in rows)

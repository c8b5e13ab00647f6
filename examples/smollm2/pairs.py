"""Preference pairs from the model's own answers: `python pairs.py SAMPLES_DIR OUT.jsonl` reads the samples of
`tidyrl eval ... --sampled --samples-per-prompt K --output-dir SAMPLES_DIR` (eval_samples.jsonl, each completion
with its reward) and writes, for every prompt with both a right (reward 1) and a wrong (reward 0) completion,
min(right, wrong) pairs {"prompt", "chosen", "rejected"}, each completion used once; right answers that stopped
by themselves come first, so a pair teaches stopping where it can. Prompts whose K samples all agree give no pair.
"""

import json
import sys
from collections import defaultdict
from pathlib import Path


def make_pairs(samples: list[dict]) -> list[dict]:
    """The pairs from eval_samples.jsonl rows, in prompt order; distinct texts only (a pair of equal texts is
    refused by the dpo and reward stages)."""
    by_prompt = defaultdict(list)
    for s in samples:
        by_prompt[s["prompt_index"]].append(s)
    pairs = []
    for index in sorted(by_prompt):
        group = sorted(by_prompt[index], key=lambda s: s["sample"])
        right = sorted({s["completion"]: s for s in group if s["reward"] >= 1.0}.values(), key=lambda s: s["truncated"])
        wrong = list({s["completion"]: s for s in group if s["reward"] <= 0.0}.values())
        pairs += [{"prompt": group[0]["prompt"], "chosen": r["completion"], "rejected": w["completion"]}
                  for r, w in zip(right, wrong)]
    return pairs


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit("usage: python pairs.py SAMPLES_DIR OUT.jsonl")
    rows = [json.loads(line) for line in (Path(argv[0]) / "eval_samples.jsonl").read_text().splitlines()]
    pairs = make_pairs(rows)
    Path(argv[1]).write_text("".join(json.dumps(p) + "\n" for p in pairs))
    prompts = len({r["prompt_index"] for r in rows})
    print(f"{argv[1]}: {len(pairs)} pairs from {prompts} prompts x {len(rows) // max(prompts, 1)} samples "
          f"({sum(r['reward'] >= 1.0 for r in rows) / len(rows):.3f} of the samples right)")


if __name__ == "__main__":
    main(sys.argv[1:])

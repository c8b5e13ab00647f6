"""Host memory of loading a policy and its reference (the RL stages' first step), per way of placing them: each mode
in a fresh process, its peak RSS (VmHWM, the mapped file's pages included) and the memory it owns (RssAnon) at
the end, beside the size of one model's weights (imports alone: the first row).

    python benchmarks/bench_loading.py                          # CPU: the host mode (what a CPU run does)
    python benchmarks/bench_loading.py --device cuda            # all three modes, Qwen2.5-0.5B's shape in bf16
    python benchmarks/bench_loading.py --device cuda --hidden 1536 --intermediate 8960 --layers 28 --heads 12

Modes (`models.loading.placed`):
  host            both models on the host, each copied out of the file's mapping (`in_own_memory`): a CPU run.
  copy-then-move  the alternative `placed` avoids: the policy copied onto the host and kept there until
                  `prepare`, the reference copied onto the host, then moved to the device.
  placed          what a GPU run does: each model moved to the device straight from the file's mapping.
`--device meta` runs the moving modes without a GPU, to check the script: moving to meta reads nothing from the
file, so its figures are a lower bound, not a GPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from shapes import add_shape_arguments, qwen2_config

SRC = Path(__file__).resolve().parent.parent / "src"
MODES = ("imports", "host", "copy-then-move", "placed")  # imports: torch, transformers, tidyrl; no weights


def build(args, folder: Path) -> None:
    """A Qwen2 model of the asked shape (its output layer tied below 1.5B's width, as Qwen2.5's), saved in bf16."""
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(qwen2_config(args, tie_word_embeddings=args.hidden < 1536)).to(torch.bfloat16).save_pretrained(
        folder)


def file_facts(folder: Path) -> tuple[int, int, int]:
    """(bytes of the weights, tensors the files leave off 64-byte alignment, tensors), from the files' headers: a
    safetensors file is 8 bytes of header length, the JSON header, then the data at the header's offsets (a tied
    weight saved once). `in_own_memory` copies the misaligned tensors on the host."""
    size = off = total = 0
    for file in folder.glob("*.safetensors"):
        with open(file, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
        for key, entry in header.items():
            if key != "__metadata__":
                start, end = entry["data_offsets"]
                size += end - start
                off += (8 + length + start) % 64 != 0
                total += 1
    return size, off, total


def child(mode: str, folder: str, device: str) -> None:
    """One mode, in this process: prints a JSON line with its figures."""
    sys.path.insert(0, str(SRC))
    import torch  # what every mode imports: the first row's figure
    import transformers

    from tidyrl.models.loading import load_causal_lm

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"

    policy = reference = None
    if mode == "imports":  # and the model's classes, built on meta: what loading needs before it reads a weight
        config = transformers.AutoConfig.from_pretrained(folder)
        with torch.device("meta"):
            transformers.AutoModelForCausalLM.from_config(config)
    elif mode == "host":
        policy = load_causal_lm(folder, "bfloat16")
        reference = load_causal_lm(folder, "bfloat16")
    elif mode == "copy-then-move":
        policy = load_causal_lm(folder, "bfloat16")
        reference = load_causal_lm(folder, "bfloat16").to(device)
        policy.to(device)  # accelerate's prepare
    elif mode == "placed":
        policy = load_causal_lm(folder, "bfloat16", device=device)
        reference = load_causal_lm(folder, "bfloat16", device=device)
    # VmHWM, not ru_maxrss: the latter carries the parent's peak across fork and exec
    status = dict(line.split(":", 1) for line in open("/proc/self/status") if line.startswith(("Rss", "VmHWM")))
    print(json.dumps({"mode": mode, "peak_mib": int(status["VmHWM"].split()[0]) / 1024,
                      "anon_mib": int(status["RssAnon"].split()[0]) / 1024,
                      "where": "-" if policy is None else f"{next(policy.parameters()).device}, "
                                                          f"{next(reference.parameters()).device}",
                      "versions": versions}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (the host mode only), cuda, or meta (a check)")
    add_shape_arguments(parser, hidden=896, intermediate=4864, layers=24, heads=14, vocab=151936)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    modes = MODES if args.device != "cpu" else MODES[:2]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        build(args, folder)
        size, off, total = file_facts(folder)
        size /= 2**20
        print(f"one model: {size:.0f} MiB of bf16 weights ({args.layers} layers, hidden {args.hidden}); "
              f"device {args.device}; {off} of its {total} tensors off 64-byte alignment in the file (the host way "
              "copies those)")
        env = {**os.environ, "PYTHONPATH": str(SRC), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
        base = None
        for mode in modes:
            out = subprocess.run([sys.executable, __file__, "--child", mode, str(folder), args.device],
                                 capture_output=True, text=True, env=env, check=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            if base is None:
                print(r["versions"])
                print(f"{'mode':<16}{'peak RSS MiB':>14}{'above imports':>15}{'x model':>9}{'owned at end MiB':>18}"
                      "  weights on")
                base = r["peak_mib"]
            above = r["peak_mib"] - base
            print(f"{mode:<16}{r['peak_mib']:>14.0f}{above:>15.0f}{above / size:>9.2f}{r['anon_mib']:>18.0f}  "
                  f"{r['where']}")


if __name__ == "__main__":
    main()

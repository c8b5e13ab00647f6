"""What tidyrl prints for a person, from one helper: every line starts `tidyrl: ` (a command's own name, e.g.
`tidyrl eval: `), and a run's lines are printed by its main process only. Every part may use it; it imports no other
part (tests/test_layers.py). Results a command prints for a program (plan.json, a path) are not such lines."""

from __future__ import annotations

import sys
from typing import Iterable, Optional, Union


def say(text: Union[str, Iterable[Optional[str]], None], *, main: bool = True, err: bool = False,
        prefix: str = "tidyrl") -> None:
    """Print `text` (a string of one or more lines, or a sequence of them; None, empty strings and empty lines are
    skipped) as `<prefix>: <line>` each, flushed at once. `main`: whether this process prints (a run's main
    process: each line appears once, whatever the number of processes); `err`: to stderr (warnings, a command's
    notes beside its result on stdout), else stdout."""
    if not main or not text:
        return
    stream = sys.stderr if err else sys.stdout  # read at the call: a test's capture replaces them
    for part in [text] if isinstance(text, str) else text:
        for line in (part or "").splitlines():
            if line:
                print(f"{prefix}: {line}", file=stream, flush=True)

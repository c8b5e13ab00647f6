"""The import paths that moved into DESIGN §6's folders in 0.2 keep working for one release, with a
DeprecationWarning that names the new path (tidyrl/_moved.py)."""

from __future__ import annotations

import importlib
import sys

import pytest

from tidyrl._moved import MOVED


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_import_path_gives_the_new_module_and_says_where_it_went(old, monkeypatch):
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    new = importlib.import_module(MOVED[old])
    assert module is new  # one module: what a user sets on the old name, the library sees
    assert new.__spec__.name == MOVED[old]  # and the new module keeps its own identity


def test_a_yaml_reward_by_its_old_path_still_loads(monkeypatch):
    from tidyrl.rewards import load_reward_function
    from tidyrl.rewards.verifiable import math_answer

    monkeypatch.delitem(sys.modules, "tidyrl.verifiable", raising=False)
    with pytest.warns(DeprecationWarning, match="tidyrl.rewards.verifiable:<name>"):
        fn = load_reward_function("tidyrl.verifiable:math_answer", None)
    assert fn is math_answer

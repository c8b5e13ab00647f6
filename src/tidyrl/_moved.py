"""Import paths that moved in 0.2 (the layout of DESIGN §6) keep working for one release, with a
DeprecationWarning naming the new path: `import tidyrl.verifiable` and a YAML `tidyrl.verifiable:math_answer` give
the module `tidyrl.rewards.verifiable` itself (the same object, so attributes set on one are set on the other)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings

MOVED = {
    "tidyrl.verifiable": "tidyrl.rewards.verifiable",
    "tidyrl.reward_model": "tidyrl.rewards.reward_models",
    "tidyrl.tasks": "tidyrl.data.reasoning_gym",
    "tidyrl.offline_data": "tidyrl.data.offline",
    "tidyrl.lora": "tidyrl.models.lora",
    "tidyrl.sharding": "tidyrl.models.sharding",
    "tidyrl.ops": "tidyrl.models.ops",
    "tidyrl.devices": "tidyrl.models.devices",
    "tidyrl.host_memory": "tidyrl.models.host_memory",
    "tidyrl.tiny": "tidyrl.models.tiny",
    "tidyrl.rollout": "tidyrl.rollouts",
    "tidyrl.multiturn": "tidyrl.rollouts.episodes",
    "tidyrl.models.engines": "tidyrl.engines",
}
"""Old module -> the module that now holds its contents."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self._spec_of = {}

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        new = MOVED[spec.name]
        # stacklevel: past importlib's frames, at the importing line where Python can tell
        warnings.warn(f"{spec.name} moved to {new}; the old name works until tidyrl 0.3. Import {new} "
                      f"(in a YAML file: {new}:<name>)", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._spec_of[new] = module.__spec__  # the import system sets the old name's spec on it: put it back
        return module

    def exec_module(self, module):
        # The module is the new one, already executed: only its own spec is restored.
        module.__spec__ = self._spec_of.get(module.__name__, module.__spec__)


def install() -> None:
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.append(_MovedModules())

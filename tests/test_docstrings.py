"""A module docstring names only what exists: every dotted name it puts in backticks that starts at a module of the
package (`models.sequences.sample_seed`, `table.Algorithm.advantages`, `tidyrl.loops.run.setup`) resolves, part by
part, to a module, a function, a class or a member of one; every plain class-like name (`PromptStream`) is one
the package defines.

Read from the source (no module is imported). A plain lower-case name is not checked: in docstrings it is as often
a config key's last part, a metric, a value or an argument (`greedy`, `seed`, `reward_mean`) as a function, and
telling them apart would take a list of exceptions. Dotted names that are config keys (`rollout.engine`) are
the configuration reference's, checked there (tests/test_docs.py).
"""

from __future__ import annotations

import ast
import builtins
import re
from pathlib import Path

import pytest

from tidyrl.config import Config, _all_keys

SRC = Path(__file__).resolve().parent.parent / "src" / "tidyrl"
NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\(\))?")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


PATHS = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}
TREES = {m: ast.parse(p.read_text()) for m, p in PATHS.items()}
CONFIG_KEYS = set(_all_keys(Config))


def members(body) -> dict[str, ast.AST]:
    """The names a module or class body defines (functions, classes, assignments, imports), each to its node."""
    found = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, ast.Assign):
            found.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            found[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update({(a.asname or a.name).split(".")[0]: node for a in node.names})
        elif isinstance(node, (ast.If, ast.Try)):  # names defined under a condition or a try
            found.update(members(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", [])
                                 + [n for h in getattr(node, "handlers", []) for n in h.body]))
    return found


DEFINED = {name for tree in TREES.values() for node in ast.walk(tree)
           if isinstance(node, (ast.Module, ast.ClassDef)) for name in members(node.body)}


def resolves(path: list[str], where: str) -> bool:
    """Whether `path` names something, starting at the module `where`: its submodules, then its names; a class's
    members; an imported name followed to the module it comes from (outside the package: taken as it is)."""
    if not path:
        return True
    head, rest = path[0], path[1:]
    if f"{where}.{head}" in PATHS:
        return resolves(rest, f"{where}.{head}")
    node = members(TREES[where].body).get(head)
    if node is None:
        return False
    if isinstance(node, ast.ImportFrom):  # (the package imports absolutely)
        alias = next(a for a in node.names if (a.asname or a.name) == head)
        if node.module in PATHS:
            return resolves([alias.name, *rest], node.module)
        return True  # from outside the package: taken as it is
    if isinstance(node, ast.ClassDef) and rest:
        return rest[0] in members(node.body) or any(
            isinstance(base, ast.Name) and base.id in members(TREES[where].body)
            and resolves([base.id, rest[0]], where) for base in node.bases)
    return not rest or not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))


def starts(module: str) -> list[str]:
    """Where a docstring's dotted name may start: the module itself, its package, and the top of tidyrl."""
    package = module if PATHS[module].name == "__init__.py" else module.rpartition(".")[0]
    return list(dict.fromkeys([module, package, "tidyrl"]))


def unknown_names(module: str) -> list[str]:
    doc = ast.get_docstring(TREES[module]) or ""
    wrong = []
    for text in re.findall(r"`([^`\n]+)`", doc):
        if not NAME.fullmatch(text) or text in CONFIG_KEYS:
            continue
        path = text.removesuffix("()").split(".")
        if path[0] == "tidyrl":
            path, begin = path[1:], ["tidyrl"]
        else:
            begin = [s for s in starts(module) if f"{s}.{path[0]}" in PATHS or path[0] in members(TREES[s].body)]
        if len(path) > 1 and begin:
            if not any(resolves(path, s) for s in begin):
                wrong.append(text)
        elif len(path) == 1 and path[0][:1].isupper() and not path[0].isupper():  # a class-like name
            if path[0] not in DEFINED and not hasattr(builtins, path[0]):
                wrong.append(text)
    return wrong


@pytest.mark.parametrize("module", sorted(PATHS), ids=str)
def test_a_module_docstring_names_what_exists(module):
    wrong = unknown_names(module)
    assert not wrong, f"{module}'s docstring names {wrong}, which the package does not define"


def test_the_check_finds_a_missing_name_and_follows_imports_and_classes():
    assert resolves(["engines", "base", "Capabilities", "can_sleep"], "tidyrl")
    assert resolves(["table", "Algorithm", "advantages"], "tidyrl.algorithms")
    assert resolves(["sequences", "sample_seed"], "tidyrl.models")
    assert not resolves(["vllm", "model_problems"], "tidyrl.engines")
    assert not resolves(["table", "Algorithm", "no_such_field"], "tidyrl.algorithms")

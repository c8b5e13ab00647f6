"""The documentation stays true: the configuration reference matches the config classes, links resolve,
and `--help` lists the stages and points to the reference."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import typing
from pathlib import Path

import pytest

from tidyrl.cli import main
from tidyrl.config import ALGORITHMS, Config

ROOT = Path(__file__).resolve().parent.parent


def generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "scripts" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_config_reference_page_is_up_to_date():
    page = ROOT / "docs" / "config-reference.md"
    assert page.read_text(encoding="utf-8") == generator().render(), (
        "docs/config-reference.md is stale: run `python scripts/gen_config_reference.py` and commit the page")


def leaf_keys(cls, prefix=""):
    """Every plain key of the config classes, as the reference writes it (list entries as rewards.<i>.x)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        item = typing.get_args(hint)[0] if typing.get_origin(hint) is list else None
        if dataclasses.is_dataclass(hint):
            yield from leaf_keys(hint, f"{prefix}{f.name}.")
        elif item is not None and dataclasses.is_dataclass(item):
            yield from leaf_keys(item, f"{prefix}{f.name}.<i>.")
        else:
            yield prefix + f.name, f


def test_reference_has_a_row_per_key_with_type_default_and_docstring():
    page = generator().render()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([^`]+)` \|.*\|$", page, flags=re.M)}
    keys = dict(leaf_keys(Config))
    assert set(rows) == set(keys)
    assert rows["train.learning_rate"] == "| `train.learning_rate` | number | `1e-06` | Peak learning rate of AdamW. |"
    assert rows["log.report_to"].startswith("| `log.report_to` | list of strings | `[]` | Experiment trackers")
    assert rows["rewards.<i>.weight"].startswith("| `rewards.<i>.weight` | number | `1.0` |")
    assert rows["train.rollouts"].startswith("| `train.rollouts` | integer or null | `null` |")
    for key, row in rows.items():
        assert not row.endswith("|  |"), f"{key} has no description"


def test_a_field_without_docstring_is_reported():
    gen = generator()

    @dataclasses.dataclass
    class Section:
        documented: int = 1
        """Has one."""
        bare: str = "x"

    missing = []
    rows, _ = gen.section_table(Section, "section.", missing)
    assert missing == ["section.bare"]
    assert rows[0] == "| `section.documented` | integer | `1` | Has one. |"


def test_relative_links_in_the_docs_resolve():
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


@pytest.mark.parametrize("argv", [["--help"], ["train", "--help"]])
def test_help_lists_the_stages_and_points_to_the_reference(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    text = capsys.readouterr().out
    for algorithm in ALGORITHMS:
        assert re.search(rf"^  {algorithm}\b", text, flags=re.M), algorithm
    assert "docs/config-reference.md" in text


def test_concepts_page_shows_what_tidyrl_plan_prints_for_its_worked_example(tmp_path, capsys, tiny_model_dir):
    """The JSON on docs/concepts.md is the real `tidyrl plan` output of the page's worked example."""
    import json

    import yaml

    page = (ROOT / "docs" / "concepts.md").read_text(encoding="utf-8")
    shown = json.loads(re.search(r"```json\n(.*?)```", page, flags=re.S).group(1))
    example = yaml.safe_load(re.search(r"```yaml\n(rollout:.*?)```", page, flags=re.S).group(1))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"q{i}", "word": "fig"}) + "\n" for i in range(100)))  # N = 100
    config = tmp_path / "c.yaml"
    # `tidyrl plan` checks what `train` would before loading weights: a real model folder and reward function.
    config.write_text(yaml.safe_dump({"model": str(tiny_model_dir), "data": {"path": str(prompts)},
                                      "rewards": [{"function": "tidyrl.demo:anagram_reward"}], **example}))
    assert main(["plan", str(config)]) == 0
    assert json.loads(capsys.readouterr().out) == shown


def test_the_quickstart_files_and_plan_commands_do_what_the_page_says(tmp_path, tiny_model_dir, capsys, monkeypatch):
    """The quickstart's prompt file, reward function and config, written as the page shows them (the model
    pointed at a local tiny one): every `tidyrl plan` line of section 4 succeeds or is refused as its comment
    says, and the accepted ones print the same totals."""
    import json
    import shlex

    import yaml

    page = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
    (tmp_path / "prompts.jsonl").write_text(re.search(r"```jsonl\n(.*?)```", page, flags=re.S).group(1))
    (tmp_path / "my_rewards.py").write_text(re.search(r"```python\n(# my_rewards.py.*?)```", page, flags=re.S).group(1))
    config = yaml.safe_load(re.search(r"```yaml\n(# grpo.yaml.*?)```", page, flags=re.S).group(1))
    config.update(model=str(tiny_model_dir), output_dir=str(tmp_path / "run"))
    config["log"].pop("report_to")
    (tmp_path / "grpo.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)  # where a user runs the commands, beside the files
    section = page.split("## 4.")[1].split("## 5.")[0]
    lines = [line for line in re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1).splitlines() if line]
    assert len(lines) == 3
    totals = []
    for line in lines:
        command, _, comment = line.partition("#")
        args = shlex.split(command)[1:]
        code = main(args)
        out, err = capsys.readouterr()
        if "refused" in comment:
            assert code == 2 and "does not divide" in err, line
        else:
            assert code == 0, (line, err)
            totals.append({k: v for k, v in json.loads(out).items() if k.startswith("total")})
    assert len(totals) == 2 and totals[0] == totals[1]



@pytest.mark.parametrize("name", ["dapo", "gspo"])
def test_recipes_load_and_plan(name):
    """examples/recipes: every key is a real key with a valid value, and the sizes divide on 8 processes."""
    from tidyrl.config import load_config
    from tidyrl.plan import plan_from_config

    cfg = load_config(ROOT / "examples" / "recipes" / f"{name}.yaml")
    plan = plan_from_config(cfg, 17_000, 8)
    assert plan.total_optimizer_steps == cfg.train.rollouts * cfg.train.minibatches_per_epoch
    if name == "dapo":
        assert (cfg.grpo.clip_eps, cfg.grpo.clip_eps_high, cfg.rollout.dynamic_sampling) == (0.2, 0.28, True)
        assert cfg.rollout.max_new_tokens - cfg.grpo.overlong_buffer == 16384
    else:
        assert (cfg.grpo.policy_loss, cfg.grpo.clip_eps, cfg.grpo.clip_eps_high) == ("sequence", 3e-4, 4e-4)

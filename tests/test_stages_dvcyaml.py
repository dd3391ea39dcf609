"""dvc.yaml agrees with the code: commands, code deps, artifact paths, params keys."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from stages import common

ROOT = Path(__file__).resolve().parents[1]
DVC = YAML(typ="safe", pure=True).load((ROOT / "dvc.yaml").read_text())
STAGES = DVC["stages"]
ORDER = ["prepare", "sft", "reward", "tokenize", "ppo", "evaluate"]


def outs(stage: dict) -> list[str]:
    return [next(iter(o)) if isinstance(o, dict) else o for o in stage.get("outs", []) + stage.get("metrics", [])]


def code_imports(name: str) -> set[str]:
    """Top-level packages and stages.* modules imported by stages/<name>.py."""
    tree = ast.parse((ROOT / "stages" / f"{name}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module if node.module.startswith("stages") else node.module.split(".")[0])
            if node.module == "stages":
                found |= {f"stages.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
    return found


def test_stages_in_order_with_python_dash_m():
    assert list(STAGES) == ORDER
    for name, stage in STAGES.items():
        assert stage["cmd"] == f"python3 -m stages {name}"


@pytest.mark.parametrize("name", ORDER)
def test_code_deps_cover_what_the_stage_imports(name):
    deps = set(STAGES[name]["deps"])
    imports = code_imports(name)
    assert f"stages/{name}.py" in deps
    for module in (m for m in imports if m.startswith("stages.")):
        helpers = {"common", "params", "synthetic", "resume", "scoring"}
        assert module.split(".")[1] in helpers, f"{name} imports another stage: {module}"
        assert f"stages/{module.split('.')[1]}.py" in deps
    assert ("ppo_core" in imports) == ("ppo_core" in deps)


def test_every_artifact_path_is_declared_and_state_is_not():
    """Results are DVC outputs; resumable state and timings are not: a cache:false or persist output would keep DVC's
    run-cache from restoring the stage in a queued experiment, and timings would make the lock irreproducible."""
    declared = [o for stage in STAGES.values() for o in outs(stage)]
    for name, value in vars(common).items():
        if not (isinstance(value, Path) and name.isupper()):
            continue
        covered = any(str(value) == o or str(value).startswith(o + "/") for o in declared)
        exempt = any(value.is_relative_to(path) for path in common.NOT_OUTPUTS)
        assert covered != exempt, f"{name}: {value} is {'an output' if covered else 'neither an output nor exempt'}"
    assert not [o for stage in STAGES.values() for o in stage["outs"] if isinstance(o, dict)], "outputs with options"


def test_data_deps_are_outputs_of_earlier_stages():
    seen: list[str] = []
    for name in ORDER:
        for dep in STAGES[name]["deps"]:
            if dep.startswith("data/"):
                assert any(dep == o or dep.startswith(o + "/") for o in seen), f"{name} depends on {dep}"
        seen += outs(STAGES[name])


def test_tracked_params_exist():
    params = YAML(typ="safe", pure=True).load((ROOT / "params.yaml").read_text())
    for name, stage in STAGES.items():
        assert "seed" in stage["params"], name
        for key in stage["params"]:
            node = params
            for part in key.split("."):
                assert part in node, f"{name} tracks {key}, not in params.yaml"
                node = node[part]


@pytest.mark.parametrize("name", ["sft", "reward", "ppo"])
def test_checkpoint_fingerprint_covers_what_dvc_tracks(name):
    """A checkpoint is reused only for the params, input files and code the stage's dvc.yaml entry tracks."""
    import importlib

    module = importlib.import_module(f"stages.{name}")
    assert list(module.TRACKED) == STAGES[name]["params"]
    assert {str(path) for path in module.INPUTS} == {d for d in STAGES[name]["deps"] if d.startswith("data/")}
    assert set(module.CODE) == {d for d in STAGES[name]["deps"] if not d.startswith("data/")}
    assert f"data/checkpoints/{name}" not in outs(STAGES[name])

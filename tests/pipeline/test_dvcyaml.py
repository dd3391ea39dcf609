"""dvc.yaml agrees with the code: commands, code deps (exactly what each stage executes), artifact paths, params."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from stages.shared import artifacts, resume
from stages.shared.pipeline import stage, stages
from tests.imports import import_statements

ROOT = Path(__file__).resolve().parents[2]
DVC = YAML(typ="safe", pure=True).load((ROOT / "dvc.yaml").read_text())
STAGES = DVC["stages"]
ORDER = ["sources", "prepare", "sft", "reward", "tokenize", "ppo", "evaluate", "report"]
PACKAGES = ("stages", "ppo_core", "rewards")  # the project's code
# imported by name at run time (scorer.name), so no import statement shows it
USER_CODE = {"ppo": {"rewards"}, "evaluate": {"rewards"}}


def outs(stage: dict) -> list[str]:
    return [next(iter(o)) if isinstance(o, dict) else o for o in stage.get("outs", []) + stage.get("metrics", [])]


def module_file(module: str) -> Path | None:
    """The file a project module runs from (a package's __init__.py), or None (a name inside a module)."""
    path = ROOT.joinpath(*module.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.exists():
            return candidate
    return None


def lazy_exports(init: Path) -> dict[str, str]:
    """A package's names imported on first use (``ppo_core.__init__._EXPORTS``): name -> module."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_EXPORTS" for t in node.targets):
            return ast.literal_eval(node.value)
    return {}


def imported_modules(file: Path) -> set[str]:
    """The project modules ``file`` imports when it runs: every import statement, in functions too, but those
    under ``if TYPE_CHECKING:``; a name a package exports lazily counts as its module."""
    found = set()
    for module, names in import_statements(file.read_text(), list(file.relative_to(ROOT).parts[:-1])):
        init = module_file(module)
        exports = lazy_exports(init) if init is not None and init.name == "__init__.py" else {}
        found |= {module} | {f"{module}.{exports.get(name, name)}" for name in names}
    return {m for m in found if m.split(".")[0] in PACKAGES}


def executed_files(entry_modules: list[str]) -> set[str]:
    """The project files that running ``entry_modules`` executes: their transitive imports, packages' __init__s
    included (relative paths)."""
    seen, todo = set(), list(entry_modules)
    while todo:
        parts = todo.pop().split(".")
        for i in range(1, len(parts) + 1):  # importing a.b.c runs a/__init__, a/b/__init__, then a/b/c
            file = module_file(".".join(parts[:i]))
            if file is not None and file not in seen:
                seen.add(file)
                todo.extend(imported_modules(file))
    return {str(f.relative_to(ROOT)) for f in seen}


def covered(file: str, dep: str) -> bool:
    return file == dep or file.startswith(dep.rstrip("/") + "/")


def test_stages_in_order_with_python3_dash_m():
    assert list(STAGES) == ORDER == list(stages())
    for name, spec in STAGES.items():
        assert spec["cmd"] == f"python3 -m stages {name}"


@pytest.mark.parametrize("name", ORDER)
def test_code_deps_are_exactly_what_the_stage_executes(name):
    """`python3 -m stages <name>` runs stages/__main__.py, then stages/<name>.py: every project file that executes is
    covered by the stage's code deps, and every code dep covers only files that execute (a directory: all of its
    Python files), so a change reruns exactly the stages it can affect."""
    executed = executed_files(["stages.__main__", f"stages.{name}"])
    deps = [d for d in STAGES[name]["deps"] if not d.startswith("data/")]
    uncovered = sorted(f for f in executed if not any(covered(f, d) for d in deps))
    assert not uncovered, f"{name} executes files dvc.yaml does not list: {uncovered}"
    for dep in deps:
        if dep in USER_CODE.get(name, ()):
            continue
        files = [str(p.relative_to(ROOT)) for p in (ROOT / dep).rglob("*.py")] if (ROOT / dep).is_dir() else [dep]
        unused = sorted(set(files) - executed)
        assert not unused, f"{name} lists {dep}, but never executes {unused}"


def test_a_change_to_the_trainer_reruns_only_ppo():
    for name in ORDER:
        executes = "ppo_core/trainer.py" in executed_files(["stages.__main__", f"stages.{name}"])
        assert executes == (name == "ppo"), name


def test_every_artifact_path_is_declared_and_state_is_not():
    """Results are DVC outputs; resumable state and timings are not: a cache:false or persist output would keep DVC's
    run-cache from restoring the stage in a queued experiment, and timings would make the lock irreproducible."""
    declared = [o for spec in STAGES.values() for o in outs(spec)]
    for name, value in vars(artifacts).items():
        if not (isinstance(value, Path) and name.isupper()):
            continue
        is_output = any(covered(str(value), o) for o in declared)
        exempt = any(value.is_relative_to(path) for path in artifacts.NOT_OUTPUTS)
        assert is_output != exempt, f"{name}: {value} is {'an output' if is_output else 'neither an output nor exempt'}"
    with_options = [o for name, spec in STAGES.items() for o in spec.get("outs", []) if isinstance(o, dict)
                    and name != "sources"]  # always_changed: never run-cached anyway; it persists its outputs
    assert not with_options, f"outputs with options (persist, cache: false): {with_options}"
    assert all(next(iter(o.values())) == {"persist": True} for o in STAGES["sources"]["outs"])


def test_data_deps_are_outputs_of_earlier_stages():
    seen: list[str] = []
    for name in ORDER:
        for dep in STAGES[name]["deps"]:
            if dep.startswith("data/"):
                assert any(covered(dep, o) for o in seen), f"{name} depends on {dep}"
        seen += outs(STAGES[name])


def test_tracked_params_exist():
    params = YAML(typ="safe", pure=True).load((ROOT / "params.yaml").read_text())
    for name, spec in STAGES.items():
        assert ("seed" in spec["params"]) == (name != "sources"), name  # sources hashes files: no randomness
        for key in spec["params"]:
            node = params
            for part in key.split("."):
                assert part in node, f"{name} tracks {key}, not in params.yaml"
                node = node[part]


@pytest.mark.parametrize("name", ["sft", "reward", "ppo"])
def test_a_checkpoint_fingerprint_covers_what_dvc_yaml_tracks(name, tiny_params, tiny_run):
    """The training stages fingerprint their resumable state with dvc.yaml's own lists (stages.shared.pipeline): the
    params it tracks but the `checkpoint` keys (they change no output), its data deps and its code deps."""
    spec = stage(name)
    found = resume.fingerprint(tiny_params, spec.params, spec.data, tiny_run, spec.code)
    assert list(found["params"]) == [k for k in STAGES[name]["params"] if not k.startswith("checkpoint.")]
    assert list(found["inputs"]) == [d for d in STAGES[name]["deps"] if d.startswith("data/")]
    assert list(found["code"]) == [d for d in STAGES[name]["deps"] if not d.startswith("data/")]
    assert f"data/checkpoints/{name}" not in outs(STAGES[name])


@pytest.mark.parametrize("name", ORDER)
def test_cli_help_says_what_dvc_yaml_declares(name):
    from typer.testing import CliRunner

    from stages.shared.cli import app

    text = " ".join(CliRunner().invoke(app, [name, "--help"], terminal_width=400).output.split())
    assert f"Reads: params {', '.join(STAGES[name]['params'])}" in text
    assert f"Writes: {', '.join(outs(STAGES[name]))}." in text

"""stages/ is the pipeline: one module (or package) per DVC stage, named as in dvc.yaml, and what they share in
stages.shared. The imports allowed between them, their reach into ppo_core (its public surface only) and their sizes
(STYLE.md's thin stages) are held here, as tests/test_layers.py holds ppo_core's layers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from ruamel.yaml import YAML

import ppo_core
from tests.imports import import_statements

ROOT = Path(__file__).resolve().parents[1]
STAGES = ROOT / "stages"
ENTRY = {"__init__", "__main__"}  # the package and `python3 -m stages`: the entry, not a stage
# The public surface of ppo_core that a stage may import: the package's exported names, and PPOConfig's module
PUBLIC = {"ppo_core", "ppo_core.config"}
LIMITS = {"stage": 200, "shared": 400, "function": 60}


def dvc_stage_names() -> set[str]:
    """The stages of the root dvc.yaml and of the examples' (fetch: the real-model example's)."""
    names = set()
    for path in [ROOT / "dvc.yaml", *ROOT.glob("examples/*/dvc.yaml")]:
        names |= set(YAML(typ="safe", pure=True).load(path.read_text())["stages"])
    return names


def owner(file: Path) -> str:
    """Which part of stages/ ``file`` belongs to: "shared", a stage's name, or "entry"."""
    top = file.relative_to(STAGES).parts[0].removesuffix(".py")
    return "entry" if top in ENTRY else top


def module_of(file: Path) -> list[str]:
    """The package ``file``'s relative imports are resolved in (a package's ``__init__`` is of the package itself)."""
    parts = list(file.relative_to(ROOT).with_suffix("").parts)
    return parts if file.name == "__init__.py" else parts[:-1]


def project_imports(file: Path) -> set[str]:
    """The ``stages.*`` and ``ppo_core.*`` modules ``file`` imports (in functions too), a name imported from a package
    counted as that package's module when it is one (``from stages.shared import numerics``)."""
    found = set()
    for module, names in import_statements(file.read_text(), module_of(file)):
        for name in [module, *(f"{module}.{n}" for n in names)]:
            path = ROOT.joinpath(*name.split("."))
            if name == module or path.with_suffix(".py").exists() or (path / "__init__.py").exists():
                found.add(name)
    return {m for m in found if m.split(".")[0] in ("stages", "ppo_core")}


def stage_of(module: str) -> str | None:
    """``stages.ppo.loop`` -> ``ppo``; ``stages.shared.params`` -> ``shared``; ``stages`` -> None."""
    parts = module.split(".")
    return parts[1] if parts[0] == "stages" and len(parts) > 1 else None


FILES = sorted(p for p in STAGES.rglob("*.py") if "__pycache__" not in p.parts)


def test_every_module_under_stages_is_a_dvc_stage_or_shared():
    tops = {p.relative_to(STAGES).parts[0].removesuffix(".py") for p in FILES} - ENTRY
    assert tops - {"shared"} == dvc_stage_names(), "a module of stages/ that is no DVC stage belongs in stages.shared"


@pytest.mark.parametrize("file", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_from_a_stage_to_shared_and_never_back(file):
    """shared imports no stage; a stage imports shared and its own package, no other stage; the entry
    (stages/__main__.py) imports the shared CLI, which runs a stage by its name (importlib, no import statement)."""
    own = owner(file)
    allowed = {"shared"} | ({own} if own not in ("shared", "entry") else set())
    bad = sorted(m for m in project_imports(file) if stage_of(m) not in (None, *allowed))
    assert not bad, f"{file.relative_to(ROOT)} ({own}) imports {bad}"


@pytest.mark.parametrize("file", [f for f in FILES if owner(f) not in ("shared", "entry")],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_a_stage_uses_ppo_core_through_its_public_surface(file):
    """A stage imports `ppo_core`'s exported names (and `ppo_core.config`), not its internals: what the library's
    users get is what the pipeline uses. stages.shared adapts the rest (runtime, models)."""
    inner = sorted(m for m in project_imports(file) if m.startswith("ppo_core") and m not in PUBLIC)
    assert not inner, f"{file.relative_to(ROOT)} imports ppo_core's internals {inner}"
    for module, names in import_statements(file.read_text(), module_of(file)):
        if module == "ppo_core":
            private = set(names) - set(ppo_core.__all__)
            assert not private, f"{file.relative_to(ROOT)} imports {sorted(private)}, not exported by ppo_core"


@pytest.mark.parametrize("file", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_and_functions_stay_small(file):
    """No stage module over 200 lines (a stage's package: each of its modules), no shared one over 400, no function
    over 60 (docstring included)."""
    text = file.read_text()
    limit = LIMITS["shared" if owner(file) == "shared" else "stage"]
    assert len(text.splitlines()) <= limit, f"{file.relative_to(ROOT)}: {len(text.splitlines())} lines > {limit}"
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            assert lines <= LIMITS["function"], f"{file.relative_to(ROOT)}: {node.name} is {lines} lines"


def test_the_checks_see_a_bad_import_and_a_long_function(tmp_path):
    """The rules above can fail: a shared module importing a stage, and a 61-line function."""
    shared = STAGES / "shared" / "params.py"
    text = "from stages.ppo import loop\n"
    assert {m for m, _ in import_statements(text, module_of(shared))} == {"stages.ppo"}
    assert stage_of("stages.ppo.loop") == "ppo" and stage_of("stages.shared.params") == "shared"
    long = "def f():\n" + "    x = 1\n" * 60
    node = ast.parse(long).body[0]
    assert node.end_lineno - node.lineno + 1 == 61 > LIMITS["function"]

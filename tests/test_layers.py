"""ppo_core's layers import only downwards (docs/library.md, "ppo_core's layout"), and the module paths from before the
layers still import. Each of its modules stays within 400 lines, and no two of the project's modules import each other.

    algo      the math                          imports nothing of ppo_core
    runtime   processes, ZeRO, precision, ...   imports nothing of ppo_core
    models    value-head models, sampling, ...  algo, runtime
    config    PPOConfig, checks, resolution     algo
    step      rollout passes, update, stats     algo, runtime, models, config
    top       trainer, legacy, core, __init__   anything
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import ppo_core
from tests.imports import import_statements
from tests.pipeline.test_dvcyaml import lazy_exports

PACKAGE = Path(ppo_core.__file__).parent
ALLOWED = {
    "algo": set(),
    "runtime": set(),
    "models": {"algo", "runtime"},
    "config": {"algo"},
    "step": {"algo", "runtime", "models", "config"},
    "top": {"algo", "runtime", "models", "config", "step", "top"},
}
CONFIG = {"config", "fields", "resolution"}  # the top-level modules of the config layer


def layer(module: str) -> str:
    """``ppo_core.algo.ppo_math`` -> ``algo``; ``ppo_core.config`` -> ``config``; ``ppo_core.trainer`` -> ``top``."""
    parts = module.split(".")[1:]
    if not parts:
        return "top"
    if parts[0] in ALLOWED and (PACKAGE / parts[0]).is_dir():
        return parts[0]
    return "config" if parts[0] in CONFIG else "top"


def module_name(file: Path) -> str:
    parts = file.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(file: Path) -> set[str]:
    """The ppo_core modules ``file`` imports, in functions too (not under ``if TYPE_CHECKING:``), absolute."""
    package = module_name(file).split(".")
    return imports_in(file.read_text(), package if file.name == "__init__.py" else package[:-1])


def imports_in(text: str, package: list[str]) -> set[str]:
    """``imports`` of the source ``text`` of a module of ``package`` (``["ppo_core", "algo"]``): each statement's
    module, and each imported name that is itself a module (``from . import a, b``)."""
    found = set()
    for module, names in import_statements(text, package):
        found |= {module} | {f"{module}.{name}" for name in names if is_module(f"{module}.{name}")}
    return {m for m in found if m.split(".")[0] == "ppo_core"}


def is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def upward(module: str, imported: set[str]) -> list[str]:
    """The modules of ``imported`` that ``module``'s layer may not import."""
    own = layer(module)
    return sorted(m for m in imported if m != "ppo_core" and layer(m) not in ALLOWED[own] | {own})


MODULES = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("file", MODULES, ids=lambda f: str(f.relative_to(PACKAGE)))
def test_each_module_imports_only_the_layers_below_it(file):
    own = layer(module_name(file))
    bad = upward(module_name(file), imports(file))
    assert not bad, f"{file.relative_to(PACKAGE)} ({own}) imports {bad}: {own} may import {sorted(ALLOWED[own])}"


def test_the_check_catches_an_upward_import_even_inside_a_function():
    source = (PACKAGE / "algo" / "ppo_math.py").read_text()
    assert upward("ppo_core.algo.ppo_math", imports_in(source, ["ppo_core", "algo"])) == []
    edited = source + "\n\ndef f():\n    from ..models.modeling import LMHead\n"
    assert upward("ppo_core.algo.ppo_math", imports_in(edited, ["ppo_core", "algo"])) == ["ppo_core.models.modeling"]
    assert upward("ppo_core.step.rollout", {"ppo_core.models.logprobs", "ppo_core.trainer"}) == ["ppo_core.trainer"]


def test_the_engine_does_not_import_the_legacy_surface():
    """``core`` and ``legacy`` are the legacy names over the engine: no module below the top imports them."""
    for file in MODULES:
        if layer(module_name(file)) != "top":
            legacy = {m for m in imports(file) if m in ("ppo_core.core", "ppo_core.legacy", "ppo_core.trainer")}
            assert not legacy, f"{file.relative_to(PACKAGE)} imports {sorted(legacy)}"


def test_the_sublayers_packages_run_no_code():
    """A layer's ``__init__`` is its docstring: importing ``ppo_core.algo`` for the registry loads nothing else."""
    for init in PACKAGE.glob("*/__init__.py"):
        body = ast.parse(init.read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr), init


@pytest.mark.parametrize("old", sorted(ppo_core._MOVED))
def test_the_paths_from_before_the_layers_import_the_same_module(old):
    new = importlib.import_module(f"ppo_core.{ppo_core._MOVED[old]}")
    assert importlib.import_module(f"ppo_core.{old}") is new
    assert getattr(ppo_core, old) is new
    assert new.__spec__.name == new.__name__  # its own spec, not the alias's: its relative imports resolve


def test_the_old_paths_work_in_a_fresh_process_without_importing_the_others():
    """``from ppo_core.ppo_math import ...`` in a new process, as user code written before the layers does, warning-free
    (-W error), and importing ``ppo_core`` loads none of the moved modules until asked."""
    code = ("import sys, ppo_core; assert not [m for m in sys.modules if m.startswith('ppo_core.')], sys.modules; "
            "from ppo_core.ppo_math import policy_loss; from ppo_core.rollout import Rollout; "
            "from ppo_core.step.inputs import ModelInputs; "
            "from ppo_core.core import whiten, LengthSampler, PPODecorators, set_seed; "
            "from ppo_core.registry import get_estimator; print(get_estimator('grpo').name)")
    out = subprocess.run([sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "grpo"


def legacy_method_names() -> set[str]:
    """The methods and properties of ``legacy.LegacyMethods`` and its bases: the legacy surface ``PPOTrainer``
    inherits."""
    return class_methods(PACKAGE / "legacy.py", "LegacyMethods")


def class_methods(file: Path, name: str) -> set[str]:
    """The methods and properties of the class ``name`` of ``file``, with those of its bases that a relative import
    brings from ppo_core's top modules (``from .legacy_hub import LegacyHub``)."""
    tree = ast.parse(file.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    found = {n.name for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
    sources = {alias.name: node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.level == 1
               for alias in node.names}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in sources:
            found |= class_methods(PACKAGE / f"{sources[base.id]}.py", base.id)
    return found


def self_attributes(source: str) -> set[str]:
    """The attributes a module's code reads or calls on ``self``."""
    return {node.attr for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"}


# The loop and the methods mixed into PPOTrainer beside the legacy ones
ENGINE = ("trainer.py", "policy_views.py", "checkpoints.py")


def test_the_engine_names_no_legacy_method():
    """The legacy surface is mapped on top of the engine, not threaded through it: ``trainer.py`` (the loop) and the
    engine's methods mixed in beside it never name a ``LegacyMethods`` method. A user's override is called by
    ``legacy``'s dispatchers (``hooked_advantages``, ``legacy_train_minibatch``, ``legacy_loss``), only where
    ``legacy.overrides`` finds one."""
    names = legacy_method_names()
    assert {"train_minibatch", "loss", "batched_forward_pass", "compute_rewards", "log_stats", "push_to_hub"} <= names
    for module in ENGINE:
        used = self_attributes((PACKAGE / module).read_text()) & names
        assert not used, f"{module} calls the legacy surface: {sorted(used)}"
    # the check sees a call threaded through the loop, as the step called its mini-batches before
    assert self_attributes("def f(self):\n    return self.train_minibatch(1, 2)\n") & names == {"train_minibatch"}


# ---- sizes and cycles ------------------------------------------------------------------------------------------------

LINE_LIMIT = 400  # docs/development.md, "Style": a module over it holds more than one concern
ROOT = PACKAGE.parent
PROJECT = ("ppo_core", "stages", "rewards")  # the project's packages (tests/pipeline/test_dvcyaml.py's PACKAGES)
PROJECT_FILES = sorted(f for name in PROJECT for f in (ROOT / name).rglob("*.py") if "__pycache__" not in f.parts)


@pytest.mark.parametrize("file", MODULES, ids=lambda f: str(f.relative_to(PACKAGE)))
def test_each_module_stays_within_the_line_limit(file):
    lines = len(file.read_text().splitlines())
    assert lines <= LINE_LIMIT, f"{file.relative_to(PACKAGE)} has {lines} lines, over {LINE_LIMIT}: split it by concern"


def project_file(module: str) -> Path | None:
    """The file a project module runs from (``ppo_core.ppo_math``, a path from before the layers: the module it
    names now), or None (a name inside a module, or no project module)."""
    parts = module.split(".")
    if parts[0] == "ppo_core" and len(parts) == 2 and parts[1] in ppo_core._MOVED:
        parts = ["ppo_core", *ppo_core._MOVED[parts[1]].split(".")]
    path = ROOT.joinpath(*parts)
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def imported_files(file: Path, text: str | None = None) -> set[Path]:
    """The project files that ``file`` (its source ``text``, where given) imports when it runs: each statement's
    module, each imported name that is a module, and a name its package exports lazily as that name's module; in
    functions too, but not under ``if TYPE_CHECKING:`` (annotations only: never run)."""
    text = file.read_text() if text is None else text
    found = set()
    for module, names in import_statements(text, list(file.relative_to(ROOT).parts[:-1])):
        if module.split(".")[0] not in PROJECT:
            continue
        init = project_file(module)
        exports = lazy_exports(init) if init is not None and init.name == "__init__.py" else {}
        found |= {module} | {f"{module}.{exports.get(name, name)}" for name in names}
    return {f for f in map(project_file, found) if f is not None and f != file}


def mutual_imports(graph: dict[Path, set[Path]]) -> list[tuple[str, str]]:
    """The pairs of files of ``graph`` (file -> the files it imports) that import each other."""
    return sorted((str(a.relative_to(ROOT)), str(b.relative_to(ROOT))) for a, imported in graph.items()
                  for b in imported if a in graph.get(b, ()) and str(a) < str(b))


def test_no_two_modules_import_each_other():
    """Imports between the project's modules go one way: no two import each other, at module level or inside a
    function (a cycle there is a cycle too, deferred until the function runs). A piece both need goes in a module
    below both (``algo.surrogates`` below ``ppo_math`` and the registry; ``stages.shared.param_sections`` below the
    checks and the loader)."""
    cycles = mutual_imports({file: imported_files(file) for file in PROJECT_FILES})
    assert not cycles, f"modules that import each other: {cycles}"


def test_the_cycle_check_sees_an_import_back_inside_a_function():
    ppo_math, registry = PACKAGE / "algo" / "ppo_math.py", PACKAGE / "algo" / "registry.py"
    graph = {ppo_math: imported_files(ppo_math), registry: imported_files(registry)}
    assert registry in graph[ppo_math] and mutual_imports(graph) == []
    edited = registry.read_text() + "\n\ndef f():\n    from .ppo_math import aggregate\n"
    graph[registry] = imported_files(registry, edited)
    assert mutual_imports(graph) == [("ppo_core/algo/ppo_math.py", "ppo_core/algo/registry.py")]
    # a name exported lazily counts as its module: ``from ppo_core import PPOConfig`` imports ppo_core/config.py
    assert PACKAGE / "config.py" in imported_files(registry, "def f():\n    from ppo_core import PPOConfig\n")

"""Where a scorer's scores come from beyond the params and the stage's inputs: its code, hashed, or its installed
package's version. The sources stage records it for DVC (data/sources/scorer.json); the ppo stage's checkpoint
fingerprint holds it, so that a run never resumes with another scorer."""

from __future__ import annotations

import importlib.util
import sysconfig
from importlib.metadata import packages_distributions, version
from pathlib import Path
from typing import Any

from stages.shared.params import Params
from stages.shared.pipeline import CODE_ROOT
from stages.shared.resume import digest
from stages.shared.runtime import StageError, untracked_hint


def scorer_origin(params: Params) -> dict[str, dict[str, Any]]:
    """What the scores depend on beyond the params and the stage's inputs, as fingerprint entries: {"code": {file:
    sha256}} for a callable defined in a file, {"versions": {distribution: version}} for one from an installed
    package, {"inputs": {dir: sha256}} for a pipeline model given as a local directory; {} for the reward model (an
    input of the stage already)."""
    spec = params.scorer
    if spec.source == "pipeline":
        local = Path(spec.name)
        return {"inputs": {spec.name: digest(local)}} if local.is_dir() else {}
    return callable_origin(spec.name, "scorer.name", params) if spec.source == "callable" else {}


def callable_origin(name: str, key: str, params: Params) -> dict[str, dict[str, Any]]:
    """Where the function ``name`` ("module:function", params ``key``) comes from: its module's file, hashed, or its
    installed package's version (see `scorer_origin`). The module is found, not imported: a module may do heavy work
    on import."""
    module_name = name.partition(":")[0]
    file = module_file(module_name, name, key, params)
    if file is None:
        return {}
    source = file.parent if file.name == "__init__.py" else file
    distribution = next(iter(packages_distributions().get(module_name.split(".")[0], [])), None)
    if distribution is not None and any(file.is_relative_to(folder) for folder in installed_code_folders()):
        return {"versions": {distribution: version(distribution)}}
    shown = str(source.relative_to(CODE_ROOT) if source.is_relative_to(CODE_ROOT) else source)
    return {"code": {shown: digest(source, "*.py")}}


def module_file(module_name: str, name: str, key: str, params: Params) -> Path | None:
    """The resolved source file of ``module_name`` (its ``__init__.py`` for a package), found as import would find
    it but without running it; None for a module with no file (built in). Not found: a StageError naming ``key``."""
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):  # a parent package that is missing or fails to import
        spec = None
    if spec is None:
        missing = f"{module_name.replace('.', '/')}.py"
        raise StageError(f"{params.path}: {key} '{name}' is not an importable 'module:function' "
                         f"(no module named '{module_name}'){untracked_hint(missing)}")
    return Path(spec.origin).resolve() if spec.origin and Path(spec.origin).is_file() else None


def installed_code_folders() -> list[Path]:
    """Where installed packages live (site-packages): code there is known by its distribution's version."""
    paths = sysconfig.get_paths()
    return [Path(paths[key]).resolve() for key in ("purelib", "platlib")]

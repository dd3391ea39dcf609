"""Where the material params.yaml names from outside the pipeline comes from. A local data file or model is checked
to be one before any stage reads it (the sources stage checks them all first). A scorer's scores depend, beyond the
params and the stage's inputs, on its code, hashed, or its installed package's version: the sources stage records
it for DVC (data/sources/scorer.json); the ppo stage's checkpoint fingerprint holds it, so that a run never resumes
with another scorer."""

from __future__ import annotations

import importlib.util
import os
import sysconfig
from importlib.metadata import packages_distributions, version
from pathlib import Path
from typing import Any

from stages.shared.params import SYNTHETIC, DatasetSpec, Params
from stages.shared.pipeline import CODE_ROOT
from stages.shared.resume import digest
from stages.shared.runtime import StageError, untracked_hint

# The local data files the prepare stage reads, by suffix: the pandas reader of each
LOCAL_READERS = {".parquet": "read_parquet", ".jsonl": "read_json", ".json": "read_json", ".csv": "read_csv"}


def local_data_file(spec: DatasetSpec, name: str) -> Path | None:
    """The local file ``data.<name>.source`` names, or None for the synthetic data or a Hugging Face dataset id; a
    StageError for a path with a data file's suffix that does not exist, or a local path that is no data file."""
    path = Path(spec.source)
    reader = LOCAL_READERS.get(path.suffix.lower())
    if spec.source == SYNTHETIC or (reader is None and not path.exists()):
        return None
    if reader is not None and not path.exists():
        raise StageError(f"{path}: file not found (data.{name}.source); give an existing file, a Hugging Face "
                         f"dataset id, or '{SYNTHETIC}'{untracked_hint(path)}")
    if reader is None or not path.is_file():
        raise StageError(f"{path}: not a readable .parquet/.jsonl/.json/.csv file (data.{name}.source); "
                         f"give one of those, a Hugging Face dataset id, or '{SYNTHETIC}'")
    return path


def check_model_source(name: str, key: str = "model.name_or_path") -> None:
    """A clear line, before any loader runs, for a model name that can load nothing: a directory without a saved
    model, or neither a directory nor a hub id in the local cache while downloads are off (HF_HUB_OFFLINE=1)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            raise StageError(f"{key} '{name}': the directory holds no saved model (no config.json); give the "
                             "directory that save_pretrained wrote")
        return
    if path.exists():
        raise StageError(f"{key} '{name}' is a file; give the directory that save_pretrained wrote")
    if not is_hub_id(name):  # a path (absolute, ./x, a/b/c): no hub model could have that name
        raise StageError(f"{key} '{name}': no such directory; give the directory that save_pretrained wrote, or a "
                         "Hugging Face hub id (namespace/name)")
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        from huggingface_hub import try_to_load_from_cache

        if not isinstance(try_to_load_from_cache(name, "config.json"), str):
            raise StageError(f"{key} '{name}': no such directory, and no hub model of that id in the local cache "
                             "(downloads are off: HF_HUB_OFFLINE=1); give the directory that save_pretrained wrote, "
                             "or set HF_HUB_OFFLINE=0 to download it")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` has the form of a Hugging Face hub repo id (``name`` or ``namespace/name``)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def scorer_origin(params: Params) -> dict[str, dict[str, Any]]:
    """What the scores depend on beyond the params and the stage's inputs, as fingerprint entries: {"code": {file:
    sha256}} for a callable defined in a file, {"versions": {distribution: version}} for one from an installed
    package, {"inputs": {dir: sha256}} for a pipeline model given as a local directory; {} for the reward model (an
    input of the stage already)."""
    spec = params.scorer
    if spec.source == "combined":  # each function's, merged
        merged = {}
        for name, entry in spec.functions.items():
            one = function_origin(entry.get("source", "callable"), entry.get("name"), f"scorer.functions.{name}.name",
                                  params)
            for kind, values in one.items():
                merged.setdefault(kind, {}).update(values)
        return merged
    return function_origin(spec.source, spec.name, "scorer.name", params)


def function_origin(source: str, name: str | None, key: str, params: Params) -> dict[str, dict[str, Any]]:
    """`scorer_origin` of one reward function: a pipeline's local model directory, a callable's code."""
    if source == "pipeline":
        check_model_source(name, key)  # a saved model's directory, or a hub id
        local = Path(name)
        return {"inputs": {name: digest(local)}} if local.is_dir() else {}
    return callable_origin(name, key, params) if source == "callable" else {}


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

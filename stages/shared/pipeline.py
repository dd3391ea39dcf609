"""The pipeline as dvc.yaml declares it: for each stage, the params it tracks, the code and data it depends on, and
what it writes. This is written once, in dvc.yaml, and read from there by the stages' checkpoint fingerprints
(`stages.shared.resume`), the CLI's help (`stages.shared.cli`) and the tests that hold a stage to what it declares.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

# The repository that holds dvc.yaml and the `stages`, `ppo_core` and `rewards` packages.
CODE_ROOT = Path(__file__).resolve().parents[2]
DVC_YAML = CODE_ROOT / "dvc.yaml"


@dataclass(frozen=True)
class StageSpec:
    """One stage of dvc.yaml."""

    name: str
    cmd: str
    params: tuple[str, ...]
    """Params keys it tracks, dotted as in dvc.yaml (a section, or a key in one)."""
    code: tuple[str, ...]
    """Code deps: files or package directories, relative to the repository."""
    data: tuple[Path, ...]
    """Data deps: artifacts of earlier stages, relative to the project root."""
    outs: tuple[str, ...]
    """Outputs, metrics files included."""

    @property
    def sections(self) -> tuple[str, ...]:
        """The params sections it reads (some only in part)."""
        return tuple(dict.fromkeys(key.split(".")[0] for key in self.params))


def stages() -> dict[str, StageSpec]:
    """Every stage of the pipeline being run, in order: the dvc.yaml in the working directory when it is one of this
    project's (an example's, e.g. examples/sentiment: its stages run `python3 -m stages`), else the repository's."""
    here = Path.cwd() / "dvc.yaml"
    return read_pipeline(here if here.is_file() and _runs_stages(here) else DVC_YAML)


def _runs_stages(path: Path) -> bool:
    return "python3 -m stages " in path.read_text()


@functools.cache
def read_pipeline(path: Path) -> dict[str, StageSpec]:
    """The stages of the dvc.yaml at ``path``. Code deps come relative to the repository (``../../stages/fetch.py`` in
    an example's dvc.yaml is ``stages/fetch.py``); data deps and outputs relative to the dvc.yaml's directory (the
    project root its stages run in)."""
    from ruamel.yaml import YAML

    declared = YAML(typ="safe", pure=True).load(path.read_text())["stages"]
    out = {}
    for name, stage in declared.items():
        deps = stage.get("deps", [])
        code = [_in_repository(path.parent / d) for d in deps if not d.startswith("data/")]
        out[name] = StageSpec(name=name, cmd=stage["cmd"], params=tuple(stage.get("params", [])), code=tuple(code),
                              data=tuple(Path(d) for d in deps if d.startswith("data/")),
                              outs=tuple(next(iter(out)) if isinstance(out, dict) else out  # {path: options}
                                         for out in stage.get("outs", []) + stage.get("metrics", [])))
    return out


def _in_repository(path: Path) -> str:
    """``path`` relative to the repository (as the root dvc.yaml names its code deps)."""
    resolved = path.resolve()
    return resolved.relative_to(CODE_ROOT).as_posix() if resolved.is_relative_to(CODE_ROOT) else str(path)


def stage(name: str) -> StageSpec:
    return stages()[name]

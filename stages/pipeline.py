"""The pipeline as dvc.yaml declares it: for each stage, the params it tracks, the code and data it depends on, and
what it writes. This is written once, in dvc.yaml, and read from there by the stages' checkpoint fingerprints
(`stages.resume`), the CLI's help (`stages.cli`) and the tests that hold a stage to what it declares.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

# The repository that holds dvc.yaml and the `stages`, `ppo_core` and `rewards` packages.
CODE_ROOT = Path(__file__).resolve().parents[1]
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


@functools.cache
def stages() -> dict[str, StageSpec]:
    """Every stage of dvc.yaml, in order."""
    from ruamel.yaml import YAML

    declared = YAML(typ="safe", pure=True).load(DVC_YAML.read_text())["stages"]
    out = {}
    for name, stage in declared.items():
        deps = stage.get("deps", [])
        out[name] = StageSpec(name=name, cmd=stage["cmd"], params=tuple(stage.get("params", [])),
                              code=tuple(d for d in deps if not d.startswith("data/")),
                              data=tuple(Path(d) for d in deps if d.startswith("data/")),
                              outs=tuple(next(iter(out)) if isinstance(out, dict) else out  # {path: options}
                                         for out in stage.get("outs", []) + stage.get("metrics", [])))
    return out


def stage(name: str) -> StageSpec:
    return stages()[name]

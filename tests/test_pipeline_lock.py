"""The committed dvc.lock is what the default pipeline produces: `make run` on a fresh clone leaves `git status` clean,
so `dvc status` has nothing to do and `dvc exp show` / `dvc exp diff` compare experiments with real baseline metrics.

What is hashed must therefore be the same on every machine the guarantee covers (README, "Same inputs, same bytes"):
the code, params and commands everywhere; the data prepare and tokenize write (no floating point) everywhere; the
trained models and everything after them where the floating-point kernels are those the lock was written with
(`stages.numerics.covered`); elsewhere the test prints which stages' outputs differ.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from stages import numerics
from tests.test_pipeline_smoke import dvc, run

ROOT = Path(__file__).resolve().parents[1]
FLOAT_FREE = ("prepare", "tokenize")  # outputs that no floating-point kernel computes


def fresh_clone(target: Path) -> Path:
    """The tracked files of the repository (what `git clone` gives), committed in a new repo at `target`."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in filter(None, files.split("\0")):
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target / name)
    run("git", "init", "-q", cwd=target)
    run("git", "add", "-A", cwd=target)
    run("git", "commit", "-qm", "clone", cwd=target)
    return target


def lock_entries(lock: dict, stage: str) -> dict:
    """A stage's lock entry with its outputs set apart: (cmd, deps, params), outs."""
    entry = dict(lock["stages"][stage])
    return {"inputs": {k: v for k, v in entry.items() if k != "outs"}, "outs": entry.get("outs")}


@pytest.mark.slow
def test_a_fresh_run_of_the_default_pipeline_reproduces_the_committed_lock(tmp_path):
    repo = fresh_clone(tmp_path / "clone")
    committed = YAML(typ="safe", pure=True).load((repo / "dvc.lock").read_text())
    out = dvc("repro", cwd=repo).stdout
    assert "Running stage 'ppo'" in out
    produced = YAML(typ="safe", pure=True).load((repo / "dvc.lock").read_text())
    assert set(produced["stages"]) == set(committed["stages"])
    for stage in committed["stages"]:  # what each stage ran with: code, data deps, params and command
        assert lock_entries(produced, stage)["inputs"] == lock_entries(committed, stage)["inputs"], stage
    for stage in FLOAT_FREE:
        assert lock_entries(produced, stage)["outs"] == lock_entries(committed, stage)["outs"], stage
    probe = "import json; from stages import numerics; print(json.dumps(numerics.current()))"
    kernels = json.loads(run(sys.executable, "-c", probe, cwd=repo).stdout)  # as in a stage process
    same_kernels = numerics.covered(kernels)
    print(f"float kernels {kernels}: outputs {'must' if same_kernels else 'need not'} match the committed lock")
    if same_kernels:  # the guarantee covers this machine: every byte, and git sees nothing to commit
        assert run("git", "status", "--porcelain", cwd=repo).stdout == ""
    else:
        different = [s for s in committed["stages"]
                     if lock_entries(produced, s)["outs"] != lock_entries(committed, s)["outs"]]
        print(f"stages whose outputs differ from the committed lock on this machine: {different}", file=sys.stderr)

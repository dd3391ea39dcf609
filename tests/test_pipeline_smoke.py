"""End to end: the project copied to a fresh git repo runs `dvc repro`, a no-op second repro, and `dvc exp run -S`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {
    **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},  # stages must come from the copy, not from ROOT
    # `python` in dvc.yaml's commands must be this venv's, as it is with the venv activated
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    "DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
    "GIT_AUTHOR_NAME": "ci", "GIT_AUTHOR_EMAIL": "ci@example.invalid",
    "GIT_COMMITTER_NAME": "ci", "GIT_COMMITTER_EMAIL": "ci@example.invalid",
}


def sh(*args: str, cwd: Path) -> str:
    result = subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True)
    assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result.stdout


def dvc(*args: str, cwd: Path) -> str:
    return sh(sys.executable, "-m", "dvc", *args, cwd=cwd)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    for name in ("dvc.yaml", "pyproject.toml", ".gitignore", ".dvcignore"):
        shutil.copy(ROOT / name, repo / name)
    for package in ("stages", "ppo_core"):
        shutil.copytree(ROOT / package, repo / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "tests" / "fixtures" / "params.tiny.yaml", repo / "params.yaml")
    sh("git", "init", "-q", cwd=repo)
    dvc("init", "-q", cwd=repo)
    dvc("config", "core.analytics", "false", cwd=repo)
    sh("git", "add", "-A", cwd=repo)
    sh("git", "commit", "-qm", "tiny project", cwd=repo)  # dvc exp run needs a commit
    return repo


@pytest.mark.slow
def test_repro_noop_and_exp_run(repo):
    out = dvc("repro", cwd=repo)
    for stage in ("prepare", "sft", "reward", "tokenize", "ppo", "evaluate"):
        assert f"Running stage '{stage}'" in out
    assert json.loads(dvc("status", "--json", cwd=repo)) == {}

    start = time.perf_counter()
    out = dvc("repro", cwd=repo)
    assert "Running stage" not in out and out.count("didn't change, skipping") == 6
    assert time.perf_counter() - start < 10  # about a second on an idle machine

    resume_after_kill(repo)

    out = dvc("exp", "run", "-n", "smoke", "-S", "ppo.learning_rate=0.00002", cwd=repo)
    assert "Stage 'sft' didn't change, skipping" in out  # a PPO change reruns only ppo and evaluate
    assert "Running stage 'ppo'" in out and "Running stage 'evaluate'" in out
    rows = json.loads(dvc("exp", "show", "--json", cwd=repo))
    experiments = [rev for row in rows for exp in (row.get("experiments") or []) for rev in exp["revs"]]
    smoke = next(rev for rev in experiments if rev["name"] == "smoke")
    metrics = smoke["data"]["metrics"]["data/eval/metrics.json"]["data"]
    assert set(metrics) == {"sft", "ppo", "win_rate"}
    assert smoke["data"]["params"]["params.yaml"]["data"]["ppo"]["learning_rate"] == 2e-05


def resume_after_kill(repo: Path) -> None:
    """`dvc repro` killed (the whole process group, SIGKILL) during the ppo stage, then `dvc repro` again: dvc
    keeps the persisted checkpoint, the stage resumes from it, and the outputs equal the uninterrupted run's."""
    ppo_outputs = ["data/models/ppo/model.safetensors", "data/ppo/stats.parquet", "data/ppo/curves.csv",
                   "data/ppo/rollouts/step-00000.parquet", "data/ppo/rollouts/step-00001.parquet"]
    expected = {path: (repo / path).read_bytes() for path in ppo_outputs}
    shutil.rmtree(repo / "data" / "checkpoints" / "ppo")  # else the forced rerun resumes from the final state
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", "-f", "-s", "ppo"], cwd=repo, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    state, deadline = repo / "data" / "checkpoints" / "ppo" / "state", time.monotonic() + 300
    while not state.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the ppo stage ended before its first checkpoint"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    rerun = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=ENV, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "Running stage 'ppo'" in rerun.stdout and "resuming from data/checkpoints/ppo/state " in rerun.stderr
    for path, content in expected.items():
        assert (repo / path).read_bytes() == content, path

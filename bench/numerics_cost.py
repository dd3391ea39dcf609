"""What portable kernels cost: the default pipeline's stages with `numerics.kernels: portable` against `native`.

Each round runs the stages from sft on (sft, reward, tokenize, ppo, evaluate: all but tokenize compute in floating
point), after prepare once, in a scratch copy of the project per mode (the committed params.yaml with
`numerics.kernels` set, the threads as committed), the two modes in alternating order from round to round; it prints
each stage's seconds (wall, the whole process: loading torch included), their medians over the rounds and the ratio
portable / native, and whether each mode's outputs were the same bytes in every round.

    .venv/bin/python bench/numerics_cost.py                 # 3 rounds: ~12 minutes on 2 cores
    .venv/bin/python bench/numerics_cost.py --rounds 1 --params tests/fixtures/params.tiny.yaml

Run it on an idle machine: the two modes share the cores in turn, never at once.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
MODES = ("portable", "native")
SETUP = ("sources", "prepare")  # float-free: once per mode
TIMED = ("sft", "reward", "tokenize", "ppo", "evaluate")  # tokenize (float-free) needs sft's tokenizer


def scratch(workdir: Path, mode: str, params: dict) -> Path:
    """A copy of the project's tracked code and dvc.yaml, with `params` and numerics.kernels: `mode`."""
    project = workdir / mode
    shutil.rmtree(project, ignore_errors=True)
    project.mkdir(parents=True)
    for name in ("stages", "ppo_core", "rewards"):
        shutil.copytree(ROOT / name, project / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "dvc.yaml", project / "dvc.yaml")
    (project / "params.yaml").write_text(yaml.safe_dump({**params, "numerics": {**params["numerics"],
                                                                                 "kernels": mode}}))
    return project


def run_stage(project: Path, stage: str) -> float:
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(project)}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "stages", stage], cwd=project, env=env, capture_output=True,
                            text=True)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{project.name} {stage} failed:\n{result.stderr[-2000:]}")
    return seconds


def outputs_digest(project: Path) -> str:
    """One hash of every file the timed stages wrote (their bytes and paths)."""
    h = hashlib.sha256()
    for folder in ("data/models", "data/sft", "data/reward", "data/ppo", "data/eval"):
        for path in sorted((project / folder).rglob("*")):
            if path.is_file():
                h.update(str(path.relative_to(project)).encode() + path.read_bytes())
    return h.hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--params", type=Path, default=ROOT / "params.yaml")
    parser.add_argument("--workdir", type=Path, default=ROOT / "bench" / "results" / "numerics_cost")
    args = parser.parse_args()
    params = yaml.safe_load(args.params.read_text())
    projects = {mode: scratch(args.workdir, mode, params) for mode in MODES}
    for project in projects.values():
        for stage in SETUP:
            run_stage(project, stage)
    seconds = {mode: {stage: [] for stage in TIMED} for mode in MODES}
    digests = {mode: set() for mode in MODES}
    for round_ in range(args.rounds):
        for mode in (MODES if round_ % 2 == 0 else MODES[::-1]):
            for stage in TIMED:
                seconds[mode][stage].append(run_stage(projects[mode], stage))
            digests[mode].add(outputs_digest(projects[mode]))
            total = sum(seconds[mode][stage][-1] for stage in TIMED)
            print(f"round {round_ + 1} {mode}: {total:.1f} s", flush=True)
    print(f"\n| stage | portable s | native s | portable / native |  (medians of {args.rounds})")
    print("|---|---|---|---|")
    for stage in (*TIMED, "all"):
        pick = (lambda m: [sum(r) for r in zip(*seconds[m].values())]) if stage == "all" else \
            (lambda m, s=stage: seconds[m][s])
        p, n = statistics.median(pick("portable")), statistics.median(pick("native"))
        print(f"| {stage} | {p:.1f} | {n:.1f} | {p / n:.2f} |")
    for mode in MODES:
        print(f"{mode}: outputs {'the same bytes in every round' if len(digests[mode]) == 1 else 'DIFFERED'} "
              f"({', '.join(sorted(digests[mode]))})")


if __name__ == "__main__":
    main()

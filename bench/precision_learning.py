"""Does bf16 autocast learn as fp32 does on a real model? The real-model example's PPO, per seed, in both precisions.

After `make example`, this reruns examples/sentiment's `ppo` and `evaluate` stages (SmolLM2-135M with LoRA, its
reward model, 24 steps of 32 rollouts, then 200 held-out prompts judged by VADER and MiniLM) for each seed with
`model.mixed_precision` bf16 and with float32, everything else as the example's params. Each run is a scratch
project in `--workdir`: the example's params.yaml with those fields and `ppo.seed` set (and no PPO checkpoints), and
links to its fetched and upstream artifacts (the SFT and reward models were trained once, in bf16, by `make example`:
both precisions start from the same policy and score with the same reward model). It prints the reward and the KL
per block of 6 steps, the held-out evaluation of each run, and the two precisions' means against float32's spread
over seeds.

    .venv/bin/python bench/precision_learning.py                          # seeds 0 1 2, two runs at a time
    .venv/bin/python bench/precision_learning.py --seeds 0 --jobs 1 --threads 2

About 8 (bf16) and 13 (fp32) minutes per ppo stage at 1 thread on the 2-core CPU of bench/README.md, plus ~3 per
evaluation. Results also go to bench/results/precision_learning.json (`--out`).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = {"fp32": None, "bf16": "bf16"}  # name -> model.mixed_precision
WRITTEN = {"data/ppo", "data/models/ppo", "data/eval", "data/checkpoints", "data/logs",  # by ppo, evaluate, report
           "data/report"}
NEEDED = ("data/tokenized", "data/models/sft", "data/models/reward")
BLOCK = 6  # steps per block of the learning curve


def run_params(example_params: dict, precision: str, seed: int) -> dict:
    """The example's params with ``precision`` and PPO ``seed``, and no resumable checkpoints (a run starts afresh)."""
    params = copy.deepcopy(example_params)
    params["model"]["mixed_precision"] = PRECISIONS[precision]
    params["ppo"]["seed"] = seed
    params["checkpoint"]["ppo_every"] = 0
    return params


def linked_inputs(example: Path) -> list[Path]:
    """What a scratch project links from ``example``: every entry of its data/ and data/models/ but what ppo,
    evaluate and report write (fetched text, prompts, tokenized sets, the SFT and reward models, the judges)."""
    data = example / "data"
    entries = [p for p in data.iterdir() if p.name != "models"] + list((data / "models").iterdir())
    return sorted(rel for rel in (p.relative_to(example) for p in entries) if rel.as_posix() not in WRITTEN)


def make_project(example: Path, project: Path, params: dict) -> None:
    """A scratch project in ``project``: ``params`` and links to the example's inputs (:func:`linked_inputs`)."""
    missing = [rel for rel in NEEDED if not (example / rel).exists()]
    if missing:
        raise SystemExit(f"{example}: no {', '.join(missing)}; run `make example` first")
    for rel in linked_inputs(example):
        (project / rel).parent.mkdir(parents=True, exist_ok=True)
        (project / rel).symlink_to((example / rel).resolve())
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def run_stages(project: Path, threads: int) -> None:
    """``python -m stages ppo`` then ``evaluate`` in ``project``, each logged to ``project/<stage>.log``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    for stage in ("ppo", "evaluate"):
        with open(project / f"{stage}.log", "w") as log:
            code = subprocess.call([sys.executable, "-m", "stages", stage], cwd=project, env=env, stdout=log,
                                   stderr=subprocess.STDOUT)
        if code != 0:
            raise RuntimeError(f"{project.name}: stage {stage} exited {code}; see {project / f'{stage}.log'}")


def finished(project: Path) -> bool:
    return (project / "data" / "eval" / "metrics.json").exists()


def run_summary(curves: pd.DataFrame, evaluation: dict) -> dict:
    """One run: reward and KL per block of ``BLOCK`` steps (``curves``: the ppo stage's curves.csv), and its held-out
    evaluation (``evaluation``: the evaluate stage's metrics.json; its numbers, the judges' included)."""
    blocks = range(0, len(curves), BLOCK)
    reward = [float(curves.reward_mean[i:i + BLOCK].mean()) for i in blocks]
    kl = [float(curves.kl[i:i + BLOCK].mean()) for i in blocks]
    held_out = {f"held-out {key}": float(value) for key, value in evaluation.items()
                if isinstance(value, (int, float)) and not isinstance(value, bool)}
    return {"reward_blocks": reward, "kl_blocks": kl, "reward, last block": reward[-1], "KL, last block": kl[-1],
            **held_out}


def compared(run: dict) -> list[str]:
    """The quantities of ``run`` that :func:`comparison` compares: the scalars."""
    return [key for key, value in run.items() if isinstance(value, float)]


def comparison(runs: dict[tuple[str, int], dict], seeds: list[int]) -> list[dict]:
    """Per compared quantity: each precision's mean over ``seeds``, float32's standard deviation over them, the
    difference of the means in those standard deviations, and bf16 minus fp32 seed by seed."""
    rows = []
    for key in compared(runs["fp32", seeds[0]]):
        fp32 = [runs["fp32", s][key] for s in seeds]
        bf16 = [runs["bf16", s][key] for s in seeds]
        sd = statistics.stdev(fp32) if len(seeds) > 1 else float("nan")
        diff = statistics.mean(bf16) - statistics.mean(fp32)
        rows.append({"quantity": key, "fp32": statistics.mean(fp32), "bf16": statistics.mean(bf16), "fp32_sd": sd,
                     "diff_in_sd": diff / sd if sd else float("nan"),
                     "paired": [b - f for f, b in zip(fp32, bf16)]})
    return rows


def markdown(runs: dict[tuple[str, int], dict], seeds: list[int]) -> str:
    """The runs and the comparison, as two markdown tables."""
    first = runs["fp32", seeds[0]]
    n_blocks = len(first["reward_blocks"])
    heads = [f"{i * BLOCK + 1}-{(i + 1) * BLOCK}" for i in range(n_blocks)]
    held_out = [key for key in compared(first) if key.startswith("held-out ")]
    lines = ["| precision | seed | " + " | ".join(f"reward {h}" for h in heads) + " | "
             + " | ".join(f"KL {h}" for h in heads) + " | " + " | ".join(held_out) + " |",
             "|---|---:|" + "---:|" * (2 * n_blocks + len(held_out))]
    for (precision, seed), r in sorted(runs.items()):
        cells = [f"{x:.2f}" for x in r["reward_blocks"] + r["kl_blocks"]] + [f"{r[key]:.3f}" for key in held_out]
        lines.append(f"| {precision} | {seed} | " + " | ".join(cells) + " |")
    lines += ["", "| quantity | fp32 mean | bf16 mean | fp32 sd over seeds | bf16 - fp32, in fp32 sds | "
              "bf16 - fp32 by seed |", "|---|---:|---:|---:|---:|---|"]
    for row in comparison(runs, seeds):
        paired = ", ".join(f"{d:+.3f}" for d in row["paired"])
        lines.append(f"| {row['quantity']} | {row['fp32']:.3f} | {row['bf16']:.3f} | {row['fp32_sd']:.3f} | "
                     f"{row['diff_in_sd']:+.2f} | {paired} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--example", type=Path, default=ROOT / "examples" / "sentiment")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (each on --threads threads)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--workdir", type=Path, default=Path.home() / ".cache" / "rlhf-pipeline" / "precision",
                        help="where the scratch projects go (each run's logs and outputs stay there)")
    parser.add_argument("--keep", action="store_true", help="reuse the runs of --workdir that finished")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "precision_learning.json")
    args = parser.parse_args(argv)

    example_params = yaml.safe_load((args.example / "params.yaml").read_text())
    projects = {}
    for seed in args.seeds:
        for precision in PRECISIONS:
            project = args.workdir / f"{precision}_seed{seed}"
            if not (args.keep and finished(project)):
                shutil.rmtree(project, ignore_errors=True)
                make_project(args.example, project, run_params(example_params, precision, seed))
            projects[precision, seed] = project

    def run(key):
        project = projects[key]
        if not finished(project):
            run_stages(project, args.threads)
        print(f"  {project.name}: {(project / 'ppo.log').read_text().strip().splitlines()[-1]}", flush=True)
        return key, run_summary(pd.read_csv(project / "data" / "ppo" / "curves.csv"),
                                json.loads((project / "data" / "eval" / "metrics.json").read_text()))

    with ThreadPoolExecutor(args.jobs) as pool:
        runs = dict(pool.map(run, sorted(projects, key=lambda k: (k[1], k[0]))))
    table = markdown(runs, args.seeds)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(
        {"runs": [{"precision": p, "seed": s, **r} for (p, s), r in sorted(runs.items())],
         "comparison": comparison(runs, args.seeds), "threads": args.threads}, indent=1))


if __name__ == "__main__":
    main()

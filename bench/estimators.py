"""The built-in advantage estimators on the embedded default pipeline: the evaluation of each, three seeds, one table.

Each estimator runs as `dvc exp run -S ppo.advantage_estimator=X -S ppo.num_generations=G` would run it: the
committed params.yaml with those two keys changed and nothing else (same rollout budget, `ppo.steps`; a group
estimator sees `steps / G` prompts, G samples each). Per seed (the top-level `seed`, so SFT and the reward model
differ too) the upstream stages run once in a work directory, then ppo and evaluate once per estimator, each as
the stage command (`python -m stages <stage> --params ...`) in its own process. Prints a markdown table (the mean
over seeds of the evaluation on the held-out prompts, and the per-seed gold gains), and writes everything as JSON.

    .venv/bin/python bench/estimators.py                        # nine estimators x seeds 0 1 2 (about 25 min here)
    .venv/bin/python bench/estimators.py --estimators gae grpo --seeds 0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from ruamel.yaml import YAML

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from stages.shared.artifacts import policy_means

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
GROUP = 4  # samples per prompt for the estimators that compare samples of one prompt
ESTIMATORS = {"gae": 1, "grpo": GROUP, "dr_grpo": GROUP, "rloo": GROUP, "reinforce_plus_plus": 1,
              "reinforce_plus_plus_baseline": GROUP, "dapo": GROUP, "gspo": GROUP, "cispo": GROUP}
UPSTREAM = ("prepare", "sft", "reward", "tokenize")


def write_params(path: Path, changes: dict[str, object]) -> Path:
    """params.yaml as committed, with dotted `changes` set (comments and order kept)."""
    yaml = YAML()
    data = yaml.load((ROOT / "params.yaml").read_text())
    for key, value in changes.items():
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[leaf] = value
    with open(path, "w") as fh:
        yaml.dump(data, fh)
    return path


def stage(name: str, params: Path, cwd: Path) -> float:
    """Run one stage as dvc.yaml's command does; its wall-clock seconds."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "stages", name, "--params", str(params)], cwd=cwd, env=env,
                            capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{name} failed in {cwd}:\n{result.stderr[-3000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--estimators", nargs="+", default=list(ESTIMATORS), choices=list(ESTIMATORS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--workdir", type=Path, default=RESULTS / "estimators")
    args = parser.parse_args()

    runs = []
    for seed in args.seeds:
        work = args.workdir / f"seed-{seed}"
        work.mkdir(parents=True, exist_ok=True)
        base = write_params(work / "params.yaml", {"seed": seed})
        for name in UPSTREAM:
            stage(name, base, work)
        for estimator in args.estimators:
            params = write_params(work / f"params-{estimator}.yaml", {
                "seed": seed, "ppo.advantage_estimator": estimator, "ppo.num_generations": ESTIMATORS[estimator]})
            seconds = stage("ppo", params, work)
            stage("evaluate", params, work)
            metrics = json.loads((work / "data" / "eval" / "metrics.json").read_text())
            sft, ppo = policy_means(metrics, "sft"), policy_means(metrics, "ppo")
            runs.append({"estimator": estimator, "G": ESTIMATORS[estimator], "seed": seed, "ppo_seconds": seconds,
                         "sft": sft, "ppo": ppo, "win_rate": metrics["win_rate"]})
            print(f"seed {seed} {estimator}: gold {sft['gold']:.2f} -> {ppo['gold']:.2f}, RM "
                  f"{sft['reward']:.2f} -> {ppo['reward']:.2f}, KL {ppo['kl']:.2f}, win rate "
                  f"{metrics['win_rate']:.3f} [{seconds:.0f} s]", flush=True)

    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "estimators.json").write_text(json.dumps(runs, indent=1))
    print(table(runs, args.estimators))


def table(runs: list[dict], estimators: list[str]) -> str:
    def mean(values) -> float:
        return statistics.fmean(values)

    lines = ["| estimator | G | RM score SFT → policy | gold score SFT → policy | gold gain per seed | KL to SFT | "
             "win rate | ppo stage (s) |", "|---|---|---|---|---|---|---|---|"]
    for estimator in estimators:
        rows = [r for r in runs if r["estimator"] == estimator]
        if not rows:
            continue
        sft_rm, rm = mean(r["sft"]["reward"] for r in rows), mean(r["ppo"]["reward"] for r in rows)
        sft_gold, gold = mean(r["sft"]["gold"] for r in rows), mean(r["ppo"]["gold"] for r in rows)
        gains = " / ".join(f"{r['ppo']['gold'] - r['sft']['gold']:+.2f}" for r in rows)
        lines.append(f"| `{estimator}` | {rows[0]['G']} | {sft_rm:.2f} → {rm:.2f} | {sft_gold:.2f} → {gold:.2f} | "
                     f"{gains} | {mean(r['ppo']['kl'] for r in rows):.2f} | "
                     f"{mean(r['win_rate'] for r in rows):.3f} | {mean(r['ppo_seconds'] for r in rows):.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Peak RSS of the ppo stage with LoRA: the reward model as an adapter on the policy's base weights, or on its own.

    python bench/reward_adapter_rss.py                       # GPT-2-small body: 12 layers, n_embd 768, 12 heads
    python bench/reward_adapter_rss.py --n-layer 6 --n-embd 512 --n-head 8

Builds one project in a temporary directory (the committed params.yaml with `model.lora` set, the model shape given,
small data: prepare, sft, reward and tokenize run once), then runs the ppo stage three times, each a subprocess of
its own whose peak resident set size is read from `wait4`:

- `shared`: the stage as it is: the reward stage's adapter loaded beside the policy's (`reward_adapter=`), one copy
  of the base weights for policy, reference and reward model;
- `separate`: the same stage with the merged reward model loaded on its own (what it did before: a second copy);
- `no reward model`: `scorer.source: callable` (a word count from `rewards/`), the floor of the other two.

Prints a markdown table: peak RSS, its difference from `shared`, wall seconds, and for `separate` the largest
difference of its first step's scores from `shared`'s (the same rollouts: the scores differ by float rounding only).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETUP = """
import sys, importlib
from pathlib import Path
from stages.shared.params import load_params
params = load_params(sys.argv[1])
for name in ("prepare", "sft", "reward", "tokenize"):
    importlib.import_module("stages." + name).run(params, Path("."))
"""

PPO = """
import sys
from pathlib import Path
from stages import ppo
from stages.shared.params import load_params
if sys.argv[2] == "separate":  # the merged reward model, loaded on its own beside the policy
    ppo.reward_adapter = lambda params, root, seq2seq: None
ppo.run(load_params(sys.argv[1]), Path("."))
"""


def write_params(out: Path, args, **scorer) -> Path:
    """The committed params.yaml with model.lora set, the model shape of `args`, small data, two PPO steps."""
    from ruamel.yaml import YAML

    yaml = YAML()
    data = yaml.load((ROOT / "params.yaml").read_text())
    data["model"].update(n_layer=args.n_layer, n_embd=args.n_embd, n_head=args.n_head)
    data["model"]["lora"] = {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": None}
    data["data"]["n_eval_prompts"] = 8
    for table, n in (("sft", 64), ("pairs", 48), ("prompts", 80)):
        data["data"][table]["n"] = n
    data["sft"]["num_train_epochs"] = data["reward"]["num_train_epochs"] = 1
    data["ppo"].update(batch_size=16, mini_batch_size=4, steps=32)  # two PPO steps of 16 rollouts
    data["checkpoint"].update(ppo_every=0, trainer_every=0)  # the loop alone: no checkpoint writes
    data["scorer"].update(scorer)
    with out.open("w") as fh:
        yaml.dump(data, fh)
    return out


def run(code: str, *argv: str, cwd: Path) -> tuple[float, float]:
    """Run ``python -c code argv`` in ``cwd``; (its peak RSS in MiB, wall seconds). A failure ends the bench."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{argv}: exit {proc.returncode}\n{stderr[-3000:]}")
    return usage.ru_maxrss / 1024, time.perf_counter() - started  # ru_maxrss: KiB on Linux


def first_scores(project: Path) -> list[float]:
    import pandas as pd

    return pd.read_parquet(project / "data" / "ppo" / "rollouts" / "step-00000.parquet")["score"].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--keep", action="store_true", help="keep the temporary project (its path is printed)")
    args = parser.parse_args()
    project = Path(tempfile.mkdtemp(prefix="reward-adapter-rss-"))
    params = write_params(project / "params.yaml", args)
    _, setup_seconds = run(SETUP, str(params), cwd=project)
    callable_params = write_params(project / "params.callable.yaml", args, source="callable",
                                   name="rewards.example:keyword_sentiment")

    import torch
    from safetensors import safe_open

    with safe_open(project / "data" / "models" / "sft" / "model.safetensors", "pt") as fh:
        n_params = sum(math.prod(fh.get_slice(key).get_shape()) for key in fh.keys())
    rows, scores = {}, {}
    for name, argv in (("shared", (str(params), "shared")), ("separate", (str(params), "separate")),
                       ("no reward model", (str(callable_params), "shared"))):
        rows[name] = run(PPO, *argv, cwd=project)
        scores[name] = first_scores(project)
    shared_rss = rows["shared"][0]
    gap = max(abs(a - b) for a, b in zip(scores["shared"], scores["separate"]))
    print(f"\nppo stage, model.lora r=8, GPT-2 {args.n_layer} layers x n_embd {args.n_embd} ({n_params / 1e6:.1f} M "
          f"parameters, {n_params * 4 / 2**20:.0f} MiB in float32), 2 PPO steps of 16 rollouts, "
          f"{torch.get_num_threads()} threads; setup (prepare, sft, reward, tokenize) {setup_seconds:.0f} s\n")
    print("| reward model | peak RSS (MiB) | vs shared | wall (s) | first-step scores vs shared |")
    print("|---|---|---|---|---|")
    checks = {"shared": "-", "separate": f"max abs diff {gap:.1e}", "no reward model": "another scorer"}
    for name, (rss, seconds) in rows.items():
        check = checks[name]
        print(f"| {name} | {rss:.0f} | {rss - shared_rss:+.0f} | {seconds:.1f} | {check} |")
    if args.keep:
        print(f"\nproject kept in {project}")
    else:
        shutil.rmtree(project)


if __name__ == "__main__":
    main()

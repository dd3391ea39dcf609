"""Run floor, TRL 0.11.4 and ppo_core side by side and print one markdown table.

Each measurement runs in its own subprocess with the right interpreter:
  floor                  this interpreter (the project venv)          bench/floor.py
  floor (TRL venv)       $TRL_PYTHON (default /work/trl-venv/bin/python) bench/floor.py
  trl                    $TRL_PYTHON                                    bench/ppo_step.py --impl trl
  ppo_core               this interpreter                               bench/ppo_step.py --impl ppo_core
The two floors matter because the venvs carry different transformers versions (5.x vs 4.46): each trainer's
"ratio to floor" is taken against the floor of its own venv, so it measures the trainer, not transformers.
Without a TRL venv the TRL rows are skipped with a note.

    .venv/bin/python bench/compare.py                      # tiny and 32k, 5 measured steps after 1 warmup
    .venv/bin/python bench/compare.py --shapes tiny --steps 10 --warmup 2

JSON results and logs go to bench/results/ (git-ignored); the table also goes to bench/results/latest.md.
"""

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import common

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
TRL_PYTHON = os.environ.get("TRL_PYTHON", "/work/trl-venv/bin/python")
IMPLS = ["floor", "floor_trl", "trl", "ppo_core"]


@dataclass(frozen=True)
class Run:
    """One row of the table: a label, the interpreter and script that produce it, and its floor row."""

    label: str
    python: str
    argv: tuple  # script and its impl-specific flags
    floor: str | None  # label of the floor row of the same venv (None for floors)


def planned_runs(impls: list) -> tuple:
    """The runs to make for each shape, and notes on what is skipped and why."""
    runs, notes = [], []
    have_trl = Path(TRL_PYTHON).exists()
    if not have_trl and {"trl", "floor_trl"} & set(impls):
        notes.append(
            f"TRL skipped: no interpreter at {TRL_PYTHON} (set TRL_PYTHON, or create the scratch venv: "
            "see bench/README.md). 'ratio to TRL' is empty."
        )
    if "floor" in impls:
        runs.append(Run("floor", sys.executable, ("bench/floor.py",), None))
    if "floor_trl" in impls and have_trl:
        runs.append(Run("floor (TRL venv)", TRL_PYTHON, ("bench/floor.py",), None))
    if "trl" in impls and have_trl:
        runs.append(Run("trl", TRL_PYTHON, ("bench/ppo_step.py", "--impl", "trl"), "floor (TRL venv)"))
    if "ppo_core" in impls:
        runs.append(Run("ppo_core", sys.executable, ("bench/ppo_step.py", "--impl", "ppo_core"), "floor"))
    return runs, notes


def wait_for_idle(max_others: float, max_wait_s: float) -> None:
    """Sample other processes' CPU share over 2 s windows until it is <= max_others or max_wait_s passes:
    a busy 2-core machine can double a step's time, so we'd rather wait than measure the neighbours."""
    t0 = time.monotonic()
    while True:
        with common.OthersLoad() as load:
            time.sleep(2.0)
        waited = time.monotonic() - t0
        if load.frac is None or load.frac <= max_others:
            if waited > 3:
                print(f"    (waited {waited:.0f} s for an idle machine)", flush=True)
            return
        if waited >= max_wait_s:
            print(f"    (still busy after {waited:.0f} s: others use {load.frac:.0%}; measuring anyway)", flush=True)
            return


def run_one(run: Run, shape: str, args) -> dict:
    """Run one measurement in a subprocess; returns its JSON result, or {'error': ...}.
    A run during which other processes took more than --max-others of the CPU is redone, up to --retries
    times: with 2 OpenMP threads on 2 cores, one busy neighbour can make a step 10x slower."""
    stem = f"{shape}-{run.label.replace(' ', '_').replace('(', '').replace(')', '')}"
    json_path, log_path = RESULTS / f"{stem}.json", RESULTS / f"{stem}.log"
    cmd = [run.python, *run.argv, "--shape", shape, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--threads", str(args.threads), "--json", str(json_path)] + (["--bf16"] if args.bf16 else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    for attempt in range(args.retries + 1):
        if args.max_others < 1:
            wait_for_idle(args.max_others, args.max_wait)
        print(f"  {shape:5s} {run.label:17s} ... ", end="", flush=True)
        json_path.unlink(missing_ok=True)
        t0 = time.monotonic()
        try:
            with open(log_path, "w") as log:
                proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                      timeout=args.timeout)
            ok = proc.returncode == 0 and json_path.exists()
        except subprocess.TimeoutExpired:
            ok, proc = False, None
        if not ok:
            why = f"timed out after {args.timeout} s" if proc is None else f"exit code {proc.returncode}"
            tail = log_path.read_text().strip().splitlines()[-1:] or [""]
            print(f"FAILED ({why}; see {log_path.relative_to(ROOT)})")
            return {"error": f"{why}: {tail[0][:200]}"}
        result = json.loads(json_path.read_text())
        others = result["others_cpu_frac"] or 0.0
        print(f"{result['median_s_per_step']:.3f} s/step ({time.monotonic() - t0:.0f} s, others' CPU {others:.0%})")
        if others <= args.max_others:
            break
    return result


def fmt(x, spec: str) -> str:
    return "" if x is None else format(x, spec)


def ratio(num: dict, den: dict | None) -> float | None:
    if not den or "error" in den or "error" in num:
        return None
    return num["median_s_per_step"] / den["median_s_per_step"]


def table(results: dict, runs: list) -> str:
    """Markdown table: one row per (shape, run); ratios against the same venv's floor and against TRL."""
    lines = [
        "| shape | impl | transformers | median s/step | CPU s/step | ratio to floor | ratio to TRL "
        "| gen tokens/s | peak RSS MiB | others' CPU |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for shape, by_label in results.items():
        for run in runs:
            r = by_label[run.label]
            if "error" in r:
                lines.append(f"| {shape} | {run.label} | | failed: {r['error']} | | | | | | |")
                continue
            memory = f"{r['peak_rss_mb']:.0f}" + (f" (GPU {r['peak_gpu_mb']:.0f})" if r["peak_gpu_mb"] else "")
            to_floor = ratio(r, by_label.get(run.floor)) if run.floor else None
            to_trl = ratio(r, by_label.get("trl")) if run.floor else None
            lines.append(
                f"| {shape} | {run.label} | {r['machine']['transformers']} | {r['median_s_per_step']:.3f} "
                f"| {r['median_cpu_s_per_step']:.2f} | {fmt(to_floor, '.2f')} | {fmt(to_trl, '.2f')} "
                f"| {r['gen_tokens_per_s']:.0f} | {memory} | {fmt(r['others_cpu_frac'], '.0%')} |"
            )
    return "\n".join(lines)


def header(args, results: dict) -> str:
    """Where and how the numbers were taken."""
    any_result = next((r for by in results.values() for r in by.values() if "error" not in r), None)
    m = any_result["machine"] if any_result else common.machine_info()
    s = common.Setting()
    device = m["gpu"] or f"CPU: {m['cpu']}, {m['cpu_count']} cores"
    return (
        f"Taken {datetime.datetime.now().isoformat(timespec='minutes')} on {device}; torch {m['torch']}, "
        f"{args.threads} torch threads, {'bf16' if args.bf16 else 'fp32'}.\n"
        f"Setting: batch {s.batch_size}, mini-batch {s.mini_batch_size}, {s.ppo_epochs} PPO epochs, "
        f"{s.max_new_tokens} new tokens, queries of {s.query_len_min}-{s.query_len_max} tokens; "
        f"median of {args.steps} steps after {args.warmup} warmup.\n"
        f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["tiny", "32k"], choices=sorted(common.SHAPES))
    parser.add_argument("--impls", nargs="+", default=IMPLS, choices=IMPLS,
                        help="rows to run (floor_trl: the floor in the TRL venv)")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="warmup steps per run")
    parser.add_argument("--threads", type=int, default=2, help="torch threads and OMP_NUM_THREADS for every run")
    parser.add_argument("--bf16", action="store_true", help="bfloat16 instead of fp32")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds before one run is abandoned")
    parser.add_argument("--max-others", type=float, default=0.15,
                        help="before each run, wait while others use more than this share of the CPU (1: never wait)")
    parser.add_argument("--max-wait", type=float, default=300, help="give up waiting for an idle machine after this")
    parser.add_argument("--retries", type=int, default=2, help="redo a run that other processes disturbed, this often")
    args = parser.parse_args()

    RESULTS.mkdir(exist_ok=True)
    runs, notes = planned_runs(args.impls)
    for note in notes:
        print(f"NOTE: {note}")
    results = {shape: {run.label: run_one(run, shape, args) for run in runs} for shape in args.shapes}

    report = header(args, results) + "\n" + table(results, runs) + "\n"
    report += "".join(f"\nNote: {n}\n" for n in notes)
    busy = [f"{s}/{l}" for s, by in results.items() for l, r in by.items()
            if (r.get("others_cpu_frac") or 0) > args.max_others]
    if busy:
        report += (f"\nNote: other processes took over {args.max_others:.0%} of the CPU during {', '.join(busy)}; "
                   "those timings are inflated.\n")
    (RESULTS / "latest.md").write_text(report)
    print("\n" + report + f"\n(written to {(RESULTS / 'latest.md').relative_to(ROOT)})")


if __name__ == "__main__":
    main()

"""Run floor, TRL 0.11.4 and ppo_core side by side, interleaved step by step, and print one markdown table.

Each contender is a worker subprocess with the right interpreter (`--serve`: build once, then one step per
request):
  floor                  this interpreter (the project venv)          bench/floor.py
  floor (TRL venv)       $TRL_PYTHON (default /work/trl-venv/bin/python) bench/floor.py
  trl                    $TRL_PYTHON                                    bench/ppo_step.py --impl trl
  ppo_core               this interpreter                               bench/ppo_step.py --impl ppo_core
  ppo_core, bf16 mixed   this interpreter                               bench/ppo_step.py --impl ppo_core --bf16
  ppo_core, LoRA r=16    this interpreter (with peft)                   bench/ppo_step.py --impl ppo_core --lora
  ppo_core, bf16 weights this interpreter                               bench/ppo_step.py --impl ppo_core --bf16-weights
  ppo_core, grpo, bf16 weights                                          ... --estimator grpo --bf16-weights
  ppo_core, grpo ...     this interpreter                               bench/ppo_step.py --estimator grpo (etc.)
  TRL GRPOTrainer G=4    $TRL_GRPO_PYTHON (default /work/trl116-venv/bin/python: trl 1.16)  bench/grpo_trl.py
The two floors matter because the venvs carry different transformers versions (5.x vs 4.46): each trainer's
"ratio to floor" is taken against the floor of its own venv, so it measures the trainer, not transformers.
Without a TRL venv the TRL rows are skipped with a note.

Why interleaved: on a shared virtual machine the speed of the cores drifts by 10-20% over minutes, so runs
made one after another compare machines as much as code. Here round r sends step r (the same queries) to
every worker in turn, one at a time, in an order that rotates each round; every ratio is taken within a
round and the table gives the median over rounds, with its interquartile range. A round during which other
processes took more than --max-others of the CPU is redone (up to --retries times).

    .venv/bin/python bench/compare.py                      # tiny and 32k, 8 measured rounds after 2 warmup
    .venv/bin/python bench/compare.py --shapes tiny --steps 20
    .venv/bin/python bench/compare.py --impls floor ppo_core ppo_core_bf16 --shapes 32k
    .venv/bin/python bench/compare.py --impls ppo_core ppo_core_lora --shapes base --steps 5 --warmup 1
    .venv/bin/python bench/compare.py --impls floor ppo_core grpo dr_grpo rloo reinforce_plus_plus \
        reinforce_plus_plus_baseline --shapes 32k                # the critic-free estimators against GAE
    .venv/bin/python bench/compare.py --impls ppo_core grpo dapo gspo cispo --shapes 32k   # the 2025 losses

Logs go to bench/results/ (git-ignored), with the whole result as JSON; the table also goes to
bench/results/latest.md.
"""

import argparse
import datetime
import json
import os
import select
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import common

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
# A peer runs in its own venv (TRL_PYTHON), or in this interpreter over a --target directory of carried wheels
# (TRL_SITE: bench/peers.sh install; first on that worker's PYTHONPATH only), as on a machine that reaches no index.
TRL_SITE, TRL_GRPO_SITE = os.environ.get("TRL_SITE"), os.environ.get("TRL_GRPO_SITE")
TRL_PYTHON = os.environ.get("TRL_PYTHON", sys.executable if TRL_SITE else "/work/trl-venv/bin/python")
TRL_GRPO_PYTHON = os.environ.get("TRL_GRPO_PYTHON",  # trl 1.16, transformers 5
                                 sys.executable if TRL_GRPO_SITE else "/work/trl116-venv/bin/python")
ESTIMATORS = ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "dapo", "gspo",
              "cispo"]  # critic-free
IMPLS = ["floor", "floor_trl", "trl", "ppo_core", "ppo_core_bf16", "ppo_core_lora", *ESTIMATORS, "grpo_lora",
         "trl_grpo", "trl_grpo_lora", "ppo_core_bf16w", "grpo_bf16w", "ppo_core_fastgen", "grpo_fastgen",
         "ppo_core_fastgen_compiled", "ppo_core_policy_sampling", "grpo_policy_sampling"]
DEFAULT_IMPLS = IMPLS[:5]  # LoRA (needs peft) on request: --impls ppo_core ppo_core_lora --shapes base
BF16 = "ppo_core, bf16 mixed"
LORA = "ppo_core, LoRA r=16"
GRPO_LORA = "ppo_core, grpo, LoRA r=16"
BF16W = "ppo_core, bf16 weights"
GRPO_BF16W = "ppo_core, grpo, bf16 weights"
FASTGEN = "ppo_core, bf16 rollout copy + static cache"
GRPO_FASTGEN = "ppo_core, grpo, bf16 rollout copy + static cache"
FASTGEN_COMPILED = "ppo_core, bf16 rollout copy + static cache, compiled layers"
POLICY_SAMPLING = "ppo_core, sampling from the policy (rollout_dtype None)"
GRPO_POLICY_SAMPLING = "ppo_core, grpo, sampling from the policy (rollout_dtype None)"
TRL_GRPO = "TRL GRPOTrainer G=4"
TRL_GRPO_LORA = "TRL GRPOTrainer G=4, LoRA r=16"


@dataclass(frozen=True)
class Run:
    """One row of the table: a label, the interpreter and script that produce it, and its floor row."""

    label: str
    python: str
    argv: tuple  # script and its impl-specific flags
    floor: str | None  # label of the floor row of the same venv (None for floors)
    peer: str | None = None  # label of the row doing the same work in another library ("ratio to peer")
    site: str | None = None  # a --target directory put first on the worker's PYTHONPATH (a carried peer)
    lora: bool = False  # only an adapter trains (the update's FLOPs: no weight gradients)


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
        runs.append(Run("floor (TRL venv)", TRL_PYTHON, ("bench/floor.py",), None, site=TRL_SITE))
    if "trl" in impls and have_trl:
        runs.append(Run("trl", TRL_PYTHON, ("bench/ppo_step.py", "--impl", "trl"), "floor (TRL venv)", site=TRL_SITE))
    if "ppo_core" in impls:
        runs.append(Run("ppo_core", sys.executable, ("bench/ppo_step.py", "--impl", "ppo_core"), "floor", "trl"))
    if "ppo_core_bf16" in impls:  # mixed precision through accelerate, against the fp32 floor
        runs.append(Run(BF16, sys.executable, ("bench/ppo_step.py", "--impl", "ppo_core", "--bf16"), "floor", "trl"))
    if "ppo_core_lora" in impls:  # adapter + value head trained, adapter-disabled reference (no weight copy)
        runs.append(Run(LORA, sys.executable, ("bench/ppo_step.py", "--impl", "ppo_core", "--lora"), "floor", "trl",
                        lora=True))
    for estimator in (e for e in ESTIMATORS if e in impls):  # the same 64 rollouts per step, G=4 where grouped
        runs.append(Run(f"ppo_core, {estimator}", sys.executable,
                        ("bench/ppo_step.py", "--impl", "ppo_core", "--estimator", estimator), "floor",
                        TRL_GRPO if estimator == "grpo" else None))
    if "grpo_lora" in impls:
        runs.append(Run(GRPO_LORA, sys.executable,
                        ("bench/ppo_step.py", "--impl", "ppo_core", "--estimator", "grpo", "--lora"), "floor",
                        TRL_GRPO_LORA, lora=True))
    if "ppo_core_bf16w" in impls:  # bf16 weights, no autocast, Adam over float32 masters (weights_dtype)
        runs.append(Run(BF16W, sys.executable, ("bench/ppo_step.py", "--impl", "ppo_core", "--bf16-weights"), "floor",
                        "trl"))
    if "grpo_bf16w" in impls:
        runs.append(Run(GRPO_BF16W, sys.executable,
                        ("bench/ppo_step.py", "--impl", "ppo_core", "--estimator", "grpo", "--bf16-weights"), "floor",
                        TRL_GRPO))
    if "ppo_core_fastgen" in impls:  # generate() from a bf16 rollout copy, static cache (compiled on CUDA)
        runs.append(Run(FASTGEN, sys.executable, ("bench/ppo_step.py", "--impl", "ppo_core", "--fast-generate"),
                        "floor", "trl"))
    if "grpo_fastgen" in impls:
        runs.append(Run(GRPO_FASTGEN, sys.executable,
                        ("bench/ppo_step.py", "--impl", "ppo_core", "--estimator", "grpo", "--fast-generate"), "floor",
                        TRL_GRPO))
    if "ppo_core_fastgen_compiled" in impls:  # and each decoder layer of the policy compiled: the update's launches
        runs.append(Run(FASTGEN_COMPILED, sys.executable,
                        ("bench/ppo_step.py", "--impl", "ppo_core", "--fast-generate", "--compile-layers"), "floor",
                        "trl"))
    if "ppo_core_policy_sampling" in impls:  # the policy samples itself, as TRL 0.11 (the default before "auto")
        runs.append(Run(POLICY_SAMPLING, sys.executable, ("bench/ppo_step.py", "--impl", "ppo_core",
                                                          "--policy-sampling"), "floor", "trl"))
    if "grpo_policy_sampling" in impls:
        runs.append(Run(GRPO_POLICY_SAMPLING, sys.executable, ("bench/ppo_step.py", "--impl", "ppo_core", "--estimator",
                                                               "grpo", "--policy-sampling"), "floor", TRL_GRPO))
    for impl, label, flags in (("trl_grpo", TRL_GRPO, ()), ("trl_grpo_lora", TRL_GRPO_LORA, ("--lora",))):
        if impl not in impls:  # TRL 1.16's GRPOTrainer on ppo_core grpo's work (bench/grpo_trl.py says what differs)
            continue
        if Path(TRL_GRPO_PYTHON).exists():
            runs.append(Run(label, TRL_GRPO_PYTHON, ("bench/grpo_trl.py", *flags), "floor", site=TRL_GRPO_SITE,
                            lora=bool(flags)))
        else:
            notes.append(f"{label} skipped: no interpreter at {TRL_GRPO_PYTHON} (set TRL_GRPO_PYTHON, or "
                         "create the venv: see bench/README.md).")
    return runs, notes


def wait_for_idle(max_others: float, max_wait_s: float) -> None:
    """Sample other processes' CPU share over 1 s windows until it is <= max_others or max_wait_s passes:
    a busy 2-core machine can double a step's time, so we'd rather wait than measure the neighbours."""
    t0 = time.monotonic()
    while True:
        with common.OthersLoad() as load:
            time.sleep(1.0)
        waited = time.monotonic() - t0
        if load.frac is None or load.frac <= max_others:
            if waited > 2:
                print(f"    (waited {waited:.0f} s for an idle machine)", flush=True)
            return
        if waited >= max_wait_s:
            print(f"    (still busy after {waited:.0f} s: others use {load.frac:.0%}; measuring anyway)", flush=True)
            return


class WorkerError(RuntimeError):
    pass


class Worker:
    """A `--serve` subprocess: one contender of one shape, asked for one step at a time."""

    def __init__(self, run: Run, shape: str, args):
        self.run, self.timeout = run, args.timeout
        stem = f"{shape}-{run.label.replace(' ', '_').replace('(', '').replace(')', '').replace(',', '')}"
        self.log_path = RESULTS / f"{stem}.log"
        cmd = [run.python, *run.argv, "--shape", shape, "--threads", str(args.threads), "--serve",
               *(["--bf16"] if args.bf16 and "--bf16" not in run.argv else [])]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
                   TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join(filter(None, (run.site, str(ROOT)))))
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, bufsize=1)

    def ask(self, command: str) -> dict:
        """Send one command line and return the worker's answer; raise WorkerError if it dies or stalls."""
        if command:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        deadline = time.monotonic() + self.timeout
        while True:
            ready, _, _ = select.select([self.proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise WorkerError(f"no answer to {command or 'start'!r} within {self.timeout} s")
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait()
                tail = self.log_path.read_text().strip().splitlines()[-1:] or [""]
                raise WorkerError(f"exit code {self.proc.returncode}: {tail[0][:200]}")
            if line.startswith(common.PROTOCOL):
                return json.loads(line[len(common.PROTOCOL):])
            self.log.write(line)  # the worker's own prints

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def measure_shape(shape: str, runs: list, args) -> dict:
    """Interleaved rounds over every contender of one shape; returns {label: result or {'error': ...}}."""
    workers, results = {}, {}
    for run in runs:  # built one after another, so that builds do not slow each other down
        print(f"  {shape:5s} starting {run.label} ...", flush=True)
        worker = Worker(run, shape, args)
        try:
            worker.ask("")
            workers[run.label] = worker
        except WorkerError as exc:
            print(f"    FAILED: {exc} (see {worker.log_path.relative_to(ROOT)})")
            results[run.label] = {"error": str(exc)}
            worker.close()
    labels = list(workers)
    rounds, redone, r = [], 0, 0
    try:
        while len(rounds) < args.warmup + args.steps and labels:
            if args.max_others < 1:
                wait_for_idle(args.max_others, args.max_wait)
            order = labels[r % len(labels):] + labels[:r % len(labels)]
            this_round = {}
            for label in order:
                try:
                    this_round[label] = workers[label].ask(f"step {r}")
                except WorkerError as exc:
                    print(f"    {label} FAILED in round {r}: {exc}")
                    results[label] = {"error": str(exc)}
                    labels.remove(label)
            r += 1
            busiest = max((s.get("others_cpu_frac") or 0.0 for s in this_round.values()), default=0.0)
            if busiest > args.max_others and redone < args.retries:
                redone += 1
                print(f"    round {r - 1} redone: other processes took {busiest:.0%} of the CPU", flush=True)
                continue
            rounds.append(this_round)
            kind = "warmup" if len(rounds) <= args.warmup else "round"
            print(f"  {shape:5s} {kind} {r - 1}: " + ", ".join(f"{k} {v['total_s']:.3f} s"
                                                            for k, v in this_round.items()), flush=True)
        measured = rounds[args.warmup:]
        for label in labels:
            steps = [rnd[label] for rnd in measured if label in rnd]
            results[label] = {
                **workers[label].ask("done"),
                "steps": len(steps),
                "warmup": args.warmup,
                **common.medians(steps),
                "others_cpu_frac": statistics.mean(s.get("others_cpu_frac") or 0.0 for s in steps),
                "per_step": steps,
            }
    finally:
        for worker in workers.values():
            worker.close()
    results["_rounds"] = measured
    return results


def round_ratios(rounds: list, num: str, den: str) -> list:
    """Per measured round: s/step of `num` divided by that of `den` (rounds where both ran)."""
    return [rnd[num]["total_s"] / rnd[den]["total_s"] for rnd in rounds if num in rnd and den in rnd]


def ratio_stats(rounds: list, num: str, den: str | None) -> tuple | None:
    """(median, first quartile, third quartile) of the per-round ratios, or None."""
    values = round_ratios(rounds, num, den) if den else []
    if not values:
        return None
    if len(values) < 2:
        return values[0], values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4)
    return statistics.median(values), q1, q3


def fmt_ratio(stats: tuple | None, invert: bool = False) -> str:
    """`m (q1-q3)`; inverted (1/x) for "N x fewer seconds"."""
    if stats is None:
        return ""
    m, q1, q3 = (1 / stats[0], 1 / stats[2], 1 / stats[1]) if invert else stats
    return f"{m:.2f} ({q1:.2f}-{q3:.2f})"


PHASES = (("gen_s", "gen_s"), ("logprobs_s", "forward_s"), ("update_s", "train_s"))  # (trainer's, floor's) keys


def tokens_per_s(steps: list) -> float | None:
    """NeMo-RL's throughput: all tokens of a step (prompts and responses) over the step's wall time, median over steps
    (None for rows that do not count their prompts' tokens)."""
    if any("prompt_tokens" not in s for s in steps):
        return None
    return statistics.median((s["prompt_tokens"] + s["gen_tokens"]) / s["total_s"] for s in steps)


def update_mfu(shape: str, run: Run, steps: list, gpu: str | None, dtype: str) -> float | None:
    """The update's model FLOPs (common.update_flops, at each step's mean sequence length, `ppo_epochs` passes) over
    its seconds, against the GPU's dense peak for `dtype`: median over steps, None without a known GPU."""
    peak = common.peak_flops(dtype, gpu) if gpu else None
    if peak is None or any("prompt_tokens" not in s for s in steps):
        return None
    setting = common.setting_for(shape)

    def mfu(s):
        seqs = setting.batch_size
        flops = setting.ppo_epochs * common.update_flops(shape, [(s["prompt_tokens"] + s["gen_tokens"]) / seqs] * seqs,
                                                         lora=run.lora)
        return flops / s["update_s"] / peak

    return statistics.median(mfu(s) for s in steps)


def step_peak_gpu_mb(steps: list) -> float | None:
    """The most GPU memory one step held (common.GpuPeak), over the measured steps."""
    peaks = [s["step_peak_gpu_mb"] for s in steps if s.get("step_peak_gpu_mb") is not None]
    return max(peaks) if peaks else None


def phase_medians(steps: list) -> list:
    """Median seconds of each phase (generate, no-grad log-prob passes, update) over the measured steps."""
    return [statistics.median(s.get(key, s.get(floor_key, float("nan"))) for s in steps) for key, floor_key in PHASES]


def table(results: dict, runs: list, bf16: bool = False) -> str:
    """Markdown table: one row per (shape, run): seconds and their split by phase; ratios (median over rounds,
    interquartile range) against the same venv's floor and against the peer library doing the same work; tokens/s
    (all tokens, generated tokens), the update's MFU and the most GPU memory a step held, where there is a GPU."""
    lines = [
        "| shape | impl | transformers | median s/step | generate s | log-probs s | update s | CPU s/step "
        "| ratio to floor | ratio to peer | tokens/s | gen tokens/s | update MFU | peak RSS MiB | step's peak GPU MiB "
        "| others' CPU |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    dash = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for shape, by_label in results.items():
        rounds = by_label["_rounds"]
        for run in runs:
            r = by_label.get(run.label)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {shape} | {run.label} | | failed: {r['error']} |" + " |" * 12)
                continue
            to_floor = ratio_stats(rounds, run.label, run.floor) if run.floor else None
            to_peer = ratio_stats(rounds, run.label, run.peer) if run.peer else None
            phases = " | ".join(f"{x:.2f}" for x in phase_medians(r["per_step"]))
            dtype = "bf16" if bf16 or {"--bf16", "--bf16-weights"} & set(run.argv) else "fp32"
            mfu = update_mfu(shape, run, r["per_step"], r["machine"]["gpu"], dtype)
            lines.append(
                f"| {shape} | {run.label} | {r['machine']['transformers']} | {r['median_s_per_step']:.3f} | {phases} "
                f"| {r['median_cpu_s_per_step']:.2f} | {fmt_ratio(to_floor)} "
                f"| {fmt_ratio(to_peer) + (f' vs {run.peer}' if to_peer else '')} "
                f"| {dash(tokens_per_s(r['per_step']), '.0f')} | {r['gen_tokens_per_s']:.0f} | {dash(mfu, '.1%')} "
                f"| {r['peak_rss_mb']:.0f} | {dash(step_peak_gpu_mb(r['per_step']), '.0f')} "
                f"| {r['others_cpu_frac']:.0%} |"
            )
    return "\n".join(lines)


def summary(results: dict) -> str:
    """The ratios the ppo_core issue sets targets for, one line per shape (median over rounds, IQR)."""
    lines = []
    for shape, by in results.items():
        rounds, parts = by["_rounds"], []
        if (trl := ratio_stats(rounds, "ppo_core", "trl")) is not None:
            parts.append(f"{fmt_ratio(trl, invert=True)}x fewer s/step than TRL")
        if (floor := ratio_stats(rounds, "ppo_core", "floor")) is not None:
            parts.append(f"{fmt_ratio(floor)}x the floor")
        if (bf16 := ratio_stats(rounds, BF16, "ppo_core")) is not None:
            parts.append(f"bf16 mixed precision {fmt_ratio(bf16, invert=True)}x faster than fp32")
        if (lora := ratio_stats(rounds, LORA, "ppo_core")) is not None and "memory" in by.get(LORA, {}):
            full, low = by["ppo_core"]["memory"], by[LORA]["memory"]
            parts.append(f"LoRA {fmt_ratio(lora, invert=True)}x faster than full PPO, holding "
                         f"{low['weights_mb']:.1f} vs {full['weights_mb']:.1f} MiB of weights (policy + reference) "
                         f"and {low['optimizer_state_mb']:.1f} vs {full['optimizer_state_mb']:.1f} MiB of optimizer "
                         f"state, peak RSS {by[LORA]['peak_rss_mb']:.0f} vs {by['ppo_core']['peak_rss_mb']:.0f} MiB")
        if (grpo := ratio_stats(rounds, "ppo_core, grpo", TRL_GRPO)) is not None:
            parts.append(f"GRPO {fmt_ratio(grpo, invert=True)}x fewer s/round than TRL's GRPOTrainer")
        if (grpo := ratio_stats(rounds, GRPO_LORA, TRL_GRPO_LORA)) is not None:
            parts.append(f"GRPO with LoRA {fmt_ratio(grpo, invert=True)}x fewer s/round than TRL's GRPOTrainer")
        for estimator in ESTIMATORS:  # a critic-free step against a GAE step (the issue: no more costly)
            if (ratio := ratio_stats(rounds, f"ppo_core, {estimator}", "ppo_core")) is not None:
                parts.append(f"{estimator} {fmt_ratio(ratio)}x the s/step of GAE")
        if parts:
            lines.append(f"- {shape}: ppo_core " + ", ".join(parts))
    return "\n".join(lines)


def header(args, results: dict) -> str:
    """Where and how the numbers were taken."""
    any_result = next((r for by in results.values() for k, r in by.items() if k != "_rounds" and "error" not in r),
                      None)
    m = any_result["machine"] if any_result else common.machine_info()
    settings = "; ".join(f"{shape}: batch {s.batch_size}, mini-batch {s.mini_batch_size}, {s.ppo_epochs} PPO epochs, "
                         f"{s.max_new_tokens} new tokens, queries of {s.query_len_min}-{s.query_len_max} tokens"
                         for shape, s in ((shape, common.setting_for(shape)) for shape in results))
    device = m["gpu"] or f"CPU: {m['cpu']}, {m['cpu_count']} cores"
    return (
        f"Taken {datetime.datetime.now().isoformat(timespec='minutes')} on {device}; torch {m['torch']}, "
        f"{args.threads} torch threads{'; every row bf16 mixed precision' if args.bf16 else ''}.\n"
        f"Setting: {settings}; {args.steps} interleaved rounds after {args.warmup} warmup; ratios are medians of "
        "per-round ratios (interquartile range in brackets).\n"
        f"Command: `{' '.join([Path(sys.executable).name, *sys.argv])}`\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["tiny", "32k"], choices=sorted(common.SHAPES))
    parser.add_argument("--impls", nargs="+", default=DEFAULT_IMPLS, choices=IMPLS,
                        help="rows to run (floor_trl: the floor in the TRL venv)")
    parser.add_argument("--steps", type=int, default=8, help="measured rounds (one step of every contender each)")
    parser.add_argument("--warmup", type=int, default=2, help="rounds run first and left out")
    parser.add_argument("--threads", type=int, default=2, help="torch threads and OMP_NUM_THREADS for every run")
    parser.add_argument("--bf16", action="store_true", help="every row in bf16 mixed precision (autocast)")
    parser.add_argument("--out", default=None, help="also write the table (markdown) and the results (JSON) here: "
                        "OUT.md, OUT.json")
    parser.add_argument("--timeout", type=int, default=900, help="seconds a worker may take to build or for one step")
    parser.add_argument("--max-others", type=float, default=0.15,
                        help="before each round, wait while others use more than this share of the CPU (1: never)")
    parser.add_argument("--max-wait", type=float, default=300, help="give up waiting for an idle machine after this")
    parser.add_argument("--retries", type=int, default=4, help="redo rounds that other processes disturbed, this often")
    args = parser.parse_args()

    RESULTS.mkdir(exist_ok=True)
    for name in sorted({common.SHAPES[shape].real for shape in args.shapes} - {None}):
        common.build_real_model(name)  # once, here: the TRL venvs' workers cannot convert it
    runs, notes = planned_runs(args.impls)
    for note in notes:
        print(f"NOTE: {note}")
    results = {shape: measure_shape(shape, runs, args) for shape in args.shapes}

    report = header(args, results) + "\n" + table(results, runs, args.bf16) + "\n\n" + summary(results) + "\n"
    report += "".join(f"\nNote: {n}\n" for n in notes)
    busy = [f"{s}/{lbl}" for s, by in results.items() for lbl, r in by.items()
            if lbl != "_rounds" and (r.get("others_cpu_frac") or 0) > args.max_others]
    if busy:
        report += (f"\nNote: other processes took over {args.max_others:.0%} of the CPU during {', '.join(busy)}; "
                   "those timings are inflated.\n")
    (RESULTS / "latest.md").write_text(report)
    (RESULTS / "latest.json").write_text(json.dumps(results, indent=1))
    if args.out:
        Path(args.out + ".md").write_text(report)
        Path(args.out + ".json").write_text(json.dumps(results, indent=1))
    print("\n" + report + f"\n(written to {(RESULTS / 'latest.md').relative_to(ROOT)})")


if __name__ == "__main__":
    main()

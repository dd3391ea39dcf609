"""report: the run on one self-contained HTML page (data/report/index.html), readable where it ran, offline.

What someone tuning RLHF looks at before the numbers: the evaluation side by side (SFT vs PPO), the per-step
curves (the proxy reward and the gold score together, so over-optimisation shows as their gap; KL and its
coefficient; entropy; the losses; clip fractions; response length; where a step's time goes), samples (held-out
prompts answered by both policies; the best and worst rollouts of the first and last steps), the reward model's
held-out accuracy, SFT's loss curve, and the params that differ from the committed params.yaml. The rewards and the
win rate are the scorer's that PPO trained on (params section `scorer`), and their labels name it. Charts are SVG
drawn by matplotlib and inlined: the page fetches nothing from a network, runs no script, and opens from a file.

The page is a DVC output like every result: the same results give the same bytes, so a fresh clone's run reproduces
the committed dvc.lock and DVC's run-cache restores the page with the stages before it. The one thing on it that
differs every run, the wall-clock seconds per step, is therefore not in it: it links to that chart, drawn beside
the timings in data/logs (see `time_chart`). `rlhf report --experiments` writes the page of a sweep instead
(stages/report/sweep.py).
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from stages.report.accuracy import accuracy_section, heldout_line
from stages.report.html import page
from stages.report.samples import extremes, score_header, side_by_side
from stages.report.sections import (
    charts,
    evaluation_table,
    heldout_charts,
    models,
    params_diff,
    time_chart,
    watched,
)
from stages.shared.artifacts import (
    EVAL_METRICS,
    EVAL_SAMPLES,
    PPO_CURVES,
    PPO_EVAL,
    PPO_METRICS,
    PPO_ROLLOUTS,
    REPORT,
    atomic_path,
    read_json,
    read_table,
)
from stages.shared.params import Params
from stages.shared.runtime import StageError


def run(params: Params, root: Path = Path(".")) -> str:
    curves = pd.read_csv(root / PPO_CURVES) if (root / PPO_CURVES).exists() else None
    if curves is None or not (root / EVAL_METRICS).exists():
        raise StageError(f"{root / PPO_CURVES} or {root / EVAL_METRICS}: not found; run the ppo and evaluate stages "
                         "first (`dvc repro` runs them in order)")
    evaluation = read_json(root / EVAL_METRICS, ["win_rate", "reward", "sft"])
    scorer = params.scorer.title  # the scorer that gave the rewards (and the win rate): its name in every label
    judges = params.evaluate.judges  # the named ones (the synthetic gold is in the tables already)
    samples = read_table(root / EVAL_SAMPLES, SAMPLE_COLUMNS + list(judges))
    sections = [
        ("Evaluation on the held-out prompts", heldout_line(evaluation) + evaluation_table(evaluation, scorer, judges)
         + accuracy_section(evaluation, params.evaluate, scorer)),
        ("PPO, step by step", charts(curves, scorer) + heldout_charts(root / PPO_EVAL, scorer) + time_chart(root)),
        ("Watching the run: the policy kept and the doctor's alerts", watched(read_json(root / PPO_METRICS))),
        ("Held-out prompts: SFT and PPO side by side", side_by_side(samples, score_header(params.scorer),
                                                                      judges=list(judges))),
        ("Rollouts: the best and worst of the first and last steps", extremes(root / PPO_ROLLOUTS, curves)),
        ("Reward model and SFT", models(root)),
        ("Params that differ from the committed params.yaml", params_diff(params)),
    ]
    with atomic_path(root / REPORT) as tmp:
        tmp.write_text(page("RLHF run report", sections))
    return f"{len(curves)} steps, win rate ({scorer}) {evaluation['win_rate']:.2f} -> {REPORT}"


SAMPLE_COLUMNS = ["policy", "query", "response", "score", "kl_to_sft", "response_tokens"]

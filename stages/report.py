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
(stages/report_sweep.py).
"""

from __future__ import annotations

import html
import io
import json
import math
import os
import subprocess
from pathlib import Path

import pandas as pd

from stages.artifacts import (
    EVAL_METRICS,
    EVAL_SAMPLES,
    PPO_CURVES,
    PPO_EVAL,
    PPO_METRICS,
    PPO_ROLLOUTS,
    PPO_TIMINGS,
    PPO_TIMINGS_RUN,
    REPORT,
    REPORT_TIMINGS,
    REWARD_METRICS,
    SFT_CURVE,
    SFT_METRICS,
    atomic_path,
    policy_means,
    read_json,
    read_table,
    sha256_file,
)
from stages.params import MIN_TEXTS_FROM_SCRATCH, Params
from stages.runtime import StageError

# curves.csv columns drawn together, one chart each: (title, [(column, label)], y label); {scorer}: the scorer's title
CHARTS = [
    ("Reward (proxy) and gold score", [("reward_mean", "{scorer}"), ("gold_mean", "gold score")], "per sample"),
    ("KL to the reference", [("kl", "KL (sum over tokens)"), ("kl_coef", "KL coefficient")], ""),
    ("Entropy of the responses", [("entropy", "entropy (sum over tokens)")], "nats"),
    ("Losses", [("loss_policy", "policy loss"), ("loss_value", "value loss")], ""),
    ("Clipping and approximate KL", [("clipfrac", "policy clip fraction"), ("approxkl", "approx. KL")], ""),
    ("Response length", [("response_len", "tokens")], "tokens"),
]
PARTIAL_TITLES = {"Reward (proxy) and gold score": "Reward (proxy)"}  # a chart's title without its missing curve
TIMINGS_ID = "step-seconds"  # the element that links to the chart of wall-clock seconds per step
TIME_PARTS = {"generate": "time/generate", "score": "time/score", "step()": "time/ppo/total"}
STYLE = """body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1180px;color:#222}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}table{border-collapse:collapse;
margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;vertical-align:top;text-align:left}th{background:#f4f4f4}
td.n{text-align:right;font-variant-numeric:tabular-nums}.charts{display:flex;flex-wrap:wrap;gap:8px}
.charts svg{width:380px;height:auto}.note{color:#666}"""


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
        ("Evaluation on the held-out prompts", evaluation_table(evaluation, scorer, judges)),
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


def page(title: str, sections: list[tuple[str, str]]) -> str:
    body = "".join(f"<h2>{html.escape(name)}</h2>\n{content}\n" for name, content in sections)
    return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{STYLE}</style></head>\n<body><h1>{html.escape(title)}</h1>\n{body}</body></html>\n")


def number(value: float) -> str:
    """A float with 4 significant digits, trailing zeros kept (``-2.600``, ``0.4266``, ``15.20``: one format down a
    column), in scientific notation past 1e4 or below 1e-3."""
    if value != value or value in (math.inf, -math.inf):
        return str(value)
    if value != 0 and not 1e-3 <= abs(value) < 1e4:
        return f"{value:.3e}"
    return f"{value:#.4g}".rstrip(".")


def table(rows: list[list], header: list[str]) -> str:
    """An HTML table; numbers right-aligned with 4 significant digits (:func:`number`), text escaped."""
    def cell(value) -> str:
        if isinstance(value, float):
            return f'<td class="n">{number(value)}</td>'
        if isinstance(value, int):
            return f'<td class="n">{value}</td>'
        return f"<td>{html.escape(str(value))}</td>"

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    return f"<table><tr>{head}</tr>" + "".join(f"<tr>{''.join(map(cell, r))}</tr>" for r in rows) + "</table>"


def evaluation_table(metrics: dict, scorer: str, judges: dict[str, str] | None = None) -> str:
    """SFT and PPO side by side; ``scorer``: the title of the scorer that gave the rewards and the win rate; ``judges``:
    `evaluate.judges` (name -> module:function), each a row after the gold score."""
    judges = judges or {}
    gold = f"gold score ({judges['gold']})" if "gold" in judges else "gold score"
    names = {"reward": f"{scorer} score", "gold": gold,
             **{name: f"judge {name} ({spec})" for name, spec in judges.items() if name != "gold"},
             "kl": "KL to SFT", "length": "response length (tokens)"}
    sft, ppo = policy_means(metrics, "sft"), policy_means(metrics, "ppo")
    rows = [[label, sft[key], ppo[key], ppo[key] - sft[key]] for key, label in names.items() if key in ppo]
    win = f"<p>Win rate of PPO over SFT ({html.escape(scorer)}, ties half): <b>{metrics['win_rate']:.3f}</b></p>"
    return table(rows, ["mean over the held-out prompts", "SFT", "PPO", "PPO - SFT"]) + win


def svg(figure) -> str:
    """A matplotlib figure as inline SVG, the same bytes for the same data (no date, fixed ids, text as text)."""
    import matplotlib.pyplot as plt

    buffer = io.StringIO()
    figure.savefig(buffer, format="svg", metadata={"Date": None}, bbox_inches="tight")
    plt.close(figure)
    text = buffer.getvalue()
    return text[text.index("<svg"):]


def figure(title: str, ylabel: str = "", xlabel: str = "PPO step"):
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams.update({"svg.hashsalt": "rlhf-report", "svg.fonttype": "none", "font.size": 9})
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.6, 3.0))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def charts(curves: pd.DataFrame, scorer: str) -> str:
    out = []
    for title, columns, ylabel in CHARTS:
        present = [(c, label) for c, label in columns if c in curves]
        if not present:
            continue
        if len(present) < len(columns):  # e.g. no gold score (a scorer of the user's own data): its title says so
            title = PARTIAL_TITLES.get(title, title)
        fig, ax = figure(title, ylabel)
        for column, label in present:
            ax.plot(curves["step"], curves[column], marker=".", label=label.format(scorer=scorer))
        ax.legend()
        out.append(svg(fig))
    return f'<div class="charts">{"".join(out)}</div>'


def heldout_charts(path: Path, scorer: str) -> str:
    """The held-out evaluations during the run (data/ppo/eval.csv, `watch.eval_every`), beside the training curves:
    the scorer's mean with the gold score and the judges (the gap between the proxy and the gold opening on prompts
    the policy never trained on), and the KL to SFT. Nothing where the run had none."""
    evals = pd.read_csv(path) if path.exists() else pd.DataFrame()
    if "reward" not in evals:
        return ""
    fig, ax = figure("Held-out prompts during the run", "mean per sample")
    for column in [c for c in evals.columns if c not in ("step", "kl", "length")]:
        label = f"{scorer} (held-out)" if column == "reward" else f"{column} (held-out)"
        ax.plot(evals["step"], evals[column], marker="o", label=label)
    ax.legend()
    kl_fig, kl_ax = figure("Held-out KL to SFT during the run", "KL (sum over tokens)")
    kl_ax.plot(evals["step"], evals["kl"], marker="o", color="tab:red", label="KL to SFT (held-out)")
    kl_ax.legend()
    return f'<div class="charts">{svg(fig)}{svg(kl_fig)}</div>'


def watched(metrics: dict) -> str:
    """Which policy data/models/ppo holds and why, where an alert stopped the run, and the doctor's alerts (per
    check: the steps it fired at, the first). Steps are counted from 0, as the charts and data/ppo/*.csv count them."""
    kept = metrics.get("kept", {"policy": "last", "step": metrics.get("steps", 0) - 1})
    if kept["policy"] == "best":
        price = f" - {kept['kl_price']:g} x KL to SFT" if kept.get("kl_price") else ""
        text = (f"<p>data/models/ppo holds the policy of step {kept['step']} (steps counted from 0, as in the "
                f"charts), the best by the held-out {html.escape(kept['by'])}{price} ({number(kept['value'])}).</p>")
    else:
        text = f"<p>data/models/ppo holds the last step's policy (step {kept['step']}, counted from 0).</p>"
    if "stopped" in metrics:
        text += f"<p><b>The run stopped at step {metrics['stopped']['step']}</b>: " \
                f"{html.escape(metrics['stopped']['reason'])}.</p>"
    alerts = metrics.get("alerts", {})
    if not alerts:
        return text + "<p>The doctor found nothing (watch.alerts).</p>"
    rows = [[check, entry["steps"], entry["first_step"], entry["first"]] for check, entry in sorted(alerts.items())]
    return text + table(rows, ["check (watch.alerts)", "steps", "first step", "what it found there"])


def time_chart(root: Path) -> str:
    """Where each step's time went (generate, score, step()): an image linked from the page, not drawn in it.

    Wall-clock seconds differ every run, and the page is a DVC output that must not (the same results, the same
    bytes), so the chart lives in data/logs/report, named after the results it belongs to (the SHA-256 of
    curves.csv), and the page links to it. It is drawn when the timings in data/logs/ppo are those of these
    results (a ppo run that executed here); where they are not, the page shows the link's text instead."""
    run_id = sha256_file(root / PPO_CURVES)
    image = REPORT_TIMINGS / f"step-seconds-{run_id[:16]}.svg"
    if (root / PPO_TIMINGS).exists() and (root / PPO_TIMINGS_RUN).exists() and \
            json.loads((root / PPO_TIMINGS_RUN).read_text()).get("curves_sha256") == run_id:
        timings = pd.read_csv(root / PPO_TIMINGS)
        parts = {name: timings[column] for name, column in TIME_PARTS.items() if column in timings}
        fig, ax = figure("Seconds per step", "seconds")
        bottom = 0
        for name, seconds in parts.items():
            ax.bar(timings["step"], seconds, bottom=bottom, label=name)
            bottom = bottom + seconds
        ax.legend()
        with atomic_path(root / image) as tmp:
            tmp.write_text(svg(fig))
    missing = (f"Seconds per step: not measured in this workspace ({image} is drawn where the ppo run of these "
               "results executed; a run restored from DVC's cache has no timings)")
    return (f'<div class="charts" id="{TIMINGS_ID}"><img src="{os.path.relpath(image, REPORT.parent)}" '
            f'width="380" alt="{html.escape(missing)}"></div>')


def score_header(scorer) -> str:
    """The samples' score column: "RM score" (the reward model, abbreviated), else the scorer's title and "score"."""
    return "RM score" if scorer.source == "reward_model" else f"{scorer.title} score"


def side_by_side(samples: pd.DataFrame, score: str, n: int = 8, judges: list[str] = ()) -> str:
    """The first ``n`` held-out prompts answered by both policies, with the scorer's score and each named judge's."""
    sft, ppo = (samples[samples["policy"] == p].reset_index(drop=True).head(n) for p in ("sft", "ppo"))
    columns = ["score", *judges]
    rows = [[s["query"], s["response"], *(float(s[c]) for c in columns), p["response"], *(float(p[c]) for c in columns)]
            for (_, s), (_, p) in zip(sft.iterrows(), ppo.iterrows())]
    header = [score, *judges]
    return table(rows, ["prompt", "SFT response", *header, "PPO response", *header])


def extremes(rollouts_dir: Path, curves: pd.DataFrame, n: int = 3) -> str:
    """The ``n`` highest- and lowest-scoring rollouts of the first and the last step."""
    out = []
    for step in sorted({int(curves["step"].min()), int(curves["step"].max())}):
        rollouts = read_table(rollouts_dir / f"step-{step:05d}.parquet", ["query", "response", "score"])
        ranked = rollouts.sort_values("score", ascending=False, kind="stable")
        rows = [["best", r["query"], r["response"], float(r["score"])] for _, r in ranked.head(n).iterrows()]
        rows += [["worst", r["query"], r["response"], float(r["score"])] for _, r in ranked.tail(n).iterrows()]
        out.append(f"<p>Step {step}</p>" + table(rows, ["rank", "prompt", "response", "score"]))
    return "".join(out)


def models(root: Path) -> str:
    reward = read_json(root / REWARD_METRICS) if (root / REWARD_METRICS).exists() else {}
    sft = read_json(root / SFT_METRICS) if (root / SFT_METRICS).exists() else {}
    rows = [[key, value] for key, value in sorted(reward.items()) if not isinstance(value, dict)]  # held-out
    caveat = ""
    if sft.get("n_train", MIN_TEXTS_FROM_SCRATCH) < MIN_TEXTS_FROM_SCRATCH:
        caveat = (f'<p class="note">SFT trained on {sft["n_train"]} texts: a model trained from scratch on so few '
                  "learns no language, and the evaluation above then compares noise.</p>")
    text = caveat + (table(rows, ["reward model, held-out pairs", "value"]) if rows else "")
    if (root / SFT_CURVE).exists():
        curve = pd.read_csv(root / SFT_CURVE)
        fig, ax = figure("SFT training loss", "loss", xlabel="optimiser step")
        ax.plot(curve["step"], curve["loss"], label="train loss (running)")
        if "eval_loss" in sft:
            ax.axhline(sft["eval_loss"], color="gray", linestyle="--", label="held-out loss (final)")
        ax.legend()
        text += f'<div class="charts">{svg(fig)}</div>'
    return text


def params_diff(params: Params) -> str:
    """The params that differ from params.yaml as committed (git HEAD): what this run, or experiment, changed. The path
    is taken from the working directory (`HEAD:./params.yaml`: an example's own, in examples/sentiment)."""
    from ruamel.yaml import YAML

    try:
        committed = subprocess.run(["git", "show", f"HEAD:./{params.path.as_posix()}"], capture_output=True, text=True,
                                   check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return '<p class="note">No committed params.yaml to compare with (not a git checkout).</p>'
    base, now = (flatten(YAML(typ="safe", pure=True).load(text)) for text in (committed, params.path.read_text()))
    rows = [[key, str(base.get(key, "(absent)")), str(now.get(key, "(absent)"))]
            for key in sorted(base.keys() | now.keys()) if base.get(key) != now.get(key)]
    return table(rows, ["key", "committed", "this run"]) if rows else "<p>None: the committed params.</p>"


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in (tree or {}).items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out

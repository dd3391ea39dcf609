"""The sections of the run's page (stages/report/): the evaluation table, the per-step and held-out curves, what
watching the run kept and raised, the wall-clock seconds (beside the page: they differ every run), samples side by
side, the best and worst rollouts, the reward model and SFT, and the params that differ from the committed ones."""

from __future__ import annotations

import html
import json
import os
import subprocess
from pathlib import Path

import pandas as pd

from stages.report.html import figure, flatten, number, shown_steps, svg, table
from stages.shared.artifacts import (
    PPO_CURVES,
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
    sha256_file,
)
from stages.shared.params import MIN_TEXTS_FROM_SCRATCH, Params

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


STEPS_NOTE = ('<p class="note">Steps are counted from 1 on this page, as the console counts them (step 24/24); the '
              "step column of data/ppo/*.csv and the rollouts' file names (step-00000.parquet) count from 0.</p>")


TIME_PARTS = {"generate": "time/generate", "score": "time/score", "step()": "time/ppo/total"}


def evaluation_table(metrics: dict, scorer: str, judges: dict[str, str] | None = None) -> str:
    """SFT and PPO side by side; ``scorer``: the title of the scorer that gave the rewards and the win rate; ``judges``:
    `evaluate.judges` (name -> module:function), each a row after the gold score."""
    judges = judges or {}
    gold = f"gold score ({judges['gold']})" if "gold" in judges else "gold score"
    sft, ppo = policy_means(metrics, "sft"), policy_means(metrics, "ppo")
    parts = {key: f"{scorer}: {key.removeprefix('reward_')}" for key in ppo if key.startswith("reward_")}  # combined's
    names = {"reward": f"{scorer} score", **parts, "gold": gold,
             **{name: f"judge {name} ({spec})" for name, spec in judges.items() if name != "gold"},
             "kl": "KL to SFT", "length": "response length (tokens)"}
    rows = [[label, sft[key], ppo[key], ppo[key] - sft[key]] for key, label in names.items() if key in ppo]
    win = f"<p>Win rate of PPO over SFT ({html.escape(scorer)}, ties half): <b>{metrics['win_rate']:.3f}</b></p>"
    return table(rows, ["mean over the held-out prompts", "SFT", "PPO", "PPO - SFT"]) + win


def charts(curves: pd.DataFrame, scorer: str) -> str:
    """The per-step curves (`CHARTS`), and with `scorer.source: combined` each reward function's mean (curves.csv's
    reward_NAME columns) in a chart of its own."""
    functions = [(c, c.removeprefix("reward_")) for c in curves if c.startswith("reward_") and c != "reward_mean"]
    out = []
    for title, columns, ylabel in CHARTS + ([("Each reward function", functions, "per sample")] if functions else []):
        present = [(c, label) for c, label in columns if c in curves]
        if not present:
            continue
        if len(present) < len(columns):  # e.g. no gold score (a scorer of the user's own data): its title says so
            title = PARTIAL_TITLES.get(title, title)
        fig, ax = figure(title, ylabel)
        for column, label in present:
            ax.plot(shown_steps(curves["step"]), curves[column], marker=".", label=label.format(scorer=scorer))
        ax.legend()
        out.append(svg(fig))
    return STEPS_NOTE + f'<div class="charts">{"".join(out)}</div>'


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
        ax.plot(shown_steps(evals["step"]), evals[column], marker="o", label=label)
    ax.legend()
    kl_fig, kl_ax = figure("Held-out KL to SFT during the run", "KL (sum over tokens)")
    kl_ax.plot(shown_steps(evals["step"]), evals["kl"], marker="o", color="tab:red", label="KL to SFT (held-out)")
    kl_ax.legend()
    return f'<div class="charts">{svg(fig)}{svg(kl_fig)}</div>'


def watched(metrics: dict) -> str:
    """Which policy data/models/ppo holds and why, where an alert stopped the run, and the doctor's alerts (per
    check: how many steps it fired at, the first). Steps are counted from 1, as the charts and the console count them
    (data/ppo/metrics.json counts from 0)."""
    kept = metrics.get("kept", {"policy": "last", "step": metrics.get("steps", 0) - 1})
    if kept["policy"] == "best":
        price = f" - {kept['kl_price']:g} x KL to SFT" if kept.get("kl_price") else ""
        text = (f"<p>data/models/ppo holds the policy of step {shown_steps(kept['step'])}, the best by the held-out "
                f"{html.escape(kept['by'])}{price} ({number(kept['value'])}).</p>")
    else:
        text = f"<p>data/models/ppo holds the last step's policy (step {shown_steps(kept['step'])}).</p>"
    if "stopped" in metrics:
        text += f"<p><b>The run stopped at step {shown_steps(metrics['stopped']['step'])}</b>: " \
                f"{html.escape(metrics['stopped']['reason'])}.</p>"
    alerts = metrics.get("alerts", {})
    if not alerts:
        return text + "<p>The doctor found nothing (watch.alerts).</p>"
    rows = [[check, entry["steps"], shown_steps(entry["first_step"]), entry["first"]]
            for check, entry in sorted(alerts.items())]
    return text + table(rows, ["check (watch.alerts)", "how many steps", "first step", "what it found there"])


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
            ax.bar(shown_steps(timings["step"]), seconds, bottom=bottom, label=name)
            bottom = bottom + seconds
        ax.legend()
        with atomic_path(root / image) as tmp:
            tmp.write_text(svg(fig))
    missing = (f"Seconds per step: not measured in this workspace ({image} is drawn where the ppo run of these "
               "results executed; a run restored from DVC's cache has no timings)")
    return (f'<div class="charts" id="{TIMINGS_ID}"><img src="{os.path.relpath(image, REPORT.parent)}" '
            f'width="380" alt="{html.escape(missing)}"></div>')


def models(root: Path) -> str:
    reward = read_json(root / REWARD_METRICS) if (root / REWARD_METRICS).exists() else {}
    sft = read_json(root / SFT_METRICS) if (root / SFT_METRICS).exists() else {}
    rows = [[key, value] for key, value in sorted(reward.items()) if not isinstance(value, dict)]  # held-out
    caveat = ""
    if sft.get("n_train", MIN_TEXTS_FROM_SCRATCH) < MIN_TEXTS_FROM_SCRATCH:
        caveat = (f'<p class="note">SFT trained on {sft["n_train"]} texts: a model trained from scratch on so few '
                  "learns no language, and the evaluation above then compares noise.</p>")
    if reward.get("trained") is False:  # the reward stage trained none: nothing scored with it
        rows, caveat = [], caveat + f'<p class="note">No reward model was trained: {html.escape(reward["why"])}.</p>'
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

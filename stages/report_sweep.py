"""The page of a sweep (`rlhf report --experiments`): the experiments as `dvc exp show` lists them (the params that
differ, the evaluation) and their PPO curves overlaid, read through DVC's own API (`dvc.api.exp_show`,
`dvc.api.read` of each experiment's curves from DVC's cache), self-contained as the run's report is.
"""

from __future__ import annotations

import io
from pathlib import Path

import pandas as pd

from stages.artifacts import PPO_CURVES, REPORT_SWEEP, atomic_path
from stages.report import figure, flatten, page, svg, table
from stages.runtime import StageError

METRICS = {"win_rate": "win rate", "gold": "PPO gold", "reward": "PPO RM score", "kl": "PPO KL to SFT",
           "accuracy": "RM accuracy"}
CURVES = [("reward_mean", "Reward (proxy) per step"), ("gold_mean", "Gold score per step"), ("kl", "KL per step")]


def write_sweep_page(root: Path, params_path: Path) -> str:
    import dvc.api
    from dvc.exceptions import DvcException
    from ruamel.yaml import YAML

    try:
        rows = [row for row in dvc.api.exp_show(repo=str(root)) if row["rev"] != "workspace"]
    except DvcException as err:
        raise StageError(f"dvc exp show: {err}; run from the project's git checkout") from None
    if not rows:
        raise StageError("no experiments to show: run some first (`dvc exp run -S ...`, or --queue then "
                         "`dvc queue start`)")
    param_keys = set(flatten(YAML(typ="safe", pure=True).load(Path(root, params_path).read_text())))
    varying = sorted(k for k in param_keys if len({str(row.get(k)) for row in rows}) > 1)
    names = [row["Experiment"] or row["rev"] for row in rows]
    header = ["experiment", *varying, *METRICS.values()]
    body = [[name, *(str(row.get(k)) for k in varying), *(number(row.get(k)) for k in METRICS)]
            for name, row in zip(names, rows)]
    curves = {name: read_curves(root, row["rev"]) for name, row in zip(names, rows)}
    sections = [("Experiments (as dvc exp show: the params that differ, the evaluation)", table(body, header)),
                ("PPO curves, overlaid", overlay({n: c for n, c in curves.items() if c is not None}))]
    with atomic_path(Path(root) / REPORT_SWEEP) as tmp:
        tmp.write_text(page("RLHF sweep report", sections))
    return f"{len(rows)} experiments, {len(varying)} params differ -> {REPORT_SWEEP}"


def number(value):
    return float(value) if isinstance(value, (int, float)) else "-"


def read_curves(root: Path, rev: str) -> pd.DataFrame | None:
    """An experiment's curves.csv from DVC's cache, or None when it has none there."""
    import dvc.api
    from dvc.exceptions import DvcException

    try:
        return pd.read_csv(io.StringIO(dvc.api.read(str(PPO_CURVES), repo=str(root), rev=rev)))
    except (DvcException, FileNotFoundError, ValueError):
        return None


def overlay(curves: dict[str, pd.DataFrame]) -> str:
    charts = []
    for column, title in CURVES:
        fig, ax = figure(title)
        for name, frame in curves.items():
            if column in frame:
                ax.plot(frame["step"], frame[column], label=name)
        ax.legend(fontsize=7)
        charts.append(svg(fig))
    return f'<div class="charts">{"".join(charts)}</div>'

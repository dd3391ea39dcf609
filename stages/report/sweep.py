"""The page of a sweep (`rlhf report --experiments`): the experiments as `dvc exp show` lists them (the params that
differ, the evaluation) and their PPO curves overlaid, read through DVC's own API (`dvc.api.exp_show`, and
`dvc.api.read` of each experiment's params file and curves), self-contained as the run's report is. Params are shown
as each experiment's params file writes them (`dvc.api.exp_show` gives an int as a float, 1 as 1.0), and a curve's
legend names its experiment's values of the params that differ.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pandas as pd

from stages.report.html import figure, flatten, page, shown_steps, svg, table
from stages.shared.artifacts import PPO_CURVES, REPORT_SWEEP, atomic_path
from stages.shared.params import ScorerParams
from stages.shared.runtime import StageError

METRICS = {"win_rate": "win rate", "gold": "PPO gold", "reward": "PPO reward", "kl": "PPO KL to SFT",
           "accuracy": "RM accuracy"}
CURVES = [("reward_mean", "Reward (proxy) per step"), ("gold_mean", "Gold score per step"), ("kl", "KL per step")]
ABSENT = "(absent)"  # a param one experiment's file does not have


def write_sweep_page(root: Path, params_path: Path) -> str:
    import dvc.api
    from dvc.exceptions import DvcException

    try:
        shown_rows = dvc.api.exp_show(repo=str(root))
    except DvcException as err:
        raise StageError(f"dvc exp show: {err}; run from the project's git checkout") from None
    rows = [row for row in shown_rows if row["rev"] != "workspace"]  # the baseline (main), then its experiments
    if not rows:
        raise StageError("no experiments to show: run some first (`dvc exp run -S ...`, or --queue then "
                         "`dvc queue start`)")
    revs = [row["rev"] for row in rows]
    params = [read_params(root, params_path, rev) for rev in revs]
    workspace = next((row for row in shown_rows if row["rev"] == "workspace"), None)
    if stands_in(workspace, rows[0]) and read_params(root, params_path, None) == params[0]:
        rows[0], revs[0] = {**workspace, "Experiment": WORKSPACE_BASELINE}, None  # None: dvc.api reads the workspace
    varying = sorted(k for k in set().union(*params) if len({shown(p.get(k, ABSENT)) for p in params}) > 1)
    names = [row["Experiment"] or row["rev"] for row in rows]
    header = ["experiment", *varying, *(reward_label(params) if k == "reward" else v for k, v in METRICS.items())]
    body = [[name, *(shown(p.get(k, ABSENT)) for k in varying), *(number(row.get(k)) for k in METRICS)]
            for name, p, row in zip(names, params, rows)]
    curves = {legend(name, p, varying): read_curves(root, rev) for name, p, rev in zip(names, params, revs)}
    sections = [("Experiments (as dvc exp show: the params that differ, the evaluation)", table(body, header)),
                ("PPO curves, overlaid", overlay({n: c for n, c in curves.items() if c is not None}))]
    with atomic_path(Path(root) / REPORT_SWEEP) as tmp:
        tmp.write_text(page("RLHF sweep report", sections))
    return (f"{len(rows)} experiment{'s' * (len(rows) != 1)}, {len(varying)} param{'s' * (len(varying) != 1)} "
            f"differ{'s' * (len(varying) == 1)} -> {REPORT_SWEEP}")


WORKSPACE_BASELINE = "workspace (this machine's run of main's params)"


def stands_in(workspace: dict | None, baseline: dict) -> bool:
    """Whether the workspace's results stand in for the baseline's on the page: main's results are in no DVC cache here
    (this machine's float kernels computed other bytes than main's lock: docs/reproducibility.md, "Same inputs, same
    bytes"), the workspace has some, and (checked by the caller) it ran with main's params."""
    has_results = lambda row: any(isinstance(row.get(key), (int, float)) for key in METRICS)  # noqa: E731 ("!": none)
    return workspace is not None and not has_results(baseline) and has_results(workspace)


def number(value):
    return float(value) if isinstance(value, (int, float)) else "-"


def read_params(root: Path, params_path: Path, rev: str | None) -> dict:
    """An experiment's params (flattened: ``ppo.learning_rate``), as its params file holds them."""
    import dvc.api
    from dvc.exceptions import DvcException
    from ruamel.yaml import YAML

    try:
        text = dvc.api.read(str(params_path), repo=str(root), rev=rev)
    except (DvcException, FileNotFoundError) as err:
        raise StageError(f"{params_path} of experiment {rev}: cannot be read ({err}); pass the params file the "
                         "experiments ran with (--params)") from None
    return flatten(YAML(typ="safe", pure=True).load(text))


def shown(value) -> str:
    """A param as YAML writes it: 1 (not 1.0), 0.0001, null, true, ["c_attn"]; a string as it is."""
    return value if isinstance(value, str) else json.dumps(value)


def legend(name: str, params: dict, varying: list[str]) -> str:
    """An experiment's name and its values of the params that differ: ``exp-abc12 (ppo.learning_rate=0.0001)``."""
    values = ", ".join(f"{key}={shown(params.get(key, ABSENT))}" for key in varying)
    return f"{name} ({values})" if values else name


def reward_label(params: list[dict]) -> str:
    """The reward column's header: it names the experiments' scorer (or says the scorer.* columns do, if they
    differ)."""
    scorers = {(p.get("scorer.source"), p.get("scorer.name"), p.get("scorer.label")) for p in params}
    if len(scorers) > 1:
        return f"{METRICS['reward']} (each one's scorer.*)"
    source, name, label = scorers.pop()
    return f"{METRICS['reward']} ({ScorerParams(source, name, label, batch_size=0).title})"


def read_curves(root: Path, rev: str | None) -> pd.DataFrame | None:
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
                ax.plot(shown_steps(frame["step"]), frame[column], label=name)
        ax.legend(fontsize=7)
        charts.append(svg(fig))
    return f'<div class="charts">{"".join(charts)}</div>'

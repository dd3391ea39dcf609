"""The page of a sweep (`rlhf report --experiments`): the experiments as `dvc exp show` lists them (the evaluation,
then the params that differ) and their PPO curves overlaid, read through DVC's own API (`dvc.api.exp_show`, and
`dvc.api.read` of each experiment's params file and curves), self-contained as the run's report is. Params are shown
as each experiment's params file writes them (`dvc.api.exp_show` gives an int as a float, 1 as 1.0). Made to be read
at a glance in a 1400 px window: each chart is the page's full width, its legend names the experiments only (their
params are in the table), and the table keeps the page's width, its long names and values wrapping at their dots.
"""

from __future__ import annotations

import html
import io
import json
import re
from pathlib import Path

import pandas as pd

from stages.report.html import figure, flatten, page, shown_steps, svg
from stages.report.html import number as formatted
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
    curves = {name: read_curves(root, rev) for name, rev in zip(names, revs)}
    text = sweep_page(names, params, rows, varying, {n: c for n, c in curves.items() if c is not None})
    with atomic_path(Path(root) / REPORT_SWEEP) as tmp:
        tmp.write_text(text)
    return (f"{len(rows)} experiment{'s' * (len(rows) != 1)}, {len(varying)} param{'s' * (len(varying) != 1)} "
            f"differ{'s' * (len(varying) == 1)} -> {REPORT_SWEEP}")


WORKSPACE_BASELINE = "workspace (this machine's run of main's params)"

# The sweep's own rules, after the run page's (html.STYLE, left as it is: html.py is a dep of the report stage, whose
# page is a DVC output): charts one per row at the page's width; a table no wider than the page, whose params wrap at
# the break points `breakable` marks or, past them, anywhere, and whose names and numbers never break inside a word.
SWEEP_STYLE = """.wide svg{display:block;width:100%;height:auto;margin:8px 0}table.sweep{max-width:100%}
.sweep .param{overflow-wrap:anywhere;border-left:2px solid #bbb}.sweep td.n,.sweep td.name{white-space:nowrap}"""
CHART_INCHES = (11.0, 3.0)  # (width, height) of an overlaid chart: about the page's 1180 px, so text keeps its size


def sweep_page(names: list[str], params: list[dict], rows: list[dict], varying: list[str],
               curves: dict[str, pd.DataFrame]) -> str:
    """The sweep's page: the experiments' table, then their curves overlaid (``curves``: experiment name -> its
    curves.csv; ``names``, ``params``, ``rows``: one per experiment, in the table's order)."""
    sections = [("Experiments (as dvc exp show: the evaluation, then the params that differ)",
                 experiments_table(names, params, rows, varying)),
                ("PPO curves, overlaid (each experiment's params: the table above)", overlay(curves))]
    return page("RLHF sweep report", sections).replace("</style>", f"\n{SWEEP_STYLE}</style>", 1)


def experiments_table(names: list[str], params: list[dict], rows: list[dict], varying: list[str]) -> str:
    """One row per experiment: its name, its evaluation (``METRICS``, from its `dvc exp show` row), then its values of
    the params that differ (``varying``). The results come first, where a reader looks, whatever the params' count."""
    metrics = [reward_label(params) if key == "reward" else label for key, label in METRICS.items()]
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ["experiment", *metrics])
    head += "".join(f'<th class="param">{breakable(key)}</th>' for key in varying)
    body = ""
    for name, values, row in zip(names, params, rows):
        results = (number(row.get(key)) for key in METRICS)
        cells = "".join(f'<td class="n">{formatted(x)}</td>' if isinstance(x, float) else f"<td>{x}</td>"
                        for x in results)
        cells += "".join(f'<td class="param">{breakable(shown(values.get(key, ABSENT)))}</td>' for key in varying)
        body += f'<tr><td class="name">{html.escape(name)}</td>{cells}</tr>'  # gauge-thaw, not gauge- / thaw
    return f'<table class="sweep"><tr>{head}</tr>{body}</table>'


BREAK = re.compile(r"(?<=[./:_])(?=[A-Za-z])")  # after a separator, before a letter: never inside a number


def breakable(text: str) -> str:
    """``text`` escaped, with a line-break opportunity (``<wbr>``) after each ``.``, ``/``, ``:`` or ``_`` that a letter
    follows: ``data.prompts.columns.query`` wraps at its dots, ``0.0001`` and ``1e-05`` stay whole."""
    return "<wbr>".join(html.escape(part) for part in BREAK.split(text))


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
    """One chart per curve in ``CURVES`` that some experiment has (no gold score on a user's own data), the page's width
    each, every experiment a line labelled with its name."""
    from matplotlib.ticker import MaxNLocator

    charts = []
    for column, title in CURVES:
        if not any(column in frame for frame in curves.values()):
            continue
        fig, ax = figure(title)
        fig.set_size_inches(*CHART_INCHES)
        for name, frame in curves.items():
            if column in frame:
                ax.plot(shown_steps(frame["step"]), frame[column], label=name)  # counted from 1, as the console
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole
        ax.legend(fontsize=8)
        charts.append(svg(fig))
    return f'<div class="wide">{"".join(charts)}</div>'

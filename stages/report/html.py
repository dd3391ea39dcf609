"""The report's HTML, self-contained: the page and its style, tables with one number format down a column, and
matplotlib figures inlined as SVG (no script, no network), their PPO steps counted from 1 as the console counts them.
The run's page (stages/report/) and a sweep's (stages/report/sweep.py) are both built from these."""

from __future__ import annotations

import html
import io
import math

STYLE = """body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1180px;color:#222}
h1{font-size:22px}h2{font-size:18px;margin-top:28px;border-bottom:1px solid #ddd}table{border-collapse:collapse;
margin:8px 0}td,th{border:1px solid #ddd;padding:3px 8px;vertical-align:top;text-align:left}th{background:#f4f4f4}
td.n{text-align:right;font-variant-numeric:tabular-nums}.charts{display:flex;flex-wrap:wrap;gap:8px}
.charts svg{width:380px;height:auto}.note{color:#666}"""


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


def column_format(values: list) -> str:
    """The one format of a column's floats: 2 decimals, as the stages' summary lines print their means (``-0.15``,
    ``10.61``, ``0.83``), so that the page, the console and numbers copied from either agree; 3 significant digits in
    scientific notation for a column that reaches 1e4 or stays under 0.1, where 2 decimals would be too long or 0.00."""
    finite = [abs(v) for v in values if isinstance(v, float) and math.isfinite(v)]
    largest = max(finite, default=1.0)
    return ".2f" if 0.1 <= largest < 1e4 or largest == 0 else ".2e"


def table(rows: list[list], header: list[str]) -> str:
    """An HTML table; numbers right-aligned, each column's floats in one format (:func:`column_format`), text
    escaped."""
    formats = [column_format(list(column)) for column in zip(*rows)]

    def cell(value, fmt: str) -> str:
        if isinstance(value, float):
            return f'<td class="n">{format(value, fmt) if math.isfinite(value) else value}</td>'
        if isinstance(value, int):
            return f'<td class="n">{value}</td>'
        return f"<td>{html.escape(str(value))}</td>"

    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join(f"<tr>{''.join(map(cell, row, formats))}</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def shown_steps(steps):
    """PPO steps as the page shows them: counted from 1, as the console counts them (``step 24/24``, the summary
    line, the warnings); the ``step`` column of data/ppo/*.csv and the rollouts' file names count from 0."""
    return steps + 1


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
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(4.6, 3.0))
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no tick at 2.5
    if ylabel:
        ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    return fig, ax


def flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in (tree or {}).items():
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out

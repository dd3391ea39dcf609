"""The report's samples: held-out prompts answered by both policies side by side, and the best and worst rollouts of
the first and last PPO steps."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from stages.report.html import shown_steps, table
from stages.shared.artifacts import read_table


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
        out.append(f"<p>Step {shown_steps(step)} (step-{step:05d}.parquet)</p>"
                   + table(rows, ["rank", "prompt", "response", "score"]))
    return "".join(out)

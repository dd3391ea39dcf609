"""A ppo run's tables: each step's rollouts, gathered from every process, and the per-step tables built from
`step()`'s stats (stats.parquet, timings.csv, curves.csv).

Plain data and how it is written: where it is written, and when (the run's work in progress, a checkpoint, the
published artifacts), is stages/ppo/checkpoints.py's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from accelerate.utils import gather_object

from stages.shared.artifacts import PPO_CURVES, PPO_EVAL, PPO_STATS, PPO_TIMINGS, write_csv, write_parquet

# curves.csv column -> step() stats key (plus reward_mean and gold_mean, computed from the raw scores)
CURVES = {"kl": "objective/kl", "kl_coef": "objective/kl_coef", "entropy": "objective/entropy",
          "loss_value": "ppo/loss/value", "loss_policy": "ppo/loss/policy", "clipfrac": "ppo/policy/clipfrac",
          "approxkl": "ppo/policy/approxkl", "response_len": "tokens/responses_len_mean"}


# A rollouts file's columns, in the order the published files have them (gold: with the synthetic data only). The
# order is part of the files' bytes, which DVC hashes: a new column goes at the end.
ROLLOUT_COLUMNS = ("step", "query", "response", "score", "kl", "query_tokens", "response_tokens", "ends_with_eos",
                   "response_ids", "gold")


def rollout_table(gathered: dict[str, list], kl) -> dict[str, list]:
    """A step's rollouts file: the columns gathered from every process (`gather_columns`) and the per-sample KL of
    step()'s stats (``objective/kl_dist``, gathered by step() itself, in the same process order), in
    `ROLLOUT_COLUMNS`'s order."""
    columns = gathered | {"kl": np.asarray(kl, dtype=float).tolist()}
    return {key: columns[key] for key in ROLLOUT_COLUMNS if key in columns} | columns  # any other one after them


def gather_columns(columns: dict[str, list], accelerator) -> dict[str, list]:
    """Each process's equal-length columns, concatenated in process order; the columns themselves on one."""
    if accelerator.num_processes == 1:
        return columns
    parts = gather_object([columns])  # one dict per process
    return {key: [value for part in parts for value in part[key]] for key in columns}


class StepTables:
    """The per-step tables: stats.parquet (every step() stat but the wall-clock `time/*` ones), timings.csv (those),
    curves.csv, eval.csv (the held-out evaluations); and what watching the run found (stages/ppo/watch.py): the first
    step's health, the alerts, the best policy so far, where the run stopped. Rewritten (atomically) in the checkpoint
    directory after each step, checkpointed with the trainer, and published at the end."""

    def __init__(self):
        self.stats: list[dict] = []
        self.timings: list[dict] = []
        self.curves: list[dict] = []
        self.evals: list[dict] = []
        self.alerts: list[dict] = []
        self.first_health: dict | None = None
        self.best: dict | None = None  # {"step", "value"}: the policy keep: best holds so far
        self.stopped: dict | None = None  # {"step", "reason"}: an alert stopped the run (watch.on_alert: stop)
        self.heldout: dict | None = None  # {"prompts", "in_train"}: what the held-out evaluations are over

    def append(self, step: int, stats: dict, scores: list[float], gold: list[float] | None) -> None:
        keys = sorted(stats)
        self.stats.append({"step": step} | {k: to_python(stats[k]) for k in keys if not k.startswith("time/")})
        self.timings.append({"step": step} | {k: float(stats[k]) for k in keys if k.startswith("time/")})
        self.curves.append({"step": step, "reward_mean": float(np.mean(scores))}
                           | ({"gold_mean": float(np.mean(gold))} if gold else {})
                           | {name: float(stats.get(key, "nan")) for name, key in CURVES.items()}  # nan: no critic
                           | {f"reward_{key.split('/')[1]}": float(value) for key, value in stats.items()
                              if key.startswith("rewards/") and key.endswith("/mean")})  # scorer.functions' own

    def write(self, paths: dict[Path, Path]) -> None:
        """Write each table to `paths[its final path]` (the final path itself, or the working copy)."""
        write_parquet({key: [row[key] for row in self.stats] for key in self.stats[0]}, paths[PPO_STATS])
        write_csv(self.timings, paths[PPO_TIMINGS])
        write_csv(self.curves, paths[PPO_CURVES])
        write_csv(self.evals, paths[PPO_EVAL], columns=None if self.evals else ["step"])

    def state(self) -> dict:
        """The rows so far and what watching found, for a checkpoint (plain Python values)."""
        return {"stats": self.stats, "timings": self.timings, "curves": self.curves, "evals": self.evals,
                "alerts": self.alerts, "first_health": self.first_health, "best": self.best, "stopped": self.stopped,
                "heldout": self.heldout}

    @classmethod
    def from_state(cls, state: dict) -> StepTables:
        tables = cls()
        for name, value in state.items():
            setattr(tables, name, value)
        return tables


def to_python(value):
    """A step() stat as a Parquet-friendly value: a float, or a list of floats for histograms."""
    array = np.asarray(value, dtype=float)
    return float(array) if array.ndim == 0 else array.ravel().tolist()

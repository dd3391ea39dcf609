"""The page's accuracy table (evaluate's `accuracy` group, stages/shared/accuracy.py): per reward, SFT and PPO side by
side with the paired standard error of their difference, and where the run's curve of it is."""

from __future__ import annotations

import html

from stages.report.html import table
from stages.shared.heldout import heldout_words
from stages.shared.params import EvaluateParams

ACROSS_THE_RUN = ('<p class="note">Across the run: the held-out evaluations of the ppo stage (data/ppo/eval.csv, '
                  "charted in PPO, step by step) sample one response per prompt, so for a 0/1 reward their mean "
                  "is the sampled accuracy (pass@1) at each evaluation; greedy accuracy and pass@k are measured here, "
                  "at the end only.</p>")


def accuracy_section(metrics: dict, evaluate: EvaluateParams, scorer: str) -> str:
    """Rows of (reward, statistic): the base model (where evaluate had one: `evaluate.base`), SFT, PPO, PPO - SFT, the
    paired standard error of PPO - SFT over the prompts.
    ``scorer``: the title of the scorer whose rewards are ``reward``. Empty where evaluate made no table (off)."""
    if "accuracy" not in metrics:
        return ""
    passes = "reward = 1" if evaluate.success_threshold is None else f"reward >= {evaluate.success_threshold:g}"
    n = evaluate.samples_per_prompt
    rows, base = [], all("base" in entry for entry in metrics["accuracy"].values())
    for name, entry in metrics["accuracy"].items():
        reward = {"reward": f"{scorer} score", "gold": "gold score"}.get(
            name, f"scorer function {name.removeprefix('reward_')}" if name.startswith("reward_") else f"judge {name}")
        for statistic, sft in entry["sft"].items():
            se = entry["paired_se"][statistic]
            rows.append([reward, statistic_words(statistic, n, passes),  # a greedy-only base: its greedy row
                         *([entry["base"].get(statistic, "")] if base else []),
                         sft, entry["ppo"][statistic], entry["ppo"][statistic] - sft,
                         "n/a (one prompt)" if se is None else se])
    header = ["reward", "over the held-out prompts", *(["base model"] if base else []), "SFT", "PPO", "PPO - SFT",
              "paired standard error of PPO - SFT"]
    return "<h3>Accuracy and pass@k</h3>" + table(rows, header) + ACROSS_THE_RUN


def statistic_words(statistic: str, n: int, passes: str) -> str:
    """``mean``, ``greedy``, ``pass@k`` in words, with what counts as a pass (``passes``) and ``n``, the samples per
    prompt."""
    if statistic == "mean":
        return f"mean reward of {n} sampled responses per prompt"
    if statistic == "greedy":
        return f"greedy accuracy (one greedy response per prompt, a pass: {passes})"
    return f"{statistic} of {n} samples (unbiased estimator; a pass: {passes})"


def heldout_line(metrics: dict) -> str:
    """What the held-out figures are over: how many prompts, and how many of them are training prompts (evaluate's
    ``heldout``; none by construction). Empty for metrics written before evaluate measured it."""
    if "heldout" not in metrics:
        return ""
    held = metrics["heldout"]
    return f"<p>Over {html.escape(heldout_words(held['prompts'], held['in_train']))}.</p>"

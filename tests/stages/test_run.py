"""Settings whose effect reaches several stages, run one after another on a copy of the tiny run (see
conftest.tiny_run): a callable scorer through ppo, evaluate and the report; real data (no gold score) through ppo and
evaluate. Each stage's own tests are in its ``test_<stage>.py``."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pandas as pd
import pytest

from stages import ppo
from stages.shared import scoring
from stages.shared.artifacts import EVAL_METRICS, EVAL_SAMPLES, PPO_CURVES, PPO_ROLLOUTS
from stages.shared.params import ScorerParams


def test_evaluate_and_the_report_measure_the_scorer_the_policy_was_trained_on(tiny_run, tiny_params, tmp_path,
                                                                              monkeypatch):
    """scorer.source: callable: evaluate's reward and win rate are the callable's on the held-out samples (not the
    reward model's), the gold score stays beside them, and the report names the callable wherever it shows them."""
    from stages import evaluate, report
    from stages.shared.artifacts import REPORT
    from tests.conftest import params_per_stage

    (tmp_path / "word_scores.py").write_text("def words(texts):\n    return [float(len(t.split())) for t in texts]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints", "ppo", "eval", "report", "logs"))
    scorer = ScorerParams(source="callable", name="word_scores:words", label="POSITIVE", batch_size=8)
    params = params_per_stage(dataclasses.replace(tiny_params, scorer=scorer))  # each stage: what dvc.yaml tracks
    ppo.run(params["ppo"], root)
    summary = evaluate.run(params["evaluate"], root)
    report.run(params["report"], root)

    metrics = json.loads((root / EVAL_METRICS).read_text())
    samples = pd.read_parquet(root / EVAL_SAMPLES)
    by = {name: samples[samples["policy"] == name].reset_index(drop=True) for name in ("sft", "ppo")}
    words = {name: (s["query"] + s["response"]).str.split().str.len().astype(float) for name, s in by.items()}
    assert metrics["reward"] == pytest.approx(words["ppo"].mean(), abs=1e-12)
    assert metrics["sft"]["reward"] == pytest.approx(words["sft"].mean(), abs=1e-12)
    wins = (words["ppo"] > words["sft"]).sum() + 0.5 * (words["ppo"] == words["sft"]).sum()
    assert metrics["win_rate"] == wins / len(by["ppo"])
    assert metrics["gold"] == pytest.approx(by["ppo"]["gold"].mean(), abs=1e-12)
    reward_model = scoring.build_scorer(tiny_params, root)(list(by["ppo"]["query"] + by["ppo"]["response"]))
    assert abs(metrics["reward"] - sum(reward_model) / len(reward_model)) > 1  # what was reported before
    assert "reward (callable word_scores:words) " in summary

    page = (root / REPORT).read_text()
    assert "<td>callable word_scores:words score</td>" in page  # the evaluation table
    assert "Win rate of PPO over SFT (callable word_scores:words, ties half)" in page
    assert ">callable word_scores:words<" in page  # the legend of the reward curve (an SVG text element)
    assert page.count("<th>callable word_scores:words score</th>") == 2  # the side-by-side samples' two columns
    assert not any(label in page for label in (">reward model<", "reward model score", "RM score"))


def test_real_data_runs_have_no_gold_score(tiny_run, tiny_params, tmp_path):
    """Without the synthetic data the gold score is unknown: ppo and evaluate leave it out rather than guess."""
    from stages import evaluate

    real = dataclasses.replace(tiny_params.data.prompts, source="prompts.jsonl")
    params = dataclasses.replace(tiny_params, data=dataclasses.replace(tiny_params.data, prompts=real))
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root)
    ppo.run(params, root)
    evaluate.run(params, root)
    assert "gold" not in pd.read_parquet(root / PPO_ROLLOUTS).columns
    assert "gold_mean" not in pd.read_csv(root / PPO_CURVES).columns
    metrics = json.loads((root / EVAL_METRICS).read_text())
    assert set(metrics) == {"win_rate", "reward", "kl", "length", "sft", "heldout"}
    assert set(metrics["sft"]) == {"reward", "length"}

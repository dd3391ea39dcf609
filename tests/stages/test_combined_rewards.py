"""Several rewards, weighted (issue 47, item 4): `scorer.source: combined` sums `scorer.functions`, each with its
weight, a None left out as TRL's GRPOTrainer leaves it out, and each function's own mean and std reach the stats, the
curves, the held-out watch, evaluate and the report under its name."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pandas as pd
import pytest
import torch

from stages import evaluate, ppo, prepare, tokenize
from stages.shared.artifacts import EVAL_METRICS, EVAL_SAMPLES, PPO_CURVES, PPO_EVAL, PPO_STATS
from stages.shared.scoring import Combined, Row, component_stats, scored
from tests.stages.test_columns import WORDS, with_prompts, write_prompts, written_module

FUNCTIONS = '''
def exact(completions, answer, prompts, **kwargs):
    """1 where the row's answer is its prompt's, None on every third response (does not apply)."""
    from tests.stages.test_columns import answer_of
    return [None if i % 3 == 2 else float(a == answer_of(p)) for i, (p, a) in enumerate(zip(prompts, answer))]

def length(texts):
    return [len(t) / 100 for t in texts]

def never(completions, **kwargs):
    return [None] * len(completions)
'''


@pytest.fixture
def functions(tmp_path, monkeypatch):
    return written_module("weighted", FUNCTIONS, tmp_path, monkeypatch)


def test_the_weighted_sum_leaves_a_none_out_as_trl_does(tiny_params):
    """TRL's GRPOTrainer: rewards_per_func with NaN where a function returned None, then nansum(rewards * weights)."""
    per_function = {"a": [1.0, None, 0.5, None], "b": [2.0, 3.0, None, None], "c": [None, -1.0, 4.0, None]}
    weights = {"a": 1.0, "b": 0.5, "c": -2.0}
    def returning(values):
        return lambda completions: values

    combined = Combined({name: (returning(values), weights[name]) for name, values in per_function.items()})
    got = scored(combined, ["x"] * 4, tiny_params.scorer, "here", row=Row(["p"] * 4, ["c"] * 4, {}))
    table = torch.tensor([[math.nan if v is None else v for v in values] for values in per_function.values()]).T
    trl = torch.nansum(table * torch.tensor(list(weights.values())), dim=1)
    assert got == pytest.approx(trl.tolist())
    assert combined.last == per_function
    stats = component_stats(combined.last)
    assert stats["rewards/a/mean"] == 0.75 and stats["rewards/a/std"] == pytest.approx(math.sqrt(0.125))
    assert math.isnan(component_stats({"d": [None, None]})["rewards/d/mean"])  # applied to none: not measured


def combined_params(params, **functions):
    scorer = dataclasses.replace(params.scorer, source="combined", name=None, functions=functions)
    return dataclasses.replace(params, scorer=scorer)


def test_each_function_is_reported_under_its_own_name_through_ppo_evaluate_and_the_report(
        tiny_run, tiny_params, tmp_path, functions):
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints", "ppo", "eval", "report", "logs"))
    source = tmp_path / "qa.jsonl"
    write_prompts(source, [f"{w} {i}" for i in range(4) for w in WORDS])
    params = combined_params(with_prompts(tiny_params, source, n_eval_prompts=8),
                             exact={"name": "weighted:exact", "weight": 1.0},
                             length={"name": "weighted:length", "weight": 0.5})
    prepare.run(params, root)
    tokenize.run(params, root)
    ppo.run(params, root)
    stats = pd.read_parquet(root / PPO_STATS)
    for name in ("exact", "length"):
        assert {f"rewards/{name}/mean", f"rewards/{name}/std"} <= set(stats.columns)
    assert (stats["rewards/exact/mean"] == 1.0).all()  # each response against its own prompt's answer
    curves = pd.read_csv(root / PPO_CURVES)
    assert {"reward_exact", "reward_length"} <= set(curves.columns)
    rollouts = pd.concat(pd.read_parquet(p) for p in sorted((root / "data" / "ppo" / "rollouts").glob("*.parquet")))
    # the step's reward is the weighted sum, the exact reward left out where it did not apply
    expected = rollouts["reward_exact"].fillna(0.0) + 0.5 * rollouts["reward_length"]
    assert rollouts["score"].tolist() == pytest.approx(expected.tolist())
    if (root / PPO_EVAL).exists() and len(pd.read_csv(root / PPO_EVAL)):
        assert {"reward_exact", "reward_length"} <= set(pd.read_csv(root / PPO_EVAL).columns)
    evaluate.run(params, root)
    metrics = json.loads((root / EVAL_METRICS).read_text())
    assert metrics["reward_exact"] == 1.0 and metrics["sft"]["reward_exact"] == 1.0 and "reward_length" in metrics
    samples = pd.read_parquet(root / EVAL_SAMPLES)
    assert {"reward_exact", "reward_length"} <= set(samples.columns)
    assert samples["reward_exact"].isna().any()  # None where it did not apply, not 0
    from stages import report

    report.run(params, root)
    page = (root / "data" / "report" / "index.html").read_text()
    assert "Each reward function" in page and "combined exact+length: exact" in page
    # one sample per prompt (pass@1 alone): the accuracy table still has each function's row, from that sample
    one = dataclasses.replace(params, evaluate=dataclasses.replace(params.evaluate, samples_per_prompt=1,
                                                                   pass_at_k=[1], success_threshold=0.5))
    evaluate.run(one, root)
    table = json.loads((root / EVAL_METRICS).read_text())["accuracy"]
    assert list(table) == ["reward", "reward_exact", "reward_length"]
    first = pd.read_parquet(root / EVAL_SAMPLES).groupby("policy", sort=False)
    for policy, rows in first:
        for name in ("reward_exact", "reward_length"):
            assert table[name][policy]["pass@1"] == pytest.approx((rows[name].fillna(0.0) >= 0.5).mean())


def test_a_function_that_never_applies_reports_nothing_measured_and_adds_nothing(tiny_params, functions):
    combined = Combined({"never": (functions.never, 1.0), "length": (functions.length, 1.0)})
    got = scored(combined, ["ab", "abcd"], tiny_params.scorer, "here", row=Row(["p", "q"], ["ab", "abcd"], {}))
    assert got == [0.02, 0.04]
    assert math.isnan(component_stats(combined.last)["rewards/never/mean"])

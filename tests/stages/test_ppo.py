"""The ppo stage (stages/ppo/) on tiny params (the shared run, see conftest.tiny_run, and reruns in a copy of it): its
outputs and their columns, byte-identical reruns, the group estimators (GRPO, Dr. GRPO, DAPO) and what it says of them,
a callable scorer, ppo.steps rounded up, and prompts tokenized by another tokenizer refused."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys

import pandas as pd
import pyarrow.parquet as pq
import pytest
from transformers import AutoModelForCausalLM

from stages import ppo, report, sft, tokenize
from stages.shared.artifacts import (
    EVAL_METRICS,
    PPO_CURVES,
    PPO_METRICS,
    PPO_MODEL,
    PPO_ROLLOUTS,
    PPO_STATS,
    PPO_TIMINGS,
    REPORT,
    SFT_MODEL,
)
from stages.shared.params import ScorerParams
from stages.shared.runtime import StageError


def test_ppo_writes_rollouts_stats_curves_and_a_plain_model(tiny_run, tiny_params):
    steps = -(-tiny_params.ppo["steps"] // tiny_params.ppo["batch_size"])
    files = sorted(p.name for p in (tiny_run / PPO_ROLLOUTS).iterdir())
    assert files == [f"step-{i:05d}.parquet" for i in range(steps)]
    rollouts = pd.read_parquet(tiny_run / PPO_ROLLOUTS)
    expected = {"step", "query", "response", "score", "kl", "query_tokens", "response_tokens", "gold"}
    assert expected <= set(rollouts.columns)
    assert len(rollouts) == steps * tiny_params.ppo["batch_size"]
    assert (rollouts["response_tokens"] <= tiny_params.generation.max_new_tokens).all()
    stats = pd.read_parquet(tiny_run / PPO_STATS)
    assert stats["step"].tolist() == list(range(steps))
    assert {"objective/kl", "objective/entropy", "ppo/loss/value", "ppo/policy/clipfrac"} <= set(stats.columns)
    assert not any(c.startswith("time/") for c in stats.columns)  # wall-clock stats go to timings.csv
    assert "time/ppo/total" in pd.read_csv(tiny_run / PPO_TIMINGS).columns
    curves = pd.read_csv(tiny_run / PPO_CURVES)
    assert {"step", "reward_mean", "gold_mean", "kl", "entropy", "loss_value"} <= set(curves.columns)
    metrics = json.loads((tiny_run / PPO_METRICS).read_text())
    assert metrics["steps"] == steps
    assert metrics["resolved"] == tiny_params.ppo_config.resolved.to_dict()  # what the run trained with, recorded
    assert metrics["resolved"]["kl_in"] == "reward" and metrics["resolved"]["policy_loss"] == "clip"
    model = AutoModelForCausalLM.from_pretrained(tiny_run / PPO_MODEL)  # plain transformers, no value head class
    assert model.config.vocab_size == AutoModelForCausalLM.from_pretrained(tiny_run / SFT_MODEL).config.vocab_size


def test_rollouts_files_keep_their_columns_in_order(tiny_run):
    """The columns of every rollouts file, in the order the published files have them: the order is part of their
    bytes (DVC's hashes), and the loop builds the KL column apart from the others (from step()'s gathered stats)."""
    expected = ["step", "query", "response", "score", "kl", "query_tokens", "response_tokens", "ends_with_eos",
                "response_ids", "gold"]
    for path in sorted((tiny_run / PPO_ROLLOUTS).iterdir()):
        assert pq.read_schema(path).names == expected, path.name


def test_ppo_is_deterministic_on_cpu(tiny_run, tiny_params, tmp_path):
    """Same inputs and seed: byte-identical policy, rollouts and stats (so DVC sees no change)."""
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints"))  # a rerun, not a resume
    ppo.run(tiny_params, root)
    outputs = [PPO_MODEL / "model.safetensors", PPO_STATS, PPO_CURVES, *sorted((tiny_run / PPO_ROLLOUTS).iterdir())]
    for path in outputs:
        rel = path.relative_to(tiny_run) if path.is_absolute() else path
        assert (root / rel).read_bytes() == (tiny_run / rel).read_bytes(), rel


def test_ppo_with_a_group_estimator_samples_each_prompt_g_times_within_the_same_budget(tiny_run, tiny_params,
                                                                                        tmp_path):
    """`-S ppo.advantage_estimator=grpo -S ppo.num_generations=4` and nothing else: the same rollouts in all
    (ppo.steps), from steps / 4 distinct prompts, each sampled 4 times in a row within its step; no critic stats."""
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints", "ppo", "eval", "report", "logs"))
    shutil.rmtree(root / PPO_MODEL, ignore_errors=True)
    group = 4
    params = dataclasses.replace(tiny_params, ppo={**tiny_params.ppo, "advantage_estimator": "grpo",
                                                   "num_generations": group})
    ppo.run(params, root)
    rollouts = pd.read_parquet(root / PPO_ROLLOUTS)
    assert len(rollouts) == tiny_params.ppo["steps"]
    blocks = rollouts["query"].groupby(rollouts.index // group)
    assert (blocks.nunique() == 1).all() and rollouts["query"].nunique() == len(rollouts) // group
    assert (rollouts.groupby("step").size() == tiny_params.ppo["batch_size"]).all()
    stats = pd.read_parquet(root / PPO_STATS)
    assert not [c for c in stats.columns if c.startswith(("ppo/val/", "ppo/returns/")) or c == "ppo/loss/value"]
    assert {"ppo/loss/policy", "objective/kl"} <= set(stats.columns)
    assert pd.read_csv(root / PPO_CURVES)["loss_value"].isna().all()  # no critic: nothing to draw


def test_dr_grpo_skips_the_reference_and_says_its_kl_was_not_measured(tiny_run, tiny_params, tmp_path):
    """Dr. GRPO's KL has coefficient 0: the ppo stage runs without the reference pass, its KL columns are NaN (not a
    made-up 0), its summary says so, and the report draws the run."""
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints", "ppo", "report", "logs"))
    shutil.rmtree(root / PPO_MODEL, ignore_errors=True)
    params = dataclasses.replace(tiny_params, ppo={**tiny_params.ppo, "advantage_estimator": "dr_grpo",
                                                   "num_generations": 4})
    summary = ppo.run(params, root)
    assert "kl not measured (coefficient 0: no reference pass)" in summary, summary
    assert pd.read_csv(root / PPO_CURVES)["kl"].isna().all()
    assert pd.read_parquet(root / PPO_ROLLOUTS)["kl"].isna().all()
    assert pd.read_parquet(root / PPO_STATS)["ppo/loss/policy"].notna().all()
    report.run(params, root)
    assert (root / REPORT).stat().st_size > 0


def test_ppo_with_bf16_weights_trains_through_masters_and_evaluate_reads_its_policy(tiny_run, tiny_params, tmp_path):
    """`-S ppo.weights_dtype=bfloat16`: the stage trains bf16 weights through float32 masters (PPOConfig.weights_dtype)
    and saves a policy that plain transformers loads in bf16 and evaluate judges."""
    import torch

    from stages import evaluate

    root = copy_for_ppo(tiny_run, tmp_path)
    params = dataclasses.replace(tiny_params, ppo={**tiny_params.ppo, "weights_dtype": "bfloat16"})
    ppo.run(params, root)
    stats = pd.read_parquet(root / PPO_STATS)
    assert stats["ppo/loss/total"].notna().all() and len(stats) == len(pd.read_parquet(tiny_run / PPO_STATS))
    model = AutoModelForCausalLM.from_pretrained(root / PPO_MODEL, dtype="auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    evaluate.run(params, root)
    assert json.loads((root / EVAL_METRICS).read_text())


def test_ppo_with_a_callable_scorer(tiny_run, tiny_params, tmp_path, monkeypatch):
    """scorer.source: callable takes the list of texts (here: 1.0 per exclamation mark)."""
    (tmp_path / "my_scores.py").write_text("def excitement(texts):\n    return [float(t.count('!')) for t in texts]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root)
    shutil.rmtree(root / "data" / "models" / "reward")  # not needed by this scorer
    scorer = ScorerParams(source="callable", name="my_scores:excitement", label="POSITIVE", batch_size=8)
    ppo.run(dataclasses.replace(tiny_params, scorer=scorer), root)
    rollouts = pd.read_parquet(root / PPO_ROLLOUTS)
    assert (rollouts["score"] == rollouts["response"].str.count("!")).all()


def copy_for_ppo(tiny_run, tmp_path):
    """A project holding what the ppo stage reads (and none of what it writes)."""
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints", "ppo", "eval", "report", "logs"))
    shutil.rmtree(root / PPO_MODEL, ignore_errors=True)
    return root


def test_groups_without_a_reward_spread_are_warned_about_once(tiny_run, tiny_params, tmp_path, monkeypatch, capfd):
    """GRPO with a scorer that gives most prompts' samples one score learns nothing from them: the share is in the
    stats every step, and the log says so once (not at every step)."""
    (tmp_path / "flat_scores.py").write_text("def score(texts):\n    return [float(len(texts) > 99)] * len(texts)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    root = copy_for_ppo(tiny_run, tmp_path)
    params = dataclasses.replace(
        tiny_params, scorer=ScorerParams(source="callable", name="flat_scores:score", label="POSITIVE", batch_size=8),
        ppo={**tiny_params.ppo, "advantage_estimator": "grpo", "num_generations": 4})
    ppo.run(params, root)
    assert (pd.read_parquet(root / PPO_STATS)["ppo/frac_reward_zero_std"] == 1.0).all()
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: ppo: step 1: in 100% of the prompts every sample got the same score, so their "
                        "advantages are 0 and they teach nothing (ppo/frac_reward_zero_std in data/ppo/stats.parquet); "
                        "a scorer with finer grades, a higher generation.temperature or a larger ppo.num_generations "
                        "gives them a signal"]


def test_scores_far_outside_a_sane_scale_are_warned_about_once(tiny_run, tiny_params, tmp_path, monkeypatch, capfd):
    """A scorer returning values of 1e6 trains, but the log says once (not at every step) that the scale is far
    outside a reward's (past stages.ppo.loop.LARGE_SCORE) and what rescales it; with ppo.use_score_scaling on, or a
    ppo.score_clip within that scale, nothing is said."""
    from stages.ppo.loop import LARGE_SCORE, warn_if_large_scores

    (tmp_path / "huge_scores.py").write_text("def score(texts):\n    return [1e6 * (len(t) % 2) for t in texts]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    root = copy_for_ppo(tiny_run, tmp_path)
    scorer = ScorerParams(source="callable", name="huge_scores:score", label="POSITIVE", batch_size=8)
    ppo.run(dataclasses.replace(tiny_params, scorer=scorer), root)
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: ppo: step 1: scores reach 1e+06 in magnitude (over 1000), a scale at which the KL "
                        "penalty weighs nothing and the value loss grows with its square; set ppo.use_score_scaling: "
                        "true or ppo.score_clip, or scale the scorer's output down (scores of a few units train best)"]
    config = tiny_params.ppo_config
    assert not warn_if_large_scores([LARGE_SCORE, -LARGE_SCORE], 0, True, config)  # at the threshold: sane
    assert not warn_if_large_scores([1e6], 0, True, dataclasses.replace(config, use_score_scaling=True))
    assert not warn_if_large_scores([1e6], 0, True, dataclasses.replace(config, score_clip=10.0))
    assert warn_if_large_scores([1e6], 0, True, dataclasses.replace(config, score_clip=1e5))
    assert capfd.readouterr().err.count("warning:") == 1


def test_dapo_trains_on_nothing_rather_than_on_groups_without_a_spread(tiny_run, tiny_params, tmp_path, monkeypatch,
                                                                       capfd):
    """DAPO's dynamic sampling leaves every group of one score out of the loss: with a scorer that gives every sample
    the same score, every response is left out, each mini-batch's loss is 0 (not 0/0), and the log
    says what was done."""
    (tmp_path / "flat_scores.py").write_text("def score(texts):\n    return [1.0] * len(texts)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    root = copy_for_ppo(tiny_run, tmp_path)
    params = dataclasses.replace(
        tiny_params, scorer=ScorerParams(source="callable", name="flat_scores:score", label="POSITIVE", batch_size=8),
        ppo={**tiny_params.ppo, "advantage_estimator": "dapo", "num_generations": 4,
             "overlong_buffer_len": 0})  # no length penalty: it would give long responses other scores
    ppo.run(params, root)
    stats = pd.read_parquet(root / PPO_STATS)
    assert (stats["ppo/frac_responses_left_out"] == 1.0).all() and (stats["ppo/loss/policy"] == 0.0).all()
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "so ppo.dynamic_sampling left them out of the loss, which trained on the others " \
        "(ppo/frac_responses_left_out)" in warnings[0]


def test_the_summary_says_its_numbers_are_the_training_batches():
    """The summary's reward and KL are the first and last training batches' (evaluate reports the held-out ones): it
    says so, with the steps counted from 1 as the progress line counts them."""
    from stages.ppo.tables import StepTables

    tables = StepTables()
    for step, (reward, kl) in enumerate([(-1.18, 0.0), (0.52, 1.31), (1.42, 6.95)]):
        tables.curves.append({"step": step, "reward_mean": reward, "kl": kl})
    assert ppo.summary(tables, 0) == ("3 steps, reward -1.18 -> 1.42, kl 6.95 (training batches: step 1's -> step "
                                      "3's; held-out: evaluate) -> data/models/ppo")


def test_steps_that_are_not_a_whole_number_of_batches_are_said(tiny_run, tiny_params, tmp_path, capfd):
    """Legacy rounds ppo.steps up to whole step() calls (total_ppo_epochs): kept, and said."""
    root = copy_for_ppo(tiny_run, tmp_path)
    summary = ppo.run(dataclasses.replace(tiny_params, ppo={**tiny_params.ppo, "steps": 10}), root)
    assert summary.startswith("2 steps, reward")
    assert "note: ppo: ppo.steps (10) is not a multiple of ppo.batch_size (8): running 2 steps of 8 rollouts (16 in " \
           "all)\n" in capfd.readouterr().err


def test_prompts_tokenized_by_another_tokenizer_are_refused(tiny_run, tiny_params, tmp_path):
    """`rlhf sft` with a new vocabulary, then `rlhf ppo` without `rlhf tokenize`: the token ids on disk mean other
    tokens now (or none: an IndexError deep in the embedding). The tokenizer they were made with is recorded with
    them, and checked."""
    root = copy_for_ppo(tiny_run, tmp_path)
    sft.run(dataclasses.replace(tiny_params, model=dataclasses.replace(tiny_params.model, vocab_size=290)), root)
    with pytest.raises(StageError, match=r"data/tokenized/train.parquet: tokenized with another tokenizer than "
                                         r".*data/models/sft's \(it was saved again after tokenize ran\); rerun "
                                         r"tokenize \(`rlhf tokenize`, or `dvc repro`\)$"):
        ppo.run(tiny_params, root)
    tokenize.run(tiny_params, root)
    ppo.run(tiny_params, root)  # tokenized again: accepted


def test_scorer_input_response_gives_the_scorer_the_responses_alone(tiny_run, tiny_params, tmp_path, monkeypatch):
    """scorer.input: response: the scorer sees each response without its prompt (query_response, the default: both,
    as the seed scores)."""
    (tmp_path / "seen_scores.py").write_text("SEEN = []\ndef score(texts):\n    SEEN.extend(texts)\n"
                                             "    return [float(len(t)) for t in texts]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "seen_scores", raising=False)
    root = copy_for_ppo(tiny_run, tmp_path)
    scorer = ScorerParams(source="callable", name="seen_scores:score", label="POSITIVE", batch_size=8,
                          input="response")
    no_heldout = dataclasses.replace(tiny_params.watch, eval_every=0)  # the scorer sees the rollouts alone
    ppo.run(dataclasses.replace(tiny_params, scorer=scorer, watch=no_heldout), root)
    rollouts = pd.read_parquet(root / PPO_ROLLOUTS)
    import seen_scores

    assert seen_scores.SEEN == rollouts["response"].tolist()  # the responses as generated, in order, no prompt
    assert (rollouts["score"] == rollouts["response"].str.len()).all()

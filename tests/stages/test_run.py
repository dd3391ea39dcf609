"""sft, reward, tokenize, ppo, evaluate run directly on tiny params (one shared run, see conftest.tiny_run)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from stages import ppo, report, scoring, sft, tokenize
from stages.artifacts import (
    EVAL_METRICS,
    EVAL_SAMPLES,
    PPO_CURVES,
    PPO_METRICS,
    PPO_MODEL,
    PPO_ROLLOUTS,
    PPO_STATS,
    PPO_TIMINGS,
    RAW_PAIRS,
    RAW_SFT,
    REPORT,
    REWARD_METRICS,
    REWARD_MODEL,
    SFT_METRICS,
    SFT_MODEL,
    TOKENIZED_EVAL,
    TOKENIZED_TRAIN,
)
from stages.params import ScorerParams
from stages.runtime import StageError


def test_sft_model_loads_with_plain_transformers(tiny_run, tiny_params):
    tokenizer = AutoTokenizer.from_pretrained(tiny_run / SFT_MODEL)
    model = AutoModelForCausalLM.from_pretrained(tiny_run / SFT_MODEL)
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert model.config.n_layer == tiny_params.model.n_layer
    text = "the movie was very good, but the plot was slow."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # byte-level BPE: exact round trip
    assert set(json.loads((tiny_run / SFT_METRICS).read_text())) >= {"train_loss", "eval_loss"}


def test_sft_is_deterministic_on_cpu(tiny_run, tiny_params, tmp_path):
    (tmp_path / RAW_SFT).parent.mkdir(parents=True)
    shutil.copy(tiny_run / RAW_SFT, tmp_path / RAW_SFT)
    sft.run(tiny_params, tmp_path)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / SFT_MODEL / name).read_bytes() == (tiny_run / SFT_MODEL / name).read_bytes(), name


def test_reward_model_has_one_scalar_head(tiny_run, tiny_params):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_run / REWARD_MODEL)
    assert model.config.num_labels == 1
    assert AutoTokenizer.from_pretrained(tiny_run / REWARD_MODEL).model_max_length == tiny_params.reward.max_length


def test_reward_metrics_are_the_saved_model_s_on_the_held_out_pairs(tiny_run, tiny_params):
    """accuracy is the fraction of held-out pairs (the stage's seeded split) that the saved RM orders right."""
    import random

    from stages.models import load_reward_model, reward_scores

    pairs = pd.read_parquet(tiny_run / "data" / "raw" / "pairs.parquet")
    order = list(range(len(pairs)))
    random.Random(f"{tiny_params.seed}-reward").shuffle(order)
    held_out = pairs.iloc[order[:round(len(pairs) * tiny_params.reward.eval_fraction)]]
    model, tokenizer = load_reward_model(tiny_run / REWARD_MODEL)
    chosen = reward_scores(model, tokenizer, (held_out["prompt"] + held_out["chosen"]).tolist(), 8)
    rejected = reward_scores(model, tokenizer, (held_out["prompt"] + held_out["rejected"]).tolist(), 8)
    metrics = json.loads((tiny_run / REWARD_METRICS).read_text())
    assert metrics["pairs"] == {"train": len(pairs) - 16, "eval": len(held_out)} and len(held_out) == 16
    assert metrics["accuracy"] == sum(c > r for c, r in zip(chosen, rejected)) / 16
    assert metrics["margin"] == pytest.approx(sum(c - r for c, r in zip(chosen, rejected)) / 16, abs=1e-6)
    assert set(metrics["train"]) == {"accuracy", "loss"}


def test_tokenize_truncates_filters_and_round_trips(tiny_run, tiny_params):
    tokenizer = AutoTokenizer.from_pretrained(tiny_run / SFT_MODEL)
    for path in (TOKENIZED_TRAIN, TOKENIZED_EVAL):
        frame = pd.read_parquet(tiny_run / path)
        assert list(frame.columns) == ["query", "input_ids"] and len(frame)
        lengths = frame["input_ids"].map(len)
        assert lengths.between(tiny_params.tokenize.min_query_tokens, tiny_params.tokenize.max_query_tokens).all()
        assert all(tokenizer.decode(ids) == q for q, ids in zip(frame["query"], frame["input_ids"]))


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
    assert json.loads((tiny_run / PPO_METRICS).read_text())["steps"] == steps
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


def test_evaluate_metrics_are_those_of_its_samples(tiny_run, tiny_params):
    """metrics.json summarises samples.parquet: each policy's means, and the win rate over the same prompts."""
    metrics = json.loads((tiny_run / EVAL_METRICS).read_text())
    samples = pd.read_parquet(tiny_run / EVAL_SAMPLES)
    n = tiny_params.evaluate.n_prompts
    assert samples.groupby("policy").size().to_dict() == {"ppo": n, "sft": n}
    by = {name: samples[samples["policy"] == name].reset_index(drop=True) for name in ("sft", "ppo")}
    assert (by["sft"]["query"] == by["ppo"]["query"]).all()
    ppo, sft = by["ppo"], by["sft"]
    assert list(metrics) == ["win_rate", "gold", "reward", "kl", "length", "sft"]  # the top level: the PPO policy's
    means = {"gold": "gold", "reward": "score", "kl": "kl_to_sft", "length": "response_tokens"}
    assert {k: metrics[k] for k in means} == pytest.approx({k: ppo[c].mean() for k, c in means.items()}, abs=1e-12)
    assert metrics["sft"] == pytest.approx({k: sft[c].mean() for k, c in means.items() if k != "kl"}, abs=1e-12)
    assert (sft["kl_to_sft"] == 0).all()  # KL(sft || sft): left out of the metrics
    wins = (by["ppo"]["score"] > by["sft"]["score"]).sum() + 0.5 * (by["ppo"]["score"] == by["sft"]["score"]).sum()
    assert metrics["win_rate"] == wins / n


def test_evaluate_metrics_by_hand():
    from stages.artifacts import evaluation_metrics, policy_means
    from stages.evaluate import policy_metrics, win_rate

    rows = {"score": [1.0, -2.0, 0.5, 3.0], "kl_to_sft": [0.0, 0.25, 0.5, 0.25], "response_tokens": [3, 5, 4, 8],
            "gold": [1, -1, 0, 2]}
    # score (1 - 2 + 0.5 + 3) / 4 = 0.625; kl 1.0 / 4 = 0.25; length 20 / 4 = 5; gold 2 / 4 = 0.5
    ppo = policy_metrics(rows, ["gold"])
    assert ppo == {"gold": 0.5, "reward": 0.625, "kl": 0.25, "length": 5.0}
    assert "gold" not in policy_metrics(rows)  # only the judges named
    sft = {"gold": 0.0, "reward": -1.0, "kl": 0.0, "length": 4.0}
    metrics = evaluation_metrics(ppo, sft, 0.75)
    assert metrics == {"win_rate": 0.75, **ppo, "sft": {"gold": 0.0, "reward": -1.0, "length": 4.0}}
    assert policy_means(metrics, "ppo") == ppo and policy_means(metrics, "sft") == sft
    # ppo vs sft per prompt: 2 > 1 win, 1 = 1 tie, 1 < 2 loss, 0 = 0 tie: (1 + 0.5 + 0 + 0.5) / 4
    assert win_rate([2.0, 1.0, 1.0, 0.0], [1.0, 1.0, 2.0, 0.0]) == 0.5
    # a tie counts half, not as a win (>= would give 1.0) nor as nothing (dropping ties would give 0.5)
    assert win_rate([2.0, 2.0], [1.0, 2.0]) == 0.75


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


def test_evaluate_and_the_report_measure_the_scorer_the_policy_was_trained_on(tiny_run, tiny_params, tmp_path,
                                                                              monkeypatch):
    """scorer.source: callable: evaluate's reward and win rate are the callable's on the held-out samples (not the
    reward model's), the gold score stays beside them, and the report names the callable wherever it shows them."""
    from stages import evaluate, report
    from stages.artifacts import REPORT
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


JUDGES = """
def vowels(texts):
    return [float(sum(c in "aeiou" for c in t)) for t in texts]


def words(texts):
    return [float(len(t.split())) for t in texts]
"""


def test_evaluate_reports_each_judge_as_a_metric_and_a_samples_column(tiny_run, tiny_params, tmp_path, monkeypatch):
    """evaluate.judges, scorers the policy never trained on: each is a column of data/eval/samples.parquet (its score of
    each sample's query + response) and a metric of each policy (their mean), beside the scorer's; one named `gold`
    takes the place of the synthetic data's lexicon (as the example's VADER does)."""
    from stages import evaluate
    from stages.synthetic import gold_score
    from tests.conftest import params_per_stage

    (tmp_path / "my_judges.py").write_text(JUDGES)
    monkeypatch.syspath_prepend(str(tmp_path))
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints", "eval", "report", "logs"))
    judges = {"gold": "my_judges:vowels", "words": "my_judges:words"}
    params = dataclasses.replace(tiny_params, evaluate=dataclasses.replace(tiny_params.evaluate, judges=judges))
    summary = evaluate.run(params_per_stage(params)["evaluate"], root)  # evaluate tracks the evaluate section

    metrics = json.loads((root / EVAL_METRICS).read_text())
    samples = pd.read_parquet(root / EVAL_SAMPLES)
    assert list(samples.columns) == ["policy", "query", "response", "score", "kl_to_sft", "response_tokens", "gold",
                                     "words"]
    assert list(metrics) == ["win_rate", "gold", "words", "reward", "kl", "length", "sft"]
    assert list(metrics["sft"]) == ["gold", "words", "reward", "length"]
    for policy, means in (("ppo", metrics), ("sft", metrics["sft"])):
        texts = (samples["query"] + samples["response"])[samples["policy"] == policy]
        vowels = texts.map(lambda t: sum(c in "aeiou" for c in t)).astype(float)
        words = texts.str.split().str.len().astype(float)
        assert samples.loc[texts.index, "gold"].tolist() == vowels.tolist()
        assert samples.loc[texts.index, "words"].tolist() == words.tolist()
        assert means["gold"] == pytest.approx(vowels.mean(), abs=1e-12)
        assert means["words"] == pytest.approx(words.mean(), abs=1e-12)
        assert means["gold"] != pytest.approx(np.mean([gold_score(t) for t in texts]))  # not the lexicon's
    assert f", words {metrics['sft']['words']:.2f} -> {metrics['words']:.2f}," in summary
    # the report: a row per judge (the gold score named by its function), and the judges beside each sample's score
    from stages import report

    report.run(params_per_stage(params)["report"], root)
    page = (root / "data" / "report" / "index.html").read_text()
    assert "<td>gold score (my_judges:vowels)</td>" in page and "<td>judge words (my_judges:words)</td>" in page
    assert "<th>SFT response</th><th>RM score</th><th>gold</th><th>words</th><th>PPO response</th>" in page


def test_a_judge_that_fails_is_one_line_naming_it(tiny_params, tmp_path, monkeypatch):
    """A judge that cannot be imported, or whose scores are not finite numbers, stops evaluate with one line naming
    the judge, as the scorer's problems do."""
    from stages.evaluate import judge_functions, scores_of

    (tmp_path / "odd_judges.py").write_text(JUDGES + "\n\ndef broken(texts):\n    return [float('nan')] * len(texts)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with_judges = lambda judges: dataclasses.replace(  # noqa: E731
        tiny_params, evaluate=dataclasses.replace(tiny_params.evaluate, judges=judges))
    with pytest.raises(StageError, match=r"evaluate.judges.mine 'no_such_module:score' is not an importable "
                                         r"'module:function'"):
        judge_functions(with_judges({"mine": "no_such_module:score"}))
    with pytest.raises(StageError, match=r"odd_judges has no function 'nothing'"):
        judge_functions(with_judges({"mine": "odd_judges:nothing"}))
    params = with_judges({"mine": "odd_judges:broken"})
    fn = judge_functions(params)["mine"]
    with pytest.raises(StageError) as err:
        scores_of(fn, ["a b", "c"], params, "ppo", who="judge mine")
    assert str(err.value) == ("the ppo policy's samples 1-2: judge mine returned nan for text 0; scores must be finite "
                              "numbers")


def test_pipeline_scorer_reads_the_named_label(tiny_run, tiny_params, tmp_path):
    """scorer.source: pipeline, as in the seed: a text-classification model's raw score of one label."""
    labels = {0: "NEGATIVE", 1: "POSITIVE"}
    model = AutoModelForSequenceClassification.from_pretrained(
        tiny_run / SFT_MODEL, num_labels=2, id2label=labels, label2id={v: k for k, v in labels.items()})
    tokenizer = AutoTokenizer.from_pretrained(tiny_run / SFT_MODEL)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp_path / "clf")
    tokenizer.save_pretrained(tmp_path / "clf")
    scorer = ScorerParams(source="pipeline", name=str(tmp_path / "clf"), label="POSITIVE", batch_size=4)
    score = scoring.build_scorer(dataclasses.replace(tiny_params, scorer=scorer), tiny_run)
    texts = ["the movie was good.", "the plot was bad.", "the cast"]
    scores = score(texts)
    logits = model.eval()(**tokenizer(texts[:1], return_tensors="pt")).logits.detach()
    assert len(scores) == 3 and scores[0] == pytest.approx(float(logits[0, 1]), abs=1e-5)
    wrong = dataclasses.replace(scorer, label="HAPPY")
    with pytest.raises(StageError, match="scorer.label 'HAPPY' is not a label"):
        scoring.build_scorer(dataclasses.replace(tiny_params, scorer=wrong), tiny_run)(texts)


def test_bad_callable_scorer_is_a_clear_error(tiny_params, tmp_path):
    scorer = ScorerParams(source="callable", name="no_such_module:score", label="POSITIVE", batch_size=8)
    with pytest.raises(StageError, match="scorer.name 'no_such_module:score' is not an importable"):
        scoring.build_scorer(dataclasses.replace(tiny_params, scorer=scorer), tmp_path)


def test_missing_upstream_model_is_a_clear_error(tiny_params, tmp_path):
    with pytest.raises(StageError, match=r"data/models/sft: no saved model here; run the stage that writes it"):
        tokenize.run(tiny_params, tmp_path)


def test_sft_from_a_local_pretrained_path(tiny_run, tiny_params, tmp_path):
    """model.name_or_path: fine-tune an existing causal LM (here the tiny SFT model) instead of training one."""
    (tmp_path / RAW_SFT).parent.mkdir(parents=True)
    shutil.copy(tiny_run / RAW_SFT, tmp_path / RAW_SFT)
    model = dataclasses.replace(tiny_params.model, name_or_path=str(tiny_run / SFT_MODEL))
    sft.run(dataclasses.replace(tiny_params, model=model), tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path / SFT_MODEL).get_vocab() == \
        AutoTokenizer.from_pretrained(tiny_run / SFT_MODEL).get_vocab()
    loss = json.loads((tmp_path / SFT_METRICS).read_text())["eval_loss"]
    assert loss < json.loads((tiny_run / SFT_METRICS).read_text())["eval_loss"]  # it started from trained weights


def test_sft_and_reward_train_float32_weights_from_a_bf16_checkpoint(tiny_run, tiny_params, tmp_path):
    """transformers 5 loads a checkpoint in its saved dtype: from a bf16 model (sft's model.name_or_path, or the SFT
    model reward starts from) the stages trained bf16 weights, with no float32 master copy, and saved them so. They
    load float32 and save float32."""
    import torch
    from safetensors.torch import load_file

    from stages import reward

    bf16 = tmp_path / "bf16"
    AutoModelForCausalLM.from_pretrained(tiny_run / SFT_MODEL).to(torch.bfloat16).save_pretrained(bf16)
    AutoTokenizer.from_pretrained(tiny_run / SFT_MODEL).save_pretrained(bf16)
    dtypes = lambda path: {t.dtype for t in load_file(path / "model.safetensors").values()}  # noqa: E731
    assert dtypes(bf16) == {torch.bfloat16}
    (tmp_path / RAW_SFT).parent.mkdir(parents=True)
    shutil.copy(tiny_run / RAW_SFT, tmp_path / RAW_SFT)
    sft.run(dataclasses.replace(tiny_params, model=dataclasses.replace(tiny_params.model, name_or_path=str(bf16))),
            tmp_path)
    assert dtypes(tmp_path / SFT_MODEL) == {torch.float32}
    shutil.copytree(tiny_run / RAW_PAIRS.parent, tmp_path / "reward" / RAW_PAIRS.parent)
    shutil.copytree(bf16, tmp_path / "reward" / SFT_MODEL)
    reward.run(tiny_params, tmp_path / "reward")
    assert dtypes(tmp_path / "reward" / REWARD_MODEL) == {torch.float32}


def test_sft_and_reward_ask_transformers_for_tf32_only_on_gpus_that_have_it(tiny_params, tmp_path, monkeypatch):
    """TrainingArguments(tf32=True) where the GPU has TF32 (ppo_core.runtime.utils.tf32_supported,
    which NVIDIA_TF32_OVERRIDE=0 turns off), else None: torch's own setting (tf32=True raises on a GPU without it)."""
    from stages import reward

    for stage in (sft, reward):
        monkeypatch.setattr(stage, "TrainingArguments", lambda **kwargs: kwargs)
        assert stage.training_args(tiny_params, tmp_path)["tf32"] is None  # this CPU
        monkeypatch.setattr(stage, "tf32_supported", lambda device: True)
        assert stage.training_args(tiny_params, tmp_path)["tf32"] is True


def test_mixed_precision_is_the_trainers_autocast(tiny_params, tmp_path, monkeypatch):
    """model.mixed_precision: sft and reward train float32 weights under transformers' bf16 or fp16 autocast."""
    from stages import reward
    from stages.models import autocast_args

    assert autocast_args(None) == {"bf16": False, "fp16": False}
    assert autocast_args("bf16") == {"bf16": True, "fp16": False}
    assert autocast_args("fp16") == {"bf16": False, "fp16": True}
    for stage in (sft, reward):
        monkeypatch.setattr(stage, "TrainingArguments", lambda **kwargs: kwargs)
        for precision in (None, "bf16", "fp16"):
            params = dataclasses.replace(tiny_params,
                                         model=dataclasses.replace(tiny_params.model, mixed_precision=precision))
            args = stage.training_args(params, tmp_path)
            assert (args["bf16"], args["fp16"]) == (precision == "bf16", precision == "fp16"), (stage, precision)


def test_sft_under_bf16_autocast_trains_and_saves_float32_weights_on_cpu(tiny_run, tiny_params, tmp_path):
    """bf16 is the arithmetic, not the weights: the sft stage under model.mixed_precision bf16 computes otherwise than
    in float32 (other weights after the same steps), learns as much (its eval loss, 5.35 as the float32 run's,
    measured; an untrained model's is about ln 320 = 5.77), and saves float32 weights."""
    import torch
    from safetensors.torch import load_file

    (tmp_path / RAW_SFT).parent.mkdir(parents=True)
    shutil.copy(tiny_run / RAW_SFT, tmp_path / RAW_SFT)
    model = dataclasses.replace(tiny_params.model, mixed_precision="bf16")
    sft.run(dataclasses.replace(tiny_params, model=model), tmp_path)
    weights = load_file(tmp_path / SFT_MODEL / "model.safetensors")
    float32_run = load_file(tiny_run / SFT_MODEL / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.float32}
    assert not torch.equal(weights["transformer.h.0.mlp.c_fc.weight"], float32_run["transformer.h.0.mlp.c_fc.weight"])
    loss, float32_loss = (json.loads((root / SFT_METRICS).read_text())["eval_loss"] for root in (tmp_path, tiny_run))
    assert loss == pytest.approx(float32_loss, abs=0.01) and loss < math.log(320) - 0.2


def test_unloadable_model_is_a_clear_error(tiny_params, tiny_run, tmp_path):
    (tmp_path / RAW_SFT).parent.mkdir(parents=True)
    shutil.copy(tiny_run / RAW_SFT, tmp_path / RAW_SFT)
    model = dataclasses.replace(tiny_params.model, name_or_path="no-such-org/no-such-model")
    with pytest.raises(StageError, match=r"^model.name_or_path 'no-such-org/no-such-model': no such directory, and no "
                                         r"hub model of that id in the local cache"):
        sft.run(dataclasses.replace(tiny_params, model=model), tmp_path)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")  # a config, but no model transformers can load from it
    model = dataclasses.replace(tiny_params.model, name_or_path=str(tmp_path / "broken"))
    with pytest.raises(StageError, match=r"model.name_or_path '.*broken' could not be loaded \(.+\); give a local "
                                         r"save_pretrained directory") as err:
        sft.run(dataclasses.replace(tiny_params, model=model), tmp_path)
    assert "\n" not in str(err.value)


def test_logprob_sums_match_one_sample_at_a_time(tiny_run):
    """The padded batch in evaluate.logprob_sums gives each sample's sum_t log p(response_t | ...) as if alone."""
    import torch

    from stages.evaluate import logprob_sums

    model = AutoModelForCausalLM.from_pretrained(tiny_run / SFT_MODEL).eval()
    queries, responses = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14, 0]]
    expected = []
    for q, r in zip(queries, responses):
        ids = torch.tensor([q + r])
        with torch.no_grad():
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)  # (T-1, V)
        expected.append(sum(float(logprobs[len(q) - 1 + t, tok]) for t, tok in enumerate(r)))
    assert logprob_sums(model, queries, responses, batch_size=2) == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("arch", ["gpt2", "t5"])
def test_logprob_sums_score_the_response_tokens_without_full_logits(arch):
    """evaluate's KL comes from ppo_core's scoring pass, as the PPO step's: the LM head at the response positions only,
    chunk by chunk (evaluate materialised float32 (B, T-1, V) logits and their log-softmax). Its sums equal those
    of the full logits, and the LM head module's own forward (the full logits) never runs."""
    import torch

    from stages.evaluate import logprob_sums
    from tests.tiny import tiny_causal_lm, tiny_seq2seq_lm

    model = (tiny_causal_lm() if arch == "gpt2" else tiny_seq2seq_lm(arch)).eval()
    queries, responses = [[5, 6, 7], [8, 9], [10]], [[10, 11], [12, 13, 14, 1], [15]]
    expected = []
    with torch.no_grad():
        for q, r in zip(queries, responses):
            if arch == "gpt2":
                logits = model(input_ids=torch.tensor([q + r])).logits[0, len(q) - 1:-1]  # (R, V)
            else:
                decoder_ids = torch.tensor([[model.config.decoder_start_token_id] + r[:-1]])
                logits = model(input_ids=torch.tensor([q]), decoder_input_ids=decoder_ids).logits[0]
            expected.append(float(torch.log_softmax(logits.float(), -1)[torch.arange(len(r)), r].sum()))
    full_logits = []
    model.get_output_embeddings().register_forward_hook(lambda *args: full_logits.append(1))
    assert logprob_sums(model, queries, responses, batch_size=2) == pytest.approx(expected, abs=1e-5)
    assert not full_logits


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
    assert set(metrics) == {"win_rate", "reward", "kl", "length", "sft"} and set(metrics["sft"]) == {"reward", "length"}


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

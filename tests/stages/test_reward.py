"""stages/reward.py on tiny params (the shared run, see conftest.tiny_run): one scalar head, and metrics that are the
saved model's on the held-out pairs. What reward shares with sft (float32 weights, its Trainer's arguments) is
``test_models.py``."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from stages.shared.artifacts import REWARD_METRICS, REWARD_MODEL


def test_reward_model_has_one_scalar_head(tiny_run, tiny_params):
    model = AutoModelForSequenceClassification.from_pretrained(tiny_run / REWARD_MODEL)
    assert model.config.num_labels == 1
    assert AutoTokenizer.from_pretrained(tiny_run / REWARD_MODEL).model_max_length == tiny_params.reward.max_length


def test_reward_metrics_are_the_saved_model_s_on_the_held_out_pairs(tiny_run, tiny_params):
    """accuracy is the fraction of held-out pairs (the stage's seeded split) that the saved RM orders right."""
    import random

    from stages.shared.models import load_reward_model, reward_scores

    pairs = pd.read_parquet(tiny_run / "data" / "raw" / "pairs.parquet")
    order = list(range(len(pairs)))
    random.Random(f"{tiny_params.seed}-reward").shuffle(order)
    held_out = pairs.iloc[order[:round(len(pairs) * tiny_params.reward.eval_fraction)]]
    model, tokenizer = load_reward_model(tiny_run / REWARD_MODEL)
    chosen = reward_scores(model, tokenizer, (held_out["prompt"] + held_out["chosen"]).tolist(), 8)
    rejected = reward_scores(model, tokenizer, (held_out["prompt"] + held_out["rejected"]).tolist(), 8)
    metrics = json.loads((tiny_run / REWARD_METRICS).read_text())
    assert metrics["pairs"] == {"train": 48, "eval": 16, "train_scored": 48} and len(held_out) == 16  # all 48 < 256
    assert metrics["accuracy"] == sum(c > r for c, r in zip(chosen, rejected)) / 16
    assert metrics["margin"] == pytest.approx(sum(c - r for c, r in zip(chosen, rejected)) / 16, abs=1e-6)
    assert set(metrics["train"]) == {"accuracy", "loss"}


def test_train_metrics_are_the_saved_model_s_on_the_first_training_pairs_only(tiny_run, tiny_params, tmp_path,
                                                                              monkeypatch):
    """The train accuracy and loss are scored on the first TRAIN_METRIC_ROWS of the shuffled training pairs, not all
    of them (8 here, of 48): the scoring of the whole set cost a third of training again on a 2-core CPU."""
    import random
    import shutil

    from stages import reward
    from stages.shared.artifacts import RAW_PAIRS, SFT_MODEL
    from stages.shared.models import load_reward_model, reward_scores

    monkeypatch.setattr(reward, "TRAIN_METRIC_ROWS", 8)
    (tmp_path / RAW_PAIRS).parent.mkdir(parents=True)
    shutil.copy(tiny_run / RAW_PAIRS, tmp_path / RAW_PAIRS)
    shutil.copytree(tiny_run / SFT_MODEL, tmp_path / SFT_MODEL)
    reward.run(tiny_params, tmp_path)
    pairs = pd.read_parquet(tmp_path / RAW_PAIRS)
    order = list(range(len(pairs)))
    random.Random(f"{tiny_params.seed}-reward").shuffle(order)
    first = pairs.iloc[order[16:24]]  # after the 16 held out
    model, tokenizer = load_reward_model(tmp_path / REWARD_MODEL)
    chosen = reward_scores(model, tokenizer, (first["prompt"] + first["chosen"]).tolist(), 8)
    rejected = reward_scores(model, tokenizer, (first["prompt"] + first["rejected"]).tolist(), 8)
    metrics = json.loads((tmp_path / REWARD_METRICS).read_text())
    assert metrics["pairs"] == {"train": 48, "eval": 16, "train_scored": 8}
    assert metrics["train"]["accuracy"] == sum(c > r for c, r in zip(chosen, rejected)) / 8
    assert metrics["train"]["loss"] == pytest.approx(reward.bradley_terry_loss(chosen, rejected), abs=1e-5)


def test_no_reward_model_is_trained_where_nothing_scores_with_it(tiny_run, tiny_params, tmp_path):
    """A callable scorer (a verifiable task's checker) needs no reward model: the reward stage trains none, says so,
    and writes the same bytes whatever its inputs, so nothing downstream reruns for them; ppo and evaluate run."""
    import dataclasses
    import shutil
    import time

    from stages import reward
    from stages.shared.artifacts import RAW_PAIRS, REWARD_METRICS, REWARD_MODEL

    scorer = dataclasses.replace(tiny_params.scorer, source="callable", name="rewards.answers:states_a_number")
    params = dataclasses.replace(tiny_params, scorer=scorer)
    outputs = {}
    for name in ("a", "b"):
        root = tmp_path / name
        shutil.copytree(tiny_run / "data" / "raw", root / "data" / "raw")
        shutil.copytree(tiny_run / "data" / "models" / "sft", root / "data" / "models" / "sft")
        if name == "b":  # other pairs: nothing changes
            (root / RAW_PAIRS).write_bytes((tiny_run / "data" / "raw" / "sft.parquet").read_bytes())
        started = time.perf_counter()
        summary = reward.run(params, root)
        assert time.perf_counter() - started < 5 and summary.startswith("not trained: nothing scores with the reward")
        outputs[name] = {p.relative_to(root): p.read_bytes()
                         for p in sorted([*(root / REWARD_MODEL).rglob("*"), root / REWARD_METRICS]) if p.is_file()}
    assert outputs["a"] == outputs["b"] and len(outputs["a"]) == 2
    from stages import evaluate, ppo

    root = tmp_path / "a"  # ppo and evaluate need none of it
    shutil.copytree(tiny_run / "data" / "tokenized", root / "data" / "tokenized")
    ppo.run(params, root)
    assert "200 held-out prompts" not in evaluate.run(params, root)  # (tiny: fewer) it ran to the end
    combined = dataclasses.replace(tiny_params.scorer, source="combined", name=None,
                                   functions={"rm": {"source": "reward_model", "weight": 1.0}})
    assert reward.needs_reward_model(combined) and reward.needs_reward_model(tiny_params.scorer)
    assert not reward.needs_reward_model(scorer)

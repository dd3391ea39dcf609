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
    assert metrics["pairs"] == {"train": len(pairs) - 16, "eval": len(held_out)} and len(held_out) == 16
    assert metrics["accuracy"] == sum(c > r for c, r in zip(chosen, rejected)) / 16
    assert metrics["margin"] == pytest.approx(sum(c - r for c, r in zip(chosen, rejected)) / 16, abs=1e-6)
    assert set(metrics["train"]) == {"accuracy", "loss"}

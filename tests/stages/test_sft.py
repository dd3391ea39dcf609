"""stages/sft.py on tiny params (the shared run, see conftest.tiny_run): a model and tokenizer plain transformers
loads, byte-identical reruns, fine-tuning a local model, bf16 autocast with float32 weights, and an unloadable model as
one clear error. What sft and reward share (float32 weights, their Trainer's arguments) is ``test_models.py``."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from stages import sft
from stages.shared.artifacts import RAW_SFT, SFT_METRICS, SFT_MODEL
from stages.shared.runtime import StageError


def test_sft_model_loads_with_plain_transformers(tiny_run, tiny_params):
    tokenizer = AutoTokenizer.from_pretrained(tiny_run / SFT_MODEL)
    model = AutoModelForCausalLM.from_pretrained(tiny_run / SFT_MODEL)
    assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id != tokenizer.eos_token_id
    assert model.config.n_layer == tiny_params.model.n_layer
    text = "the movie was very good, but the plot was slow."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # byte-level BPE: exact round trip
    metrics = json.loads((tiny_run / SFT_METRICS).read_text())
    assert set(metrics) >= {"train_loss", "eval_loss"} and metrics["n_train_loss"] == metrics["n_train"] == 152


def test_train_loss_is_the_saved_model_s_on_the_first_training_texts_only(tiny_run, tiny_params, tmp_path,
                                                                          monkeypatch):
    """The train loss is over the first TRAIN_METRIC_ROWS of the shuffled training texts, not all of them (8 here, of
    152; one batch): over the whole set it cost a third of training again on a 2-core CPU. Both losses are the saved
    model's own mean over the tokens it predicts (transformers' Trainer would divide a GPT-2 head's summed loss by
    every label, each text's first too: 5.36 here for 5.56)."""
    import torch

    from stages.shared import chat

    monkeypatch.setattr(sft, "TRAIN_METRIC_ROWS", 8)
    (tmp_path / RAW_SFT).parent.mkdir(parents=True)
    shutil.copy(tiny_run / RAW_SFT, tmp_path / RAW_SFT)
    sft.run(tiny_params, tmp_path)
    metrics = json.loads((tmp_path / SFT_METRICS).read_text())
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / SFT_MODEL)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / SFT_MODEL).eval()
    examples, collator = chat.sft_examples(chat.read_sft(tmp_path / RAW_SFT), tokenizer, tiny_params.sft.max_length,
                                           tiny_params.chat, "tiny")
    with torch.no_grad():  # one batch each (sft.batch_size 32): the model's mean over every label but each first
        train_loss = float(model(**collator(examples[metrics["n_eval"]:metrics["n_eval"] + 8])).loss)
        eval_loss = float(model(**collator(examples[:metrics["n_eval"]])).loss)
    assert metrics["n_train_loss"] == 8 and metrics["n_train"] == 152 and metrics["n_eval"] == 8
    assert metrics["train_loss"] == pytest.approx(train_loss, abs=1e-5)
    assert metrics["eval_loss"] == pytest.approx(eval_loss, abs=1e-5)
    assert metrics["train_loss"] != pytest.approx(json.loads((tiny_run / SFT_METRICS).read_text())["train_loss"],
                                                  abs=1e-5)  # the same model's loss over all 152 is another number


def test_sft_is_deterministic_on_cpu(tiny_run, tiny_params, tmp_path):
    (tmp_path / RAW_SFT).parent.mkdir(parents=True)
    shutil.copy(tiny_run / RAW_SFT, tmp_path / RAW_SFT)
    sft.run(tiny_params, tmp_path)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (tmp_path / SFT_MODEL / name).read_bytes() == (tiny_run / SFT_MODEL / name).read_bytes(), name


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


def test_sft_under_bf16_autocast_trains_and_saves_float32_weights_on_cpu(tiny_run, tiny_params, tmp_path):
    """bf16 is the arithmetic, not the weights: the sft stage under model.mixed_precision bf16 computes otherwise than
    in float32 (other weights after the same steps), learns as much (its eval loss, the model's mean token loss, 5.57
    as the float32 run's, measured; an untrained model's is about ln 320 = 5.77), and saves float32 weights. (Until the
    losses were the model's own means, they read 5.35: transformers divided by each text's first label too, ~4% more
    labels than predictions, so the old bound of ln 320 - 0.2 on them was a true mean under ~5.8, looser than this.)"""
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
    assert loss == pytest.approx(float32_loss, abs=0.01) and loss < math.log(320) - 0.1


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


def test_too_little_sft_data_is_said():
    """Nine texts for a model trained from scratch make byte garbage, and a win rate that compares noise: sft warns,
    and the report's page says so beside the models (below)."""
    assert sft.too_little_data(9, 2, from_scratch=True).startswith("9 training texts (data.sft.n) for a model trained "
                                                                   "from scratch: under 500 it learns no language")
    assert sft.too_little_data(9, 2, from_scratch=False).startswith("9 training texts make 2 optimiser steps")
    assert sft.too_little_data(4000, 240, from_scratch=True) is None
    assert sft.too_little_data(400, 26, from_scratch=False) is None


def test_the_report_says_when_sft_had_too_few_texts(tmp_path):
    from stages.report.sections import models
    from stages.shared.artifacts import SFT_METRICS

    (tmp_path / SFT_METRICS).parent.mkdir(parents=True)
    (tmp_path / SFT_METRICS).write_text(json.dumps({"n_train": 9, "eval_loss": 5.0}))
    assert "SFT trained on 9 texts: a model trained from scratch on so few learns no language" in models(tmp_path)
    (tmp_path / SFT_METRICS).write_text(json.dumps({"n_train": 3800, "eval_loss": 2.0}))
    assert "SFT trained on" not in models(tmp_path)

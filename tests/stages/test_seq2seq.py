"""An encoder-decoder policy (a tiny T5 built here) through sft, reward, tokenize, ppo and evaluate."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pandas as pd
import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoModelForSequenceClassification, T5Config, T5ForConditionalGeneration

from stages import evaluate, ppo, reward, sft, tokenize
from stages.shared.artifacts import EVAL_METRICS, PPO_MODEL, PPO_ROLLOUTS, RAW_SFT, REWARD_MODEL, SFT_MODEL
from tests.conftest import params_per_stage


def test_t5_runs_through_the_pipeline(tiny_run, tiny_params, tmp_path):
    shutil.copytree(tiny_run / "data" / "raw", tmp_path / "data" / "raw")
    texts = pd.read_parquet(tmp_path / RAW_SFT)["text"].tolist()
    tokenizer = sft.train_tokenizer(texts, 320, 48)
    torch.manual_seed(0)
    config = T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
                      relative_attention_num_buckets=8, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.pad_token_id)
    T5ForConditionalGeneration(config).save_pretrained(tmp_path / "t5")
    tokenizer.save_pretrained(tmp_path / "t5")
    model = dataclasses.replace(tiny_params.model, name_or_path=str(tmp_path / "t5"))
    params = params_per_stage(dataclasses.replace(tiny_params, model=model))

    for stage in (sft, reward, tokenize, ppo, evaluate):
        stage.run(params[stage.__name__.split(".")[1]], tmp_path)

    assert AutoModelForSeq2SeqLM.from_pretrained(tmp_path / PPO_MODEL).config.is_encoder_decoder
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / REWARD_MODEL).config.num_labels == 1
    rollouts = pd.read_parquet(tmp_path / PPO_ROLLOUTS)
    assert rollouts["response_tokens"].between(1, tiny_params.generation.max_new_tokens).all()
    assert rollouts["score"].map(math.isfinite).all()
    metrics = json.loads((tmp_path / EVAL_METRICS).read_text())
    assert math.isfinite(metrics["kl"]) and math.isfinite(metrics["sft"]["reward"])
    assert (tmp_path / SFT_MODEL / "model.safetensors").exists()


def test_seq2seq_logprob_sums_match_one_sample_at_a_time():
    """The padded batch gives each sample's sum_t log p(response_t | query, response_<t) as if alone."""
    from tests.tiny import tiny_seq2seq_lm

    model = tiny_seq2seq_lm("t5").eval()
    queries, responses = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14, 1]]
    expected = []
    for q, r in zip(queries, responses):
        dec = torch.tensor([[model.config.decoder_start_token_id, *r]])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([q]), decoder_input_ids=dec[:, :-1]).logits[0]
        expected.append(float(torch.log_softmax(logits, -1).gather(-1, dec[0, 1:, None]).sum()))
    got = evaluate.logprob_sums(model, queries, responses, batch_size=2)
    assert got == pytest.approx(expected, abs=1e-5)

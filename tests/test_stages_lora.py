"""`model.lora`: the sft, reward and ppo stages train LoRA adapters and save plain (merged) transformers models."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from stages import ppo, reward, sft
from stages.artifacts import PPO_MODEL, RAW_PAIRS, RAW_SFT, REWARD_MODEL, SFT_METRICS, SFT_MODEL
from stages.params import LoraParams
from stages.runtime import StageError

LORA = LoraParams(r=4, alpha=8.0, dropout=0.0, target_modules=["c_attn"])


def with_lora(params, lora=LORA):
    return dataclasses.replace(params, model=dataclasses.replace(params.model, lora=lora))


def test_sft_and_reward_train_adapters_and_save_merged_models(tiny_run, tiny_params, tmp_path):
    for path in (RAW_SFT, RAW_PAIRS):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(tiny_run / path, tmp_path / path)
    params = with_lora(tiny_params)
    sft.run(params, tmp_path)
    metrics = json.loads((tmp_path / SFT_METRICS).read_text())
    assert 0 < metrics["n_trained_params"] < metrics["n_params"] / 4
    weights = load_file(tmp_path / SFT_MODEL / "model.safetensors")
    assert not any("lora" in key for key in weights)  # merged: a plain GPT-2 checkpoint
    AutoModelForCausalLM.from_pretrained(tmp_path / SFT_MODEL)

    reward.run(params, tmp_path)
    assert not any("lora" in key for key in load_file(tmp_path / REWARD_MODEL / "model.safetensors"))
    rm = AutoModelForSequenceClassification.from_pretrained(tmp_path / REWARD_MODEL)
    base = AutoModelForSequenceClassification.from_pretrained(tmp_path / SFT_MODEL, num_labels=1)
    assert not torch.equal(rm.score.weight, base.score.weight)  # the head was trained, and saved


def test_ppo_trains_an_adapter_with_the_adapter_disabled_reference(tiny_run, tiny_params, tmp_path):
    from peft import PeftModel

    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints"))
    summary = ppo.run(with_lora(tiny_params), root)
    assert "steps" in summary
    merged = AutoModelForCausalLM.from_pretrained(root / PPO_MODEL).eval()
    sft_model = AutoModelForCausalLM.from_pretrained(root / SFT_MODEL).eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / SFT_MODEL),
                                        root / PPO_MODEL / "adapter").eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        merged_logits, adapted_logits = merged(ids).logits, adapted(ids).logits
        sft_logits = sft_model(ids).logits
    assert torch.allclose(merged_logits, adapted_logits, atol=1e-5)  # merged model == SFT + saved adapter
    assert not torch.allclose(merged_logits, sft_logits, atol=1e-4)  # and the adapter learned something
    assert (root / PPO_MODEL / "value_head.safetensors").exists()


def test_bad_target_modules_is_a_clear_error(tiny_run, tiny_params, tmp_path):
    (tmp_path / RAW_SFT).parent.mkdir(parents=True)
    shutil.copy(tiny_run / RAW_SFT, tmp_path / RAW_SFT)
    params = with_lora(tiny_params, dataclasses.replace(LORA, target_modules=["q_proj"]))
    with pytest.raises(StageError, match=r"model.lora: .*q_proj"):
        sft.run(params, tmp_path)

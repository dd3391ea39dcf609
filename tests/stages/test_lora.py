"""`model.lora`: the sft, reward and ppo stages train LoRA adapters and save plain (merged) transformers models; the
reward stage also saves its adapter with its score head, and ppo scores with it on the policy's own base weights
(one copy of them for policy, reference and reward model)."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pandas as pd
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from ppo_core import PPOTrainer
from stages import ppo, reward, sft, tokenize
from stages.ppo.checkpoints import STATE, rollout_file
from stages.shared import scoring
from stages.shared.artifacts import (
    PPO_CHECKPOINTS,
    PPO_MODEL,
    PPO_ROLLOUTS,
    RAW_SFT,
    REWARD_ADAPTER,
    REWARD_MODEL,
    SFT_METRICS,
    SFT_MODEL,
)
from stages.shared.models import load_reward_model, reward_scores
from stages.shared.params import LoraParams
from stages.shared.runtime import StageError
from tests.conftest import cpu_only
from tests.stages.test_resume import EXCLUDE, digests

LORA = LoraParams(r=4, alpha=8.0, dropout=0.0, target_modules=["c_attn"])
SCORE_TOL = 1e-5  # the reward adapter on the base vs the same adapter merged into it: float32 rounding only


def with_lora(params, lora=LORA):
    return dataclasses.replace(params, model=dataclasses.replace(params.model, lora=lora))


@pytest.fixture(scope="module")
def lora_run(tiny_run, tiny_params, tmp_path_factory):
    """tiny_run's raw data through sft, reward and tokenize with model.lora set (on the CPU, as tiny_run)."""
    root = tmp_path_factory.mktemp("lora_run")
    shutil.copytree(tiny_run / "data" / "raw", root / "data" / "raw")
    with cpu_only():
        for stage in (sft, reward, tokenize):
            stage.run(with_lora(tiny_params), root)
    return root


def project(lora_run, root):
    """A copy of lora_run: what the ppo stage reads."""
    shutil.copytree(lora_run, root)
    return root


def test_sft_and_reward_train_adapters_and_save_merged_models(lora_run):
    metrics = json.loads((lora_run / SFT_METRICS).read_text())
    assert 0 < metrics["n_trained_params"] < metrics["n_params"] / 4
    weights = load_file(lora_run / SFT_MODEL / "model.safetensors")
    assert not any("lora" in key for key in weights)  # merged: a plain GPT-2 checkpoint
    AutoModelForCausalLM.from_pretrained(lora_run / SFT_MODEL)

    assert not any("lora" in key for key in load_file(lora_run / REWARD_MODEL / "model.safetensors"))
    rm = AutoModelForSequenceClassification.from_pretrained(lora_run / REWARD_MODEL).eval()
    base = AutoModelForSequenceClassification.from_pretrained(lora_run / SFT_MODEL, num_labels=1)
    assert not torch.equal(rm.score.weight, base.score.weight)  # the head was trained, and saved


def test_reward_stage_saves_its_adapter_with_the_score_head_beside_the_merged_model(lora_run):
    from peft import PeftModel

    keys = load_file(lora_run / REWARD_ADAPTER / "adapter_model.safetensors")
    assert any("lora_A" in key for key in keys) and "base_model.model.score.weight" in keys
    merged = AutoModelForSequenceClassification.from_pretrained(lora_run / REWARD_MODEL).eval()
    base = AutoModelForSequenceClassification.from_pretrained(lora_run / SFT_MODEL, num_labels=1)
    base.config.pad_token_id = merged.config.pad_token_id
    adapted = PeftModel.from_pretrained(base, lora_run / REWARD_ADAPTER).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
    with torch.no_grad():
        torch.testing.assert_close(adapted(ids).logits, merged(ids).logits, atol=SCORE_TOL, rtol=0)


def test_ppo_trains_an_adapter_with_the_adapter_disabled_reference(lora_run, tiny_params, tmp_path):
    from peft import PeftModel

    root = project(lora_run, tmp_path / "project")
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
    assert sorted(p.name for p in (root / PPO_MODEL / "adapter").iterdir() if p.is_dir()) == []  # no reward adapter


def test_ppo_scores_with_the_reward_adapter_as_the_merged_reward_model_does(lora_run, tiny_params, tmp_path,
                                                                            monkeypatch):
    """No second copy of the base weights is loaded (the reward model class is never instantiated), and the first
    step's scores are the merged reward model's on the same texts, to float32 rounding."""
    root = project(lora_run, tmp_path / "project")

    def no_second_model(*args, **kwargs):
        raise AssertionError("the ppo stage loaded a separate reward model")

    with monkeypatch.context() as patch:
        patch.setattr(AutoModelForSequenceClassification, "from_pretrained", no_second_model)
        ppo.run(with_lora(tiny_params), root)
    rollouts = pd.read_parquet(root / PPO_ROLLOUTS / rollout_file(0))
    texts = (rollouts["query"] + rollouts["response"]).tolist()
    rm, tokenizer = load_reward_model(root / REWARD_MODEL)
    separate = torch.tensor(reward_scores(rm, tokenizer, texts, tiny_params.scorer.batch_size))
    shared = torch.tensor(rollouts["score"].tolist())
    torch.testing.assert_close(shared, separate, atol=SCORE_TOL, rtol=0)
    assert separate.std() > 0.01  # real scores, not a constant


def test_ppo_with_the_reward_adapter_resumes_to_the_same_artifacts_on_cpu(lora_run, tiny_params, tmp_path,
                                                                          monkeypatch):
    """A run stopped after its first step's checkpoint resumes (the reward adapter's weights in the checkpoint as the
    policy's), and ends with the bytes of an uninterrupted run; a checkpoint is not resumed once the reward adapter
    changed (it is an input of the fingerprint, inside data/models/reward)."""
    params = with_lora(tiny_params)
    whole = project(lora_run, tmp_path / "whole")
    ppo.run(params, whole)

    def interrupted(root):
        step, calls = PPOTrainer.step, []

        def stops_at_the_second(self, *args, **kwargs):
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("killed")
            return step(self, *args, **kwargs)

        with monkeypatch.context() as patch, pytest.raises(RuntimeError, match="killed"):
            patch.setattr(PPOTrainer, "step", stops_at_the_second)
            ppo.run(params, root)
        assert (root / PPO_CHECKPOINTS / STATE).exists()
        return root

    resumed = interrupted(project(lora_run, tmp_path / "resumed"))
    assert "resumed at step 1" in ppo.run(params, resumed)
    # the adapter's config and model card name the SFT model by its path: the project's, here a different one
    named = [PPO_MODEL / "adapter" / name for name in ("adapter_config.json", "README.md")]
    assert digests(resumed, EXCLUDE + tuple(map(str, named))) == digests(whole, EXCLUDE + tuple(map(str, named)))
    for path in named:
        assert (resumed / path).read_text().replace(str(resumed), "") == (whole / path).read_text().replace(
            str(whole), ""), path

    changed = interrupted(project(lora_run, tmp_path / "changed"))
    weights = changed / REWARD_ADAPTER / "adapter_model.safetensors"
    state = load_file(weights)
    state["base_model.model.score.weight"] = state["base_model.model.score.weight"] * 2
    save_file(state, weights, metadata={"format": "pt"})
    stop = dataclasses.replace(params, checkpoint=dataclasses.replace(params.checkpoint, on_mismatch="stop"))
    with pytest.raises(StageError, match=r"other inputs \(data/models/reward changed\)"):
        ppo.run(stop, changed)


@pytest.mark.slow
@pytest.mark.parametrize("config", [None, "zero3"])
def test_ppo_scores_with_the_reward_adapter_in_two_processes(config, lora_run, tiny_params, tmp_path):
    """Under `accelerate launch` (DDP, or DeepSpeed ZeRO-3 with the weights sharded) each process scores its share
    with the reward adapter as the merged reward model does."""
    from tests.conftest import write_params
    from tests.stages.test_distributed import PPO_CHANGES, launch_stage

    if config is not None:
        pytest.importorskip("deepspeed")
    root = project(lora_run, tmp_path / "project")
    lora = {"r": LORA.r, "alpha": LORA.alpha, "dropout": LORA.dropout, "target_modules": LORA.target_modules}
    changes = {key.replace("__", "."): value for key, value in PPO_CHANGES.items()} | {"model.lora": lora}
    code, output = launch_stage("ppo", write_params(root, changes), root, config=config)
    assert code == 0, output[-3000:]
    rollouts = pd.read_parquet(root / PPO_ROLLOUTS / rollout_file(0))
    rm, tokenizer = load_reward_model(root / REWARD_MODEL)
    separate = reward_scores(rm, tokenizer, (rollouts["query"] + rollouts["response"]).tolist(), 8)
    torch.testing.assert_close(torch.tensor(rollouts["score"].tolist()), torch.tensor(separate), atol=SCORE_TOL,
                               rtol=0)


def test_the_reward_adapter_is_used_only_with_lora_the_reward_model_and_a_causal_lm(lora_run, tiny_run, tiny_params):
    lora = with_lora(tiny_params)
    assert scoring.reward_adapter(lora, lora_run, seq2seq=False) == lora_run / REWARD_ADAPTER
    assert scoring.reward_adapter(lora, lora_run, seq2seq=True) is None  # encoder-decoders: the merged model
    assert scoring.reward_adapter(tiny_params, lora_run, seq2seq=False) is None  # no LoRA: the default path
    callable_scorer = dataclasses.replace(lora.scorer, source="callable", name="rewards.example:keyword_sentiment")
    assert scoring.reward_adapter(dataclasses.replace(lora, scorer=callable_scorer), tiny_run, seq2seq=False) is None
    with pytest.raises(StageError, match=r"data/models/reward/adapter: no reward adapter .*`dvc repro -f reward`"):
        scoring.reward_adapter(lora, tiny_run, seq2seq=False)  # a reward model trained without LoRA


def test_bad_target_modules_is_a_clear_error(tiny_run, tiny_params, tmp_path):
    (tmp_path / RAW_SFT).parent.mkdir(parents=True)
    shutil.copy(tiny_run / RAW_SFT, tmp_path / RAW_SFT)
    params = with_lora(tiny_params, dataclasses.replace(LORA, target_modules=["q_proj"]))
    with pytest.raises(StageError, match=r"model.lora: .*q_proj"):
        sft.run(params, tmp_path)

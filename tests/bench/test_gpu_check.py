"""bench/gpu_check.sh and bench/gpu_stage.py, as far as a machine without a GPU can check them (the whole script runs
on the CPU with DRY_RUN=1 in about a minute and a half: not part of the suite)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import gpu_stage


def test_the_gpu_check_script_parses():
    result = subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_a_variant_is_the_params_with_its_changes(tmp_path, tiny_params):
    from stages.shared.params import load_params

    changes = ["ppo.steps=128", "ppo.accelerator_kwargs={mixed_precision: fp16}",
               "model.lora={r: 8, alpha: 16, dropout: 0.0, target_modules: [c_attn]}"]
    path = gpu_stage.params_with(tiny_params.path, changes, tmp_path / "params.yaml")
    params = load_params(path)
    assert params.ppo["steps"] == 128 and params.ppo["accelerator_kwargs"] == {"mixed_precision": "fp16"}
    assert params.model.lora.r == 8 and params.model.lora.target_modules == ["c_attn"]
    assert params.sft == tiny_params.sft  # the rest as it was


def test_mfu_needs_a_known_gpu(monkeypatch):
    assert gpu_stage.peak_flops("bf16") is None  # no GPU here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert gpu_stage.peak_flops("bf16") == 989e12 and gpu_stage.peak_flops("tf32") == 494e12
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Some Future GPU")
    assert gpu_stage.peak_flops("bf16") is None


def test_a_finished_run_is_measured(tiny_run, tiny_params):
    result = gpu_stage.measure(tiny_run, tiny_params, seconds=2.0)
    assert result["pass"] and result["dtype"] == "fp32" and result["mfu_update"] is None  # a CPU: no peak to divide by
    assert result["s_per_step"] == pytest.approx(1.0) and result["tokens_per_s"] > 0
    assert result["first_kl"] == 0  # the policy is its own reference at step 1 (exactly, on a CPU)


@pytest.mark.slow
def test_a_lora_variant_trains_its_reward_adapter_first(tiny_run, tmp_path):
    """The GPU check's project has a full reward model; a LoRA policy scores with the reward stage's adapter (failed
    on the first GPU run: 'no reward adapter'), so the variant reruns that stage with its model.lora, as dvc would."""
    import json
    import shutil

    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints", "ppo"))
    assert not (root / "data" / "models" / "reward" / "adapter").exists()
    out = tmp_path / "variants.jsonl"
    lora = "model.lora={r: 8, alpha: 16, dropout: 0.0, target_modules: [c_attn]}"
    subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_stage.py"), "--root", str(root), "--name", "lora",
                    "--params", str(ROOT / "tests" / "fixtures" / "params.tiny.yaml"), "--json", str(out),
                    "--set", "ppo.steps=16", "--set", lora], check=True, capture_output=True, cwd=root,
                   env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    row = json.loads(out.read_text())
    assert row["pass"] and row["error"] is None, row
    assert (root / "data" / "models" / "reward" / "adapter").is_dir()


def test_unmeasured_reference_stats_pass_and_other_nans_fail(tiny_run):
    """dapo, gspo and cispo skip the reference pass (their KL's coefficient is 0), so their KL stats are NaN in every
    step: not measured, not a failure (the first GPU run of them failed on that). Any other NaN fails."""
    import numpy as np
    import pandas as pd

    stats = pd.read_parquet(tiny_run / "data" / "ppo" / "stats.parquet")
    assert gpu_stage.all_finite(stats)
    unmeasured = stats.copy()
    unmeasured["objective/kl"] = np.nan
    unmeasured["objective/kl_dist"] = [np.full(np.shape(v), np.nan) for v in stats["objective/kl_dist"]]
    assert gpu_stage.all_finite(unmeasured)
    partly = stats.copy()
    partly.loc[partly.index[-1], "objective/kl"] = np.nan  # measured in one step, NaN in another: a failure
    assert not gpu_stage.all_finite(partly)
    bad = stats.copy()
    bad["ppo/loss/policy"] = np.nan
    assert not gpu_stage.all_finite(bad)

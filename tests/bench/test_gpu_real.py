"""bench/gpu_real.sh and its parts, on a CPU: the model shapes from configs, the counted FLOPs, the table's
throughput and MFU, and (slow) the whole script at test size with both TRLs installed from wheels, as the GPU machine
installs them, so that the GPU run is one shot."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile

import pytest

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import common
import compare


@pytest.mark.parametrize("script", ["gpu_real.sh", "peers.sh"])
def test_the_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(ROOT / "bench" / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_every_config_is_a_shape_with_the_realistic_work():
    configs = sorted(p.stem for p in common.CONFIGS.glob("*.json"))
    assert configs == ["qwen2_5_0_5b", "qwen2_5_1_5b", "smollm2_135m", "smollm2_360m", "tiny_qwen2"]
    assert {shape.config for shape in common.SHAPES.values() if shape.config} == set(configs)
    work = common.setting_for("qwen2.5_0.5b")
    assert (work.batch_size, work.mini_batch_size, work.max_new_tokens) == (64, 16, 256)
    assert 112 <= work.query_len_min <= work.query_len_max <= 144  # prompts of ~128 tokens
    assert common.SHAPES["qwen2.5_0.5b"].vocab_size == 151936


def test_a_config_model_is_seeded_and_counted_as_the_flops_count_it():
    """The matmul weights the FLOP count uses are the model's own 2-D weights (the tied head counted once, as the one
    product per token it is); the weights depend on the seed alone."""
    model = common.build_model("tiny_qwen2", seed=0)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.config.vocab_size == 512
    two_d = sum(p.numel() for p in model.parameters() if p.dim() == 2)
    assert common.matmul_params("tiny_qwen2") == (two_d, 2, 64)
    assert common.weights_digest(model) == common.weights_digest(common.build_model("tiny_qwen2", seed=0))
    assert common.weights_digest(model) != common.weights_digest(common.build_model("tiny_qwen2", seed=1))
    assert model.config.pad_token_id == common.PAD_ID and model.config.eos_token_id == common.EOS_ID


def test_a_gpt2_shape_counts_its_blocks_and_head():
    model = common.build_model("tiny")
    blocks = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and ".h." in n)
    n, layers, width = common.matmul_params("tiny")
    assert (layers, width) == (2, 128) and n == blocks + 384 * 128  # the tied head: wte, not the positions (wpe)


def test_update_flops_are_forward_and_backward_with_causal_attention():
    n, layers, width = common.matmul_params("tiny_qwen2")
    forward = 2 * n * 10 + 2 * layers * 10 * 10 * width + 2 * n * 20 + 2 * layers * 20 * 20 * width
    assert common.update_flops("tiny_qwen2", [10, 20]) == 3 * forward
    assert common.update_flops("tiny_qwen2", [10, 20], lora=True) == 2 * forward  # no weight gradients


def test_the_table_counts_all_tokens_and_the_update_against_the_gpus_peak():
    steps = [{"prompt_tokens": 8 * 8, "gen_tokens": 8 * 8, "total_s": 0.5, "update_s": 0.25},
             {"prompt_tokens": 8 * 8, "gen_tokens": 8 * 8, "total_s": 1.0, "update_s": 0.5}]
    assert compare.tokens_per_s(steps) == pytest.approx((128 / 0.5 + 128 / 1.0) / 2)
    assert compare.tokens_per_s([{"gen_tokens": 4, "total_s": 1.0}]) is None  # a row that does not count its prompts
    run = compare.Run("x", sys.executable, (), None)
    flops = common.setting_for("tiny_qwen2").ppo_epochs * common.update_flops("tiny_qwen2", [16.0] * 8)
    assert compare.update_mfu("tiny_qwen2", run, steps, "NVIDIA H100 80GB HBM3", "bf16") == \
        pytest.approx((flops / 0.25 + flops / 0.5) / 2 / 989e12)  # the median of the two steps
    assert compare.update_mfu("tiny_qwen2", run, steps, None, "bf16") is None  # a CPU
    assert compare.update_mfu("tiny_qwen2", run, steps, "Some Future GPU", "bf16") is None
    assert compare.step_peak_gpu_mb([{"step_peak_gpu_mb": 3.0}, {"step_peak_gpu_mb": 5.0}]) == 5.0


def test_a_peer_worker_gets_its_site_first_on_its_path(monkeypatch, tmp_path):
    monkeypatch.setattr(compare, "TRL_PYTHON", sys.executable)
    monkeypatch.setattr(compare, "TRL_SITE", str(tmp_path))
    runs, notes = compare.planned_runs(["trl", "ppo_core"])
    trl = next(r for r in runs if r.label == "trl")
    assert trl.site == str(tmp_path) and trl.python == sys.executable and not notes
    assert next(r for r in runs if r.label == "ppo_core").site is None


@pytest.mark.slow
def test_the_gpu_run_works_on_a_cpu_at_test_size(tmp_path):
    """The whole script (DRY_RUN=1: tiny_qwen2 for every shape), the peers downloaded as wheels for this Python and
    installed the way the GPU machine installs them: every section writes its table, no row fails, both TRLs ran.
    Where no package index answers, the script runs without the peers and says so, and the rest must hold alike."""
    env = dict(os.environ, WHL=str(tmp_path / "whl"), PYTHON=sys.executable)
    download = subprocess.run(["bash", "bench/peers.sh", "download"], cwd=ROOT, env=env, capture_output=True,
                              text=True)
    have_peers = download.returncode == 0
    out = tmp_path / "out"
    run = subprocess.run(["bash", "bench/gpu_real.sh"], cwd=ROOT, env=dict(env, DRY_RUN="1", OUT=str(out)),
                         capture_output=True, text=True, timeout=900)
    report, log = (out / "gpu_real.md").read_text(), (out / "gpu_real.log").read_text()
    assert run.returncode == 0, report + log[-3000:]
    assert report.count("## ") == 5 and "failed" not in report and "no table" not in report
    for label in ("ppo_core", "ppo_core, sampling from the policy (rollout_dtype None)", "ppo_core, grpo",
                  "ppo_core, bf16 weights", "ppo_core, grpo, bf16 weights"):
        assert f"| tiny_qwen2 | {label} |" in report  # the defaults' rows: no flags
    if have_peers:
        assert "| tiny_qwen2 | trl | 4.46.3 |" in report  # TRL 0.11.4 on its own transformers
        assert "| tiny_qwen2 | TRL GRPOTrainer G=4 |" in report and "vs TRL GRPOTrainer G=4" in report
    else:  # no index here: the TRL rows are left out, and the log says why
        assert "TRL rows skipped" in log and "| tiny_qwen2 | trl |" not in report, download.stderr[-500:]
    for engine in ("generate", "generate_bf16w", "static_bf16w", "compiled_bf16w"):
        assert f"| {engine} |" in report
    assert "kind of work" in report
    with tarfile.open(out / "json.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["compare_big.json", "compare_main.json", "compare_tiny_qwen2.json",
                                          "profile.json", "rollout.json"]

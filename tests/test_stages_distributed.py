"""The training stages under `accelerate launch` with 2 CPU processes (gloo): the command dvc.yaml would run
with the one documented change, one set of artifacts, the PPO global batch = ppo.batch_size per process x 2,
and an error on one process ending both with its message (no hang)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from transformers import AutoModelForCausalLM

from stages.common import PPO_MODEL, PPO_ROLLOUTS, PPO_STATS, SFT_METRICS, SFT_MODEL
from tests.conftest import ROOT
from tests.test_core_distributed import free_port
from tests.test_stages_resume import params_file, remove_outputs_as_dvc_does

pytestmark = pytest.mark.slow


def launch_stage(stage: str, params: Path, cwd: Path, timeout: float = 300) -> tuple[int, str]:
    """`accelerate launch --multi_gpu --num_processes 2 -m stages STAGE` on CPU; a hang fails the test."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), "-m", "stages", stage, "--params", str(params)]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{stage}: 2 processes still running after {timeout} s (a hang):\n{output[-3000:]}")
    return proc.returncode, output


def test_ppo_stage_in_two_processes(tiny_run, tmp_path):
    """ppo.batch_size 4 per process: each step's rollouts hold the global batch of 8, written once."""
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints"))
    remove_outputs_as_dvc_does(root, "ppo")
    # ppo.steps counts rollouts per process, as in the seed: ceil(8 / 4) = 2 steps of 2 x 4 rollouts
    params = params_file(tmp_path, ppo__batch_size=4, ppo__mini_batch_size=2, ppo__steps=8)
    code, output = launch_stage("ppo", params, root)
    assert code == 0, output[-3000:]
    assert output.count("ppo: 2 steps") == 1  # the summary line: one process reports
    rollouts = pd.read_parquet(root / PPO_ROLLOUTS)
    assert sorted(p.name for p in (root / PPO_ROLLOUTS).iterdir()) == ["step-00000.parquet", "step-00001.parquet"]
    assert rollouts.groupby("step").size().tolist() == [8, 8]
    assert rollouts.groupby("step")["query"].nunique().tolist() == [8, 8]  # two different shards, not one twice
    assert pd.read_parquet(root / PPO_STATS)["step"].tolist() == [0, 1]
    AutoModelForCausalLM.from_pretrained(root / PPO_MODEL)
    assert not list(root.rglob(".*tmp-*"))


def test_sft_stage_in_two_processes(tiny_run, tmp_path):
    """sft.batch_size 16 per process = the one-process run's 32: close eval loss, one model written."""
    root = tmp_path / "project"
    shutil.copytree(tiny_run / "data" / "raw", root / "data" / "raw")
    params = params_file(tmp_path, sft__batch_size=16)
    code, output = launch_stage("sft", params, root)
    assert code == 0, output[-3000:]
    assert output.count("sft: ") == 1
    two = json.loads((root / SFT_METRICS).read_text())
    one = json.loads((tiny_run / SFT_METRICS).read_text())
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=0.02)
    AutoModelForCausalLM.from_pretrained(root / SFT_MODEL)


def test_a_scorer_failing_on_one_process_ends_both(tiny_run, tmp_path):
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints"))
    remove_outputs_as_dvc_does(root, "ppo")
    (root / "rank_scorer.py").write_text(
        "import math, os\n\ndef score(texts):\n"
        "    return [math.nan if os.environ['RANK'] == '1' else 1.0 for _ in texts]\n")
    params = params_file(tmp_path, ppo__batch_size=4, ppo__mini_batch_size=2, ppo__steps=8, scorer__source="callable",
                         scorer__name="rank_scorer:score")
    start = time.monotonic()
    code, output = launch_stage("ppo", params, root, timeout=180)
    assert code != 0 and time.monotonic() - start < 120
    assert "error: ppo: PPO step 1: scorer (callable rank_scorer:score) returned nan for text 0" in output
    assert not (root / PPO_MODEL).exists()

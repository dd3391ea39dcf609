"""The Typer app (`rlhf` / `python -m stages`): help texts, a single-stage run, one-line errors with exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stages.cli import app

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "fixtures" / "params.tiny.yaml"
STAGES = ["prepare", "sft", "reward", "tokenize", "ppo", "evaluate"]


def run_module(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    return subprocess.run([sys.executable, "-m", "stages", *args], cwd=cwd, env=env, capture_output=True, text=True)


def test_app_help_lists_every_stage():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for stage in STAGES:
        assert stage in result.output


@pytest.mark.parametrize("stage", STAGES)
def test_stage_help_says_what_it_reads_and_writes(stage):
    result = CliRunner().invoke(app, [stage, "--help"], terminal_width=200)
    assert result.exit_code == 0
    assert "Reads:" in result.output and "Writes:" in result.output and "--params" in result.output


def test_single_stage_run_prints_a_summary(tmp_path):
    result = run_module("prepare", "--params", str(TINY), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("prepare: 160 SFT texts")
    assert (tmp_path / "data" / "raw" / "sft.parquet").exists()


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(TINY.read_text().replace("  n_eval_prompts: 8\n", "  n_eval_prompts: 8\n  n_eval_promts: 9\n"))
    result = run_module("prepare", "--params", str(params), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: prepare: {params}: unknown key 'data.n_eval_promts'; did you mean "
                                     "'data.n_eval_prompts'?")
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_missing_input_is_exit_2_and_debug_shows_the_traceback(tmp_path):
    result = run_module("sft", "--params", str(TINY), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "data/raw/sft.parquet: not found" in result.stderr
    debug = run_module("sft", "--params", str(TINY), "--debug", cwd=tmp_path)
    assert debug.returncode != 0 and "Traceback" in debug.stderr

"""bench/precision_learning.py: bf16 and fp32 runs of a project's ppo and evaluate stages, on the tiny pipeline (the
real-model example it is written for takes an hour)."""

from __future__ import annotations

import json
import sys

import pandas as pd
import pytest
import yaml

from tests.conftest import ROOT, TINY_PARAMS, write_params

sys.path.insert(0, str(ROOT / "bench"))
import precision_learning


@pytest.fixture
def example(tiny_run, tmp_path):
    """A project whose upstream stages ran (the shared tiny run, its ppo and evaluate outputs included)."""
    root = tmp_path / "example"
    root.mkdir()
    (root / "data").symlink_to(tiny_run / "data")
    write_params(root, {})
    return root


def test_run_params_change_the_precision_and_seed_only():
    params = yaml.safe_load(TINY_PARAMS.read_text())
    got = precision_learning.run_params(params, "bf16", 3)
    assert got["model"]["mixed_precision"] == "bf16" and got["ppo"]["seed"] == 3
    assert got["checkpoint"]["ppo_every"] == 0
    assert precision_learning.run_params(params, "fp32", 3)["model"]["mixed_precision"] is None
    for section, key in (("model", "mixed_precision"), ("ppo", "seed"), ("checkpoint", "ppo_every")):
        got[section][key] = params[section][key]
    assert got == params  # nothing else changed, and the input untouched
    assert params["model"]["mixed_precision"] != "bf16"


def test_a_project_links_the_inputs_and_none_of_the_outputs(example, tmp_path):
    linked = {rel.as_posix() for rel in precision_learning.linked_inputs(example)}
    assert {"data/tokenized", "data/models/sft", "data/models/reward", "data/raw"} <= linked
    assert not linked & precision_learning.WRITTEN
    assert (example / "data" / "logs").exists()  # the ppo stage's timings of the tiny run: written, so not linked
    assert (example / "data" / "ppo").exists()  # the tiny run's own ppo outputs exist, and stay out


def test_a_project_without_upstream_models_says_to_run_the_example(tmp_path):
    empty = tmp_path / "empty"
    (empty / "data" / "models").mkdir(parents=True)
    with pytest.raises(SystemExit, match="run `make example` first"):
        precision_learning.make_project(empty, tmp_path / "p", {})


def test_run_summary_blocks_the_curves_and_keeps_the_judges():
    curves = pd.DataFrame({"reward_mean": [0.0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], "kl": [1.0] * 12})
    got = precision_learning.run_summary(curves, {"win_rate": 0.5, "gold": 0.25, "kl": 3, "sft": {"gold": 0.1}})
    assert got["reward_blocks"] == [2.5, 8.5] and got["reward, last block"] == 8.5 and got["KL, last block"] == 1.0
    assert {k: got[k] for k in got if k.startswith("held-out")} == {
        "held-out win_rate": 0.5, "held-out gold": 0.25, "held-out kl": 3.0}


@pytest.mark.slow
def test_both_precisions_run_per_seed_and_are_compared(example, tmp_path, capsys):
    out = tmp_path / "result.json"
    precision_learning.main(["--example", str(example), "--seeds", "0", "1", "--jobs", "2",
                             "--workdir", str(tmp_path / "work"), "--out", str(out)])
    result = json.loads(out.read_text())
    runs = {(r["precision"], r["seed"]): r for r in result["runs"]}
    assert set(runs) == {("fp32", 0), ("fp32", 1), ("bf16", 0), ("bf16", 1)}
    for precision, seed in runs:
        params = yaml.safe_load((tmp_path / "work" / f"{precision}_seed{seed}" / "params.yaml").read_text())
        assert params["model"]["mixed_precision"] == precision_learning.PRECISIONS[precision]
        assert params["ppo"]["seed"] == seed
    # the precision took effect (at this size both may sample the same tokens, and score them alike: the KL differs)
    assert runs["bf16", 0]["kl_blocks"] != runs["fp32", 0]["kl_blocks"]
    assert runs["fp32", 0]["reward_blocks"] != runs["fp32", 1]["reward_blocks"]  # and so did the seed
    rows = {row["quantity"]: row for row in result["comparison"]}
    assert {"reward, last block", "KL, last block", "held-out reward", "held-out kl"} <= set(rows)
    assert rows["held-out reward"]["paired"] == pytest.approx(
        [runs["bf16", s]["held-out reward"] - runs["fp32", s]["held-out reward"] for s in (0, 1)])
    printed = capsys.readouterr().out
    assert "| precision | seed |" in printed and "| bf16 | 1 |" in printed

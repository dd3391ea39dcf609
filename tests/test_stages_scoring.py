"""Where the ppo stage's reward comes from: user reward code under rewards/ is tracked by dvc.yaml; code elsewhere is
warned about; and whatever it is, an interrupted run's checkpoint is resumed only for the same reward code."""

from __future__ import annotations

import dataclasses
import hashlib
import shutil
from importlib.metadata import version

import pytest
from ruamel.yaml import YAML

from stages import ppo, ppo_run, resume, scoring
from stages.artifacts import PPO_CHECKPOINTS
from tests.conftest import ROOT

DVC_STAGES = YAML(typ="safe", pure=True).load((ROOT / "dvc.yaml").read_text())["stages"]


def with_scorer(params, name: str):
    return dataclasses.replace(params, scorer=dataclasses.replace(params.scorer, source="callable", name=name))


def test_rewards_is_a_dep_of_ppo_and_its_example_scores_texts():
    from rewards.example import keyword_sentiment

    assert scoring.REWARDS in DVC_STAGES["ppo"]["deps"]
    assert keyword_sentiment(["A good, FUN movie.", "dull and slow but good", ""]) == [2.0, -1.0, 0.0]


def test_reward_code_under_rewards_is_fingerprinted_without_a_warning(tiny_params, capfd):
    origin = scoring.scorer_origin(with_scorer(tiny_params, "rewards.example:keyword_sentiment"))
    expected = hashlib.sha256(b"example.py\0" + (ROOT / "rewards" / "example.py").read_bytes()).hexdigest()
    assert origin == {"code": {"rewards/example.py": resume.digest(ROOT / "rewards" / "example.py")}}
    assert origin["code"]["rewards/example.py"] == expected
    assert capfd.readouterr().err == ""


def test_reward_code_elsewhere_is_fingerprinted_with_a_one_line_warning(tiny_params, tmp_path, monkeypatch, capfd):
    (tmp_path / "myreward.py").write_text("def score(texts):\n    return [1.0] * len(texts)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "myreward", raising=False)
    origin = scoring.scorer_origin(with_scorer(tiny_params, "myreward:score"))
    path = str((tmp_path / "myreward.py").resolve())
    assert origin == {"code": {path: resume.digest(tmp_path / "myreward.py")}}
    assert capfd.readouterr().err == (
        f"warning: ppo: scorer.name 'myreward:score' is defined in {path}, which dvc.yaml does not track: editing it "
        "will not rerun ppo; move it under rewards/ (scorer.name: rewards.myreward:score)\n")


def test_an_installed_package_reward_is_known_by_its_version(tiny_params, capfd):
    assert scoring.scorer_origin(with_scorer(tiny_params, "tqdm:tqdm")) == {"versions": {"tqdm": version("tqdm")}}
    assert capfd.readouterr().err == ""


def test_a_pipeline_model_directory_is_an_input_of_the_fingerprint(tiny_params, tiny_run):
    model = tiny_run / "data" / "models" / "reward"
    params = dataclasses.replace(tiny_params, scorer=dataclasses.replace(tiny_params.scorer, source="pipeline",
                                                                         name=str(model)))
    assert scoring.scorer_origin(params) == {"inputs": {str(model): resume.digest(model)}}


@pytest.mark.slow
def test_an_edit_to_the_reward_code_starts_an_interrupted_run_afresh(tiny_run, tiny_params, tmp_path, monkeypatch,
                                                                      capfd):
    """The user edits their reward function after a run was interrupted: the checkpoint holds scores of the old
    function, so the rerun must start fresh rather than resume (on_mismatch: restart says so)."""
    module = tmp_path / "editable_reward.py"
    module.write_text("def score(texts):\n    return [float(len(t) % 3) for t in texts]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    params = with_scorer(tiny_params, "editable_reward:score")
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root)
    monkeypatch.setattr(ppo_run, "discard", lambda directory: None)  # as if killed after publishing
    ppo.run(params, root)
    assert (root / PPO_CHECKPOINTS / ppo_run.STATE).exists()

    module.write_text("def score(texts):\n    return [float(len(t) % 5) for t in texts]\n")
    monkeypatch.delitem(__import__("sys").modules, "editable_reward")
    capfd.readouterr()
    ppo.run(params, root)
    err = capfd.readouterr().err
    assert f"data/checkpoints/ppo was written with other code ({module.resolve()} changed); starting fresh" in err
    assert "resuming" not in err

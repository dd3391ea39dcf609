"""stages/sources.py: the user's reward code found (not imported) and hashed wherever it lies, an installed package's
reward known by its version, a pipeline model by its directory's digest: what the sources stage records, so that DVC
reruns ppo when it changes."""

from __future__ import annotations

import dataclasses
import hashlib
from importlib.metadata import version

from stages import sources
from stages.shared import resume
from tests.conftest import ROOT
from tests.stages.test_scoring import with_scorer


def test_reward_code_under_rewards_is_fingerprinted_without_a_warning(tiny_params, capfd):
    origin = sources.scorer_origin(with_scorer(tiny_params, "rewards.example:keyword_sentiment"))
    expected = hashlib.sha256(b"example.py\0" + (ROOT / "rewards" / "example.py").read_bytes()).hexdigest()
    assert origin == {"code": {"rewards/example.py": resume.digest(ROOT / "rewards" / "example.py")}}
    assert origin["code"]["rewards/example.py"] == expected
    assert capfd.readouterr().err == ""


def test_reward_code_elsewhere_is_found_and_hashed_without_running_it(tiny_params, tmp_path, monkeypatch, capfd):
    (tmp_path / "myreward.py").write_text("raise SystemExit('imported')\ndef score(texts):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "myreward", raising=False)
    origin = sources.scorer_origin(with_scorer(tiny_params, "myreward:score"))
    path = str((tmp_path / "myreward.py").resolve())
    assert origin == {"code": {path: resume.digest(tmp_path / "myreward.py")}}
    assert capfd.readouterr().err == "" and "myreward" not in __import__("sys").modules


def test_an_installed_package_reward_is_known_by_its_version(tiny_params, capfd):
    assert sources.scorer_origin(with_scorer(tiny_params, "tqdm:tqdm")) == {"versions": {"tqdm": version("tqdm")}}
    assert capfd.readouterr().err == ""


def test_a_pipeline_model_directory_is_an_input_of_the_fingerprint(tiny_params, tiny_run):
    model = tiny_run / "data" / "models" / "reward"
    params = dataclasses.replace(tiny_params, scorer=dataclasses.replace(tiny_params.scorer, source="pipeline",
                                                                         name=str(model)))
    assert sources.scorer_origin(params) == {"inputs": {str(model): resume.digest(model)}}


def test_status_says_which_local_source_changed_since_the_last_run(tiny_params, tmp_path, monkeypatch):
    """`rlhf status`: what `dvc status` cannot see (a local data file edited since the last `dvc repro`), and which
    stages the next run reruns for it; nothing written."""
    from typer.testing import CliRunner

    from stages.shared.cli import app
    from tests.conftest import write_params

    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"query": "prompt {i} is"}}\n' for i in range(300)))
    params = write_params(tmp_path, {"data.prompts.source": "prompts.jsonl"})
    result = CliRunner().invoke(app, ["status", "--params", str(params)])
    assert result.exit_code == 0 and "not recorded yet" in result.stdout  # no run yet
    CliRunner().invoke(app, ["sources", "--params", str(params)])
    before = {p: p.read_bytes() for p in (tmp_path / "data" / "sources").iterdir()}
    result = CliRunner().invoke(app, ["status", "--params", str(params)])
    assert result.stdout == "status: the local data, model and scorer are as the last run recorded them\n"
    prompts.write_text(prompts.read_text() + '{"query": "one more prompt"}\n')
    result = CliRunner().invoke(app, ["status", "--params", str(params)])
    assert result.exit_code == 0 and result.stdout == (
        "status: data.prompts.source (prompts.jsonl) changed since the last run: the next `dvc repro` reruns prepare "
        "and what follows\n")
    assert {p: p.read_bytes() for p in (tmp_path / "data" / "sources").iterdir()} == before


def test_status_says_a_changed_scorer_once(tiny_params, tmp_path):
    """A scorer changed from the reward model to a function of the user's changes three entries of its record (its
    source, its name, its code): `rlhf status` says so in one line, not three."""
    sources.run(tiny_params, tmp_path)
    assert sources.changes(tiny_params, tmp_path) == []
    assert sources.changes(with_scorer(tiny_params, "rewards.example:keyword_sentiment"), tmp_path) == [
        "scorer (callable rewards.example:keyword_sentiment) changed since the last run: the next `dvc repro` reruns "
        "ppo and evaluate and what follows"]

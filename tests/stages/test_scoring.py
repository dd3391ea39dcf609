"""stages/shared/scoring.py: the scorer built from the params (a pipeline model's named label, a callable that cannot be
imported, a reward module a queued experiment lacks), rewards/ as a dep of ppo, and an interrupted run's checkpoint
resumed only for the same reward code. How the reward code is found and hashed: tests/stages/test_sources.py."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
from ruamel.yaml import YAML
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from stages import ppo, sources
from stages.ppo import checkpoints
from stages.shared import scoring
from stages.shared.artifacts import PPO_CHECKPOINTS, SFT_MODEL
from stages.shared.params import ScorerParams
from stages.shared.runtime import StageError
from tests.conftest import ROOT

DVC_STAGES = YAML(typ="safe", pure=True).load((ROOT / "dvc.yaml").read_text())["stages"]


def with_scorer(params, name: str):
    return dataclasses.replace(params, scorer=dataclasses.replace(params.scorer, source="callable", name=name))


def test_rewards_is_a_dep_of_ppo_and_its_example_scores_texts():
    from rewards.example import keyword_sentiment

    assert scoring.REWARDS in DVC_STAGES["ppo"]["deps"]
    assert keyword_sentiment(["A good, FUN movie.", "dull and slow but good", ""]) == [2.0, -1.0, 0.0]



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
    monkeypatch.setattr(checkpoints, "discard", lambda directory: None)  # as if killed after publishing
    ppo.run(params, root)
    assert (root / PPO_CHECKPOINTS / checkpoints.STATE).exists()

    module.write_text("def score(texts):\n    return [float(len(t) % 5) for t in texts]\n")
    monkeypatch.delitem(__import__("sys").modules, "editable_reward")
    capfd.readouterr()
    ppo.run(params, root)
    err = capfd.readouterr().err
    assert f"data/checkpoints/ppo was written with other code ({module.resolve()} changed); starting fresh" in err
    assert "resuming" not in err


def test_a_missing_reward_module_in_a_queued_experiment_says_to_git_add_it(tiny_params, tmp_path, monkeypatch):
    """A queued (or --temp) experiment runs in a copy of the project under .dvc/tmp/exps that holds only what git
    tracks: a reward module the user has not added is missing there, and the error says how to give it."""
    copy = tmp_path / "project" / ".dvc" / "tmp" / "exps" / "tmpabc123"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    params = with_scorer(tiny_params, "rewards.my_reward:score")
    with pytest.raises(scoring.StageError, match=r"scorer.name 'rewards.my_reward:score' is not an importable "
                                                 r"'module:function' \(No module named 'rewards.my_reward'\); queued "
                                                 r"experiments run in a copy of the project that holds only the files "
                                                 r"git tracks: `git add rewards/my_reward.py` \(staging is enough\), "
                                                 r"or pass `-C rewards/my_reward.py` to `dvc exp run`$"):
        scoring.build_scorer(params, copy)
    with pytest.raises(scoring.StageError, match="`git add rewards/my_reward.py`"):  # the sources stage, first
        sources.scorer_origin(params)
    monkeypatch.chdir(tmp_path)  # the workspace: no such hint
    with pytest.raises(scoring.StageError, match=r"\(No module named 'rewards.my_reward'\)$"):
        scoring.build_scorer(params, tmp_path)


def test_pipeline_scorer_reads_the_named_label(tiny_run, tiny_params, tmp_path):
    """scorer.source: pipeline, as in the seed: a text-classification model's raw score of one label."""
    labels = {0: "NEGATIVE", 1: "POSITIVE"}
    model = AutoModelForSequenceClassification.from_pretrained(
        tiny_run / SFT_MODEL, num_labels=2, id2label=labels, label2id={v: k for k, v in labels.items()})
    tokenizer = AutoTokenizer.from_pretrained(tiny_run / SFT_MODEL)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(tmp_path / "clf")
    tokenizer.save_pretrained(tmp_path / "clf")
    scorer = ScorerParams(source="pipeline", name=str(tmp_path / "clf"), label="POSITIVE", batch_size=4)
    score = scoring.build_scorer(dataclasses.replace(tiny_params, scorer=scorer), tiny_run)
    texts = ["the movie was good.", "the plot was bad.", "the cast"]
    scores = score(texts)
    logits = model.eval()(**tokenizer(texts[:1], return_tensors="pt")).logits.detach()
    assert len(scores) == 3 and scores[0] == pytest.approx(float(logits[0, 1]), abs=1e-5)
    wrong = dataclasses.replace(scorer, label="HAPPY")
    with pytest.raises(StageError, match="scorer.label 'HAPPY' is not a label"):
        scoring.build_scorer(dataclasses.replace(tiny_params, scorer=wrong), tiny_run)(texts)


def test_bad_callable_scorer_is_a_clear_error(tiny_params, tmp_path):
    scorer = ScorerParams(source="callable", name="no_such_module:score", label="POSITIVE", batch_size=8)
    with pytest.raises(StageError, match="scorer.name 'no_such_module:score' is not an importable"):
        scoring.build_scorer(dataclasses.replace(tiny_params, scorer=scorer), tmp_path)


SIGNATURES = '''def two_args(texts, labels):
    return [0.0] * len(texts)

def keywords_only(*, texts):
    return [0.0] * len(texts)

def texts_and_options(texts, scale=1.0, **columns):
    return [scale] * len(texts)

class Scorer:
    def __call__(self, texts, extra):
        return [0.0] * len(texts)

scorer = Scorer()
'''


def test_a_scorer_that_cannot_take_the_texts_is_refused_naming_its_file(tiny_params, tmp_path, monkeypatch):
    """A function that cannot be called with one positional argument, the list of texts, is refused where it is loaded,
    in one line naming the function and its file and line: called, its TypeError would point at
    stages/shared/scoring.py. Extra parameters with defaults, or keyword ones (**columns), are accepted."""
    (tmp_path / "signatures.py").write_text(SIGNATURES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(__import__("sys").modules, "signatures", raising=False)
    for name, shown in (("two_args", "two_args(texts, labels) (signatures.py:1)"),
                        ("keywords_only", "keywords_only(*, texts) (signatures.py:4)"),
                        ("scorer", "Scorer(texts, extra) (signatures.py:11)")):
        with pytest.raises(StageError) as caught:
            scoring.build_scorer(with_scorer(tiny_params, f"signatures:{name}"), tmp_path)
        assert str(caught.value) == (
            f"{tiny_params.path}: scorer.name 'signatures:{name}': {shown} cannot be called with one argument, the "
            "list of texts; give its other parameters defaults, or wrap it in a def score(texts)")
    assert scoring.build_scorer(with_scorer(tiny_params, "signatures:texts_and_options"), tmp_path)(["a"]) == [1.0]

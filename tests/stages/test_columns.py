"""Columns that travel with each prompt (`data.prompts.keep`) and reward functions that see the row (issue 47, items 1
and 3): a prompt's answer goes through prepare, tokenize, every rollout row and evaluate's samples unchanged, and a
function ``f(completions, answer, **kwargs)`` scores each response against its own prompt's answer, as TRL's
GRPOTrainer calls reward functions."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pandas as pd
import pytest

from stages import evaluate, ppo, prepare, tokenize
from stages.shared.artifacts import EVAL_SAMPLES, RAW_PROMPTS_EVAL, RAW_PROMPTS_TRAIN, TOKENIZED_EVAL, TOKENIZED_TRAIN
from stages.shared.params import DatasetSpec
from stages.shared.runtime import StageError
from stages.shared.scoring import Row, load_callable, scored, takes_the_row

WORDS = ("the film was", "the plot was", "the cast was", "the music was", "the ending was", "the acting was",
         "this movie was", "the story was", "the script was", "the pacing was")


def answer_of(query: str) -> int:
    """Each prompt's answer: a function of the prompt alone, so any row can be checked against its own query."""
    return sum(map(ord, query)) % 97


def write_prompts(path, queries):
    """A JSONL of prompts with an answer and a nested `meta` column per row (the source's own names)."""
    rows = [{"question": q, "answer": answer_of(q), "meta": {"id": i, "tags": ["a", "b"][: i % 3]}}
            for i, q in enumerate(queries)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def with_prompts(params, source, keep=("answer", "meta"), **data):
    """``params`` with the prompts of ``source`` keeping ``keep``, whole (no cut: each query is its source's)."""
    prompts = DatasetSpec(source=str(source), split="train", columns={"query": "question"}, n=None, keep=list(keep))
    whole = dataclasses.replace(params.tokenize, max_query_tokens=None, truncation="refuse")
    return dataclasses.replace(params, data=dataclasses.replace(params.data, prompts=prompts, **data), tokenize=whole)


REWARDS = '''
SEEN = []

def accuracy(completions, answer, prompts, **kwargs):
    """1 where the row's answer is its own prompt's (it must be: the test checks the stages keep rows together)."""
    from tests.stages.test_columns import answer_of
    SEEN.append(list(zip(prompts, answer, kwargs["meta"])))
    return [float(a == answer_of(p)) for p, a in zip(prompts, answer)]

def wants_missing(completions, label):
    return [1.0] * len(completions)

def sometimes(completions, **kwargs):
    return [None if i % 2 else 2.0 for i in range(len(completions))]

CALLS = []

def trl_style(prompts, completions, completion_ids, trainer_state, **kwargs):
    """TRL's GRPOTrainer's other two arguments: each completion's token ids and the trainer's state."""
    CALLS.append((list(completions), [list(ids) for ids in completion_ids], trainer_state.global_step,
                  trainer_state.max_steps))
    return [float(len(ids)) for ids in completion_ids]
'''


def written_module(name: str, source: str, folder, monkeypatch):
    """The module ``name`` of ``source``, written to ``folder`` and imported afresh (a user's reward file)."""
    import importlib

    (folder / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(__import__("sys").modules, name, raising=False)
    return importlib.import_module(name)


@pytest.fixture
def rewards_module(tmp_path, monkeypatch):
    return written_module("row_rewards", REWARDS, tmp_path, monkeypatch)


def test_kept_columns_go_through_prepare_and_tokenize_row_by_row(tiny_run, tiny_params, tmp_path):
    source = tmp_path / "qa.jsonl"
    write_prompts(source, [f"{w} {i}" for i in range(4) for w in WORDS])  # 40 prompts, shuffled by prepare
    params = with_prompts(tiny_params, source, n_eval_prompts=8)
    summary = prepare.run(params, tmp_path)
    assert "with answer, meta" in summary
    for path in (RAW_PROMPTS_TRAIN, RAW_PROMPTS_EVAL):
        raw = pd.read_parquet(tmp_path / path)
        assert list(raw.columns) == ["query", "answer", "meta"]
        assert [answer_of(q) for q in raw["query"]] == raw["answer"].tolist()
    shutil.copytree(tiny_run / "data" / "models" / "sft", tmp_path / "data" / "models" / "sft")
    tokenize.run(params, tmp_path)
    for path in (TOKENIZED_TRAIN, TOKENIZED_EVAL):
        table = pd.read_parquet(tmp_path / path)
        assert list(table.columns) == ["query", "input_ids", "answer", "meta"]
        assert [answer_of(q) for q in table["query"]] == table["answer"].tolist()
        assert all(m["tags"].tolist() == ["a", "b"][: m["id"] % 3] for m in table["meta"])  # nested, as given


def test_a_kept_column_the_source_lacks_or_cannot_store_is_one_line_at_prepare(tiny_params, tmp_path):
    source = tmp_path / "qa.jsonl"
    write_prompts(source, [f"{w} {i}" for i in range(2) for w in WORDS])
    with pytest.raises(StageError, match=r"qa.jsonl: column 'answr' not found \(data.prompts.keep names it\)"):
        prepare.run(with_prompts(tiny_params, source, keep=["answr"], n_eval_prompts=2), tmp_path)
    rows = [{"question": f"{w} x", "answer": 3} for w in WORDS]
    rows[6]["answer"] = {"not": "a number"}
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(StageError, match=r"qa.jsonl: column 'answer' \(data.prompts.keep\) cannot be stored: row 7 "
                                         r"holds \{'not': 'a number'\} \(dict\)"):
        prepare.run(with_prompts(tiny_params, source, keep=["answer"], n_eval_prompts=2), tmp_path)


def test_a_reward_function_is_told_apart_by_its_signature(rewards_module):
    assert takes_the_row(rewards_module.accuracy) and takes_the_row(rewards_module.sometimes)
    assert not takes_the_row(lambda texts: [0.0] * len(texts))  # today's texts -> scores: called as it was


def test_none_means_the_reward_does_not_apply_and_counts_0(rewards_module, tiny_params):
    row = Row(["p1", "p2", "p3"], ["a", "b", "c"], {})
    assert scored(rewards_module.sometimes, ["x"] * 3, tiny_params.scorer, "here", "f", row) == [2.0, 0.0, 2.0]
    with pytest.raises(StageError, match=r"returned None \(NoneType\) for text 0; return a number"):  # no row: a number
        scored(lambda texts: [None] * len(texts), ["x"], tiny_params.scorer, "here", "f")


def test_a_row_function_that_takes_a_column_nobody_keeps_is_refused_at_load(rewards_module, tiny_params):
    with pytest.raises(StageError, match=r"takes 'label', which is not a column of the prompts: add it to "
                                         r"data.prompts.keep \(kept now: none\)"):
        load_callable("row_rewards:wants_missing", "scorer.name", tiny_params)


def test_each_response_is_scored_against_its_own_prompt_s_answer_through_ppo_and_evaluate(
        tiny_run, tiny_params, tmp_path, rewards_module):
    """GRPO with 2 samples a prompt, a callable scorer that takes the row: each of a step's responses is scored with
    its own prompt's answer (the scorer returns 1 only then), every rollout row and evaluate's samples hold it."""
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints", "ppo", "eval", "report", "logs"))
    source = tmp_path / "qa.jsonl"
    write_prompts(source, [f"{w} {i}" for i in range(4) for w in WORDS])
    params = with_prompts(tiny_params, source, n_eval_prompts=8)
    params = dataclasses.replace(
        params, scorer=dataclasses.replace(params.scorer, source="callable", name="row_rewards:accuracy"),
        ppo={**params.ppo, "advantage_estimator": "grpo", "num_generations": 2},
        evaluate=dataclasses.replace(params.evaluate, judges={"accuracy": "row_rewards:accuracy"}))
    prepare.run(params, root)
    tokenize.run(params, root)
    ppo.run(params, root)
    seen = [x for batch in rewards_module.SEEN for x in batch]
    assert seen and all(answer == answer_of(prompt) for prompt, answer, _ in seen)
    rollouts = pd.concat(pd.read_parquet(p) for p in sorted((root / "data" / "ppo" / "rollouts").glob("*.parquet")))
    assert {"answer", "meta"} <= set(rollouts.columns) and (rollouts["score"] == 1.0).all()
    assert (rollouts.groupby("query")["answer"].nunique() == 1).all()  # a prompt's G samples: one answer
    evaluate.run(params, root)
    samples = pd.read_parquet(root / EVAL_SAMPLES)
    assert {"answer", "meta"} <= set(samples.columns)
    assert (samples["score"] == 1.0).all() and (samples["accuracy"] == 1.0).all()



def test_a_trl_reward_function_gets_the_completions_token_ids_and_the_trainer_state(tiny_run, tiny_params, tmp_path,
                                                                                    rewards_module):
    """``f(prompts, completions, completion_ids, trainer_state, **kwargs)``, as TRL's GRPOTrainer calls it: each
    completion's token ids (EOS kept, no padding: they decode to the completion) and a transformers TrainerState whose
    global_step is the ppo steps done (0 for the first step's rollouts, k + 1 at the held-out watch after step k, all
    of them in evaluate) and max_steps the run's."""
    from transformers import AutoTokenizer

    from stages.shared.artifacts import SFT_MODEL

    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints", "ppo", "eval", "report", "logs"))
    params = dataclasses.replace(tiny_params, scorer=dataclasses.replace(
        tiny_params.scorer, source="callable", name="row_rewards:trl_style", input="response"),
        watch=dataclasses.replace(tiny_params.watch, eval_prompts=4))  # told apart from a step's 8 by their count
    steps = params.ppo_config.total_ppo_epochs
    ppo.run(params, root)
    tokenizer = AutoTokenizer.from_pretrained(root / SFT_MODEL)
    calls = rewards_module.CALLS
    for completions, ids, _, max_steps in calls:
        assert max_steps == steps and len(ids) == len(completions)
        assert tokenizer.batch_decode(ids, skip_special_tokens=True) == completions
    trained = [step for _, ids, step, _ in calls if len(ids) == params.ppo["batch_size"]]
    watched = [step for _, ids, step, _ in calls if len(ids) == params.watch.eval_prompts]
    assert trained == list(range(steps))
    assert watched == list(range(params.watch.eval_every, steps + 1, params.watch.eval_every))
    rollouts = pd.concat(pd.read_parquet(p) for p in sorted((root / "data" / "ppo" / "rollouts").glob("*.parquet")))
    assert rollouts["score"].tolist() == [float(len(ids)) for ids in rollouts["response_ids"]]
    del calls[:]
    evaluate.run(params, root)
    assert calls and all(step == steps for _, _, step, _ in calls)


def test_the_shipped_answer_rewards_check_the_last_number_and_load_as_row_functions(tiny_params):
    import doctest

    import rewards.answers

    assert doctest.testmod(rewards.answers).failed == 0
    assert rewards.answers.accuracy(["1,200 in all", "about 3.5", "-4"], answer=[1200, "3.5", -5]) == [1.0, 1.0, 0.0]
    kept = dataclasses.replace(tiny_params.data.prompts, keep=["answer"])
    params = dataclasses.replace(tiny_params, data=dataclasses.replace(tiny_params.data, prompts=kept))
    fn = load_callable("rewards.answers:accuracy", "scorer.name", params)
    row = Row(["q1", "q2"], ["it is 4", "it is 5"], {"answer": [4, 4]})
    assert scored(fn, ["x", "y"], params.scorer, "here", "accuracy", row) == [1.0, 0.0]

"""stages/fetch_tasks.py without the model: reasoning-gym's problems (distinct, their answers right), the worked answers
SFT learns (each step's arithmetic right, the result last, accepted by the task's own checker), the pairs, and the
held-out prompts prepare takes from them, which are neither SFT problems nor RL prompts. Skipped where reasoning-gym is
not installed (`make example-verifiable` and `make test` install it)."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("reasoning_gym")

from rewards.verifiable import accuracy, answer_format
from stages import fetch_tasks, prepare
from stages.shared.artifacts import RAW_PROMPTS_EVAL, RAW_PROMPTS_TRAIN, RAW_SFT, write_parquet
from stages.shared.params import load_params
from stages.shared.runtime import StageError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_PARAMS = ROOT / "examples" / "verifiable" / "params.yaml"
STEP = re.compile(r"^(-?\d+) ([+-]) (\d+) = (-?\d+)$")  # one sentence of a worked answer, its full stop cut


def by_hand(expression: str) -> int:
    """The value of a chain sum, left to right: "23 + 45 - 17" -> 51 (the expression's own operators, Python's ints)."""
    terms = expression.split()
    total = int(terms[0])
    for op, term in zip(terms[1::2], terms[2::2]):
        total = total + int(term) if op == "+" else total - int(term)
    return total


@pytest.fixture(scope="module")
def generated():
    return fetch_tasks.problems(600, seed=0)


def test_the_problems_are_distinct_chain_sums_whose_answers_are_right(generated):
    assert len({p["question"] for p in generated}) == len(generated) == 600
    for p in generated:
        assert p["question"] == f"State the final answer to the following arithmetic problem: {p['expression']} ="
        assert p["answer"] == str(by_hand(p["expression"]))
        terms = p["expression"].split()[::2]
        assert 2 <= len(terms) <= 3 and all(len(t) == 1 for t in terms)  # TASK_CONFIG's 2-3 terms of 1 digit
    assert {len(p["expression"].split()) for p in generated} == {3, 5}  # both sizes drawn


def test_the_same_seed_gives_the_same_problems_and_another_seed_others(generated):
    assert fetch_tasks.problems(600, seed=0) == generated
    assert fetch_tasks.problems(600, seed=1) != generated


def test_too_few_distinct_problems_is_one_line(monkeypatch):
    monkeypatch.setattr(fetch_tasks, "TASK_CONFIG", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})
    with pytest.raises(StageError, match=r"gave 1\d\d distinct problems in 1200, fewer than the 300 asked; widen"):
        fetch_tasks.problems(300, seed=0)  # one-digit sums of two terms: 200 of them (10 x 10 x 2)


def test_worked_answers_by_hand():
    assert fetch_tasks.worked_answer("23 + 45 - 17") == "23 + 45 = 68. 68 - 17 = 51. The answer is 51."
    assert fetch_tasks.worked_answer("3 - 8 + 2") == "3 - 8 = -5. -5 + 2 = -3. The answer is -3."
    assert fetch_tasks.worked_answer("4 - 1") == "4 - 1 = 3. The answer is 3."


def test_every_worked_answer_computes_each_step_right_and_states_the_answer_last(generated):
    for p in generated:
        *steps, last = fetch_tasks.worked_answer(p["expression"]).split(". ")
        assert last == f"The answer is {p['answer']}."
        previous = p["expression"].split()[0]
        for step in steps:
            a, op, b, result = STEP.match(step).groups()
            assert a == previous and int(result) == (int(a) + int(b) if op == "+" else int(a) - int(b))
            previous = result
        assert previous == p["answer"]


def test_the_task_s_checker_accepts_every_worked_answer_and_a_wrong_one_stops_the_stage(generated):
    completions = [fetch_tasks.worked_answer(p["expression"]) for p in generated]
    fetch_tasks.check_answers(generated, completions)  # no error
    completions[7] = completions[7].replace("The answer is ", "The answer is 1")
    with pytest.raises(StageError, match=re.escape(f"problem {generated[7]['question']!r} (answer "
                                                   f"{generated[7]['answer']}) is not solved by its worked answer")):
        fetch_tasks.check_answers(generated, completions)


def test_the_split_is_disjoint_and_both_sides_hold_the_same_mixture(generated):
    solved, prompts = fetch_tasks.split(generated, 300, seed=0)
    assert len(solved) == len(prompts) == 300
    assert not {p["question"] for p in solved} & {p["question"] for p in prompts}
    assert solved != generated[:300]  # shuffled: reasoning-gym gives the few one-digit sums first
    one_digit_sums = [sum(len(p["expression"]) <= 5 for p in side) for side in (solved, prompts)]
    assert abs(one_digit_sums[0] - one_digit_sums[1]) < 25, one_digit_sums


def test_pairs_choose_the_worked_answer_over_the_same_one_with_a_wrong_result(generated):
    completions = [fetch_tasks.worked_answer(p["expression"]) for p in generated]
    table = fetch_tasks.pairs(generated, completions, seed=0)
    assert table["chosen"] == completions
    answers = [p["answer"] for p in generated]
    assert accuracy(table["chosen"], answers) == [1.0] * 600
    assert accuracy(table["rejected"], answers) == [0.0] * 600
    assert answer_format(table["rejected"]) == [1.0] * 600
    for chosen, rejected in zip(table["chosen"], table["rejected"]):
        assert chosen.rsplit("The answer is", 1)[0] == rejected.rsplit("The answer is", 1)[0]
    assert table["prompt"] == [p["question"] + " " for p in generated]


def test_the_held_out_prompts_are_neither_sft_problems_nor_training_prompts(tmp_path, monkeypatch):
    """The tables fetch_tasks writes, then prepare with the example's params: at least 200 held-out problems, none of
    them an SFT problem or a prompt RL trains on, each with its answer."""
    for path, table in fetch_tasks.problem_tables(seed=0).items():
        write_parquet(table, tmp_path / path)
    monkeypatch.chdir(tmp_path)
    params = load_params(EXAMPLE_PARAMS)
    prepare.run(params, tmp_path)
    sft, train, held_out = (pd.read_parquet(tmp_path / p) for p in (RAW_SFT, RAW_PROMPTS_TRAIN, RAW_PROMPTS_EVAL))
    assert len(held_out) == params.data.n_eval_prompts >= 200
    assert len(sft) == params.data.sft.n and len(train) == params.data.prompts.n - len(held_out)
    assert not set(held_out["query"]) & set(sft["prompt"]) and not set(held_out["query"]) & set(train["query"])
    assert not set(train["query"]) & set(sft["prompt"])
    expressions = held_out["query"].str.removeprefix("State the final answer to the following arithmetic problem: ")
    assert [str(by_hand(e.removesuffix(" ="))) for e in expressions] == held_out["answer"].tolist()


def test_a_missing_package_is_one_line_naming_the_make_target(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "reasoning_gym" else real(name))
    with pytest.raises(StageError, match=r"^the package reasoning_gym is not installed; `make example-verifiable`"):
        fetch_tasks.run(load_params(EXAMPLE_PARAMS), Path("unused"))

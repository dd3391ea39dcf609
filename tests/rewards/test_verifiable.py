"""rewards/verifiable.py, the verifiable example's rewards: the stated answer read from a response, reasoning-gym's
checker made 0/1, the format reward, and their sum, by hand; then as the stages load and call them (by keyword, each
response against its own prompt's kept answer). Skipped where reasoning-gym is not installed (`make
example-verifiable` and `make test` install it)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("reasoning_gym")

from rewards import verifiable
from rewards.verifiable import accuracy, answer_format, stated_answer
from stages.shared.params import load_params
from stages.shared.scoring import Combined, Row, build_scorer, scored, takes_the_row

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE_PARAMS = ROOT / "examples" / "verifiable" / "params.yaml"


@pytest.mark.parametrize(("completion", "stated"), [
    ("23 + 45 = 68. 68 - 17 = 51. The answer is 51.", "51"),
    ("3 - 8 = -5. The answer is -5", "-5"),               # no final full stop
    ("The answer is 1,000.", "1000"),                     # a thousands comma, as the checker strips it
    ("The answer is 7. Then 7 + 1 = 8.", "7"),            # the answer sentence, not the last number
    ("The answer is 7. No wait. The answer is 9.", "9"),  # the last answer sentence
    ("I think it is 12", "12"),                           # no answer sentence: the last number
    ("no idea", None),
])
def test_the_stated_answer_by_hand(completion, stated):
    assert stated_answer(completion) == stated


def test_accuracy_is_the_checker_s_full_credit_only():
    """reasoning-gym's chain_sum checker gives 0.5 to "15" for 5 (the answer inside a wrong number); that is wrong
    here. A number written as the checker tolerates it ("+05", "5.0") is right; None where a prompt has no answer."""
    assert verifiable.score_answer("15", {"answer": "5"}) == 0.5  # what the checker gives, kept out of the reward
    completions = ["The answer is 5.", "The answer is 15.", "The answer is +05.", "The answer is 5.0.", "It is -5",
                   "five", "The answer is 5."]
    assert accuracy(completions, answer=["5", "5", "5", "5", "-5", "5", None]) == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0, None]
    assert accuracy(["The answer is 12."], answer=[12]) == [1.0]  # an integer column reads as its text


def test_the_format_is_the_answer_sentence_last():
    completions = ["2 + 3 = 5. The answer is 5.", "The answer is -5", "The answer is 5. Hope it helps!",
                   "2 + 3 = 5", "The answer is five.", "Then The answer is 5.", "  The answer is 5.\n"]
    assert answer_format(completions) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0]


def test_the_stages_call_them_by_keyword_each_response_against_its_own_prompt_s_answer():
    """The example's scorer combines accuracy (weight 1) and the format (weight 0.1), each called as ppo calls it with
    num_generations 2: the two responses to one prompt both get that prompt's answer, the next prompt's two theirs. A
    right answer earns 1.1, a wrong one in form 0.1; where a prompt has no answer, accuracy does not apply (None, left
    out of the sum as TRL leaves it out) and the format alone counts."""
    params = load_params(EXAMPLE_PARAMS)
    score = build_scorer(params, EXAMPLE_PARAMS.parent)
    assert isinstance(score, Combined)
    assert score.functions == {"correct": (accuracy, 1.0), "format": (answer_format, 0.1)}
    assert takes_the_row(accuracy) and takes_the_row(answer_format)
    row = Row(prompts=["1 + 2 =", "1 + 2 =", "5 - 9 =", "5 - 9 ="],
              completions=["The answer is 3.", "The answer is -4.", "The answer is 3.", "5 - 9 = -4. The answer is -4"],
              columns={"answer": ["3", "3", "-4", "-4"]})
    assert scored(score, row.completions, params.scorer, "PPO step 1", row=row) == pytest.approx([1.1, 0.1, 0.1, 1.1])
    assert score.last == {"correct": [1.0, 0.0, 0.0, 1.0], "format": [1.0, 1.0, 1.0, 1.0]}
    none = row._replace(columns={"answer": ["3", None, "-4", "-4"]})
    assert scored(score, row.completions, params.scorer, "PPO step 1", row=none) == pytest.approx([1.1, 0.1, 0.1, 1.1])
    assert score.last["correct"] == [1.0, None, 0.0, 1.0]

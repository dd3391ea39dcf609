"""stages/shared/synthetic.py: the documented gold-score rules, and data with the properties the pipeline relies on."""

from __future__ import annotations

import statistics

import pytest

from stages.shared import synthetic
from stages.shared.synthetic import gold_score


@pytest.mark.parametrize(("text", "expected"), [
    ("was very good", 2),            # intensifier doubles: +1 * 2
    ("was not bad", 1),              # negator flips: -1 * -1
    ("was not very good", -2),       # both: +1 * 2 * -1
    ("was dull, but fun", 0),        # -1 + 1
    ("not, good", 1),                # a mark forgets the negator
    ("not good and bad", -2),        # the negator is used once: -1, then -1
    ("the theater was full.", 0),    # fillers carry no sentiment
    ("GREAT. Great!", 2),            # case-insensitive
])
def test_gold_score_rules(text, expected):
    assert gold_score(text) == expected


def test_reviews_are_neutral_on_average_and_short():
    texts = synthetic.reviews(4000, seed=0)
    golds = [gold_score(t) for t in texts]
    assert abs(statistics.mean(golds)) < 0.15  # symmetric moods; sd is about 2.8
    assert statistics.pstdev(golds) > 2
    lengths = [len(t.split()) for t in texts]
    assert min(lengths) >= 3 and max(lengths) <= 30


def test_pairs_prefer_the_higher_gold_score():
    for prompt, chosen, rejected in synthetic.pairs(200, seed=0):
        assert gold_score(prompt + chosen) > gold_score(prompt + rejected)
        assert chosen.startswith(" ") and rejected.startswith(" ")


def test_prompts_are_neutral_openers():
    for prompt in synthetic.prompts(200, seed=0):
        assert 2 <= len(prompt.split()) <= 5
        assert gold_score(prompt) == 0


def test_seeded():
    assert synthetic.reviews(50, seed=1) == synthetic.reviews(50, seed=1)
    assert synthetic.reviews(50, seed=1) != synthetic.reviews(50, seed=2)

"""Rewards checked against each prompt's own answer (verifiable tasks): keep the prompts source's answer column with
each prompt (`data.prompts.keep: [answer]`) and name one of these in params.yaml, e.g.
`scorer: {source: callable, name: rewards.answers:accuracy}`. Each is called as TRL's GRPOTrainer calls reward
functions: by keyword, `completions` (the responses) and every kept column, each a list over the batch.
"""

from __future__ import annotations

import re

NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def final_number(text: str) -> float | None:
    """The last number in ``text`` (the answer a model states last), or None where it states none.

    >>> final_number("3 + 4 = 7, so the answer is 7."), final_number("no idea")
    (7.0, None)
    """
    numbers = NUMBER.findall(text.replace(",", ""))
    return float(numbers[-1]) if numbers else None


def accuracy(completions: list[str], answer: list, **kwargs) -> list[float | None]:
    """1.0 where a completion's last number equals its prompt's answer, else 0.0; None (the reward does not apply:
    it counts 0) where the prompt has no answer.

    >>> accuracy(["so it is 12", "it is 13", "it is 5"], answer=[12, "12", None])
    [1.0, 0.0, None]
    """
    def right(completion: str, expected) -> bool:
        stated = final_number(completion)
        return stated is not None and stated == float(expected)

    return per_answer(completions, answer, right)


def per_answer(completions: list[str], answer: list, right) -> list[float | None]:
    """1.0 where ``right(completion, expected)`` holds for a completion and its prompt's answer, else 0.0; None (the
    reward does not apply: it counts 0) where the prompt has no answer. The loop every accuracy reward shares."""
    return [None if expected is None else float(right(completion, expected))
            for completion, expected in zip(completions, answer)]


def states_a_number(completions: list[str], **kwargs) -> list[float]:
    """A format reward: 1.0 where a completion states a number at all (its last one is read as the answer).

    >>> states_a_number(["it is 7", "seven"])
    [1.0, 0.0]
    """
    return [float(final_number(c) is not None) for c in completions]

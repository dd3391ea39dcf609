"""An example reward function: `scorer: {source: callable, name: rewards.example:keyword_sentiment}` in params.yaml.

It counts sentiment words, a crude stand-in for a learned reward model: the reward a PPO policy maximises can be
any function of the text. Copy this file to start your own; anything imported here must be installed (or live in
this package) so that a queued experiment finds it too.
"""

from __future__ import annotations

import re

POSITIVE = frozenset({"good", "great", "wonderful", "brilliant", "excellent", "fun", "beautiful", "clever", "funny"})
NEGATIVE = frozenset({"bad", "terrible", "awful", "boring", "dull", "weak", "poor", "tedious", "slow"})
WORD = re.compile(r"[a-z]+")


def keyword_sentiment(texts: list[str]) -> list[float]:
    """Per text: the number of POSITIVE words minus the number of NEGATIVE ones (case-insensitive).

    >>> keyword_sentiment(["A good, fun movie.", "Dull and slow, but good"])
    [2.0, -1.0]
    """
    scores = []
    for text in texts:
        words = WORD.findall(text.lower())
        scores.append(float(sum(w in POSITIVE for w in words) - sum(w in NEGATIVE for w in words)))
    return scores

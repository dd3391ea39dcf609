"""Synthetic movie reviews with a known gold sentiment score: the pipeline's default, offline data.

Grammar (`|` a choice, `[x]` optional, each choice uniform unless a probability is given):

    review := opener body
    opener := [lead] subject verb                      2-5 words, e.g. "overall the acting was": the prompt
    body   := phrase (joiner clause){0,2} "."          the continuation a policy writes
    clause := subject verb phrase | filler
    phrase := [negator] [intensifier] adjective [and [intensifier] adjective]
    joiner := "," "and" | "," "but" | "."

Word lists are LEADS, SUBJECTS, VERBS, POSITIVE, NEGATIVE, NEGATORS, INTENSIFIERS and FILLERS below. A review
has a mood p (0.1, 0.5 or 0.9, uniform): each phrase is positive with probability p, and is written either
with an adjective of its polarity, or (probability NEGATION_RATE) with a negator and an adjective of the
opposite polarity ("not bad" is positive). Openers and fillers carry no sentiment. Moods are symmetric, so the
SFT texts are neutral on average.

Gold score (`gold_score`), for any text: split it into lowercase words and the marks "." "," ; each POSITIVE
word scores +1 and each NEGATIVE word -1; an intensifier doubles the next sentiment word, a negator flips its
sign; both are forgotten at a mark, at "and" / "but", and once used. The score is the sum. Examples:
"was very good" = +2, "was not bad" = +1, "was not very good" = -2, "was dull, but fun" = 0.

The gold score labels the preference pairs and is used in evaluation; it is never an input of the policy or
the reward model.
"""

from __future__ import annotations

import random
import re

LEADS = ("", "", "", "honestly", "overall", "i think", "i thought", "to me", "for me", "in short")
SUBJECTS = (
    "the movie", "this movie", "the film", "this film", "the story", "the plot", "the acting", "the cast",
    "the ending", "the script", "the music", "the soundtrack", "the dialogue", "the pacing", "the direction",
    "the visuals", "the lead", "the villain", "the sequel", "the opening", "the finale",
)
VERBS = ("was", "is", "felt", "seemed", "looked")
POSITIVE = (
    "good", "great", "wonderful", "brilliant", "excellent", "moving", "charming", "fun", "beautiful", "superb",
    "delightful", "enjoyable", "clever", "gripping", "stunning", "touching", "funny", "fresh", "smart", "lovely",
)
NEGATIVE = (
    "bad", "terrible", "awful", "boring", "dull", "weak", "poor", "clumsy", "tedious", "bland", "messy",
    "painful", "silly", "predictable", "forgettable", "slow", "flat", "lazy", "ugly", "annoying",
)
NEGATORS = ("not", "never", "hardly")
INTENSIFIERS = ("very", "really", "truly", "extremely", "so")
FILLERS = (
    "i saw it last week", "it runs about two hours", "we watched it at home", "my friend picked it",
    "the theater was full", "it came out in june", "i went with my sister", "we saw the late show",
)
JOINERS = (", and", ", but", ".")
MOODS = (0.1, 0.5, 0.9)
NEGATION_RATE = 0.15
INTENSIFIER_RATE = 0.3
SECOND_ADJECTIVE_RATE = 0.3
FILLER_RATE = 0.25

_WORD = re.compile(r"[a-z]+|[.,]")
_VALENCE = {**{w: 1 for w in POSITIVE}, **{w: -1 for w in NEGATIVE}}
_RESET = {".", ",", "and", "but"}


def gold_score(text: str) -> float:
    """The lexicon score of `text` (rules in the module docstring)."""
    score, sign, scale = 0, 1, 1
    for word in _WORD.findall(text.lower()):
        if word in _VALENCE:
            score += sign * scale * _VALENCE[word]
            sign, scale = 1, 1
        elif word in NEGATORS:
            sign = -1
        elif word in INTENSIFIERS:
            scale = 2
        elif word in _RESET:
            sign, scale = 1, 1
    return float(score)


def opener(rng: random.Random) -> str:
    """[lead] subject verb, e.g. "overall the acting was"."""
    return " ".join(w for w in (rng.choice(LEADS), rng.choice(SUBJECTS), rng.choice(VERBS)) if w)


def body(rng: random.Random) -> str:
    """The continuation of an opener, with a leading space: " really good, but the plot was slow."."""
    mood = rng.choice(MOODS)
    text = " " + _phrase(rng, mood)
    for _ in range(rng.randint(0, 2)):
        if rng.random() < FILLER_RATE:
            clause = rng.choice(FILLERS)
        else:
            clause = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {_phrase(rng, mood)}"
        text += f"{rng.choice(JOINERS)} {clause}"
    return text + "."


def _phrase(rng: random.Random, mood: float) -> str:
    positive = rng.random() < mood
    negated = rng.random() < NEGATION_RATE
    words = [rng.choice(NEGATORS)] if negated else []
    words += _adjective(rng, positive != negated)
    if not negated and rng.random() < SECOND_ADJECTIVE_RATE:
        words += ["and", *_adjective(rng, positive)]
    return " ".join(words)


def _adjective(rng: random.Random, positive: bool) -> list[str]:
    intensifier = [rng.choice(INTENSIFIERS)] if rng.random() < INTENSIFIER_RATE else []
    return intensifier + [rng.choice(POSITIVE if positive else NEGATIVE)]


def reviews(n: int, seed: int) -> list[str]:
    """`n` full reviews (SFT texts)."""
    rng = random.Random(f"{seed}-sft")
    return [opener(rng) + body(rng) for _ in range(n)]


def prompts(n: int, seed: int) -> list[str]:
    """`n` openers (PPO prompts), drawn as shuffled passes over every distinct opener (840): as many distinct prompts
    as `n` allows, so that a held-out set of 200 (data.n_eval_prompts) is a quarter of them at most and none of its
    prompts is a training prompt (prepare splits by distinct prompt). Independent draws would give 633 distinct
    prompts in 1,400."""
    rng = random.Random(f"{seed}-prompts")
    every = sorted({" ".join(w for w in (lead, subject, verb) if w)
                    for lead in LEADS for subject in SUBJECTS for verb in VERBS})
    out = []
    while len(out) < n:
        rng.shuffle(every)
        out += every
    return out[:n]


def pairs(n: int, seed: int) -> list[tuple[str, str, str]]:
    """`n` (prompt, chosen, rejected): two bodies for one opener, the one with the higher gold score chosen.

    Ties are redrawn, so every pair has a strict preference.
    """
    rng = random.Random(f"{seed}-pairs")
    out = []
    while len(out) < n:
        prompt, a, b = opener(rng), body(rng), body(rng)
        if gold_score(a) != gold_score(b):
            out.append((prompt, a, b) if gold_score(a) > gold_score(b) else (prompt, b, a))
    return out

"""The ppo stage's reward: the function `scorer.source` names, and a check of what it returns.

`scorer.source` is the trained reward model (default), a transformers text-classification pipeline (the raw score
of `scorer.label`, as in the seed), or a Python callable `module:function` taking the list of texts.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from transformers import pipeline

from stages.common import REWARD_MODEL, StageError, device, load_reward_model, reward_scores
from stages.params import Params


def build_scorer(params: Params, root: Path) -> Callable[[list[str]], list[float]]:
    """The reward function chosen by `scorer.source`: texts (query + response) -> one float each."""
    spec = params.scorer
    if spec.source == "reward_model":
        model, tokenizer = load_reward_model(root / REWARD_MODEL)
        return lambda texts: reward_scores(model, tokenizer, texts, spec.batch_size)
    if spec.source == "pipeline":
        try:
            pipe = pipeline("text-classification", model=spec.name, device=device())
        except (OSError, ValueError) as err:
            raise StageError(f"{params.path}: scorer.name '{spec.name}' could not be loaded as a text-classification "
                             f"model ({' '.join(str(err).split())[:160]}); give a local path or a model id") from None

        def score_with_pipeline(texts: list[str]) -> list[float]:
            outputs = pipe(texts, batch_size=spec.batch_size, function_to_apply="none", top_k=None)
            by_label = [{o["label"]: o["score"] for o in out} for out in outputs]
            if spec.label not in by_label[0]:
                raise StageError(f"{params.path}: scorer.label '{spec.label}' is not a label of {spec.name} "
                                 f"(labels: {sorted(by_label[0])})")
            return [float(labels[spec.label]) for labels in by_label]

        return score_with_pipeline
    module_name, _, attr = spec.name.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as err:
        raise StageError(f"{params.path}: scorer.name '{spec.name}' is not an importable 'module:function' "
                         f"({err})") from None

    return fn  # its output is checked by `checked_scores`


def checked_scores(scores, n: int, params: Params, step: int) -> list[float]:
    """The scorer's output as n finite floats, or a StageError naming the step (counted from 1, as `step()`'s
    errors count them), the text and the value."""
    where = f"PPO step {step + 1}: scorer ({params.scorer.source}{f' {params.scorer.name}' if params.scorer.name else ''})"
    try:
        scores = list(scores)
    except TypeError:
        raise StageError(f"{where} returned {type(scores).__name__}, not a list; return one number per text") from None
    if len(scores) != n:
        raise StageError(f"{where} returned {len(scores)} scores for {n} texts; return one number per text")
    out = []
    for i, value in enumerate(scores):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise StageError(f"{where} returned {value!r} ({type(value).__name__}) for text {i}; return a number")
        if not np.isfinite(value):
            raise StageError(f"{where} returned {value} for text {i}; scores must be finite numbers")
        out.append(float(value))
    return out

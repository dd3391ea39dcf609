"""ppo: the seed's loop on ppo_core (generate, score, `step()`), ceil(ppo.steps / ppo.batch_size) times.

The reward source is `scorer.source`: the trained reward model (default), a transformers text-classification
pipeline (the raw score of `scorer.label`, as in the seed), or a Python callable `module:function` taking the
list of texts. Each step writes its rollouts (data/ppo/rollouts/step-NNNNN.parquet) and rewrites the stats
table (one row of all `step()` stats per step, but the wall-clock `time/*` ones, which go to timings.csv so that
every other artifact is byte-identical across runs), the curves for `dvc plots`; the metrics come at the end.
"""

from __future__ import annotations

import dataclasses
import importlib
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import AutoTokenizer, pipeline

from ppo_core import AutoModelForCausalLMWithValueHead, PPOTrainer
from stages.common import (PPO_CURVES, PPO_METRICS, PPO_MODEL, PPO_ROLLOUTS, PPO_STATS, PPO_TIMINGS, REWARD_MODEL,
                           SFT_MODEL, TOKENIZED_TRAIN, StageError, device, fresh_dir, load_reward_model, read_table,
                           require_dir, reward_scores, save_pretrained, seed_everything, write_csv, write_json,
                           write_parquet)
from stages.params import Params, ppo_config
from stages.synthetic import gold_score

# curves.csv column -> step() stats key (plus reward_mean and gold_mean, computed from the raw scores)
CURVES = {"kl": "objective/kl", "kl_coef": "objective/kl_coef", "entropy": "objective/entropy",
          "loss_value": "ppo/loss/value", "loss_policy": "ppo/loss/policy", "clipfrac": "ppo/policy/clipfrac",
          "approxkl": "ppo/policy/approxkl", "response_len": "tokens/responses_len_mean"}


def run(params: Params, root: Path = Path(".")) -> str:
    seed_everything(params.seed)
    config = ppo_config(params)
    prompts = read_table(root / TOKENIZED_TRAIN, ["query", "input_ids"])
    if len(prompts) < config.batch_size:
        raise StageError(f"{TOKENIZED_TRAIN}: {len(prompts)} prompts, fewer than ppo.batch_size={config.batch_size}; "
                         f"lower ppo.batch_size in {params.path} or give more prompts")
    tokenizer = AutoTokenizer.from_pretrained(require_dir(root / SFT_MODEL))
    model = AutoModelForCausalLMWithValueHead.from_pretrained(root / SFT_MODEL)
    trainer = PPOTrainer(config, model, ref_model=None, tokenizer=tokenizer)  # reference: a frozen copy of SFT
    score = build_scorer(params, root)
    generation = {**dataclasses.asdict(params.generation), "pad_token_id": tokenizer.pad_token_id,
                  "eos_token_id": tokenizer.eos_token_id}
    batches = query_batches(len(prompts), config.batch_size, params.seed)
    rollouts_dir = fresh_dir(root / PPO_ROLLOUTS)  # step files are added one by one, each atomically
    tables = StepTables(root)
    for step in tqdm(range(config.total_ppo_epochs), desc="ppo", unit="step"):
        idx = next(batches)
        query_tensors = [torch.tensor(prompts["input_ids"][i]) for i in idx]
        queries = [prompts["query"][i] for i in idx]
        # 1. rollout
        response_tensors = trainer.generate(query_tensors, batch_size=len(idx), return_prompt=False, **generation)
        responses = tokenizer.batch_decode(response_tensors, skip_special_tokens=True)
        # 2. score
        texts = [q + r for q, r in zip(queries, responses)]
        scores = score(texts)
        # 3. optimise
        stats = trainer.step(query_tensors, response_tensors, [torch.tensor(s, dtype=torch.float) for s in scores])
        # 4. record
        gold = [gold_score(t) for t in texts] if params.data.is_synthetic else None
        rollouts = {
            "step": [step] * len(idx), "query": queries, "response": responses, "score": scores,
            "kl": np.asarray(stats["objective/kl_dist"], dtype=float).tolist(),
            "query_tokens": [len(q) for q in query_tensors], "response_tokens": [len(r) for r in response_tensors],
            "ends_with_eos": [bool(len(r)) and int(r[-1]) == tokenizer.eos_token_id for r in response_tensors],
            "response_ids": [r.tolist() for r in response_tensors],
        } | ({"gold": gold} if gold else {})
        write_parquet(rollouts, rollouts_dir / f"step-{step:05d}.parquet")
        tables.append(step, stats, scores, gold)
    save_pretrained(root / PPO_MODEL, trainer.accelerator.unwrap_model(trainer.model), tokenizer)
    first, last = tables.curves[0], tables.curves[-1]
    write_json({"steps": len(tables.curves)} | {f"final_{k}": v for k, v in last.items() if k != "step"},
               root / PPO_METRICS)
    return (f"{len(tables.curves)} steps, reward {first['reward_mean']:.2f} -> {last['reward_mean']:.2f}, "
            f"kl {last['kl']:.2f} -> {PPO_MODEL}")


class StepTables:
    """The per-step tables, rewritten (atomically) after each step so that a failed run can be inspected:
    stats.parquet (every step() stat but the wall-clock `time/*` ones), timings.csv (those), curves.csv."""

    def __init__(self, root: Path):
        self.root = root
        self.stats: list[dict] = []
        self.timings: list[dict] = []
        self.curves: list[dict] = []

    def append(self, step: int, stats: dict, scores: list[float], gold: list[float] | None) -> None:
        keys = sorted(stats)
        self.stats.append({"step": step} | {k: to_python(stats[k]) for k in keys if not k.startswith("time/")})
        self.timings.append({"step": step} | {k: float(stats[k]) for k in keys if k.startswith("time/")})
        self.curves.append({"step": step, "reward_mean": float(np.mean(scores))}
                           | ({"gold_mean": float(np.mean(gold))} if gold else {})
                           | {name: float(stats[key]) for name, key in CURVES.items()})
        write_parquet({key: [row[key] for row in self.stats] for key in self.stats[0]}, self.root / PPO_STATS)
        write_csv(self.timings, self.root / PPO_TIMINGS)
        write_csv(self.curves, self.root / PPO_CURVES)


def query_batches(n: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Endless batches of row indices: a seeded shuffle per epoch, the last incomplete batch dropped."""
    rng = random.Random(f"{seed}-ppo")
    while True:
        order = list(range(n))
        rng.shuffle(order)
        for start in range(0, n - batch_size + 1, batch_size):
            yield order[start:start + batch_size]


def to_python(value):
    """A step() stat as a Parquet-friendly value: a float, or a list of floats for histograms."""
    array = np.asarray(value, dtype=float)
    return float(array) if array.ndim == 0 else array.ravel().tolist()


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

    def score_with_callable(texts: list[str]) -> list[float]:
        scores = list(fn(texts))
        if len(scores) != len(texts):
            raise StageError(f"scorer {spec.name} returned {len(scores)} scores for {len(texts)} texts; "
                             "return one per text")
        return [float(s) for s in scores]

    return score_with_callable

"""evaluate: the SFT and PPO policies on the held-out prompts, side by side.

Per policy: the mean score of the scorer PPO trained on (`scorer.source`: the reward model, a text-classification
pipeline or the user's callable, built and checked as the ppo stage does: stages/shared/scoring.py), the mean gold score
(default synthetic data only), KL to the SFT policy (sum over response tokens of log pi(y_t) - log pi_sft(y_t) at the
sampling temperature, over the policy's own samples: a Monte Carlo estimate of KL(pi || pi_sft)), and mean response
length. Win rate: the fraction of prompts where that scorer scores the PPO response above the SFT one (ties count half).
Both policies are loaded with plain transformers and sampled with the `generation` kwargs of the PPO rollouts.

data/eval/metrics.json puts what a sweep compares at the top (`dvc exp show --only-changed` in 100 columns), the SFT
baseline in a group: ``{"win_rate", "gold", "reward", "kl", "length", "sft": {"gold", "reward", "length"},
"heldout": {"prompts", "in_train"}}`` (top: the PPO policy; `gold` with the synthetic data only; `heldout`: the prompts
evaluated, and how many are training prompts, 0 as prepare splits by distinct prompt). Which scorer gave `reward` is
the `scorer` params section, which dvc.yaml tracks for this stage.

With `evaluate.samples_per_prompt` > 1 or `evaluate.pass_at_k` set, a last group, ``accuracy``: per reward (``reward``,
the scorer's, ``reward_NAME`` for each function of a combined scorer, then each judge's), each policy's mean over n
samples per prompt, greedy accuracy and pass@k, and the paired standard errors of PPO - SFT (stages/shared/accuracy.py);
with a pretrained `model.name_or_path`, that base model's too (`evaluate.base`). Its extra samples are drawn after
everything above, which stays as it is; off (the default), nothing more is drawn and metrics.json is as it was.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, AutoTokenizer

from ppo_core import response_logprobs, set_seed
from stages.shared import auto, scoring
from stages.shared.accuracy import accuracy_table, policy_metrics, win_rate
from stages.shared.artifacts import (
    EVAL_METRICS,
    EVAL_SAMPLES,
    PPO_MODEL,
    SFT_MODEL,
    TOKENIZED_EVAL,
    TOKENIZED_TRAIN,
    check_tokenized_with,
    evaluation_metrics,
    publishing,
    read_prompts,
    require_dir,
    write_json,
    write_parquet,
)
from stages.shared.heldout import heldout_words, training_prompts_among, travelling_columns
from stages.shared.models import is_encoder_decoder, load_base, load_float32, sample_responses
from stages.shared.params import Params
from stages.shared.runtime import device, note, tf32_on_gpu
from stages.shared.scoring import Combined, Row, build_scorer, function_rewards, judge_functions, scored, scorer_texts
from stages.shared.typed_params import sampled_temperature


def run(params: Params, root: Path = Path(".")) -> str:
    with tf32_on_gpu():
        return compare_policies(params, root)


def compare_policies(params: Params, root: Path) -> str:
    """Sample, score and measure both policies on the held-out prompts; write the samples and the metrics."""
    set_seed(params.seed)
    prompts = read_prompts(root / TOKENIZED_EVAL)
    if params.evaluate.n_prompts is not None and params.evaluate.n_prompts > len(prompts):
        note(f"evaluate: evaluate.n_prompts is {params.evaluate.n_prompts}, but {TOKENIZED_EVAL} holds {len(prompts)} "
             f"held-out prompts: evaluating all {len(prompts)}")
    prompts = prompts.head(params.evaluate.n_prompts)
    queries, query_ids = prompts["query"].tolist(), [x.tolist() for x in prompts["input_ids"]]
    kept = {k: v[:len(queries)] for k, v in travelling_columns(root / TOKENIZED_EVAL, params.data.prompts.keep).items()}
    tokenizer = AutoTokenizer.from_pretrained(require_dir(root / SFT_MODEL))
    check_tokenized_with(root / TOKENIZED_EVAL, root / SFT_MODEL)
    model_class = AutoModelForSeq2SeqLM if is_encoder_decoder(require_dir(root / SFT_MODEL)) else AutoModelForCausalLM
    policies = {name: load_float32(model_class, require_dir(root / path)).to(device()).eval()
                for name, path in (("sft", SFT_MODEL), ("ppo", PPO_MODEL))}
    score = build_scorer(params, root)  # the reward PPO trained on
    generation = {**auto.generation(params), "pad_token_id": tokenizer.pad_token_id,
                  "eos_token_id": tokenizer.eos_token_id}
    bs, t = params.evaluate.batch_size, sampled_temperature(params.generation)  # t: the KL of what was sampled
    judges = judge_functions(params)
    columns = {"policy": [], "query": [], "response": [], "score": [], "kl_to_sft": [], "response_tokens": []}
    parts = [f"reward_{name}" for name in params.scorer.functions]  # scorer.source combined: each function's
    columns |= {name: [] for name in (*parts, *judges, *kept)}
    by_policy, first = {}, {}  # first: {policy: {reward name: its (P,) rewards}} of the samples above
    for name, policy in policies.items():
        response_ids = sample_responses(policy, tokenizer, query_ids, generation, bs, desc=f"evaluate {name}")
        responses = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
        texts = [q + r for q, r in zip(queries, responses)]
        if name == "sft":
            kl = np.zeros(len(texts))  # KL(sft || sft)
        else:
            kl = np.subtract(logprob_sums(policy, query_ids, response_ids, bs, t),
                             logprob_sums(policies["sft"], query_ids, response_ids, bs, t))
        seen = Row(queries, responses, kept, response_ids, scoring.trained_state(params))
        rows = {"policy": [name] * len(texts), "query": queries, "response": responses,
                "score": scores_of(score, scorer_texts(params.scorer, queries, responses), params, name, row=seen),
                "kl_to_sft": kl.tolist(), "response_tokens": [len(r) for r in response_ids]}
        rows |= {f"reward_{k}": v for k, v in (score.last if isinstance(score, Combined) else {}).items()}
        for judge, fn in judges.items():
            rows[judge] = scores_of(fn, texts, params, name, who=f"judge {judge}", row=seen)
        rows |= kept
        for key in columns:
            columns[key] += rows[key]
        by_policy[name] = policy_metrics(rows, list(judges), parts)
        first[name] = {"reward": rows["score"]} | function_rewards(score) | {judge: rows[judge] for judge in judges}
    n = len(queries)
    wins = win_rate(columns["score"][n:], columns["score"][:n])
    in_train = training_prompts_among(queries, read_prompts(root / TOKENIZED_TRAIN)["query"])
    metrics = evaluation_metrics(by_policy["ppo"], by_policy["sft"], wins, {"prompts": n, "in_train": in_train})
    if params.evaluate.samples_per_prompt > 1 or params.evaluate.pass_at_k:  # off: not a draw more (the same bytes)
        scorers = {"reward": score} | judges
        metrics["accuracy"] = sampled_accuracy(params, policies, tokenizer, (queries, query_ids), generation, scorers,
                                               first, kept)
    with publishing():  # both or neither
        write_parquet(columns, root / EVAL_SAMPLES)
        write_json(metrics, root / EVAL_METRICS, sort_keys=False)
    judged = "".join(f", {judge} {metrics['sft'][judge]:.2f} -> {metrics[judge]:.2f}" for judge in judges)
    return (f"{heldout_words(n, in_train)}: reward ({params.scorer.title}) {metrics['sft']['reward']:.2f} (sft) -> "
            f"{metrics['reward']:.2f} (ppo){judged}, win rate {metrics['win_rate']:.2f}, kl {metrics['kl']:.2f} -> "
            f"{EVAL_METRICS}")


def sampled_accuracy(params: Params, policies: dict, tokenizer, prompts: tuple[list[str], list[list[int]]],
                     generation: dict, scorers: dict, first: dict[str, dict[str, list[float]]],
                     kept: dict[str, list] | None = None) -> dict:
    """metrics.json's ``accuracy`` group (stages/shared/accuracy.py) over ``prompts`` (queries, their token ids): each
    policy's n = `evaluate.samples_per_prompt` samples per prompt (``first``'s rewards where it has that policy's, of
    the samples above, then the rest drawn after both policies' first, so those stay as they are; then the base
    model's, where `model.name_or_path` names one, loaded after SFT's and PPO's draws: `evaluate.base`) and one greedy
    response per prompt, each scored by every function of ``scorers`` (``reward``: the scorer, each of a combined
    scorer's functions, then the judges; one that sees the row gets each prompt's ``kept`` columns)."""
    kept, n, n_prompts = kept or {}, params.evaluate.samples_per_prompt, len(prompts[0])
    greedy_generation = generation | {"do_sample": False}
    sampled, greedy, base = {}, {}, params.model.name_or_path  # base: the pretrained model SFT started from, if any
    for name in [*policies, *(["base"] if base is not None and params.evaluate.base != "none" else [])]:
        policy = policies[name] if name in policies else load_base(type(policies["sft"]), base, tokenizer)
        drawn = [first[name]] if name in first else []  # the base model has no samples above
        if name in policies or params.evaluate.base == "sampled":  # (P, n) each: the first sample, then the others
            if copies := n - len(drawn):  # none where the first sample is all n (a draw of none scores nothing)
                drawn.append(rewards_of(params, name, policy, tokenizer, tuple(repeated(x, copies) for x in prompts),
                                        generation, scorers, {k: repeated(v, copies) for k, v in kept.items()}))
            sampled[name] = {fn: np.concatenate([np.reshape(d[fn], (n_prompts, -1)) for d in drawn], axis=1)
                             for fn in drawn[0]}
        greedy[name] = rewards_of(params, name, policy, tokenizer, prompts, greedy_generation, scorers, kept)
    return accuracy_table(sampled, greedy, params.evaluate.pass_at_k, params.evaluate.success_threshold)


def repeated(items: list, copies: int) -> list:
    """Each item ``copies`` times, a prompt's copies together."""
    return [x for x in items for _ in range(copies)]


def rewards_of(params: Params, name: str, policy, tokenizer, prompts: tuple[list[str], list[list[int]]],
               generation: dict, scorers: dict, kept: dict[str, list] | None = None) -> dict[str, np.ndarray]:
    """One response per prompt of ``prompts`` (queries, their token ids) by ``policy``, scored by each of ``scorers``
    as above (the scorer on `scorer.input`'s texts, a judge on query + response): {reward name: (len(prompts),)}."""
    queries, query_ids = prompts
    mode = "sampled" if generation["do_sample"] else "greedy"
    response_ids = sample_responses(policy, tokenizer, query_ids, generation, params.evaluate.batch_size,
                                    desc=f"evaluate {name}, {mode}", share_prompts=True)  # pass@k's copies
    responses = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
    texts = {"reward": scorer_texts(params.scorer, queries, responses)}
    seen = Row(queries, responses, kept or {}, response_ids, scoring.trained_state(params))
    out = {fn: np.array(scores_of(score, texts.get(fn, [q + r for q, r in zip(queries, responses)]), params,
                                  f"{name} ({mode})", who=None if fn == "reward" else f"judge {fn}", row=seen),
                        dtype=np.float64)
           for fn, score in scorers.items()}
    parts = {fn: np.array(values, dtype=np.float64) for fn, values in function_rewards(scorers["reward"]).items()}
    return {"reward": out.pop("reward")} | parts | out


def scores_of(score, texts: list[str], params: Params, policy: str, who: str | None = None,
              row: Row | None = None) -> list[float]:
    """The checked scores of a policy's texts by the scorer (or ``who``, a judge), `evaluate.batch_size` at a time
    (as the ppo stage calls the scorer on one step's rollouts; the reward model and a pipeline batch each call by
    `scorer.batch_size`); a reward function that sees the row gets ``row``'s slice of the batch."""
    out, size, parts = [], params.evaluate.batch_size, {}
    for start in range(0, len(texts), size):
        batch = texts[start:start + size]
        at = f"the {policy} policy's samples {start + 1}-{start + len(batch)}"
        part = None if row is None else row.sliced(start, start + size)
        out += scored(score, batch, params.scorer, at, who, part)
        for name, values in (score.last.items() if isinstance(score, Combined) else ()):
            parts.setdefault(name, []).extend(values)  # a Combined's functions' rewards, over every batch
    if isinstance(score, Combined):
        score.last = parts
    return out


def logprob_sums(model, query_ids: list[list[int]], response_ids: list[list[int]], batch_size: int,
                 temperature: float = 1.0) -> list[float]:
    """sum_t log pi(response_t | query, response_<t) per sample at ``temperature``, ``batch_size`` at a time: the PPO
    step's scoring pass (``ppo_core.response_logprobs``, which gives an encoder-decoder's encoder the query)."""
    sums = []
    for i in range(0, len(query_ids), batch_size):
        queries, responses = ([torch.tensor(x, device=model.device) for x in ids[i:i + batch_size]]
                              for ids in (query_ids, response_ids))
        sums += response_logprobs(model, queries, responses, temperature).sum(-1).tolist()  # (B, R), 0 at padding
    return sums

"""Accuracy and pass@k: summaries of per-sample rewards, pure functions of arrays (evaluate's `accuracy` group).

Notation: P prompts, n samples per prompt (`evaluate.samples_per_prompt`), c of them passes (reward >= the success
threshold), k <= n. A reward is any function's: the scorer's (`reward`), a judge's, or any other of that shape; the
table takes ``{name: (P, n) array}`` of sampled rewards and ``{name: (P,) array}`` of greedy ones, so a new set of
reward functions plugs in without a change here. SFT and PPO answer the same P prompts in the same order, so their
difference is paired by prompt: its standard error is that of the P per-prompt differences.
"""

from __future__ import annotations

import math

import numpy as np

from stages.shared.runtime import StageError

POLICIES = ("base", "sft", "ppo")  # as the table reads: the pretrained model (where there is one), SFT, then PPO


def pass_at_k(passes: np.ndarray, k: int) -> np.ndarray:
    """Chen et al. (2021)'s unbiased pass@k of each prompt: the chance that k of its n samples, drawn without
    replacement, hold at least one pass.

    Args:
        passes: (P, n) bool, True = that sample passed.
        k: 1 <= k <= n.
    Returns:
        (P,) float64: 1 - C(n - c, k) / C(n, k), c = passes per prompt (1 when n - c < k: every k-subset passes).
    """
    n = passes.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n samples per prompt ({n})")
    # exact integers: C(n, k) overflows float64 long before n does (C(1000, 500) ~ 1e299)
    return np.array([1.0 - math.comb(n - int(c), k) / math.comb(n, k) for c in passes.sum(axis=1)], dtype=np.float64)


def passed(rewards: np.ndarray, threshold: float | None, name: str, policy: str) -> np.ndarray:
    """Which rewards count as a pass: >= ``threshold``; with ``threshold`` None each must be 0 or 1 (a 0/1 reward),
    else one line naming the reward ``name``, the ``policy`` and the first other value's place.

    Args:
        rewards: (P, n) of sampled responses, or (P,) of greedy ones.
    Returns:
        bool, the shape of ``rewards``.
    """
    if threshold is not None:
        return rewards >= threshold
    odd = np.argwhere((rewards != 0) & (rewards != 1))
    if len(odd):
        at = tuple(int(i) for i in odd[0])
        where = f"sample {at[1]} of prompt {at[0]}" if len(at) > 1 else f"greedy response to prompt {at[0]}"
        raise StageError(f"evaluate: the reward '{name}' gave {float(rewards[at]):g} for the {policy} policy's "
                         f"{where}, but evaluate.success_threshold is null (a reward must be 0 or 1); set it to the "
                         "reward that passes")
    return rewards == 1


def per_prompt(sampled: np.ndarray | None, greedy: np.ndarray, ks: list[int], threshold: float | None, name: str,
               policy: str) -> dict[str, np.ndarray]:
    """One policy's statistics of one reward, per prompt: ``mean`` (over its n samples), ``greedy`` (1 if its greedy
    response passed) and ``pass@k`` for each k of ``ks``; ``greedy`` alone where it has no samples.

    Args:
        sampled: (P, n) rewards of the sampled responses, or None (a greedy-only policy: `evaluate.base: greedy`).
        greedy: (P,) rewards of the greedy responses.
    Returns:
        {statistic: (P,) float64}; the table's figures are their means over the prompts.
    """
    if sampled is None:
        return {"greedy": passed(greedy, threshold, name, policy).astype(np.float64)}
    passes = passed(sampled, threshold, name, policy)  # the samples checked first, as they were drawn
    return {"mean": sampled.mean(axis=1, dtype=np.float64),
            "greedy": passed(greedy, threshold, name, policy).astype(np.float64),
            **{f"pass@{k}": pass_at_k(passes, k) for k in ks}}


def paired_se(policy: np.ndarray, baseline: np.ndarray) -> float | None:
    """The standard error of mean(policy - baseline) over prompts answered by both: (P,) arrays, paired by prompt.

    SE = std(d, ddof=1) / sqrt(P), d_i = policy_i - baseline_i; None for one prompt (no spread to measure)."""
    d = np.asarray(policy, dtype=np.float64) - np.asarray(baseline, dtype=np.float64)
    if len(d) < 2:
        return None
    return float(d.std(ddof=1) / math.sqrt(len(d)))


def accuracy_table(sampled: dict[str, dict[str, np.ndarray]], greedy: dict[str, dict[str, np.ndarray]],
                   ks: list[int], threshold: float | None) -> dict[str, dict[str, dict[str, float | None]]]:
    """metrics.json's ``accuracy`` group: per reward, each policy's statistics (means over prompts) and the paired
    standard error of PPO - SFT for each.

    Args:
        sampled: {policy ("sft", "ppo", and "base" where evaluate sampled a pretrained model): {reward name: (P, n)
            rewards}}.
        greedy: {policy (those of ``sampled``, and "base" where evaluate had a pretrained model): {reward name: (P,)
            rewards of the greedy responses}}; a policy here without samples has the ``greedy`` statistic only.
        ks: the k of pass@k; threshold: see `passed`.
    Returns:
        {reward name: {"base": {statistic: mean} (where given), "sft": {...}, "ppo": {...},
        "paired_se": {statistic: SE of PPO - SFT, or None}}}.
    """
    out, policies = {}, [p for p in POLICIES if p in greedy]
    for name in sampled["ppo"]:
        stats = {p: per_prompt(sampled[p][name] if p in sampled else None, greedy[p][name], ks, threshold, name, p)
                 for p in policies}
        out[name] = {p: {s: float(v.mean()) for s, v in stats[p].items()} for p in policies}
        out[name]["paired_se"] = {s: paired_se(stats["ppo"][s], stats["sft"][s]) for s in stats["ppo"]}
    return out


def policy_metrics(rows: dict[str, list], judges: list[str] = (), parts: list[str] = ()) -> dict[str, float]:
    """A policy's means over its samples: each judge's (the gold score first), the scorer's, each of its functions'
    (``parts``, over the samples it applied to), KL to SFT and response length."""
    return {judge: float(np.mean(rows[judge])) for judge in judges} | {"reward": float(np.mean(rows["score"]))} | {
        part: float(np.mean([v for v in rows[part] if v is not None] or [np.nan])) for part in parts} | {
        "kl": float(np.mean(rows["kl_to_sft"])), "length": float(np.mean(rows["response_tokens"]))}


def win_rate(scores: list[float], baseline_scores: list[float]) -> float:
    """The fraction of prompts where ``scores`` beat ``baseline_scores`` (same prompt, same order), ties half."""
    scores, baseline = np.array(scores), np.array(baseline_scores)
    return float(np.mean((scores > baseline) + 0.5 * (scores == baseline)))

"""Critic-free advantage estimators, the KL loss term and loss aggregation, as pure functions.

GAE with a learned critic (``ppo_math.gae_advantages``) is PPO's estimator; these replace the critic by other samples
of the same prompt (GRPO, Dr. GRPO, RLOO) or by the batch (REINFORCE++). The batch is laid out in groups: ``G``
samples per prompt, consecutive (``scores[k*G:(k+1)*G]`` answer one prompt), so a group is one ``view(-1, G)``.

Notation: ``B`` samples (``B = P * G``: ``P`` prompts of ``G`` samples), ``R`` response length, ``mask`` ``(B, R)``
1 = a token that counts. Sequence-level advantages ``(B,)`` are broadcast to every token of their response.

References: GRPO (Shao et al. 2024, DeepSeekMath), Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like
Training"), RLOO (Ahmadian et al. 2024, after Kool et al. 2019), REINFORCE++ (Hu 2025, OpenRLHF), and the k1/k2/k3
KL estimators (Schulman 2020, "Approximating KL divergence").
"""

from __future__ import annotations

import torch

from .core import SumAcross, masked_whiten
from .ppo_math import discount_matrix

KL_ESTIMATORS = ("k1", "k2", "k3")  # PPOConfig.kl_estimator's choices
LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # PPOConfig.loss_aggregation's


def grouped(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(B,)`` -> ``(B / G, G)``: one row per prompt (its samples are consecutive)."""
    if scores.ndim != 1 or scores.numel() % group_size:
        raise ValueError(f"grouped: {scores.numel()} scores do not split into groups of {group_size} samples.")
    return scores.view(-1, group_size)


def group_advantages(scores: torch.Tensor, group_size: int, estimator: str, scale_rewards: str = "group",
                     eps: float = 1e-4, batch_std: torch.Tensor | None = None) -> torch.Tensor:
    """Sequence-level advantages ``(B,)`` of the group estimators, from one score per sample ``(B,)``.

    # grpo:    A_i = (r_i - mean_g) / (std_g + eps)            std over the group (unbiased), or the batch's
    # dr_grpo: A_i =  r_i - mean_g                              no std: Dr. GRPO's fix of GRPO's difficulty bias
    # rloo:    A_i =  r_i - (sum_g - r_i) / (G - 1)             the mean of the *other* samples: unbiased baseline

    ``scale_rewards`` (grpo only): ``"group"`` divides by each group's std (GRPO), ``"batch"`` by the whole batch's
    (TRL's ``scale_rewards="batch"``; ``batch_std``: the global batch's, under N processes), ``"none"`` by nothing
    (then grpo is dr_grpo). Needs ``G >= 2``.
    """
    if estimator not in ("grpo", "dr_grpo", "rloo"):  # checked first: "none" below would let any name through
        raise ValueError(f"group_advantages: unknown estimator {estimator!r}; one of grpo, dr_grpo, rloo.")
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"group_advantages: scale_rewards must be 'group', 'batch' or 'none' (got {scale_rewards!r}).")
    if group_size < 2:
        raise ValueError(f"group_advantages: {estimator} compares the samples of a prompt, so it needs "
                         f"num_generations >= 2 (got {group_size}).")
    groups = grouped(scores, group_size)  # (P, G)
    mean = groups.mean(dim=1, keepdim=True)  # (P, 1)
    if estimator == "rloo":
        return (groups - (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)).reshape(-1)
    centred = groups - mean
    if estimator == "dr_grpo" or scale_rewards == "none":
        return centred.reshape(-1)
    if scale_rewards == "group":
        std = groups.std(dim=1, keepdim=True)
    else:
        std = scores.std() if batch_std is None else batch_std
    return (centred / (std + eps)).reshape(-1)


def zero_std_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(B,) -> (B / G,)`` float: 1 where every sample of the prompt has the same score. Such a group has no learning
    signal (every advantage 0): the share of them is what GRPO users watch (TRL's ``frac_reward_zero_std``)."""
    groups = grouped(scores, group_size)  # (P, G)
    return (groups == groups[:, :1]).all(dim=1).to(scores.dtype)


def centred_on_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(B,)`` scores minus their group's mean (REINFORCE++-baseline's baseline, before the KL shaping)."""
    groups = grouped(scores, group_size)
    return (groups - groups.mean(dim=1, keepdim=True)).reshape(-1)


def reinforce_plus_plus_advantages(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                                   sum_across: SumAcross | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ token advantages and returns ``(B, R)``, from the KL-shaped per-token rewards ``(B, R)``
    (``ppo_math.shape_rewards``): the discounted return, whitened over every valid token of the (global) batch.

    # G_t = sum_{s>=t} gamma^(s-t) r_s ;  A = whiten(G) over the mask (and over processes with ``sum_across``)

    REINFORCE++-baseline shapes rewards from scores centred on their group first (:func:`centred_on_groups`).
    Returns ``(advantages, returns)``, zero at masked positions.
    """
    mask = mask.to(rewards.dtype)
    rewards = rewards * mask
    returns = (rewards @ discount_matrix(rewards.shape[1], gamma, rewards.dtype, rewards.device)) * mask
    return masked_whiten(returns, mask, sum_across=sum_across) * mask, returns


K3_MAX = 10.0  # the cap on the k3 estimate of one token's KL


def kl_estimate(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens, ``(B, R)``, for a KL *loss* term.

    # k1 = log p - log q                       unbiased, high variance, can be negative
    # k2 = 0.5 * (log p - log q)^2             biased, low variance (the gradient of k2 is that of KL to first order)
    # k3 = exp(log q - log p) - (log q - log p) - 1    unbiased, low variance, >= 0 (GRPO's)

    k3 grows as exp(-d) where the policy has moved far below the reference (d = log p - log q << 0): it is capped
    at ``K3_MAX`` (10, as veRL's ``low_var_kl``), so that one such token cannot make the loss infinite; a capped
    token gives no KL gradient.
    """
    diff = logprobs - ref_logprobs
    if estimator == "k1":
        return diff
    if estimator == "k2":
        return 0.5 * diff.square()
    if estimator == "k3":  # exp(-d) - 1 + d, accurate near d = 0; d clamped first so that exp cannot overflow
        return (torch.expm1(-diff.clamp(min=-K3_MAX)) + diff).clamp(max=K3_MAX)
    raise ValueError(f"kl_estimate: estimator must be one of {KL_ESTIMATORS} (got {estimator!r}).")


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, norm_length: int | torch.Tensor | None = None,
              n_tokens: torch.Tensor | float | None = None, n_sequences: torch.Tensor | float | None = None,
              ) -> torch.Tensor:
    """A per-token loss ``(B, R)`` reduced to a scalar over the valid tokens.

    # token-mean:              sum_{i,t} l m / sum_{i,t} m                 every token weighs the same (PPO's)
    # seq-mean-token-mean:     mean_i ( sum_t l m / sum_t m )              every sequence weighs the same (GRPO's)
    # seq-mean-token-sum-norm: sum_{i,t} l m / (B * norm_length)           a constant normaliser (Dr. GRPO's)

    Under N processes, pass the global counts per process (``n_tokens``: valid tokens over N; ``n_sequences``:
    sequences over N) so that the mean over processes, which DDP takes of the gradients, is the global value.
    """
    mask = mask.to(loss.dtype)
    if mode == "token-mean":
        return (loss * mask).sum() / (mask.sum() if n_tokens is None else n_tokens)
    sequences = loss.shape[0] if n_sequences is None else n_sequences
    if mode == "seq-mean-token-mean":
        per_sequence = (loss * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_sequence.sum() / sequences
    if mode == "seq-mean-token-sum-norm":
        return (loss * mask).sum() / (sequences * (mask.shape[1] if norm_length is None else norm_length))
    raise ValueError(f"aggregate: mode must be one of {LOSS_AGGREGATIONS} (got {mode!r}).")


def check_groups(queries: list[torch.Tensor], group_size: int) -> int | None:
    """The index of the first group of ``group_size`` consecutive queries that are not all the same prompt, or None."""
    for start in range(0, len(queries), group_size):
        first = queries[start]
        if any(q.shape != first.shape or not torch.equal(q, first) for q in queries[start + 1:start + group_size]):
            return start // group_size
    return None


def check_prompt_groups(queries: list[torch.Tensor], group_size: int) -> None:
    """Raise a ValueError naming the first block of ``group_size`` consecutive queries that are not one prompt."""
    bad = check_groups(queries, group_size)
    if bad is not None:
        raise ValueError(f"step: queries {bad * group_size}-{(bad + 1) * group_size - 1} (group {bad}) are not one "
                         f"prompt; with num_generations={group_size} every {group_size} consecutive samples answer "
                         "one query (trainer.dataloader repeats each prompt that many times in a row)")

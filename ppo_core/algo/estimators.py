"""Critic-free advantages as pure functions: the group baselines and REINFORCE++'s whitened returns.

GAE with a learned critic (``ppo_math.gae_advantages``) is PPO's estimator; these replace the critic by other samples
of the same prompt (GRPO, Dr. GRPO, RLOO) or by the batch (REINFORCE++). The batch is laid out in groups: ``G``
samples per prompt, consecutive (``scores[k*G:(k+1)*G]`` answer one prompt), so a group is one ``view(-1, G)``.

Notation: ``B`` samples (``B = P * G``: ``P`` prompts of ``G`` samples), ``R`` response length, ``mask`` ``(B, R)``
1 = a token that counts. Sequence-level advantages ``(B,)`` are broadcast to every token of their response.

Which estimator uses which, with its KL and loss: ``ppo_core.algo.registry``. References: GRPO (Shao et al. 2024,
DeepSeekMath), Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training"), RLOO (Ahmadian et al. 2024, after
Kool et al. 2019), REINFORCE++ (Hu 2025, OpenRLHF).
"""

from __future__ import annotations

import torch

from .functional import SumAcross, masked_whiten
from .ppo_math import discount_matrix


def grouped(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(B,)`` -> ``(B / G, G)``: one row per prompt (its samples are consecutive)."""
    if scores.ndim != 1 or scores.numel() % group_size:
        raise ValueError(f"grouped: {scores.numel()} scores do not split into groups of {group_size} samples.")
    return scores.view(-1, group_size)


def group_normalized(scores: torch.Tensor, group_size: int, scale_rewards: str = "group", eps: float = 1e-4,
                     batch_std: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO's sequence-level advantages ``(B,)`` from one score per sample ``(B,)``.

    # A_i = (r_i - mean_g) / (std_g + eps)          std over the group (unbiased), the batch's, or none

    ``scale_rewards``: ``"group"`` divides by each group's std (GRPO), ``"batch"`` by the whole batch's (TRL's
    ``scale_rewards="batch"``; ``batch_std``: the global batch's, under N processes), ``"none"`` by nothing (then it
    is :func:`group_centred`, Dr. GRPO's). Needs ``G >= 2``.
    """
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(f"group_normalized: scale_rewards must be 'group', 'batch' or 'none' (got {scale_rewards!r}).")
    centred = group_centred(scores, group_size)
    if scale_rewards == "none":
        return centred
    if scale_rewards == "group":
        std = grouped(scores, group_size).std(dim=1, keepdim=True).expand(-1, group_size).reshape(-1)
    else:
        std = scores.std() if batch_std is None else batch_std
    return centred / (std + eps)


def group_centred(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(B,)`` scores minus their group's mean: Dr. GRPO's advantages (no std, which biases GRPO towards groups of
    little spread), and REINFORCE++-baseline's scores before its KL shaping. Needs ``G >= 2``.

    # A_i = r_i - mean_g
    """
    _check_group_size(group_size)
    groups = grouped(scores, group_size)  # (P, G)
    return (groups - groups.mean(dim=1, keepdim=True)).reshape(-1)


def leave_one_out(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO's advantages ``(B,)``: each score less the mean of the *other* samples of its prompt (an unbiased
    baseline). Needs ``G >= 2``.

    # A_i = r_i - (sum_g - r_i) / (G - 1)
    """
    _check_group_size(group_size)
    groups = grouped(scores, group_size)  # (P, G)
    return (groups - (groups.sum(dim=1, keepdim=True) - groups) / (group_size - 1)).reshape(-1)


def _check_group_size(group_size: int) -> None:
    if group_size < 2:
        raise ValueError("a group estimator compares the samples of a prompt, so it needs num_generations >= 2 "
                         f"(got {group_size}).")


def zero_std_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """``(B,) -> (B / G,)`` float: 1 where every sample of the prompt has the same score. Such a group has no learning
    signal (every advantage 0): the share of them is what GRPO users watch (TRL's ``frac_reward_zero_std``)."""
    groups = grouped(scores, group_size)  # (P, G)
    return (groups == groups[:, :1]).all(dim=1).to(scores.dtype)


def reinforce_plus_plus_advantages(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
                                   sum_across: SumAcross | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ token advantages and returns ``(B, R)``, from the KL-shaped per-token rewards ``(B, R)``
    (``ppo_math.shape_rewards``): the discounted return, whitened over every valid token of the (global) batch.

    # G_t = sum_{s>=t} gamma^(s-t) r_s ;  A = whiten(G) over the mask (and over processes with ``sum_across``)

    REINFORCE++-baseline shapes rewards from scores centred on their group first (:func:`group_centred`).
    Returns ``(advantages, returns)``, zero at masked positions.
    """
    mask = mask.to(rewards.dtype)
    rewards = rewards * mask
    returns = (rewards @ discount_matrix(rewards.shape[1], gamma, rewards.dtype, rewards.device)) * mask
    return masked_whiten(returns, mask, sum_across=sum_across) * mask, returns


def soft_overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_len: int,
                          penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's overlong reward shaping (Yu et al. 2025, eq. 13): ``(B,)`` response lengths -> ``(B,)`` penalties <= 0,
    added to the scores. A response longer than ``max_length - buffer_len`` loses linearly more, up to
    ``penalty_factor`` at ``max_length`` and beyond (``L_max``, ``L_cache``; TRL's ``get_soft_overlong_punishment``).

    # 0                                      L <= L_max - L_cache
    # (L_max - L_cache - L) / L_cache        L_max - L_cache < L <= L_max        (times penalty_factor)
    # -1                                     L > L_max
    """
    if not 0 < buffer_len <= max_length:
        raise ValueError(f"soft_overlong_penalty: buffer_len must be in (0, max_length={max_length}] "
                         f"(got {buffer_len}).")
    expected = max_length - buffer_len
    over = (lengths.to(torch.float32) - expected).clamp(min=0) / buffer_len  # 0 .. 1 inside the buffer
    return -penalty_factor * over.clamp(max=1.0)


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

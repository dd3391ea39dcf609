"""The PPO math of the legacy trainer as pure functions: KL penalties, shaped rewards, GAE, losses.

Notation: ``B`` batch, ``R`` response length (the longest response in the batch), ``V`` vocabulary.
All per-token tensors are *response-aligned*: position ``t`` is the ``t``-th response token, and
``mask`` (``(B, R)``, 1 = valid response token, 0 = padding or masked by ``response_masks``) says which
positions count. Values and log-probabilities at masked positions are ignored by every statistic.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .choices import IMPORTANCE_SAMPLING_LEVELS, KL_PENALTIES, LOSS_AGGREGATIONS
from .functional import SumAcross, clip_by_value, masked_whiten
from .outputs import Advantages, ShapedRewards
from .registry import get_policy_loss  # torch-free: it names the surrogates by path
from .surrogates import cispo_surrogate, clipped_surrogate  # noqa: F401 (imported from here, as before they moved)

K3_MAX = 10.0  # the cap on the k3 estimate of one token's KL


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mode: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probabilities, ``(B, R)`` x2 ->
    ``(B, R)``.

    # kl, k1:  d = log p - log q                          unbiased, high variance, can be negative per token
    # abs:     |d|
    # mse, k2: 0.5 * d^2                                  biased, low variance (its gradient is KL's to first order)
    # k3:      exp(-d) - 1 + d                            unbiased, low variance, >= 0 (GRPO's)

    k3 grows as exp(-d) where the policy has moved far below the reference (d << 0): it is capped at ``K3_MAX`` (10,
    as veRL's ``low_var_kl``), so that one such token cannot make the loss infinite; a capped token gives no gradient.
    ``full`` needs the whole distributions: see :func:`ppo_core.models.logprobs.full_kl`.
    """
    diff = logprobs - ref_logprobs
    if mode in ("kl", "k1"):
        return diff
    if mode == "abs":
        return diff.abs()
    if mode in ("mse", "k2"):
        return 0.5 * diff.square()
    if mode == "k3":  # exp(-d) - 1 + d, accurate near d = 0; d clamped first so that exp cannot overflow
        return (torch.expm1(-diff.clamp(min=-K3_MAX)) + diff).clamp(max=K3_MAX)
    raise ValueError(f"kl_penalty: mode must be one of {KL_PENALTIES[:-1]} here (got {mode!r}); "
                     "'full' is computed from the distributions by ppo_core.models.logprobs.full_kl.")


def full_kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """The ``full`` KL penalty from whole log-probability distributions, ``(B, R, V)`` x2 -> ``(B, R)``.

    # full: KL(p || q) = sum_v p_v (log p_v - log q_v)
    (legacy's ``F.kl_div(ref_logprobs, logprobs, log_target=True, reduction="none").sum(-1)``). The trainer computes
    the same from hidden states without the ``(B, R, V)`` tensors: :func:`ppo_core.models.logprobs.full_kl`.
    """
    return (logprobs.exp() * (logprobs - ref_logprobs)).sum(-1)


def shape_rewards(scores: torch.Tensor, kls: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> ShapedRewards:
    """KL-penalised per-token rewards with the sequence score added on the last valid response token.

    Args:
        scores: ``(B,)`` one scalar score per sample.
        kls: ``(B, R)`` per-token KL estimate.
        mask: ``(B, R)`` 1 = valid response token. Every row must have at least one valid token.
        kl_coef: the current KL coefficient (beta).
    """
    mask = mask.to(kls.dtype)
    kls = kls * mask
    non_score = -kl_coef * kls  # r_t = -beta * KL_t
    # Index of the last valid token per row: argmax over positions weighted by (position + 1).
    positions = torch.arange(1, mask.shape[1] + 1, device=mask.device, dtype=mask.dtype)
    last = (mask * positions).argmax(dim=1)  # (B,)
    rewards = non_score.clone()
    rewards[torch.arange(rewards.shape[0], device=rewards.device), last] += scores.to(rewards.dtype)
    return ShapedRewards(rewards, non_score, kls)


def discount_matrix(length: int, discount: float, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``M[s, t] = discount^(s - t)`` for ``s >= t`` else 0, shape ``(length, length)``.

    ``x @ M`` computes the reverse discounted cumulative sum ``y_t = sum_{s>=t} discount^(s-t) x_s``
    for every row of ``x`` in one matrix product, instead of a Python loop over time.
    """
    idx = torch.arange(length, device=device)
    power = (idx[:, None] - idx[None, :]).to(dtype)  # s - t
    return torch.where(power >= 0, torch.as_tensor(discount, dtype=dtype, device=device) ** power.clamp(min=0),
                       torch.zeros((), dtype=dtype, device=device))


def gae_advantages(values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float,
                   whiten_rewards: bool = False, sum_across: SumAcross | None = None) -> Advantages:
    """Generalised advantage estimation (Schulman et al. 2016) with the legacy trainer's conventions.

    Values and rewards are zeroed at masked positions first, and ``V`` beyond the last position is 0.

    # delta_t = r_t + gamma * V_{t+1} - V_t
    # A_t     = delta_t + gamma * lam * A_{t+1}          (= sum_{s>=t} (gamma*lam)^(s-t) delta_s)
    # returns = A + V ;  advantages = whiten(A) over the mask

    Args:
        values: ``(B, R)`` value predictions of the rollout policy.
        rewards: ``(B, R)`` shaped rewards.
        mask: ``(B, R)`` 1 = valid token.
        whiten_rewards: whiten the rewards over the mask first, keeping their mean (legacy option).
        sum_across: a cross-process sum: whiten with the mean and variance of every process's valid tokens
            (the global batch), not of this process's alone.
    """
    mask = mask.to(values.dtype)
    values, rewards = values * mask, rewards * mask
    if whiten_rewards:
        rewards = masked_whiten(rewards, mask, shift_mean=False, sum_across=sum_across) * mask
    next_values = torch.nn.functional.pad(values[:, 1:], (0, 1))  # V_{t+1}, with V_R = 0
    deltas = rewards + gamma * next_values - values
    # Reverse discounted cumulative sum over time as one (B, R) x (R, R) product.
    advantages = deltas @ discount_matrix(deltas.shape[1], gamma * lam, deltas.dtype, deltas.device)
    returns = advantages + values
    advantages = masked_whiten(advantages, mask, sum_across=sum_across) * mask
    return Advantages(advantages.detach(), returns.detach())


def token_mean(values: torch.Tensor, mask: torch.Tensor, n_tokens: torch.Tensor | float | None = None) -> torch.Tensor:
    """``E_mask[x]`` of a loss or a statistic: the sum over the valid tokens divided by ``n_tokens``.

    ``n_tokens=None`` divides by the mask's own count, in the values' dtype (:func:`masked_mean`'s number, bit for
    bit), or by 1 where the mask has none: an empty mini-batch's mean is 0, its sum over no token, not NaN. Under N
    data-parallel processes the trainer passes ``n / N`` (:func:`ppo_core.runtime.distributed.tokens_per_process`): the
    mean over processes of the results, which is what DDP takes of the gradients, is then the token mean over the
    global mini-batch, even when the processes hold different numbers of tokens.
    """
    if n_tokens is None:
        mask = mask.to(values.dtype)
        count = mask.sum()
        return (values * mask).sum() / torch.where(count > 0, count, torch.ones_like(count))
    return (values * mask.to(values.dtype)).sum() / n_tokens


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean",
              norm_length: int | torch.Tensor | None = None, n_tokens: torch.Tensor | float | None = None,
              n_sequences: torch.Tensor | float | None = None) -> torch.Tensor:
    """A per-token loss ``(B, R)`` reduced to a scalar over the valid tokens: every policy and KL loss goes through it.

    # token-mean:              sum_{i,t} l m / sum_{i,t} m                 every token weighs the same (PPO's, DAPO's)
    # seq-mean-token-mean:     mean_i ( sum_t l m / sum_t m )              every sequence weighs the same (GRPO's)
    # seq-mean-token-sum-norm: sum_{i,t} l m / (B * norm_length)           a constant normaliser (Dr. GRPO's)

    The sequence mean counts the rows with a valid token (a row masked whole, e.g. by dynamic sampling, is not a
    sequence). Dr. GRPO's ``B`` counts every row, masked whole or not (TRL's ``per_token_loss.size(0)``): with
    ``norm_length`` fixed, its normaliser is the same constant in every step, so a token's weight never depends on what
    else its step masked (the paper's intent; a count of the rows with a token would weigh the kept ones more in a
    step that masks more). ``n_tokens`` and ``n_sequences``: the divisors of the token and the sequence means (None:
    this ``mask``'s own counts); the trainer passes its accumulation window's global counts over the window's share of
    backward passes (:class:`Divisors`), so that the update does not depend on how the window is split. ``B`` needs
    none: every mini-batch of a step has the same rows, which are its window's over that share.
    """
    if mode == "token-mean":
        return token_mean(loss, mask, n_tokens)
    mask = mask.to(loss.dtype)
    if mode == "seq-mean-token-mean":
        lengths = mask.sum(dim=1)  # (B,)
        sequences = (lengths > 0).sum().clamp(min=1) if n_sequences is None else n_sequences
        return ((loss * mask).sum(dim=1) / lengths.clamp(min=1)).sum() / sequences
    if mode == "seq-mean-token-sum-norm":
        return (loss * mask).sum() / (mask.shape[0] * (mask.shape[1] if norm_length is None else norm_length))
    raise ValueError(f"aggregate: mode must be one of {LOSS_AGGREGATIONS} (got {mode!r}).")


class Divisors(NamedTuple):
    """What a mini-batch's means divide by (0-d tensors), so that an update depends on its accumulation window's
    global batch only, not on how the window is split into mini-batches and processes.

    A window is ``gradient_accumulation_steps`` (GA) mini-batches on each of N processes; its gradient is the mean over
    processes (DDP's all-reduce) of the sum over its mini-batches of each backward's gradient divided by GA
    (accelerate's ``backward``). A mini-batch whose sums divide by the window's global count over ``N * GA`` then
    contributes exactly its share of the window's mean: every token (or sequence) of the window weighs the same,
    wherever it falls. ``None``: this mini-batch's own count (one process and one mini-batch per window, where the two
    are the same number: the plain mean, bit for bit).

    # token-mean:              sum_{mb,t} l m / (n_window / (N GA))
    # seq-mean-token-mean:     sum_{mb,i} (row mean) / (s_window / (N GA))     s: the sequences with a token
    # seq-mean-token-sum-norm: sum_{mb,t} l m / (b * L)                         b: the mini-batch's rows (all of them,
    #                                                                           = the window's over N GA), L a constant
    """

    tokens: torch.Tensor | None
    sequences: torch.Tensor | None


class PolicyLoss(NamedTuple):
    """Policy loss and its diagnostics (scalars)."""

    loss: torch.Tensor
    clipfrac: torch.Tensor  # fraction of tokens where the clipped branch was taken (CISPO: whose weight was capped)
    approxkl: torch.Tensor  # k2 estimate: 0.5 * E[(log p_new - log p_old)^2]
    policykl: torch.Tensor  # k1 estimate: E[log p_old - log p_new]
    ratio_mean: torch.Tensor  # the importance ratio in use (per sequence with importance_sampling_level="sequence")


def importance_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                         level: str = "token") -> torch.Tensor:
    """``(B, R)`` log importance ratios: per token (PPO's), or per sequence (GSPO, Zheng et al. 2025: the
    length-normalised log-ratio of the whole response, the same at each of its tokens, with the gradient of that
    mean).

    # token:    log r_t = log p_t - log p_old_t
    # sequence: log s   = sum_t m_t (log p_t - log p_old_t) / sum_t m_t
    """
    log_ratio = logprobs - old_logprobs
    if level == "token":
        return log_ratio
    if level == "sequence":
        mask = mask.to(log_ratio.dtype)
        per_sequence = (log_ratio * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)  # (B,)
        return per_sequence[:, None].expand_as(log_ratio)
    raise ValueError(f"importance_log_ratio: level must be one of {IMPORTANCE_SAMPLING_LEVELS} (got {level!r}).")


def policy_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, cliprange: float, n_tokens: torch.Tensor | float | None = None,
                reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, cliprange_high: float | None = None,
                level: str = "token", kind: str = "clip", weights: torch.Tensor | None = None, **params) -> PolicyLoss:
    """The policy loss, all inputs ``(B, R)``; every ``E_mask`` is a :func:`token_mean`.

    # ratio = exp(log p_new - log p_old)   (per sequence with level="sequence": :func:`importance_log_ratio`)
    # clip:  L = E_mask[ max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high)) ]   PPO; DAPO's decoupled clip
    # cispo: L = E_mask[ -sg(min(ratio, cap)) * A * log p_new ]                            CISPO (MiniMax-M1 2025)

    ``kind`` names a registered policy loss (``registry.POLICY_LOSS_REGISTRY``: ``clip``, ``gspo``, ``cispo``, or a
    user's), ``params`` its own parameters (CISPO's ``cap``). ``cliprange`` is eps_low, ``cliprange_high`` eps_high
    (None: ``cliprange``, PPO's symmetric clip). ``reduce`` replaces the loss's token mean (the per-sequence means of
    :func:`aggregate`); the statistics stay token means. ``weights`` ``(B, R)``, where given, multiply each token's
    loss before the mean (the rollout correction's importance weights, ``rollout_correction.sampling_weights``).
    """
    high = cliprange if cliprange_high is None else cliprange_high
    ratio = torch.exp(importance_log_ratio(logprobs, old_logprobs, mask, level))
    per_token, was_clipped = get_policy_loss(kind).function()(ratio, advantages, logprobs, cliprange, high, **params)
    if weights is not None:
        per_token = per_token * weights
    loss = token_mean(per_token, mask, n_tokens) if reduce is None else reduce(per_token)
    with torch.no_grad():
        log_ratio = logprobs - old_logprobs
        clipfrac = token_mean(was_clipped.to(logprobs.dtype), mask, n_tokens)
        approxkl = 0.5 * token_mean(log_ratio.square(), mask, n_tokens)
        policykl = token_mean(-log_ratio, mask, n_tokens)
        ratio_mean = token_mean(ratio, mask, n_tokens)
    return PolicyLoss(loss, clipfrac, approxkl, policykl, ratio_mean)


class ValueLoss(NamedTuple):
    loss: torch.Tensor
    clipfrac: torch.Tensor  # fraction of tokens where the clipped prediction gave the larger error


def value_loss(vpreds: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float, n_tokens: torch.Tensor | float | None = None) -> ValueLoss:
    """Clipped value loss, all inputs ``(B, R)``; every ``E_mask`` is a :func:`token_mean`.

    # v_clip = clip(v, V_old - c, V_old + c)
    # L_V    = 0.5 * E_mask[ max((v - R)^2, (v_clip - R)^2) ]
    """
    vpred_clipped = clip_by_value(vpreds, old_values - cliprange_value, old_values + cliprange_value)
    losses = (vpreds - returns).square()
    losses_clipped = (vpred_clipped - returns).square()
    loss = 0.5 * token_mean(torch.max(losses, losses_clipped), mask, n_tokens)
    with torch.no_grad():
        clipfrac = token_mean((losses_clipped > losses).to(vpreds.dtype), mask, n_tokens)
    return ValueLoss(loss, clipfrac)

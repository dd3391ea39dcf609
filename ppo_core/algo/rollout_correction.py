"""The correction for sampling from a rollout copy: responses drawn from a bf16 copy of the policy (``rollout_dtype``)
come from a distribution ``mu`` slightly off the policy ``pi_old`` whose log-probs the step computes, and an importance
weight ``pi_old / mu`` per token (or per sequence) puts the loss back on the policy's own distribution (Yao et al.
2025, "Your efficient RL framework secretly brings you off-policy RL training"; TRL's vLLM importance-sampling
correction, veRL's rollout correction). The weight is capped, as a raw ratio's variance is unbounded.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .choices import ROLLOUT_CORRECTIONS
from .functional import SumAcross


def sampling_weights(old_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor, mode: str,
                     cap: float) -> torch.Tensor:
    """``(B, R)`` importance weights of the sampled tokens, all inputs ``(B, R)``; 0 at padding.

    # token_*:     w_t = pi_old(y_t) / mu(y_t)                  = exp(log pi_old - log mu)
    # sequence_*:  w_t = prod_t pi_old(y_t) / mu(y_t)  for every token of the sequence
    # *_truncate:  w = min(w, cap)       (TIS);    *_mask: w = w if w <= cap else 0   (the sample leaves the loss)
    """
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"sampling_weights: mode {mode!r} is not one of {ROLLOUT_CORRECTIONS}")
    log_ratio = (old_logprobs - sampling_logprobs) * mask
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(-1, keepdim=True)  # (B, 1)
    ratio = torch.exp(log_ratio)
    ratio = ratio.clamp(max=cap) if mode.endswith("truncate") else ratio.masked_fill(ratio > cap, 0.0)
    return ratio.expand_as(mask) * mask


class SamplingStats(NamedTuple):
    """How far the sampler was from the policy, over the global batch's response tokens."""

    logprob_diff_mean: torch.Tensor  # 0-d: mean |log pi_old - log mu| per token
    logprob_diff_max: torch.Tensor  # 0-d: its largest
    weight_mean: torch.Tensor  # 0-d: mean weight per token (1: no correction)
    weight_min: torch.Tensor
    weight_max: torch.Tensor


def sampling_stats(old_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, weights: torch.Tensor,
                   mask: torch.Tensor, sum_across: SumAcross, gather: SumAcross) -> SamplingStats:
    """:class:`SamplingStats` of ``(B, R)`` inputs over every process's masked tokens (``sum_across``: an element-wise
    sum over processes; ``gather``: ``(k,)`` per process -> ``(N * k,)``). No host read."""
    on = mask.bool()
    diff = (old_logprobs - sampling_logprobs).abs()
    total = sum_across(torch.stack([(diff * mask).sum(), (weights * mask).sum(), mask.sum()]).float())
    count = total[2].clamp(min=1)
    # the largest of each over the masked tokens (0 and -inf stand for no token: the values are >= 0)
    highs = torch.stack([torch.where(on, diff, 0.0).amax(), torch.where(on, weights, 0.0).amax(),
                         torch.where(on, -weights, -torch.inf).amax()]).float()
    highs = gather(highs).view(-1, 3).amax(0)
    return SamplingStats(total[0] / count, highs[0], total[1] / count, -highs[2], highs[1])

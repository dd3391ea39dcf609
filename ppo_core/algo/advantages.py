"""A step's advantages, its policy-loss reduction and its KL loss term, from the config and the estimator's registry
entry (``ppo_core.algo.registry``); and the built-in estimators' advantage functions, which that registry names. The
trainer calls these; the math is in ``ppo_math`` and ``estimators``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .estimators import (
    group_centred,
    group_normalized,
    leave_one_out,
    reinforce_plus_plus_advantages,
    soft_overlong_penalty,
    zero_std_groups,
)
from .kl_control import KLPlacement
from .ppo_math import Advantages, Divisors, ShapedRewards, aggregate, gae_advantages, kl_penalty, shape_rewards
from .registry import StepBatch, get_estimator, settings


def step_advantages(config, scores: torch.Tensor, kls: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    kl_coef: float, group) -> tuple[ShapedRewards, Advantages]:
    """The KL-shaped rewards and the advantages (and returns) of a step, all ``(B, R)``, by the estimator's function.

    ``scores`` ``(B,)``, ``kls`` and ``values`` ``(B, R)``; ``kl_coef`` is 0 when the KL goes to the loss instead
    (``kl_in="loss"``). ``group`` is the run's processes: GAE and REINFORCE++ whiten over the global batch, the group
    estimators' groups lie within one process (the batch is laid out in whole groups).
    """
    advantages = get_estimator(config.advantage_estimator).advantage_function()
    return advantages(StepBatch(scores, kls, values, mask, kl_coef), config, group)


def overlong_penalties(config, response_lengths: torch.Tensor) -> torch.Tensor | None:
    """``(B,)`` DAPO's overlong penalties of responses of ``response_lengths`` ``(B,)`` tokens (each whole, whatever its
    ``response_masks`` leave out of the loss: a response is as long as what was generated), or None where shaping is
    off."""
    buffer_len = settings(config).overlong_buffer_len
    if not buffer_len:
        return None
    return soft_overlong_penalty(response_lengths, config.max_completion_length, buffer_len,
                                 config.overlong_penalty_factor)


def truncated(responses: list[torch.Tensor], eos_token_id: int) -> torch.Tensor:
    """``(B,)`` bool: the responses that do not end with the EOS token (cut at the length limit)."""
    return torch.stack([r[-1] for r in responses]) != eos_token_id


def loss_mask(config, mask: torch.Tensor, scores: torch.Tensor, truncated: torch.Tensor | None) -> torch.Tensor:
    """``(B, R)`` the tokens the loss trains on: ``mask`` less the responses cut at the length limit
    (``mask_truncated_completions``; ``truncated`` ``(B,)`` bool, needed only then) and the groups whose samples all
    scored the same (``dynamic_sampling``: no learning signal in them). ``mask`` itself where neither is set."""
    dynamic_sampling = settings(config).dynamic_sampling
    if not (config.mask_truncated_completions or dynamic_sampling):
        return mask
    keep = torch.ones_like(scores, dtype=mask.dtype)
    if config.mask_truncated_completions:
        keep = keep * (~truncated).to(mask.dtype)
    if dynamic_sampling:
        informative = 1 - zero_std_groups(scores, config.num_generations)  # (P,)
        keep = keep * informative.repeat_interleave(config.num_generations).to(mask.dtype)
    return mask * keep[:, None]


def norm_length(config, mask: torch.Tensor, group, generated: int | None = None) -> torch.Tensor | int | None:
    """Dr. GRPO's constant L (None: not used): ``max_completion_length``, else the ``max_new_tokens`` the step's
    responses were generated with (``generated``: the trainer's last ``generate()`` call's), the same in every step
    and on every process, so that a token's weight does not depend on the other responses of its step (TRL's
    ``max_completion_length``, the paper's "generation budget"). Where neither is known (responses generated outside
    the trainer, and no ``max_completion_length``), the global batch's longest response, as before (the trainer warns
    once)."""
    if settings(config).loss_aggregation != "seq-mean-token-sum-norm":
        return None
    constant = config.max_completion_length or generated
    return constant if constant is not None else group.gather(mask.sum(dim=1)).max()


Reduce = Callable[[torch.Tensor], torch.Tensor]  # a (b, R) per-token loss -> its scalar


def loss_reduction(config, mask: torch.Tensor, divisors: Divisors, norm_length: int) -> Reduce | None:
    """How the policy loss averages its ``(b, R)`` tokens (the resolved loss aggregation, over ``divisors``); None: the
    token mean of ``ppo_math.policy_loss`` itself (PPO's, bit for bit)."""
    aggregation = settings(config).loss_aggregation
    if aggregation == "token-mean":
        return None
    return lambda loss: aggregate(loss, mask, aggregation, norm_length=norm_length,
                                  n_tokens=divisors.tokens, n_sequences=divisors.sequences)


def kl_loss(config, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None, mask: torch.Tensor,
            divisors: Divisors, norm_length: int) -> torch.Tensor | None:
    """The KL loss term (before its coefficient), reduced as the policy loss is; None when the loss has none (the KL
    in the reward, or a coefficient of 0: ``KLPlacement``)."""
    placement = KLPlacement.of(config)
    if not placement.in_loss_term() or ref_logprobs is None:
        return None
    per_token = kl_penalty(logprobs, ref_logprobs, placement.estimator)
    return aggregate(per_token, mask, settings(config).loss_aggregation, norm_length=norm_length,
                     n_tokens=divisors.tokens, n_sequences=divisors.sequences)


# ---- the built-in estimators' advantage functions: (batch, config, group) -> (shaped rewards, advantages) ----------


def sequence_advantages(per_sample: torch.Tensor, mask: torch.Tensor) -> Advantages:
    """``(B,)`` sequence-level advantages broadcast to every token of their response ``(B, R)``; no critic, so
    nothing learns the returns (they are the advantages)."""
    advantages = per_sample[:, None].to(mask.dtype) * mask
    return Advantages(advantages, advantages)


def shaped_group_scores(batch: StepBatch) -> tuple[ShapedRewards, torch.Tensor]:
    """The KL-shaped rewards ``(B, R)`` and their sum per response ``(B,)``: the score, less the KL penalty where the
    KL is in the reward."""
    shaped = shape_rewards(batch.scores, batch.kls, batch.mask, batch.kl_coef)
    return shaped, shaped.rewards.sum(dim=1)


def gae(batch: StepBatch, config, group) -> tuple[ShapedRewards, Advantages]:
    """PPO: GAE over the KL-shaped per-token rewards with the value head, whitened over the global batch."""
    shaped = shape_rewards(batch.scores, batch.kls, batch.mask, batch.kl_coef)
    return shaped, gae_advantages(batch.values, shaped.rewards, batch.mask, config.gamma, config.lam,
                                  config.whiten_rewards, sum_across=group.sum_across)


def group_normalized_advantages(batch: StepBatch, config, group) -> tuple[ShapedRewards, Advantages]:
    """GRPO's (and DAPO's, GSPO's, CISPO's): the shaped scores centred on their group and divided by its std (or the
    batch's, or none: ``scale_rewards``)."""
    shaped, scores = shaped_group_scores(batch)
    batch_std = group.gather(scores).std() if config.scale_rewards == "batch" else None
    per_sample = group_normalized(scores, config.num_generations, config.scale_rewards, batch_std=batch_std)
    return shaped, sequence_advantages(per_sample, batch.mask)


def group_centred_advantages(batch: StepBatch, config, group) -> tuple[ShapedRewards, Advantages]:
    """Dr. GRPO's: the shaped scores centred on their group, no std."""
    shaped, scores = shaped_group_scores(batch)
    return shaped, sequence_advantages(group_centred(scores, config.num_generations), batch.mask)


def leave_one_out_advantages(batch: StepBatch, config, group) -> tuple[ShapedRewards, Advantages]:
    """RLOO's: each shaped score less the mean of the other samples of its prompt."""
    shaped, scores = shaped_group_scores(batch)
    return shaped, sequence_advantages(leave_one_out(scores, config.num_generations), batch.mask)


def reinforce_plus_plus(batch: StepBatch, config, group) -> tuple[ShapedRewards, Advantages]:
    """REINFORCE++: the discounted return of the KL-shaped per-token rewards, whitened over the global batch."""
    shaped = shape_rewards(batch.scores, batch.kls, batch.mask, batch.kl_coef)
    return shaped, Advantages(*reinforce_plus_plus_advantages(shaped.rewards, batch.mask, config.gamma,
                                                              sum_across=group.sum_across))


def reinforce_plus_plus_baseline(batch: StepBatch, config, group) -> tuple[ShapedRewards, Advantages]:
    """REINFORCE++-baseline: REINFORCE++ on scores centred on their group first."""
    return reinforce_plus_plus(batch._replace(scores=group_centred(batch.scores, config.num_generations)), config,
                               group)

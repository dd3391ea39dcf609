"""A step's advantages and its policy-loss reduction, by ``PPOConfig.advantage_estimator``: GAE with the critic (PPO,
legacy TRL's), or a critic-free estimator (``ppo_core.estimators``: GRPO, Dr. GRPO, RLOO, REINFORCE++ and its group
baseline). The trainer calls these two; the math is in ``ppo_math`` and ``estimators``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .estimators import aggregate, centred_on_groups, group_advantages, kl_estimate, reinforce_plus_plus_advantages
from .ppo_math import Advantages, ShapedRewards, gae_advantages, shape_rewards


def step_advantages(config, scores: torch.Tensor, kls: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    kl_coef: float, group) -> tuple[ShapedRewards, Advantages]:
    """The KL-shaped rewards and the advantages (and returns) of a step, all ``(B, R)``.

    ``scores`` ``(B,)``, ``kls`` and ``values`` ``(B, R)``; ``kl_coef`` is 0 when the KL goes to the loss instead
    (``kl_in="loss"``). ``group`` is the run's processes: GAE and REINFORCE++ whiten over the global batch, the group
    estimators' groups lie within one process (the batch is laid out in whole groups).
    """
    estimator, size = config.advantage_estimator, config.num_generations
    reward_scores = centred_on_groups(scores, size) if estimator == "reinforce_plus_plus_baseline" else scores
    shaped = shape_rewards(reward_scores, kls, mask, kl_coef)
    if estimator == "gae":
        return shaped, gae_advantages(values, shaped.rewards, mask, config.gamma, config.lam, config.whiten_rewards,
                                      sum_across=group.sum_across)
    if estimator.startswith("reinforce_plus_plus"):
        return shaped, Advantages(*reinforce_plus_plus_advantages(shaped.rewards, mask, config.gamma,
                                                                   sum_across=group.sum_across))
    sequence = shaped.rewards.sum(dim=1)  # (B,) the score, less the KL penalty when that is in the reward
    batch_std = group.gather(sequence).std() if config.scale_rewards == "batch" else None
    per_sample = group_advantages(sequence, size, estimator, config.scale_rewards, batch_std=batch_std)  # (B,)
    advantages = per_sample[:, None].to(mask.dtype) * mask  # every token of a response: its sequence's advantage
    return shaped, Advantages(advantages, advantages)  # no critic: nothing learns the returns


Reduce = Callable[[torch.Tensor], torch.Tensor]  # a (b, R) per-token loss -> its scalar


def loss_reduction(config, mask: torch.Tensor, n_tokens, norm_length: int) -> Reduce | None:
    """How the policy loss averages its ``(b, R)`` tokens (``config.loss_aggregation``); None: the token mean of
    ``ppo_math.policy_loss`` itself (PPO's, bit for bit)."""
    if config.loss_aggregation == "token-mean":
        return None
    return lambda loss: aggregate(loss, mask, config.loss_aggregation, norm_length=norm_length, n_tokens=n_tokens)


def kl_loss(config, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None, mask: torch.Tensor, n_tokens,
            norm_length: int) -> torch.Tensor | None:
    """The KL loss term (before its coefficient), reduced as the policy loss is; None when the KL is in the reward."""
    if config.kl_in != "loss" or not config.kl_loss_coef or ref_logprobs is None:
        return None
    reduce = loss_reduction(config, mask, n_tokens, norm_length)
    per_token = kl_estimate(logprobs, ref_logprobs, config.kl_estimator)
    return reduce(per_token) if reduce is not None else aggregate(per_token, mask, "token-mean", n_tokens=n_tokens)

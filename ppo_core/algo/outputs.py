"""What an advantage estimator returns (``registry.AdvantageFn``): the KL-shaped rewards and the advantages, each
``(B, R)``, response-aligned. ``ppo_math`` computes them; the registry names them for its estimators' signatures.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class ShapedRewards(NamedTuple):
    """Per-token rewards, all ``(B, R)``, zero at masked positions."""

    rewards: torch.Tensor  # non_score_rewards plus the score on the last valid token
    non_score_rewards: torch.Tensor  # -kl_coef * kl
    kls: torch.Tensor  # the per-token KL estimate that was penalised


class Advantages(NamedTuple):
    """An estimator's results, all ``(B, R)``, zero at masked positions."""

    advantages: torch.Tensor  # GAE's: whitened over the mask
    returns: torch.Tensor  # GAE's: raw (un-whitened) advantages + values, the value-function target

"""The built-in per-token policy losses (``registry.POLICY_LOSS_REGISTRY`` names them by path): PPO's clipped
surrogate (DAPO's decoupled clip, GSPO's on the sequence ratio) and CISPO's capped weight. Each maps ``(b, R)`` ratios,
advantages and log-probs to ``(b, R)`` losses and where the clip took over; ``ppo_math.policy_loss`` reduces them.

They live apart from ``ppo_math``, which looks a loss up in the registry: the registry imports them (on first use)
from here, and nothing of ``ppo_math``.
"""

from __future__ import annotations

import torch


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, logprobs: torch.Tensor, low: float,
                      high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate per token, ``(b, R)``, and where the clip took over (DAPO's decoupled clip with
    ``high != low``; GSPO's with the sequence-level ratio).

    # L_t = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - low, 1 + high))
    """
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - low, 1.0 + high)
    return torch.max(unclipped, clipped), clipped > unclipped


def cispo_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, logprobs: torch.Tensor, low: float, high: float,
                    cap: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO's loss per token (MiniMax-M1 2025), ``(b, R)``, and where the cap took over: the importance weight capped
    at ``cap`` (its own parameter, 5.0 as TRL's; None: ``high``, as a direct call of older versions passed it) with its
    gradient stopped, so every token keeps a REINFORCE gradient.

    # L_t = -sg(min(ratio_t, cap)) * A_t * log p_t
    """
    cap = high if cap is None else cap
    return -ratio.clamp(max=cap).detach() * advantages * logprobs, ratio > cap

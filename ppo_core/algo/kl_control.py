"""KL-coefficient controllers and running score moments: small state machines with plain-number state, and the
score scaling that uses the moments.

Their whole state is a few floats, exposed through ``state_dict``/``load_state_dict`` so a run can be
checkpointed and resumed exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from .registry import settings


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. (2019), "Fine-Tuning Language Models from Human Preferences".

    # err   = clip(current_kl / target - 1, -0.2, 0.2)
    # value = value * (1 + err * n_steps / horizon)
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current: float, n_steps: int) -> None:
        proportional_error = min(max(float(current) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value, self.target, self.horizon = (float(state[k]) for k in ("value", "target", "horizon"))


class KLPlacement(NamedTuple):
    """Where a run's KL to the reference goes, with which estimate and coefficient: decided here, once, from its
    config (``KLPlacement.of``), and read wherever the KL is used (the rewards, the loss, the reference pass, the
    controller, the stats).

    - in the reward (``kl_in="reward"``, legacy PPO's): per-token shaping by ``kl_penalty``'s estimate times the
      controller's coefficient, which adapts to the KL measured (``objective/kl``: that estimate);
    - in the loss (``kl_in="loss"``, GRPO's): ``kl_loss_coef`` times ``kl_estimator``'s term, the rewards unshaped
      and the controller left alone; ``objective/kl`` measures the loss's estimate, so what is logged is what is
      penalised.
    """

    in_loss: bool
    estimator: str  # the per-token estimate, in kl_penalty's vocabulary: what is shaped or penalised, and measured
    loss_coef: float  # the loss term's coefficient (0 where the KL is in the reward)

    @classmethod
    def of(cls, config) -> KLPlacement:
        """From a ``PPOConfig`` (its ``resolved`` settings: the estimator's where a field is None) or a
        ``ResolvedConfig``."""
        resolved = settings(config)
        if resolved.kl_in == "loss":
            return cls(True, resolved.kl_estimator, float(resolved.kl_loss_coef))
        return cls(False, resolved.kl_penalty, 0.0)

    def reward_coef(self, controller) -> float:
        """The coefficient the rewards are shaped with: the controller's, or 0 where the KL is in the loss."""
        return 0.0 if self.in_loss else controller.value

    def uses_reference(self, controller) -> bool:
        """Whether the reference's log-probabilities count anywhere: not where the KL's coefficient is 0."""
        return (self.loss_coef if self.in_loss else controller.value) != 0

    def in_loss_term(self) -> bool:
        """Whether the loss has a KL term (a coefficient above 0)."""
        return self.in_loss and self.loss_coef != 0


class FixedKLController:
    """Constant KL coefficient; ``update`` is a no-op so the trainer treats both controllers alike."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class RunningMoments:
    """Streaming mean and standard deviation of scores (Chan et al. parallel update), legacy semantics.

    ``update`` takes the scores of the whole (already gathered, if distributed) batch. ``std`` is the
    unbiased running standard deviation; the initial state (mean 0, std 1, count ~0) makes the first
    update take the batch's own moments.
    """

    def __init__(self) -> None:
        self.mean, self.var, self.std, self.count = 0.0, 1.0, 1.0, 1e-24

    def update(self, xs: torch.Tensor) -> tuple[float, float]:
        """Fold ``xs`` (any shape) into the running moments; return the batch mean and unbiased std."""
        xs = xs.detach().double().flatten()
        n = xs.numel()
        xs_mean, xs_var = xs.mean().item(), xs.var(unbiased=False).item()
        delta = xs_mean - self.mean
        total = self.count + n
        # M2 of the union = M2_old + M2_new + delta^2 * n_old * n_new / n_total
        m2 = self.var * self.count + xs_var * n + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.var = m2 / total
        self.std = math.sqrt(self.var * total / (total - 1)) if total > 1 else math.sqrt(self.var)
        self.count = total
        batch_std = math.sqrt(xs_var * n / (n - 1)) if n > 1 else 0.0
        return xs_mean, batch_std

    def state_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "var": self.var, "std": self.std, "count": self.count}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.mean, self.var, self.std, self.count = (float(state[k]) for k in ("mean", "var", "std", "count"))


def scale_scores(scores: torch.Tensor, running: RunningMoments | None, use_score_norm: bool,
                 score_clip: float | None, gather: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``(B,)`` scores as ``step`` uses them: with ``running`` moments (``use_score_scaling``), divided by the running
    std of every score so far, this step's of every process too (``gather``), minus their running mean first with
    ``use_score_norm``; then clipped to ``[-score_clip, score_clip]`` (None: not clipped)."""
    scores = scores.float()
    if running is not None:
        running.update(gather(scores))
        factor = running.std + torch.finfo(scores.dtype).eps
        scores = (scores - running.mean) / factor if use_score_norm else scores / factor
    if score_clip is not None:
        scores = scores.clamp(-score_clip, score_clip)
    return scores

"""The advantage estimators, one registry: what each one computes, and where its KL, loss and clip go by default.

An :class:`Estimator` says in one place whether it uses the critic (the value head), whether it compares the samples
of a prompt (``num_generations >= 2``), where its KL to the reference goes (``kl_in``) and with which coefficient,
how its loss averages tokens, which policy loss it takes (PPO's clip or CISPO's), its clip range and importance
ratio level, and its advantage function. ``PPOConfig.resolved`` takes the fields a user leaves unset from the entry
of ``advantage_estimator`` (``ppo_core.config.resolve``: the fields themselves stay as given); the trainer reads the
entry; no other module compares an estimator's name.

A user's own estimator is one decorated function, selectable by name once its module is imported
(``PPOConfig(advantage_estimator="best_of_group")``), or as ``"module:name"``, which imports it
(``ppo.advantage_estimator: rewards.estimators:best_of_group`` in params.yaml; ``rewards/`` is a dep of the ppo
stage)::

    from ppo_core.algo.advantages import sequence_advantages, shaped_group_scores
    from ppo_core.algo.registry import register_estimator

    @register_estimator("best_of_group", needs_groups=True)
    def best_of_group(batch, config, group):
        shaped, scores = shaped_group_scores(batch)  # the KL-shaped rewards (B, R), one score per sample (B,)
        groups = scores.view(-1, config.num_generations)  # (prompts, G): a prompt's samples are consecutive
        return shaped, sequence_advantages((groups - groups.max(dim=1, keepdim=True).values).reshape(-1), batch.mask)

The built-in entries and their references: PPO with GAE (legacy TRL: KL in the reward, 0.2), GRPO (DeepSeekMath: k3
KL loss, 0.04, per-sequence means), Dr. GRPO (no KL, no std, a constant normaliser), RLOO (TRL's RLOOConfig: KL in
the reward, ``kl_coef`` 0.05), REINFORCE++ (OpenRLHF's example script: ``--init_kl_coef 0.01`` in the reward) and
its group baseline (OpenRLHF: a KL loss, 0.001), and the 2025 losses on GRPO's group advantages without a KL: DAPO
(Yu et al.: decoupled clip 0.2/0.28, token mean, dynamic sampling, overlong shaping), GSPO (Zheng et al.: sequence
ratio, clip 3e-4/4e-4) and CISPO (MiniMax-M1; TRL's cap of 5.0 on the stop-gradient weight).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from .choices import IMPORTANCE_SAMPLING_LEVELS, LOSS_AGGREGATIONS, POLICY_LOSSES

if TYPE_CHECKING:  # annotations only: checking a config loads neither torch nor the math
    import torch

    from .ppo_math import Advantages, ShapedRewards


class StepBatch(NamedTuple):
    """What an advantage function gets of a step: ``B`` samples, response-aligned (``R`` the longest response)."""

    scores: torch.Tensor  # (B,) one score per sample (after the legacy score scaling and any overlong shaping)
    kls: torch.Tensor  # (B, R) the per-token KL to the reference (kl_penalty's estimate; 0 without a reference pass)
    values: torch.Tensor  # (B, R) the value head's predictions (used by estimators with the critic)
    mask: torch.Tensor  # (B, R) 1 = a response token that counts
    kl_coef: float  # the KL's coefficient in the rewards (0 when the KL goes to the loss)


AdvantageFn = Callable[[StepBatch, object, object], "tuple[ShapedRewards, Advantages]"]
"""``(batch, config, group) -> (shaped rewards, advantages)``; ``group`` is the run's processes
(``ppo_core.runtime.distributed.ProcessGroup``: ``sum_across``, ``gather``) for statistics over the global batch."""


@dataclass(frozen=True)
class Estimator:
    """One advantage estimator and its reference settings (each a default that a PPOConfig field overrides)."""

    name: str
    advantages: AdvantageFn | str  # the function, or "module:function" (the built-ins': imported on first use)
    uses_critic: bool = False  # trains the value head (critic-free estimators freeze it)
    needs_groups: bool = False  # compares the num_generations samples of a prompt (G >= 2)
    kl_in: str = "reward"  # where the KL goes: "reward" (per-token shaping) or "loss" (a loss term)
    kl_coef: float = 0.0  # its coefficient there (init_kl_coef, or kl_loss_coef)
    loss_aggregation: str = "token-mean"  # ppo_math.LOSS_AGGREGATIONS
    policy_loss: str = "clip"  # ppo_math.POLICY_LOSSES
    cliprange: float = 0.2  # eps_low (and eps_high, unless epsilon_high)
    epsilon_high: float | None = None  # the clip's upper eps (CISPO: the cap on the weight); None: cliprange
    importance_sampling_level: str = "token"  # "sequence": GSPO's ratio
    dynamic_sampling: bool = False  # leave groups with one score for all out of the loss (DAPO)
    overlong_buffer_fraction: float = 0.0  # DAPO's L_cache / L_max (its paper's 4096 / 20480), of max_completion_length

    def __post_init__(self):
        checks = [("kl_in", self.kl_in, ("reward", "loss")), ("loss_aggregation", self.loss_aggregation,
                  LOSS_AGGREGATIONS), ("policy_loss", self.policy_loss, POLICY_LOSSES),
                  ("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)]
        for field, value, choices in checks:
            if value not in choices:
                raise ValueError(f"estimator {self.name!r}: {field} must be one of {choices} (got {value!r}).")

    def advantage_function(self) -> AdvantageFn:
        """The advantage function (a ``"module:function"`` path imported here)."""
        if not isinstance(self.advantages, str):
            return self.advantages
        module, _, name = self.advantages.partition(":")
        return getattr(importlib.import_module(module), name)


ESTIMATORS: dict[str, Estimator] = {}
LEGACY_ESTIMATOR = "gae"  # legacy TRL's PPO: the one its step hooks (compute_rewards, compute_advantages, ...) compute


def register_estimator(name: str, **settings) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register the decorated advantage function as estimator ``name`` with the :class:`Estimator` ``settings``.

    A name already taken raises (no silent replacement of a built-in); ``replace=True`` in ``settings`` replaces.
    """
    replace = settings.pop("replace", False)
    unknown = set(settings) - {f.name for f in dataclasses.fields(Estimator)}
    if unknown:
        raise TypeError(f"register_estimator({name!r}): unknown settings {sorted(unknown)}.")

    def register(fn: AdvantageFn) -> AdvantageFn:
        if name in ESTIMATORS and not replace:
            raise ValueError(f"register_estimator: {name!r} is registered already (replace=True replaces it).")
        ESTIMATORS[name] = Estimator(name=name, advantages=fn, **settings)
        return fn

    return register


def get_estimator(name: str) -> Estimator:
    """The registered estimator ``name``, or with ``"module:name"`` the one ``module`` registers as ``name`` (imported
    here: how a params file selects an estimator of the user's own, e.g. ``rewards.estimators:best_of_group``); a
    ValueError naming the registered ones otherwise."""
    if isinstance(name, str) and name not in ESTIMATORS and ":" in name:
        module, _, short = name.partition(":")
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ValueError(f"advantage_estimator: {name!r}: cannot import {module!r} ({err}).") from None
        name = short
    try:
        return ESTIMATORS[name]
    except (KeyError, TypeError):
        raise ValueError(f"advantage_estimator: {name!r} is not a registered estimator; one of "
                         f"{', '.join(ESTIMATORS)}, or one of your own (ppo_core.algo.registry.register_estimator; "
                         "'module:name' imports its module).") from None


def settings(config):
    """What ``config`` trains with: a ``PPOConfig``'s ``resolved`` settings (its fields as given, each None filled from
    its estimator), or the object itself where it holds them by name (a ``ResolvedConfig``, a namespace in a test)."""
    return getattr(config, "resolved", config)


# ---- the built-in estimators: their functions are in ppo_core.algo.advantages, named here by path so that checking a
# config (every stage builds one from params.yaml) does not load the math --------------------------------------------


def _builtin(name: str, function: str, **entry) -> None:
    ESTIMATORS[name] = Estimator(name=name, advantages=f"ppo_core.algo.advantages:{function}", **entry)


_builtin(LEGACY_ESTIMATOR, "gae", uses_critic=True, kl_coef=0.2)
_builtin("grpo", "group_normalized_advantages", needs_groups=True, kl_in="loss", kl_coef=0.04,
         loss_aggregation="seq-mean-token-mean")
_builtin("dr_grpo", "group_centred_advantages", needs_groups=True, kl_in="loss",
         loss_aggregation="seq-mean-token-sum-norm")
_builtin("rloo", "leave_one_out_advantages", needs_groups=True, kl_coef=0.05)
_builtin("reinforce_plus_plus", "reinforce_plus_plus", kl_coef=0.01)
_builtin("reinforce_plus_plus_baseline", "reinforce_plus_plus_baseline", needs_groups=True, kl_in="loss",
         kl_coef=0.001)
_builtin("dapo", "group_normalized_advantages", needs_groups=True, kl_in="loss", epsilon_high=0.28,
         dynamic_sampling=True, overlong_buffer_fraction=0.2)
_builtin("gspo", "group_normalized_advantages", needs_groups=True, kl_in="loss", loss_aggregation="seq-mean-token-mean",
         cliprange=3e-4, epsilon_high=4e-4, importance_sampling_level="sequence")
_builtin("cispo", "group_normalized_advantages", needs_groups=True, kl_in="loss", policy_loss="cispo",
         epsilon_high=5.0)

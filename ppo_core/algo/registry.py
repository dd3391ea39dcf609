"""The advantage estimators, one registry: what each one computes, and where its KL, loss and clip go by default.

An :class:`Estimator` says in one place whether it uses the critic (the value head), whether it compares the samples
of a prompt (``num_generations >= 2``), where its KL to the reference goes (``kl_in``) and with which coefficient,
how its loss averages tokens, which policy loss it takes (PPO's clip or CISPO's), its clip range and importance
ratio level, and its advantage function. ``PPOConfig.resolved`` takes the fields a user leaves unset from the entry
of ``advantage_estimator`` (``ppo_core.resolution.resolve``: the fields themselves stay as given); the trainer reads the
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

Policy losses are a registry of their own (:class:`PolicyLoss`, ``register_policy_loss``): PPO's clip, GSPO's clip
of the sequence ratio, CISPO's capped weight, or a user's function of the ratio, the advantages and the log-probs,
with its own parameters (``PPOConfig.policy_loss_kwargs``); an estimator entry names its default one.

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

from .choices import IMPORTANCE_SAMPLING_LEVELS, LOSS_AGGREGATIONS

if TYPE_CHECKING:  # annotations only: checking a config loads neither torch nor the math
    import torch

    from .outputs import Advantages, ShapedRewards


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
    policy_loss: str = "clip"  # its default policy loss: a name in POLICY_LOSS_REGISTRY
    cliprange: float = 0.2  # eps_low (and eps_high, unless epsilon_high)
    epsilon_high: float | None = None  # the clip's upper eps (CISPO: the cap on the weight); None: cliprange
    importance_sampling_level: str = "token"  # "sequence": GSPO's ratio
    dynamic_sampling: bool = False  # leave groups with one score for all out of the loss (DAPO)
    overlong_buffer_fraction: float = 0.0  # DAPO's L_cache / L_max (its paper's 4096 / 20480), of max_completion_length

    def __post_init__(self):
        checks = [("kl_in", self.kl_in, ("reward", "loss")),
                  ("loss_aggregation", self.loss_aggregation, LOSS_AGGREGATIONS),
                  ("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)]
        for field, value, choices in checks:
            if value not in choices:
                raise ValueError(f"estimator {self.name!r}: {field} must be one of {choices} (got {value!r}).")

    def advantage_function(self) -> AdvantageFn:
        """The advantage function (a ``"module:function"`` path imported here)."""
        return _imported(self.advantages)


def _imported(function: Callable | str) -> Callable:
    """``function`` itself, or the function a ``"module:function"`` path names (imported on first use)."""
    if not isinstance(function, str):
        return function
    module, _, name = function.partition(":")
    return getattr(importlib.import_module(module), name)


ESTIMATORS: dict[str, Estimator] = {}
LEGACY_ESTIMATOR = "gae"  # legacy TRL's PPO: the one its step hooks (compute_rewards, compute_advantages, ...) compute


def register_estimator(name: str, **settings) -> Callable[[AdvantageFn], AdvantageFn]:
    """Register the decorated advantage function as estimator ``name`` with the :class:`Estimator` ``settings``.

    A name already taken raises (no silent replacement of a built-in); ``replace=True`` in ``settings`` replaces.
    """
    return _registrar(ESTIMATORS, Estimator, "advantages", "register_estimator", name, settings)


def _registrar(table: dict, entry: type, function_field: str, caller: str, name: str, settings: dict) -> Callable:
    """The decorator that puts ``entry(name=name, <function_field>=fn, **settings)`` into ``table``; unknown settings
    raise here, a name already taken at decoration (unless ``replace=True``)."""
    replace = settings.pop("replace", False)
    unknown = set(settings) - {f.name for f in dataclasses.fields(entry)}
    if unknown:
        raise TypeError(f"{caller}({name!r}): unknown settings {sorted(unknown)}.")

    def register(fn):
        if name in table and not replace:
            raise ValueError(f"{caller}: {name!r} is registered already (replace=True replaces it).")
        table[name] = entry(name=name, **{function_field: fn}, **settings)
        return fn

    return register


def get_estimator(name: str) -> Estimator:
    """The registered estimator ``name``, or with ``"module:name"`` the one ``module`` registers as ``name`` (imported
    here: how a params file selects an estimator of the user's own, e.g. ``rewards.estimators:best_of_group``); a
    ValueError naming the registered ones otherwise."""
    return _lookup(ESTIMATORS, name, "advantage_estimator", "estimator", "register_estimator")


def _lookup(table: dict, name: str, field: str, what: str, register: str):
    """``table[name]``, importing ``module`` first for ``"module:name"``; else a ValueError worded for ``field``."""
    if isinstance(name, str) and name not in table and ":" in name:
        module, _, short = name.partition(":")
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise ValueError(f"{field}: {name!r}: cannot import {module!r} ({err}).") from None
        name = short
    try:
        return table[name]
    except (KeyError, TypeError):
        raise ValueError(f"{field}: {name!r} is not a registered {what}; one of {', '.join(table)}, or one of your "
                         f"own (ppo_core.algo.registry.{register}; 'module:name' imports its module).") from None


# ---- the policy losses: how a token's loss follows from its importance ratio and advantage --------------------------

PolicyLossFn = Callable[..., "tuple[torch.Tensor, torch.Tensor]"]
"""``(ratio, advantages, logprobs, low, high, **params) -> (per-token loss, was_clipped)``, all ``(b, R)``: ``ratio``
the importance ratio (per token, or the sequence's at each of its tokens), ``low``/``high`` the clip's eps, ``params``
the loss's own parameters; the engine reduces the loss (the run's aggregation, over its accumulation window) and
takes the statistics (``was_clipped``'s mean is ``ppo/policy/clipfrac``)."""


@dataclass(frozen=True)
class PolicyLoss:
    """One policy loss, beside the estimators (veRL keeps ``adv_estimator`` and ``policy_loss.loss_mode`` apart): its
    per-token function, its own parameters with their defaults (``PPOConfig.policy_loss_kwargs`` overrides them), and
    the clip and ratio level it takes where it is not the estimator's own loss (None: the estimator's)."""

    name: str
    per_token: PolicyLossFn | str  # the function, or "module:function" (the built-ins': imported on first use)
    params: dict = dataclasses.field(default_factory=dict)
    cliprange: float | None = None
    epsilon_high: float | None = None
    importance_sampling_level: str | None = None

    def __post_init__(self):
        level = self.importance_sampling_level
        if level is not None and level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(f"policy loss {self.name!r}: importance_sampling_level must be one of "
                             f"{IMPORTANCE_SAMPLING_LEVELS} (got {level!r}).")

    def function(self) -> PolicyLossFn:
        """The per-token function (a ``"module:function"`` path imported here)."""
        return _imported(self.per_token)


POLICY_LOSS_REGISTRY: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, **settings) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register the decorated per-token function as policy loss ``name`` with the :class:`PolicyLoss` ``settings``
    (``params``: its own parameters and their defaults); chosen by ``PPOConfig(policy_loss=name)``, or from a params
    file as ``"module:name"``. A name already taken raises; ``replace=True`` replaces."""
    return _registrar(POLICY_LOSS_REGISTRY, PolicyLoss, "per_token", "register_policy_loss", name, settings)


def get_policy_loss(name: str) -> PolicyLoss:
    """The registered policy loss ``name`` (``"module:name"`` imports ``module`` first); a ValueError naming the
    registered ones otherwise."""
    return _lookup(POLICY_LOSS_REGISTRY, name, "policy_loss", "policy loss", "register_policy_loss")


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
         policy_loss="gspo", cliprange=3e-4, epsilon_high=4e-4, importance_sampling_level="sequence")
_builtin("cispo", "group_normalized_advantages", needs_groups=True, kl_in="loss", policy_loss="cispo")

# The built-in policy losses (algo.surrogates): PPO's clip (DAPO's decoupled clip with epsilon_high), GSPO's (the
# clip of the sequence-level ratio, at its paper's 3e-4 / 4e-4), CISPO's (a stop-gradient weight capped at `cap`: 5.0,
# TRL's; its own parameter, not the clip's epsilon_high).
for _name, _function, _settings in (
        ("clip", "clipped_surrogate", {}),
        ("gspo", "clipped_surrogate",
         {"cliprange": 3e-4, "epsilon_high": 4e-4, "importance_sampling_level": "sequence"}),
        ("cispo", "cispo_surrogate", {"params": {"cap": 5.0}})):
    POLICY_LOSS_REGISTRY[_name] = PolicyLoss(name=_name, per_token=f"ppo_core.algo.surrogates:{_function}", **_settings)

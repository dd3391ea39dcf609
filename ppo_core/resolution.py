"""A config's resolution: what a ``PPOConfig`` trains with, every default its estimator gives applied
(:class:`ResolvedConfig`, by :func:`resolve`), the run's batch sizes across its processes (:class:`RunSizes`) and the
legacy copy a trainer holds (:func:`run_config`). ``ppo_core.config`` keeps the fields and their checks, and calls
:func:`resolve` on construction (so an estimator's settings are checked before any model loads); these names import
from there too."""

from __future__ import annotations

import copy
import dataclasses
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .algo.choices import LOSS_TYPES
from .algo.registry import get_estimator, get_policy_loss
from .fields import ConfigError, _literal, check_range

if TYPE_CHECKING:  # annotations only: config imports this module, to resolve a config on construction
    from .config import PPOConfig


@dataclass(frozen=True)
class RunSizes:
    """A run's batch sizes across its processes, worked out once from its config and its number of processes: by the
    trainer (``PPOTrainer.sizes``), and by a loop that needs them before it builds one."""

    num_processes: int
    batch_size: int
    """samples per ``step()`` on each process"""
    mini_batch_size: int
    backward_batch_size: int
    """samples per optimizer update on each process: ``mini_batch_size * gradient_accumulation_steps``"""
    num_generations: int

    @classmethod
    def of(cls, config: PPOConfig, num_processes: int) -> RunSizes:
        return cls(num_processes, config.batch_size, config.mini_batch_size, config.backward_batch_size,
                   config.num_generations)

    @property
    def global_batch_size(self) -> int:
        """samples per ``step()`` over every process"""
        return self.batch_size * self.num_processes

    @property
    def global_backward_batch_size(self) -> int:
        return self.backward_batch_size * self.num_processes

    @property
    def prompts_per_step(self) -> int:
        """distinct prompts in a step's global batch (each sampled ``num_generations`` times)"""
        return self.global_batch_size // self.num_generations


def run_config(config: PPOConfig, sizes: RunSizes, is_encoder_decoder: bool, is_peft_model: bool,
               resolved: ResolvedConfig | None = None, rollout: tuple[str | None, ...] | None = None) -> PPOConfig:
    """A copy of ``config`` with the legacy fields of the run filled (``world_size``, ``global_batch_size``,
    ``global_backward_batch_size``, ``is_encoder_decoder``, ``is_peft_model``; ``temperature`` 1.0 for None) and the
    estimator's settings resolved into the fields left None (``RESOLVED_FIELDS``): what ``trainer.config`` holds, as
    legacy user code reads them there (``trainer.config.init_kl_coef`` is 0.2 for PPO, as legacy TRL's). The caller's
    ``config`` is left as it was built, so ``dataclasses.replace`` on it still means what it says.

    ``rollout``: ``rollout_dtype`` and ``rollout_correction`` as this machine runs them ("auto" resolved by the trainer:
    ``models.rollout_copy.rollout_choice``). The copy holds ``resolved`` (what every part of the run reads as
    ``run.resolved``) and refuses an edit of the fields
    in ``FIXED_IN_A_RUN``; the others (``ratio_threshold``, ``early_stopping``, ``ppo_epochs``, ...) are read as each
    step goes, and follow an edit, as legacy's did."""
    run = copy.copy(config)
    run.world_size = sizes.num_processes
    run.global_batch_size = sizes.global_batch_size
    run.global_backward_batch_size = sizes.global_backward_batch_size
    run.is_encoder_decoder, run.is_peft_model = is_encoder_decoder, is_peft_model
    run.temperature = 1.0 if config.temperature is None else config.temperature  # None: legacy's raw logits
    if rollout is not None:  # rollout_dtype and rollout_correction as this machine runs them ("auto" resolved)
        run.rollout_dtype, run.rollout_correction = rollout
    resolved = resolve(config) if resolved is None else resolved
    for name in RESOLVED_FIELDS:
        setattr(run, name, getattr(resolved, name))
    object.__setattr__(run, "_run_resolved", resolved)
    object.__setattr__(run, "_fixed_fields", FIXED_IN_A_RUN)
    return run


@dataclass(frozen=True)
class ResolvedConfig:
    """What a config trains with, every default its estimator gives applied: worked out once from the user's fields
    as given (:func:`resolve`; ``PPOConfig.resolved``), never written back into them, so a config built by
    ``dataclasses.replace`` resolves as the same fields given at construction do. The trainer reads it (its
    ``trainer.resolved``; ``trainer.config``, the legacy copy, holds these values in its fields), the checkpoint and the
    ppo stage's metrics record it (``to_dict``)."""

    advantage_estimator: str
    uses_critic: bool
    """the value head trains (GAE's critic); critic-free estimators leave it alone"""
    kl_in: Literal["reward", "loss"]
    init_kl_coef: float
    """the KL's coefficient in the rewards (where the controller starts); 0 where the KL goes to the loss"""
    kl_penalty: str
    """the per-token estimate the rewards are shaped with"""
    kl_loss_coef: float
    """the KL loss term's coefficient; 0 where the KL goes to the reward"""
    kl_estimator: str
    """the loss term's per-token estimate"""
    loss_aggregation: str
    policy_loss: str
    """a registered policy loss: 'clip' (PPO's clipped surrogate, DAPO's decoupled clip), 'gspo', 'cispo', a user's"""
    policy_loss_kwargs: dict
    """its own parameters, its defaults under the user's (CISPO's cap)"""
    cliprange: float
    """the clip's lower eps"""
    epsilon_high: float
    """the clip's upper eps"""
    importance_sampling_level: Literal["token", "sequence"]
    dynamic_sampling: bool
    overlong_buffer_len: int
    """DAPO's L_cache in tokens (0: no overlong shaping)"""
    max_completion_length: int | None
    """Dr. GRPO's constant normaliser and DAPO's L_max; None: the max_new_tokens generate() was called with"""
    scale_rewards: str
    num_generations: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# The PPOConfig fields a resolution fills when left None (the legacy copy of the trainer holds them filled).
RESOLVED_FIELDS = ("kl_in", "init_kl_coef", "kl_loss_coef", "loss_aggregation", "policy_loss", "policy_loss_kwargs",
                   "cliprange", "epsilon_high", "importance_sampling_level", "dynamic_sampling", "overlong_buffer_len")
# What a trainer reads of its config once: what resolution reads, the run's sizes, and what its optimizer, KL
# controller, accelerator and models were built with. An edit of one of them on ``trainer.config`` is refused.
FIXED_IN_A_RUN = frozenset(RESOLVED_FIELDS + (
    "advantage_estimator", "loss_type", "kl_penalty", "kl_estimator", "max_completion_length", "scale_rewards",
    "num_generations", "batch_size", "mini_batch_size", "gradient_accumulation_steps", "backward_batch_size",
    "world_size", "global_batch_size", "global_backward_batch_size", "seed", "learning_rate", "adap_kl_ctrl", "target",
    "horizon", "max_grad_norm", "max_consecutive_overflows", "accelerator_kwargs", "project_kwargs",
    "gradient_checkpointing", "disable_dropout", "rollout_dtype", "is_encoder_decoder", "is_peft_model",
    "lr_scheduler_type", "warmup_ratio", "weights_dtype"))


def resolve(config: PPOConfig) -> ResolvedConfig:
    """``config``'s estimator settings, each the user's field where given, else the estimator's registry entry's
    (``ppo_core.algo.registry``), checked for what they imply together; a ``ConfigError`` naming the field otherwise.
    Pure: ``config`` is left as it is."""
    try:
        entry = get_estimator(config.advantage_estimator)
    except ValueError as err:  # worded for the config or the params file, as every other bad value
        raise ConfigError("advantage_estimator", "{key}" + _literal(str(err).partition(":")[2])) from None
    kl_in = config.kl_in or entry.kl_in
    check_range("kl_loss_coef", config.kl_loss_coef, f"unset (or 0) when the KL is in the reward (kl_in "
                f"{kl_in!r}, whose coefficient is init_kl_coef)",
                kl_in == "loss" or not config.kl_loss_coef, "set kl_in: 'loss' for a KL loss term")
    kl_loss_coef = config.kl_loss_coef if config.kl_loss_coef is not None else \
        entry.kl_coef if kl_in == "loss" else 0.0
    # the rewards' coefficient: none where the KL goes to the loss, whatever init_kl_coef says (the trainer warns)
    init_kl_coef = 0.0 if kl_in == "loss" else config.init_kl_coef if config.init_kl_coef is not None else \
        entry.kl_coef
    loss_aggregation, policy_loss = _resolve_loss(config, entry)
    try:
        loss = get_policy_loss(policy_loss)
    except ValueError as err:
        raise ConfigError("policy_loss", "{key}" + _literal(str(err).partition(":")[2])) from None
    # the clip and the ratio's level: the user's, else the estimator's; a loss that is not the estimator's own (GSPO's
    # with grpo, say) brings its own where it has them
    own = loss.name == entry.policy_loss
    defaults = entry if own else _Fallback(loss, entry)
    cliprange = defaults.cliprange if config.cliprange is None else config.cliprange
    epsilon_high = next(e for e in (config.epsilon_high, defaults.epsilon_high, cliprange) if e is not None)
    level = config.importance_sampling_level or defaults.importance_sampling_level
    unknown = sorted(set(config.policy_loss_kwargs) - set(loss.params))
    check_range("policy_loss_kwargs", config.policy_loss_kwargs, f"parameters of policy loss {loss.name!r} (one of "
                f"{sorted(loss.params) or 'none'}; not {unknown})", not unknown)
    params = {**loss.params, **config.policy_loss_kwargs}
    if "cap" in loss.params and "cap" not in config.policy_loss_kwargs and config.epsilon_high is not None:
        params["cap"] = config.epsilon_high  # TRL's meaning of epsilon_high with CISPO's loss
    dynamic_sampling = entry.dynamic_sampling if config.dynamic_sampling is None else config.dynamic_sampling
    overlong_buffer_len = config.overlong_buffer_len
    if overlong_buffer_len is None:
        overlong_buffer_len = int(entry.overlong_buffer_fraction * (config.max_completion_length or 0))
    check_range("overlong_buffer_len", overlong_buffer_len, f"<= max_completion_length "
                f"({config.max_completion_length}), which overlong shaping needs",
                not overlong_buffer_len or overlong_buffer_len <= (config.max_completion_length or 0))
    group = config.num_generations
    check_range("num_generations", group, ">= 2 for advantage_estimator " + config.advantage_estimator,
                group >= 2 or not entry.needs_groups, "the estimator compares the samples of a prompt")
    check_range("dynamic_sampling", dynamic_sampling, "false with num_generations 1 (it drops groups of one "
                "score, and a group of one sample always has one)", group >= 2 or not dynamic_sampling)
    for name in ("batch_size", "mini_batch_size"):
        value = getattr(config, name)
        check_range(name, value, f"a multiple of num_generations ({group})", value % group == 0,
                    "a prompt's samples must not straddle two batches")
    return ResolvedConfig(
        advantage_estimator=entry.name, uses_critic=entry.uses_critic, kl_in=kl_in, init_kl_coef=float(init_kl_coef),
        kl_penalty=config.kl_penalty, kl_loss_coef=float(kl_loss_coef), kl_estimator=config.kl_estimator,
        loss_aggregation=loss_aggregation, policy_loss=loss.name, policy_loss_kwargs=params,
        cliprange=float(cliprange), epsilon_high=float(epsilon_high), importance_sampling_level=level,
        dynamic_sampling=bool(dynamic_sampling), overlong_buffer_len=int(overlong_buffer_len),
        max_completion_length=config.max_completion_length, scale_rewards=config.scale_rewards,
        num_generations=group)


def warn_unused_kl_coef(config: PPOConfig, resolved: ResolvedConfig) -> None:
    """Warn where the user's ``init_kl_coef`` applies nowhere: the KL goes to the loss, whose coefficient is
    ``kl_loss_coef`` (the opposite case, ``kl_loss_coef`` with the KL in the reward, is refused by :func:`resolve`; this
    one only warns, so that a params file written for PPO runs ``-S ppo.advantage_estimator=grpo`` as it is)."""
    if resolved.kl_in == "loss" and config.init_kl_coef:
        warnings.warn(f"PPOTrainer: init_kl_coef={config.init_kl_coef} is the KL's coefficient in the rewards, but "
                      f"with advantage_estimator {resolved.advantage_estimator!r} the KL goes to the loss (kl_in "
                      f"'loss', kl_loss_coef {resolved.kl_loss_coef:g}): init_kl_coef is not used (0 in "
                      "trainer.config and objective/kl_coef). Set kl_loss_coef for the loss term, or kl_in: 'reward'.",
                      UserWarning, stacklevel=3)


class _Fallback:
    """A policy loss's clip and ratio level, the estimator's where the loss has none."""

    def __init__(self, loss, entry):
        for name in ("cliprange", "epsilon_high", "importance_sampling_level"):
            own = getattr(loss, name)
            setattr(self, name, getattr(entry, name) if own is None else own)


def _resolve_loss(config: PPOConfig, entry) -> tuple[str, str]:
    """(the loss aggregation, the policy loss's name): the user's fields, else loss_type's (TRL's name for an
    aggregation and a loss), else the estimator's."""
    if config.loss_type is None:
        return config.loss_aggregation or entry.loss_aggregation, config.policy_loss or entry.policy_loss
    implied, policy_loss = LOSS_TYPES[config.loss_type]
    check_range("loss_aggregation", config.loss_aggregation, f"{implied!r}, as loss_type {config.loss_type!r} "
                "implies (or unset)", config.loss_aggregation in (None, implied), "set one of the two")
    check_range("policy_loss", config.policy_loss, f"{policy_loss!r}, as loss_type {config.loss_type!r} implies (or "
                "unset)", config.policy_loss in (None, policy_loss), "set one of the two")
    return implied, policy_loss

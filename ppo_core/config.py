"""``PPOConfig``: every field of the legacy ``trl.PPOConfig``, same names and defaults, validated.

Validation happens on construction, so a bad value fails before any model is loaded: an unknown key, a wrong
type, a non-positive size or rate, or a ``batch_size`` that ``mini_batch_size * gradient_accumulation_steps``
does not divide raises a ``ValueError`` (:class:`~ppo_core.fields.ConfigError`) naming the field and what it must
be, worded as the pipeline's params loader words it (``ppo_core.fields``). Values read from YAML are accepted as
the YAML loader gives them: PyYAML reads ``1e-5`` as the *string* ``"1e-5"``, so numeric fields accept numeric
strings (and nothing else).

What a config trains with, its estimator's defaults applied (``resolve``, ``ResolvedConfig``), and a run's sizes and
legacy copy (``RunSizes``, ``run_config``) are worked out in ``ppo_core.resolution``; they import from here too.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import sys
import typing
import warnings
from dataclasses import dataclass, field
from typing import Any, Literal

from .fields import ConfigError, check_keys, check_range, checked

# resolve checks an estimator's settings on construction; the other names import from here as before they moved
from .resolution import (  # noqa: F401
    FIXED_IN_A_RUN,
    RESOLVED_FIELDS,
    ResolvedConfig,
    RunSizes,
    resolve,
    run_config,
    warn_unused_kl_coef,
)

# Fields derived from the others (on construction) or from the run (by the trainer), and what from: kept for the
# legacy API, which lets a caller pass them (and overwrites them); a params file must not set them.
DERIVED = {"world_size": "the number of processes", "global_batch_size": "batch_size * the number of processes",
           "backward_batch_size": "mini_batch_size * gradient_accumulation_steps",
           "global_backward_batch_size": "backward_batch_size * the number of processes",
           "is_encoder_decoder": "the model", "is_peft_model": "the model"}


def _default_exp_name() -> str:
    name = os.path.basename(sys.argv[0] or "ppo")
    return name[: -len(".py")] if name.endswith(".py") else name


@dataclass
class PPOConfig:
    """Configuration of :class:`ppo_core.PPOTrainer` (fields and defaults of ``trl.PPOConfig`` v0.11)."""

    exp_name: str = field(default_factory=_default_exp_name)
    """the name of this experiment (by default the script's file name)"""
    seed: int = 0
    """seed of ``set_seed`` in the trainer and of its mini-batch shuffling (plus the process index under N processes)"""
    log_with: Literal["wandb", "tensorboard", "dvclive", "comet_ml", "mlflow", "aim", "clearml"] | None = None
    """accelerate tracker to log to (requires the tracker's package)"""
    task_name: str | None = None
    """name of the task, for tracking only"""
    model_name: str | None = "gpt2"
    """name of the model, for tracking only"""
    query_dataset: str | None = "imdb"
    """name of the dataset of queries, for tracking only"""
    reward_model: str | None = "sentiment-analysis:lvwerra/distilbert-imdb"
    """the reward model, for tracking only"""
    remove_unused_columns: bool = True
    """drop dataset columns the model's forward does not take (``query``, ``response``, ``label`` kept)"""
    tracker_kwargs: dict = field(default_factory=dict)
    """keyword arguments of the tracker (e.g. ``{"wandb": {"entity": ...}}``)"""
    accelerator_kwargs: dict = field(default_factory=dict)
    """keyword arguments of ``accelerate.Accelerator`` (e.g. ``{"mixed_precision": "bf16"}``)"""
    project_kwargs: dict = field(default_factory=dict)
    """keyword arguments of ``accelerate.utils.ProjectConfiguration`` (e.g. ``logging_dir``)"""
    tracker_project_name: str = "trl"
    """project name of the tracker"""
    push_to_hub_if_best_kwargs: dict = field(default_factory=dict)
    """``push_to_hub`` arguments used when the mean score beats the best so far (needs ``repo_id``)"""
    steps: int = 20000
    """number of training samples; only used for ``total_ppo_epochs``"""
    learning_rate: float = 1.41e-5
    """Adam learning rate (when no optimizer is passed)"""
    adap_kl_ctrl: bool = True
    """adaptive KL controller (Ziegler et al.) instead of a fixed coefficient"""
    init_kl_coef: float | None = None
    """initial KL penalty coefficient (beta) in the rewards; None: the estimator's (0.2 for PPO, legacy TRL's; see
    ppo_core.algo.registry), 0 when the KL goes to the loss"""
    kl_penalty: Literal["kl", "k1", "abs", "mse", "k2", "k3", "full"] = "kl"  # choices.KL_PENALTIES
    """per-token KL estimate in the rewards: 'kl' = 'k1' (logp - ref), 'abs', 'mse' = 'k2' (0.5 * diff^2), 'k3'
    (low variance, >= 0) or 'full' (whole distribution)"""
    target: float | None = 6
    """target KL of the adaptive controller"""
    horizon: float | None = 10000
    """horizon of the adaptive controller"""
    gamma: float = 1
    """GAE discount"""
    lam: float = 0.95
    """GAE lambda"""
    cliprange: float | None = None
    """policy ratio clip range (TRL GRPOConfig's ``epsilon``, the lower one where epsilon_high is set); None: the
    estimator's (0.2; GSPO's 3e-4)"""
    cliprange_value: float = 0.2
    """value clip range"""
    vf_coef: float = 0.1
    """value loss coefficient"""
    batch_size: int = 128
    """samples per ``step()`` per process"""
    forward_batch_size: int | None = None
    """DEPRECATED: use ``mini_batch_size``; if set, it overrides ``mini_batch_size``"""
    mini_batch_size: int = 128
    """samples per optimisation mini-batch (and per no-grad forward chunk)"""
    gradient_accumulation_steps: int = 1
    """mini-batches accumulated per optimizer step"""
    world_size: int | None = None
    """number of processes (set by the trainer)"""
    ppo_epochs: int = 4
    """optimisation epochs over each batch"""
    max_grad_norm: float | None = None
    """gradient clipping norm (none if None)"""
    optimize_cuda_cache: bool | None = None
    """DEPRECATED: use ``optimize_device_cache``"""
    optimize_device_cache: bool | None = False
    """free the device cache after each step (slower, lower peak memory)"""
    early_stopping: bool = False
    """stop the PPO epochs of a step when the policy KL exceeds 1.5 * target_kl"""
    target_kl: float = 1
    """KL threshold of early stopping"""
    compare_steps: int = 1
    """every how many steps to compare the mean score for ``push_to_hub_if_best_kwargs``"""
    ratio_threshold: float = 10.0
    """skip the update of a mini-batch whose mean probability ratio exceeds this (counted in the stats)"""
    use_score_scaling: bool = False
    """divide scores by their running standard deviation"""
    use_score_norm: bool = False
    """with score scaling, also subtract the running mean"""
    score_clip: float | None = None
    """clip scores to [-score_clip, score_clip]"""
    whiten_rewards: bool = False
    """whiten the per-token rewards (keeping their mean) before GAE"""
    gradient_checkpointing: bool = False
    """gradient checkpointing in the policy (less memory, more compute)"""
    is_encoder_decoder: bool | None = None
    """set by the trainer from the model"""
    is_peft_model: bool | None = None
    """set by the trainer from the model"""
    backward_batch_size: int | None = None
    """set on construction: mini_batch_size * gradient_accumulation_steps"""
    global_backward_batch_size: int | None = None
    """set by the trainer: backward_batch_size * world_size"""
    global_batch_size: int | None = None
    """set by the trainer: batch_size * world_size"""
    dataset_num_proc: int | None = None
    """processes for dataset preprocessing"""
    disable_dropout: bool = True
    """(ppo_core) set dropout to 0 in the policy so the first PPO ratio is 1 (exactly on CPUs); see PPOTrainer"""
    max_consecutive_overflows: int = 20
    """(ppo_core) fp16 loss scaling: an overflow skips that optimizer update (counted in ppo/policy/overflowed_updates);
    this many in a row stop the run as diverged (the scale, 2^16 at first, has halved as many times)"""
    tf32: bool = True
    """(ppo_core) let float32 matmuls use TF32 on CUDA GPUs that have it (Ampere and newer) while the trainer's
    generate and step run; false leaves torch's setting as it is (no effect on CPUs)"""
    advantage_estimator: str = "gae"
    """(ppo_core) a registered estimator (``ppo_core.algo.registry``): 'gae' (PPO with a critic, the value head), or
    critic-free 'grpo', 'dr_grpo', 'rloo', 'reinforce_plus_plus', 'reinforce_plus_plus_baseline', 'dapo', 'gspo',
    'cispo', or one of your own; without the critic the value head is neither used nor trained and the ppo/val/*
    stats are absent"""
    num_generations: int = 1
    """(ppo_core) samples per prompt, G: the dataloader yields batch_size / G prompts, each G times in a row, and
    step() checks that every G consecutive queries are one prompt (grpo, dr_grpo, rloo and the baseline need G >= 2)"""
    kl_in: Literal["reward", "loss"] | None = None
    """(ppo_core) where the KL to the reference goes: 'reward' (per-token shaping with init_kl_coef and kl_penalty, as
    legacy PPO) or 'loss' (kl_loss_coef times the kl_estimator term); None: the estimator's reference choice"""
    kl_loss_coef: float | None = None
    """(ppo_core) the KL loss term's coefficient when kl_in is 'loss' (TRL GRPOConfig's ``beta``); None: the
    estimator's"""
    kl_estimator: Literal["kl", "k1", "abs", "mse", "k2", "k3"] = "k3"
    """(ppo_core) the KL loss term's per-token estimate, in kl_penalty's vocabulary ('full' is reward-side only)"""
    loss_aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] | None = None
    """(ppo_core) how the policy loss averages its tokens: over all tokens (PPO, DAPO), per sequence then over
    sequences (GRPO), or the token sum over a constant, the step's longest response (Dr. GRPO); None: loss_type's,
    else the estimator's"""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """(ppo_core) GRPO's advantages: divide the centred scores by their group's std, the batch's, or nothing"""
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo"] | None = None
    """(ppo_core) TRL GRPOConfig's loss_type: the loss aggregation and policy loss in one name (grpo: per-sequence
    means; bnpo, dapo: token mean; dr_grpo: constant normaliser; cispo: CISPO's loss, token mean); None: the
    estimator's"""
    policy_loss: str | None = None
    """(ppo_core) a registered policy loss (``ppo_core.algo.registry``): 'clip' (PPO's, DAPO's decoupled clip), 'gspo'
    (the clip of the sequence-level ratio), 'cispo', or one of your own (``register_policy_loss``; 'module:name'
    imports it); None: loss_type's, else the estimator's"""
    policy_loss_kwargs: dict = field(default_factory=dict)
    """(ppo_core) the policy loss's own parameters, over its defaults (CISPO's ``cap`` on its importance weight: 5.0)"""
    epsilon_high: float | None = None
    """(ppo_core) the clip's upper eps, decoupled from cliprange (DAPO's clip-higher: 0.28); None: the estimator's (or
    the policy loss's, where that is not the estimator's own), else cliprange. With CISPO's loss and no ``cap`` in
    policy_loss_kwargs, TRL's meaning: the cap on the importance weight"""
    importance_sampling_level: Literal["token", "sequence"] | None = None
    """(ppo_core) the importance ratio per token (PPO) or per sequence (GSPO); None: the estimator's"""
    mask_truncated_completions: bool = False
    """(ppo_core) leave responses that did not end with the EOS token (cut at the length limit) out of the loss"""
    dynamic_sampling: bool | None = None
    """(ppo_core) leave groups whose samples all scored the same out of the loss (DAPO; their advantages are 0, and
    counted in the token mean they dilute the others'); None: the estimator's"""
    max_completion_length: int | None = None
    """(ppo_core) the responses' length limit (TRL's name; the pipeline passes generation.max_new_tokens): DAPO's
    L_max of its overlong shaping"""
    overlong_buffer_len: int | None = None
    """(ppo_core) DAPO's L_cache: responses longer than max_completion_length - this lose up to
    overlong_penalty_factor from their score (0: off); None: the estimator's share of max_completion_length (DAPO:
    0.2), off without max_completion_length"""
    overlong_penalty_factor: float = 1.0
    """(ppo_core) the overlong penalty at max_completion_length"""
    rollout_dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = "auto"
    """(ppo_core) generate() samples from a copy of the policy in this dtype, synced whenever the policy's weights
    changed (veRL's rollout.dtype): on a GPU bf16 rollouts without autocast's casts, and with the static cache (what
    generate() uses with a copy on a GPU unless told otherwise) a compiled decoding step; step()'s log-probs stay the
    policy's own passes (float32: an exact copy, whose rollout_correction weights are 1). None: sample from the policy
    itself, as TRL 0.11 did. "auto": bfloat16 on a CUDA GPU with bf16, else None; None under ZeRO-3 (the weights are
    sharded)"""
    rollout_correction: Literal["auto", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] | None = (
        "auto")
    """(ppo_core) with rollout_dtype: weight each token's policy loss by pi_old / pi_copy, the policy's probability of
    the sampled token over the rollout copy's that sampled it, per token or per sequence, truncated at or zeroed above
    rollout_correction_cap (TRL's vLLM importance-sampling correction; TIS); costs one no-grad pass of the copy a
    step, and adds the sampling/* stats. None: no correction (the samples count as the policy's own); "auto":
    token_truncate wherever a copy samples"""
    rollout_correction_cap: float = 2.0
    """(ppo_core) the largest importance weight of rollout_correction"""
    weights_dtype: Literal["bfloat16"] | None = None
    """(ppo_core) hold the policy's weights (its LM; the value head stays float32) in this dtype and train them through
    float32 master copies in the default optimizer (``runtime.master_weights.MasterAdam``; DeepSpeed's and Megatron's
    bf16 optimizers): every pass computes in bf16 with no autocast casts, the weights and the reference copy take half
    the memory, and Adam's small updates accumulate in float32. The policy then samples itself (a rollout_dtype "auto"
    copy would be the same weights) with the static cache on a GPU. An optimizer passed to PPOTrainer must keep masters
    itself (MasterAdam, MasterAdamW). None: the weights as loaded, as legacy TRL"""
    lr_scheduler_type: Literal["constant", "constant_with_warmup", "linear", "cosine"] = "constant"
    """(ppo_core; TRL GRPOConfig's name, transformers' schedules) the learning rate over the run's
    ``ceil(steps / batch_size)`` step() calls: "constant" (legacy TRL's: it never moves), or after warmup_ratio of
    them rising from 0, "constant_with_warmup", or down to 0 at the end, "linear" or "cosine". With an
    ``lr_scheduler`` passed to PPOTrainer (legacy's way) it must stay "constant": two schedules are refused"""
    warmup_ratio: float = 0.0
    """(ppo_core) the share of the step() calls over which the learning rate rises from 0 (lr_scheduler_type's)"""
    temperature: float | None = None
    """(ppo_core; TRL GRPOConfig's name and meaning) the temperature the responses were sampled at: every pass of
    step() (policy, reference, rollout copy, update) divides the logits by it, so the log-probabilities, the ratio,
    the KL and the entropy are those of the distribution the responses were drawn from, as TRL's GRPOTrainer and its
    later PPOTrainer compute them. None is 1.0, legacy TRL's raw logits whatever generate() sampled at (generate()
    warns once where its temperature differs); the pipeline fills it from generation.temperature"""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, checked(getattr(self, f.name), _HINTS[f.name], f.name))
        if self.forward_batch_size is not None:
            warnings.warn("PPOConfig: forward_batch_size is deprecated; use mini_batch_size (overriding it now).",
                          FutureWarning, stacklevel=3)
            self.mini_batch_size = self.forward_batch_size
        if self.optimize_cuda_cache is not None:
            warnings.warn("PPOConfig: optimize_cuda_cache is deprecated; use optimize_device_cache.",
                          FutureWarning, stacklevel=3)
            self.optimize_device_cache = self.optimize_cuda_cache
        _check_ranges(self)
        _check_accelerate_kwargs(self)
        if self.log_with is not None and not any(importlib.util.find_spec(m) for m in TRACKER_MODULES[self.log_with]):
            raise ConfigError("log_with", f"{{key}} is {self.log_with!r}, but {TRACKER_MODULES[self.log_with][0]} is "
                              f"not installed (pip install {TRACKER_MODULES[self.log_with][0]}), so nothing would be "
                              "logged; install it or set log_with to None")
        self.backward_batch_size = self.mini_batch_size * self.gradient_accumulation_steps
        check_range("batch_size", self.batch_size, f"a multiple of mini_batch_size * gradient_accumulation_steps "
                    f"({self.mini_batch_size} * {self.gradient_accumulation_steps} = {self.backward_batch_size})",
                    self.batch_size % self.backward_batch_size == 0, "change batch_size or mini_batch_size")
        self.total_ppo_epochs = math.ceil(self.steps / self.batch_size)
        resolve(self)  # checked now, before any model loads; the fields stay as given (``resolved``)

    @property
    def resolved(self) -> ResolvedConfig:
        """What this config trains with: its fields as given, each None filled from the estimator (:func:`resolve`),
        worked out from the fields as they are now; a trainer's ``config`` holds the one its run resolved once."""
        run_resolved = self.__dict__.get("_run_resolved")
        return run_resolved if run_resolved is not None else resolve(self)

    def __setattr__(self, name: str, value: Any) -> None:
        """A trainer's ``config`` (:func:`run_config`) refuses an edit of a field the run read once, at construction
        (``FIXED_IN_A_RUN``): the edit would reach some of what the run computes and not the rest."""
        if name in self.__dict__.get("_fixed_fields", ()):
            raise dataclasses.FrozenInstanceError(
                f"trainer.config.{name} is fixed when the trainer was built (its run resolved its settings, sizes and "
                f"optimizer from it then); build a new PPOTrainer with PPOConfig(..., {name}={value!r}) to change it.")
        object.__setattr__(self, name, value)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> PPOConfig:
        """Build from a plain dict (e.g. the ``ppo:`` section of ``params.yaml``)."""
        if not isinstance(values, dict):
            raise ValueError(f"PPOConfig: expected a mapping of field names to values, got {type(values).__name__}.")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# TRL GRPOConfig's and RLOOConfig's names for fields that legacy PPOConfig names otherwise
OTHER_NAMES = {"epsilon": "TRL's epsilon is legacy PPOConfig's cliprange",
               "beta": "TRL's beta is kl_loss_coef here (the KL in the loss: kl_in 'loss')",
               "kl_coef": "TRL RLOOConfig's kl_coef is init_kl_coef here (the KL in the reward)"}
_HINTS = typing.get_type_hints(PPOConfig)
_FIELD_NAMES = [f.name for f in dataclasses.fields(PPOConfig)]
DEPRECATED = {"forward_batch_size": "mini_batch_size", "optimize_cuda_cache": "optimize_device_cache"}  # -> the new
# what a user sets, as error messages offer them: not the fields worked out from others, nor the deprecated names
SETTABLE = [name for name in _FIELD_NAMES if name not in DERIVED and name not in DEPRECATED]
# log_with's trackers: the modules accelerate needs for each (any one of them)
TRACKER_MODULES = {"wandb": ("wandb",), "tensorboard": ("tensorboard", "tensorboardX"), "dvclive": ("dvclive",),
                   "comet_ml": ("comet_ml",), "mlflow": ("mlflow",), "aim": ("aim",), "clearml": ("clearml",)}


def _reject_unknown_keys(init):
    """Make ``PPOConfig(unknown=...)`` a ConfigError with a suggestion, not a bare TypeError."""

    @functools.wraps(init)
    def checked_init(self, *args, **kwargs):
        check_keys(kwargs, _FIELD_NAMES, renamed=OTHER_NAMES, settable=SETTABLE)
        init(self, *args, **kwargs)

    return checked_init


PPOConfig.__init__ = _reject_unknown_keys(PPOConfig.__init__)


# (field, lower bound) checks; None values (optional fields) are skipped.
_POSITIVE = ["steps", "learning_rate", "batch_size", "mini_batch_size", "gradient_accumulation_steps", "ppo_epochs",
             "cliprange", "cliprange_value", "target_kl", "compare_steps", "ratio_threshold", "max_grad_norm",
             "score_clip", "target", "horizon", "world_size", "dataset_num_proc", "max_consecutive_overflows",
             "num_generations", "epsilon_high", "max_completion_length", "rollout_correction_cap", "temperature"]
_NON_NEGATIVE = ["init_kl_coef", "vf_coef", "seed", "kl_loss_coef", "overlong_buffer_len", "overlong_penalty_factor"]
_UNIT_INTERVAL = ["gamma", "lam", "warmup_ratio"]


# The Accelerator arguments the trainer passes from PPOConfig's own fields (``runtime.distributed.accelerator_for``)
_ACCELERATOR_FIELDS = {"log_with": "log_with", "gradient_accumulation_steps": "gradient_accumulation_steps",
                       "gradient_accumulation_plugin": "gradient_accumulation_steps",
                       "project_config": "project_kwargs"}


def _check_accelerate_kwargs(config: PPOConfig) -> None:
    """accelerator_kwargs' keys against ``Accelerator``'s arguments (of the accelerate installed), project_kwargs'
    against ``ProjectConfiguration``'s fields: a misspelt key fails here, not as a TypeError once the models loaded."""
    if not config.accelerator_kwargs and not config.project_kwargs:
        return
    import inspect

    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    for name, own in _ACCELERATOR_FIELDS.items():
        if name in config.accelerator_kwargs:
            raise ConfigError(f"accelerator_kwargs.{name}", f"{{key}}: the trainer passes it from {{prefix}}{own}; set "
                              "that instead")
    arguments = set(inspect.signature(Accelerator).parameters) - {"self"}
    check_keys(config.accelerator_kwargs, arguments - _ACCELERATOR_FIELDS.keys(), "accelerator_kwargs.")
    check_keys(config.project_kwargs, [f.name for f in dataclasses.fields(ProjectConfiguration)], "project_kwargs.")


def _check_ranges(config: PPOConfig) -> None:
    for name in _POSITIVE:
        value = getattr(config, name)
        check_range(name, value, "> 0", value is None or value > 0)
    for name in _NON_NEGATIVE:
        value = getattr(config, name)
        check_range(name, value, ">= 0", value is None or value >= 0)
    for name in _UNIT_INTERVAL:
        value = getattr(config, name)
        check_range(name, value, "in [0, 1]", 0 <= value <= 1)
    check_range("warmup_ratio", config.warmup_ratio, "0 with lr_scheduler_type 'constant', which has no warmup",
                config.warmup_ratio == 0 or config.lr_scheduler_type != "constant",
                "set lr_scheduler_type to 'constant_with_warmup' (or 'linear', 'cosine')")
    for name in ("target", "horizon"):
        check_range(name, None, "set for the adaptive KL controller (or adap_kl_ctrl: false)",
                    not config.adap_kl_ctrl or getattr(config, name) is not None)
    check_range("rollout_correction", config.rollout_correction, "unset without rollout_dtype (without a rollout copy "
                "the policy samples itself: every weight would be 1)",
                config.rollout_correction in (None, "auto") or config.rollout_dtype is not None, "set rollout_dtype")

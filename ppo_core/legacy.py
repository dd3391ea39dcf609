"""TRL 0.11's ``PPOTrainer`` API beyond the loop, kept thin: the legacy-named methods its users call or override,
each over the functions ``PPOTrainer.step`` calls itself (``step`` calls none of these methods, but the hooks a
user overrides: ``compute_rewards``, ``_kl_penalty``, ``compute_advantages`` through :func:`hooked_advantages`,
``train_minibatch`` and ``loss`` through :func:`legacy_train_minibatch` and :func:`legacy_loss`), and what the legacy
constructor starts from: the checks of its arguments and of a subclass's hooks.

:class:`LegacyMethods` is mixed into :class:`~ppo_core.trainer.PPOTrainer`; the attributes it reads are declared on
it (set by ``PPOTrainer.__init__``). Its logging, saving and hub methods (``log_stats``, ``save_pretrained``,
``push_to_hub``, ...) are its base's, :class:`~ppo_core.legacy_hub.LegacyHub`. The legacy methods ppo_core does not
keep, and why, are listed in docs/library.md ("What differs from TRL 0.11"). Differences in behaviour from legacy
TRL, all deliberate fixes:

* the loss forward runs in train mode (legacy called ``model.eval()`` before it, so dropout was never
  active there); dropout itself is disabled by default (``PPOConfig.disable_dropout``) so that the
  first ratio of every step is 1, as the N+ implementation study recommends (exactly on CPUs; on GPUs within
  rounding, cuBLAS choosing kernels by shape);
* ``num_shared_layers`` shares the layers' memory with the reference model (legacy duplicated it);
* padding never enters a statistic: "entropy", KL, rewards and whitening are all masked;
* a mini-batch over ``ratio_threshold`` is skipped (no backward, no optimizer step) and counted in
  ``ppo/policy/skipped_minibatches`` (legacy zeroed its loss and still stepped Adam);
* no full-vocabulary logits are materialised: log-probabilities and entropies are computed at the
  response positions only, chunk by chunk;
* encoder-decoder responses are the generated tokens *without* the decoder start token (``step``
  prepends it) and every one of them is scored (legacy returned the start token as the response's first
  token and left the first generated token out of the loss);
* under fp16 a loss-scale overflow is a skipped update, counted in the stats (legacy's scaler skipped it unseen),
  and ``max_consecutive_overflows`` in a row stop the run as diverged;
* a mini-batch waits for the GPU once (its checks), plus once per optimizer update (see ``update``);
* no reference pass where the KL's coefficient is 0: the KL stats are then NaN, not measured.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader
from transformers import PreTrainedTokenizerBase

from .algo.functional import entropy_from_logits
from .algo.kl_control import AdaptiveKLController, FixedKLController, KLPlacement
from .algo.ppo_math import (
    Advantages,
    Divisors,
    ShapedRewards,
    full_kl_penalty,
    gae_advantages,
    kl_penalty,
    shape_rewards,
)
from .algo.registry import LEGACY_ESTIMATOR
from .config import PPOConfig
from .legacy_hub import LegacyHub, push_to_hub_if_best  # noqa: F401 (the trainer imports it from here)
from .models.modeling import PreTrainedModelWrapper
from .models.reference import placed_reference
from .runtime.distributed import quiet_deepspeed_collectives
from .runtime.precision import floating_dtype
from .runtime.utils import moved, timed
from .runtime.zero import gathered
from .step import data
from .step.inputs import build_response_masks, checked_step_inputs
from .step.rollout import PolicyOutputs, Rollout, policy_outputs
from .step.stats import lengths, mean_over_processes, step_stats, warn_if_negative_kl
from .step.update import ppo_loss

if TYPE_CHECKING:
    from accelerate import Accelerator


def check_arguments(config, model, ref_model, tokenizer, training_data_collator=None) -> None:
    """Raise a ValueError saying what to pass instead, for a constructor argument ``PPOTrainer`` cannot use; warn
    that a ``training_data_collator`` is not used."""
    if not isinstance(config, PPOConfig):
        raise ValueError(f"PPOTrainer: config must be a PPOConfig, got {type(config).__name__}.")
    if not isinstance(model, PreTrainedModelWrapper):
        raise ValueError("PPOTrainer: model must be an AutoModelForCausalLMWithValueHead or an "
                         f"AutoModelForSeq2SeqLMWithValueHead (got {type(model).__name__}); wrap it with "
                         "AutoModelForCausalLMWithValueHead.from_pretrained.")
    if ref_model is not None and ref_model is model:
        raise ValueError("PPOTrainer: ref_model is the policy itself; pass ref_model=None for a frozen copy "
                         "(or, for a PEFT policy, the adapter-disabled model).")
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise ValueError("PPOTrainer: tokenizer must be a transformers PreTrainedTokenizerBase.")
    if training_data_collator is not None:
        warnings.warn("PPOTrainer: training_data_collator is not used: the trainer pads the queries and responses "
                      "of each step itself (each sequence right-padded with the tokenizer's pad token).", stacklevel=3)


# Legacy ``step`` called these on ``self``: a subclass that overrides one (token-level rewards, a custom advantage)
# has ``step`` call it too, in legacy's order, on response-aligned ``(B, R)`` tensors (:func:`hooked_advantages`).
STEP_HOOKS = ("compute_rewards", "_kl_penalty", "compute_advantages")
# Legacy ``step`` called these too, but ppo_core's contract for them differs (``batched_forward_pass`` is a no-grad
# response-aligned pass; the inputs are checked and padded once, in ``rollout.py``): an override is warned about.
NOT_STEP_HOOKS = ("batched_forward_pass", "prepare_model_inputs", "_step_safety_checker", "record_step_stats",
                  "gather_stats", "prepare_dataloader", "_generate_batched")


def overridden_step_hooks(cls: type, cfg: PPOConfig) -> tuple[str, ...]:
    """The legacy hooks of ``step`` that the trainer class ``cls`` overrides; raises where ``step`` cannot call them
    (settings with no legacy counterpart), and warns about overrides that neither ``step`` nor the constructor call."""
    def changed(name: str) -> bool:
        return getattr(cls, name) is not getattr(LegacyMethods, name)

    ignored = [name for name in NOT_STEP_HOOKS if changed(name)]
    if ignored:
        warnings.warn(f"{cls.__name__} overrides {', '.join(ignored)}, which ppo_core's step() does not call (nor "
                      "generate() or the constructor: they run their own passes); override compute_rewards, "
                      "_kl_penalty, compute_advantages, loss or train_minibatch instead.", stacklevel=3)
    hooks = tuple(name for name in STEP_HOOKS if changed(name))
    kl = KLPlacement.of(cfg)
    if hooks and (cfg.advantage_estimator != LEGACY_ESTIMATOR or kl.in_loss or kl.estimator == "full"):
        raise ValueError(f"{cls.__name__} overrides {', '.join(hooks)}, which step() calls as legacy did "
                         "only with advantage_estimator='gae', kl_in='reward' and kl_penalty other than 'full' (got "
                         f"{cfg.advantage_estimator!r}, {cfg.kl_in!r}, {cfg.kl_penalty!r}).")
    return hooks


def overrides(trainer: LegacyMethods, name: str) -> bool:
    """Whether ``trainer.<name>`` is a user's (a subclass's override, or a function set on the instance) rather than
    :class:`LegacyMethods`' own. ``step`` calls a user's ``train_minibatch`` or ``loss`` once per mini-batch, as
    legacy did, in legacy's argument order, with the keywords ppo_core adds only where its signature takes them."""
    method = getattr(trainer, name)
    return getattr(method, "__func__", method) is not getattr(LegacyMethods, name)


def _taken(function: Callable, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The entries of ``kwargs`` that ``function`` takes by name (all of them where it takes ``**kwargs``)."""
    params = inspect.signature(function).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}


def legacy_train_minibatch(trainer: LegacyMethods, mb: Rollout, out: PolicyOutputs, index: int,
                           divisors: Divisors | None) -> dict[str, torch.Tensor]:
    """``trainer.train_minibatch`` (a user's override) on the mini-batch ``mb`` and its training pass ``out``, in
    legacy's order ``(old_logprobs, values, logprobs, logits, vpreds, mask, advantages, returns)``, all ``(b, R)``;
    ``logits`` is None (the pass never materialises them: the ``entropy`` keyword has the per-token entropy)."""
    extra = dict(entropy=out.entropy, ref_logprobs=mb.ref_logprobs, norm_length=mb.norm_length, minibatch_index=index,
                 divisors=divisors)
    return trainer.train_minibatch(mb.old_logprobs, mb.old_values, out.logprobs, None, out.values, mb.mask,
                                   mb.advantages, mb.returns, **_taken(trainer.train_minibatch, extra))


def legacy_loss(trainer: LegacyMethods, mb: Rollout, out: PolicyOutputs, divisors: Divisors | None):
    """``trainer.loss`` (a user's override) on the mini-batch ``mb`` and its training pass ``out``, in legacy's order
    ``(old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns)``; ``logits`` is None, as in
    :func:`legacy_train_minibatch`. Returns what it returns: ``(policy loss, value loss, stats)``."""
    extra = dict(entropy=out.entropy, ref_logprobs=mb.ref_logprobs, norm_length=mb.norm_length, divisors=divisors)
    return trainer.loss(mb.old_logprobs, mb.old_values, None, out.values, out.logprobs, mb.mask, mb.advantages,
                        mb.returns, **_taken(trainer.loss, extra))


def as_minibatch(old_logprobs, values, logprobs, vpreds, mask, advantages, returns, entropy, ref_logprobs,
                 norm_length) -> tuple[Rollout, PolicyOutputs]:
    """Legacy's loose ``(b, R)`` tensors as the engine's mini-batch and training pass (no inputs: the loss reads
    none)."""
    return (Rollout(None, mask, old_logprobs, values, ref_logprobs, advantages, returns, norm_length),
            PolicyOutputs(logprobs, vpreds, entropy, None))


def hooked_advantages(trainer: LegacyMethods, scores: torch.Tensor, logprobs: torch.Tensor,
                      ref_logprobs: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      timing: dict[str, float]) -> tuple[ShapedRewards, Advantages]:
    """``step``'s shaped rewards and advantages through ``trainer.compute_rewards`` and ``trainer.compute_advantages``
    (a subclass's overrides), in legacy's order: ``scores`` ``(B,)``, the rest ``(B, R)``."""
    with timed(timing, "time/ppo/compute_rewards"):
        rewards, non_score_rewards, kls = trainer.compute_rewards(scores, logprobs, ref_logprobs, mask)
    with timed(timing, "time/ppo/compute_advantages"):
        _, advantages, returns = trainer.compute_advantages(values, rewards, mask)
    return ShapedRewards(rewards, non_score_rewards, kls), Advantages(advantages.detach(), returns.detach())


class LegacyMethods(LegacyHub):
    """``PPOTrainer``'s legacy TRL 0.11 methods beyond the loop (see the module docstring)."""

    # what the methods read, set by ``PPOTrainer.__init__``
    config: PPOConfig
    accelerator: Accelerator
    model: torch.nn.Module
    ref_model: torch.nn.Module | None
    tokenizer: PreTrainedTokenizerBase
    kl_ctl: AdaptiveKLController | FixedKLController
    current_device: torch.device
    current_step: int
    is_deepspeed: bool
    _zero3: bool
    _group: Any  # ``runtime.distributed.ProcessGroup`` or ``SingleProcess``
    _warned_negative_kl: bool
    _forward_precision: Callable[[], contextlib.AbstractContextManager]
    _model_inputs: Callable
    _sample: Callable
    _update_minibatch: Callable[..., dict[str, torch.Tensor]]

    def prepare_dataloader(self, dataset, data_collator=None) -> DataLoader:
        """Shuffled ``DataLoader`` of ``batch_size`` rows per process (last ragged batch dropped): see
        ``step.data.dataloader``."""
        columns = None if getattr(self, "_signature_columns", None) is None else self._signature_columns
        return data.dataloader(dataset, self.config, data_collator, columns)

    def _set_signature_columns_if_needed(self) -> None:
        """``_signature_columns``: the dataset columns ``prepare_dataloader`` keeps (the value-head model's forward
        arguments, plus ``label``, ``query`` and ``response`` for logging)."""
        if getattr(self, "_signature_columns", None) is None:
            self._signature_columns = data.signature_columns()

    def _remove_unused_columns(self, dataset):
        self._set_signature_columns_if_needed()
        drop = [c for c in dataset.column_names if c not in self._signature_columns]
        return dataset.remove_columns(drop) if drop else dataset

    @staticmethod
    def _filter_kwargs(kwargs: dict[str, Any], target_func: Callable) -> dict[str, Any]:
        """The entries of ``kwargs`` that ``target_func`` takes by name."""
        return {k: v for k, v in kwargs.items() if k in inspect.signature(target_func).parameters}

    @property
    def is_encoder_decoder(self) -> bool:
        return bool(self.config.is_encoder_decoder)

    @property
    def is_peft_model(self) -> bool:
        return bool(self.config.is_peft_model)

    @property
    def optional_peft_ctx(self) -> Callable[[], contextlib.AbstractContextManager]:
        """Legacy: a context factory under which the policy is its reference: ``disable_adapter`` of a PEFT policy
        (``nullcontext`` otherwise)."""
        if not self.is_peft_model:
            return contextlib.nullcontext
        return self.accelerator.unwrap_model(self.model).pretrained_model.disable_adapter

    def _generate_batched(self, model, query_tensors, length_sampler: Callable[[], int] | None = None,
                          batch_size: int = 4, return_prompt: bool = True, pad_to_multiple_of: int | None = None,
                          remove_padding: bool = True, **generation_kwargs):
        """What ``generate`` runs for ``model`` (the policy, or the reference: ``self.model`` or ``self.ref_model``):
        ``batch_size`` queries at a time, each response cut after its first EOS (see ``generate``).

        ``pad_to_multiple_of`` only widened legacy's padding, which is stripped from the outputs: it changes nothing
        here. ``remove_padding=False`` (legacy: keep what ``generate`` gave after the EOS) is refused.
        """
        if not remove_padding:
            raise ValueError("_generate_batched: remove_padding=False is not supported: each response is cut after "
                             "its first EOS (the EOS kept) and holds no padding; leave remove_padding=True.")
        return self._sample(*self._sampling(model), query_tensors, length_sampler, batch_size, return_prompt,
                            **generation_kwargs)

    def _step_safety_checker(self, batch_size, queries, responses, scores, masks=None):
        """Validate lengths, types and shapes; return device tensors (scores as one ``(B,)`` tensor)."""
        return checked_step_inputs(batch_size, queries, responses, scores, masks, self.current_device)

    def prepare_model_inputs(self, queries: torch.Tensor, responses: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{"input_ids", "attention_mask", "query_lens", "response_lens"}``, right-padded; for an
        encoder-decoder, the queries as ``input_ids`` and ``start + response`` as ``decoder_input_ids``."""
        inputs = self._model_inputs(list(queries), list(responses))
        lengths = inputs.query_lens + inputs.response_lens
        attention_mask = torch.arange(inputs.input_ids.shape[1], device=lengths.device)[None] < lengths[:, None]
        if self.config.is_encoder_decoder:
            return {"input_ids": inputs.encoder_input_ids, "attention_mask": inputs.encoder_attention_mask,
                    "decoder_input_ids": inputs.input_ids, "decoder_attention_mask": attention_mask.long()}
        return {"input_ids": inputs.input_ids, "attention_mask": attention_mask.long(),
                "query_lens": inputs.query_lens, "response_lens": inputs.response_lens}

    def train_minibatch(self, old_logprobs, values, logprobs, logits, vpreds, mask, advantages, returns,
                        entropy=None, ref_logprobs=None, norm_length=None, minibatch_index: int = 0,
                        divisors: Divisors | None = None) -> dict[str, torch.Tensor]:
        """Loss (``self.loss``), backward, clipping and optimizer step of one mini-batch, legacy's signature (all
        tensors ``(b, R)``; ``logits`` ``(b, R, V)`` or None) over the engine's ``PPOTrainer._update_minibatch``.
        ``minibatch_index``: its place in the step (for the error a failure raises); ``divisors``: its accumulation
        window's (None: the mini-batch is the window)."""
        if entropy is None and logits is not None:
            entropy = entropy_from_logits(logits)
        mb, out = as_minibatch(old_logprobs, values, logprobs, vpreds, mask, advantages, returns, entropy,
                               ref_logprobs, norm_length)
        return self._update_minibatch(mb, out, minibatch_index, divisors)

    def loss(self, old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns, entropy=None,
             ref_logprobs=None, norm_length=None, divisors: Divisors | None = None):
        """``(policy loss, value loss, stats)`` of a mini-batch, legacy's signature over ``step.update.ppo_loss``.

        ``logits`` (``(b, R, V)``) gives the entropy where ``entropy`` (``(b, R)``) is not given. ``norm_length``: Dr.
        GRPO's constant (the step's ``Rollout.norm_length``; None: the mini-batch's width); ``divisors``: what its
        means divide by, its accumulation window's (``step.update.window_divisors``; None: the mini-batch alone is
        the window), as TRL 0.11's loss divided.
        """
        if entropy is None and logits is not None:
            entropy = entropy_from_logits(logits)
        mb, out = as_minibatch(old_logprobs, values, logprobs, vpreds, mask, advantages, returns, entropy,
                               ref_logprobs, norm_length)
        return ppo_loss(self.config, self._group, mb, out, divisors)

    @quiet_deepspeed_collectives
    def batched_forward_pass(self, model, queries, responses, model_inputs=None, return_logits: bool = False,
                             response_masks=None):
        """``(logprobs, logits or None, values, masks)``, all response-aligned ``(B, R)`` (logits ``(B, R, V)``), with
        ``model`` in eval mode, at ``config.temperature`` (the logits divided by it). Differentiable, as legacy's (a
        custom loop's training forward); under ``torch.no_grad()`` for a rollout pass. ``model_inputs`` is accepted
        for legacy's signature: the inputs are built from the queries and responses, each moved to the trainer's
        device first (a loop's queries come from the host, generate()'s responses from the GPU)."""
        device = self.current_device
        inputs = self._model_inputs(moved(list(queries), device), moved(list(responses), device))
        model.eval()
        with self._forward_precision():
            out = policy_outputs(model, inputs, keep_hidden=return_logits, temperature=self.config.temperature)
        logits = None
        if return_logits:
            valid = inputs.response_mask()
            unwrapped = self.accelerator.unwrap_model(model)
            with gathered(unwrapped.lm_head_parameters()):  # under ZeRO-3: read outside any forward
                head = unwrapped.lm_head(self.config.temperature)
                logits = torch.zeros(*valid.shape, head.weight.shape[0], device=valid.device)
                logits[valid] = head.logits(out.hidden)
        return out.logprobs, logits, out.values, build_response_masks(response_masks, inputs)

    def compute_rewards(self, scores, logprobs, ref_logprobs, masks):
        """``(rewards, non_score_rewards, kls)``, each ``(B, R)``, zero at masked positions: the per-token KL penalty
        times ``-kl_ctl.value``, plus each ``(B,)`` score on the last valid token. With ``kl_penalty="full"``
        ``logprobs`` and ``ref_logprobs`` are the whole log-softmax distributions ``(B, R, V)``, as legacy passed."""
        if self.config.kl_penalty == "full" and logprobs.dim() != masks.dim() + 1:
            raise ValueError(f"compute_rewards: kl_penalty='full' needs the whole log-probability distributions, "
                             f"(B, R, V) (log_softmax of the logits), got shape {tuple(logprobs.shape)}.")
        return tuple(shape_rewards(scores, self._kl_penalty(logprobs, ref_logprobs), masks, self.kl_ctl.value))

    def _kl_penalty(self, logprob: torch.Tensor, ref_logprob: torch.Tensor) -> torch.Tensor:
        """The per-token KL penalty of ``config.kl_penalty``: ``kl``, ``abs``, ``mse`` from the sampled tokens'
        log-probabilities (``(B, R)`` -> ``(B, R)``), ``full`` from the whole distributions (``(B, R, V)`` ->
        ``(B, R)``); see ``ppo_math.kl_penalty`` and ``ppo_math.full_kl_penalty``."""
        if self.config.kl_penalty == "full":
            return full_kl_penalty(logprob, ref_logprob)
        return kl_penalty(logprob, ref_logprob, self.config.kl_penalty)

    def compute_advantages(self, values: torch.Tensor, rewards: torch.Tensor, mask: torch.Tensor):
        """Legacy: GAE over ``(B, R)`` ``values`` and ``rewards`` with ``config.gamma`` and ``config.lam`` (rewards
        whitened first with ``config.whiten_rewards``) -> ``(values * mask, advantages, returns)``.

        ``returns = A + values``; the advantages are whitened over the mask and detached, as legacy's; they are zero
        at masked positions and, under N processes, whitened over every process's tokens, as ``step`` does (legacy
        left padding in the whitened advantages and whitened per process). See ``ppo_math.gae_advantages``.
        """
        cfg = self.config
        out = gae_advantages(values, rewards, mask, cfg.gamma, cfg.lam, cfg.whiten_rewards,
                             sum_across=self._group.sum_across)
        return values * mask.to(values.dtype), out.advantages, out.returns

    def record_step_stats(self, kl_coef: float, **data) -> dict[str, Any]:
        """The legacy stats dict of one step (see :func:`ppo_core.step.stats.step_stats`), from ``step``'s tensors:
        ``scores``, ``logprobs``, ``ref_logprobs``, ``non_score_reward``, ``kls``, ``masks``, ``advantages``,
        ``queries``, ``responses`` and ``train_stats``."""
        stats = step_stats(
            kl_coef, data["scores"], data["logprobs"], data["ref_logprobs"], data["non_score_reward"], data["kls"],
            data["masks"], lengths(data["queries"]), lengths(data["responses"]), data["advantages"],
            data["train_stats"], self.config.mini_batch_size, self._group)
        self._warned_negative_kl = warn_if_negative_kl(stats, self._warned_negative_kl)
        return stats

    def gather_stats(self, stats: dict[str, Any]) -> dict[str, Any]:
        """The 0-d tensor stats averaged over processes (:func:`ppo_core.step.stats.mean_over_processes`)."""
        return mean_over_processes(stats, self._group)

    def _prepare_deepspeed(self, model: torch.nn.Module) -> torch.nn.Module:
        """Legacy: a frozen ``model`` (e.g. a reward model) placed for inference as the reference is: under ZeRO-3
        sharded as the policy (a DeepSpeed engine without optimizer, to call like the model), else whole on this
        process's device, in the policy's dtype under DeepSpeed; in eval mode."""
        placed = placed_reference(model, self.accelerator, self._zero3,
                                  floating_dtype(self.model) if self.is_deepspeed else None)
        if not self._zero3:
            placed.eval()  # a ZeRO-3 engine is in eval mode already
        return placed

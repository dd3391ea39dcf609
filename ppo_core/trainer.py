"""``PPOTrainer``: the legacy TRL user-loop API (``generate`` -> score anything -> ``step``) on accelerate.

The loop itself: building the trainer, ``step`` in numbered steps and its PPO epochs over mini-batches
(``_update_minibatch``: each ``Rollout`` mini-batch to ``step.update``). ``generate`` and the views of the policy and
the reference that the loop reads are mixed in from ``policy_views``, the checkpoints from ``checkpoints``. What they
call lives in the layers below (docs/library.md, "ppo_core's layout"); the legacy methods are thin shims in
``legacy``, mapped on top of the engine: ``step`` calls one only where a user overrides it.

Under N processes (``accelerate launch``, DDP or DeepSpeed ZeRO-2/3) ``step`` on each process's ``batch_size``
samples gives what one process gives on the global batch, process 0's first, up to float rounding, whenever the
mini-batches are the same: whitening, token means, the ratio-threshold skip and the stats are global, each process
shuffles and samples with its own seed (``seed + process_index``), and a bad input or a non-finite loss on any
process raises on all of them (``runtime.distributed`` says how; ``runtime.zero`` what ZeRO-3 gathers, and
``runtime.checkpoint`` the checkpoint's layout under DeepSpeed).
"""

from __future__ import annotations

import functools
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from .algo.advantages import loss_mask, norm_length, overlong_penalties, step_advantages, truncated
from .algo.estimators import check_prompt_groups
from .algo.functional import convert_to_scalar, flatten_dict
from .algo.kl_control import AdaptiveKLController, FixedKLController, KLPlacement, RunningMoments, scale_scores
from .algo.ppo_math import Advantages, Divisors, ShapedRewards
from .algo.registry import get_estimator
from .algo.rollout_correction import sampling_stats, sampling_weights
from .checkpoints import Checkpoints
from .config import PPOConfig
from .legacy import (
    LegacyMethods,
    check_arguments,
    hooked_advantages,
    legacy_loss,
    legacy_train_minibatch,
    overridden_step_hooks,
    overrides,
    push_to_hub_if_best,
)
from .models.modeling import PreTrainedModelWrapper, decoder_start_token_id
from .models.reference import frozen_reference, placed_reference
from .models.rollout_copy import RolloutCopy, rollout_choice
from .models.training import prepare_for_training
from .policy_views import PolicyViews
from .resolution import RunSizes, resolve, run_config, warn_unused_kl_coef
from .runtime.distributed import (
    accelerator_for,
    deprecated_collectives_ignored,
    mean_across,
    on_every_process,
    process_group,
    quiet_deepspeed_collectives,
)
from .runtime.precision import floating_dtype, loss_scale, prepare_dtypes, with_tf32
from .runtime.utils import free_device_cache, keep_freed_memory_for_reuse, set_seed, timed
from .runtime.zero import configure_engine, is_zero3
from .step import update
from .step.data import dataloader, warn_no_dataset
from .step.inputs import (
    ModelInputs,
    build_response_masks,
    checked_step_inputs,
    model_inputs,
    warn_if_start_token_included,
)
from .step.rollout import PolicyOutputs, Rollout, chunked_outputs, kl_per_token, policy_outputs, rollout_passes
from .step.stats import lengths, step_stats, step_summary, warn_if_negative_kl, warn_if_nothing_trained
from .step.update import Updates, minibatch_failure, ppo_loss, window_divisors, window_mean


class PPOTrainer(PolicyViews, Checkpoints, LegacyMethods):
    """Proximal Policy Optimisation for language models, with TRL's legacy ``PPOTrainer`` API.

    Args: as the legacy class. ``model`` is an :class:`AutoModelForCausalLMWithValueHead` or an
    :class:`AutoModelForSeq2SeqLMWithValueHead`. Without ``ref_model``, the reference is the policy with its adapter
    disabled when it is a PEFT model (one copy of the base weights; only the adapter and the value head train), else
    a frozen copy sharing its first ``num_shared_layers`` layers. ``config`` is left as built: ``trainer.resolved`` is
    what the run trains with (:class:`~ppo_core.resolution.ResolvedConfig`: the estimator's defaults applied to the
    fields left None), ``trainer.config`` a copy with those and legacy's run fields filled (``world_size``,
    ``is_peft_model``, ...), ``trainer.sizes`` the run's batch sizes (:class:`~ppo_core.resolution.RunSizes`), each
    worked out once.

    Process-wide effects: it seeds the global RNGs (legacy; ``seed + process_index`` under N processes); alone, it
    resets accelerate's process-wide state left by an earlier ``Accelerator`` (``runtime.distributed``); on the CPU
    it lets glibc's malloc keep large freed blocks for reuse (``runtime.utils.keep_freed_memory_for_reuse``; off with
    ``PPO_CORE_TUNE_MALLOC=0``). Under DeepSpeed, torch's deprecation warning on DeepSpeed's collectives is ignored
    only while a trainer method runs.
    """

    def __init__(self, config: PPOConfig | None = None, model: PreTrainedModelWrapper | None = None,
                 ref_model: torch.nn.Module | None = None, tokenizer: PreTrainedTokenizerBase | None = None,
                 dataset=None, optimizer: torch.optim.Optimizer | None = None, data_collator: Callable | None = None,
                 num_shared_layers: int | None = None, lr_scheduler=None, training_data_collator=None):
        config = config if config is not None else PPOConfig()
        check_arguments(config, model, ref_model, tokenizer, training_data_collator)
        self._step_hooks = overridden_step_hooks(type(self), config)  # a subclass's legacy hooks: step() calls them
        set_seed(config.seed)  # legacy behaviour: the trainer seeds the global RNGs (sampling uses them)

        # 1. accelerator, the run's sizes, the other processes
        self.accelerator = accelerator_for(config)
        self.sizes = RunSizes.of(config, self.accelerator.num_processes)
        self.resolved = resolve(config)  # what the run trains with, from the user's fields as given: once, read by all
        warn_unused_kl_coef(config, self.resolved)
        self._zero3 = is_zero3(self.accelerator)  # weights sharded too (see ``runtime.zero``)
        device = self.accelerator.device.type
        rollout = rollout_choice(config.rollout_dtype, config.rollout_correction, device,
                                 device == "cuda" and torch.cuda.is_bf16_supported(), self._zero3, config.weights_dtype)
        self.config = config = run_config(config, self.sizes, model.is_encoder_decoder, model.is_peft_model,
                                          self.resolved, rollout)
        self.is_distributed = self.accelerator.num_processes > 1
        self.is_deepspeed = self.accelerator.state.deepspeed_plugin is not None  # steps inside accelerator.backward
        if self._zero3 and config.rollout_dtype is not None:
            raise ValueError(f"PPOTrainer: rollout_dtype={config.rollout_dtype!r} copies the policy's whole weights "
                             "into a rollout copy, but under ZeRO-3 each process holds a shard of them; set "
                             "rollout_dtype=None (or train with ZeRO-2).")
        # generate()'s copy of the policy in rollout_dtype, made at the first call (None: sample from the policy)
        self._rollout = RolloutCopy(config.rollout_dtype) if config.rollout_dtype is not None else None
        self._group = process_group(self.accelerator)  # the one path to the other processes (alone: to itself)
        if self.is_distributed:  # independent sampling noise per process (the weights are synced by DDP)
            set_seed(config.seed + self.accelerator.process_index)
        if config.log_with is not None:
            self.accelerator.init_trackers(config.tracker_project_name, config=flatten_dict(config.to_dict()),
                                           init_kwargs=config.tracker_kwargs)

        # 2. tokenizer, models, what the step computes
        self.tokenizer = tokenizer
        ref_model = self._prepared_models(model, ref_model, num_shared_layers)

        # 3. data, optimiser, KL controller
        self.dataset, self.data_collator = dataset, data_collator
        self.dataloader = None if dataset is None else dataloader(dataset, config, data_collator)
        if dataset is None:
            warn_no_dataset(config.batch_size, self.accelerator.num_processes)
        optimizer = update.run_optimizer(optimizer, model.parameters(), config, self.is_deepspeed,
                                         self.accelerator.mixed_precision)
        lr_scheduler = update.run_scheduler(lr_scheduler, optimizer, config, self.is_deepspeed,
                                            self.accelerator.num_processes)
        self.kl_ctl = (AdaptiveKLController(config.init_kl_coef, config.target, config.horizon) if config.adap_kl_ctrl
                       else FixedKLController(config.init_kl_coef))
        self.running = RunningMoments()

        # 4. accelerate: device placement, mixed precision, DDP or DeepSpeed
        configure_engine(self.accelerator, model, config.mini_batch_size, config.gradient_accumulation_steps,
                         config.max_grad_norm)
        with deprecated_collectives_ignored(self.is_deepspeed):
            (self.model, self.optimizer, self.dataloader, self.lr_scheduler) = self.accelerator.prepare(
                model, optimizer, self.dataloader, lr_scheduler)
            # under DeepSpeed (or weights_dtype) the reference takes the dtype the policy's weights have
            self.ref_model = placed_reference(ref_model, self.accelerator, self._zero3, floating_dtype(self.model)
                                              if self.is_deepspeed or config.weights_dtype else None)
        self.current_device = self.accelerator.device
        if self.current_device.type == "cpu":  # (N, V) blocks reused, not page-faulted in at every mini-batch
            keep_freed_memory_for_reuse()

        self._init_state()

    def _init_state(self) -> None:
        """The state the steps advance, as a fresh run starts it (``load_checkpoint`` restores it)."""
        config = self.config
        self.current_step = 0  # logging step, advanced by log_stats (legacy)
        self.step_count = 0  # completed step() calls
        self._shuffle = torch.Generator().manual_seed(config.seed + self.accelerator.process_index)
        self._warned_negative_kl = self._warned_start_token = self._warned_norm_length = False
        self._warned_unweighted_loss = False  # rollout_correction beside a user's legacy loss hook
        self._generated_max_new_tokens = None  # the max_new_tokens of the last generate() call: Dr. GRPO's constant
        # each mini-batch's backward, clipping and optimizer step (under DDP and DeepSpeed: synced in the backward)
        self._updates = Updates(self.accelerator, self.model, self.optimizer, config.max_grad_norm,
                                config.max_consecutive_overflows, self.is_deepspeed or self.is_distributed)
        self._best_score = -math.inf

    def _prepared_models(self, model: PreTrainedModelWrapper, ref_model, num_shared_layers: int | None):
        """The policy made ready to train, the estimator read; returns the reference model (None: the PEFT policy's
        own base, adapters disabled), before ``accelerator.prepare``."""
        config = self.config
        self.estimator = get_estimator(config.advantage_estimator)  # what the step computes (algo.registry)
        self._kl = KLPlacement.of(config)  # where the KL goes, with which estimate and coefficient
        if config.num_generations > 1 and not self.estimator.needs_groups:
            warnings.warn(f"PPOTrainer: num_generations={config.num_generations} with advantage_estimator "
                          f"{config.advantage_estimator!r}, which does not compare a prompt's samples (each has its "
                          f"own baseline): every prompt is only repeated {config.num_generations} times, each step "
                          "seeing fewer prompts; set num_generations=1, or an estimator that compares them (grpo, "
                          "rloo, ...).", UserWarning, stacklevel=4)
        prepare_for_training(model, self.tokenizer, config.disable_dropout, config.gradient_checkpointing,
                             self.estimator.uses_critic, config.weights_dtype)
        self.decoder_start_token_id = decoder_start_token_id(model) if model.is_encoder_decoder else None
        ref_model = frozen_reference(model, ref_model, num_shared_layers, self._zero3)  # None: the PEFT policy's
        prepare_dtypes(self.accelerator, model, ref_model, masters=config.weights_dtype is not None)
        return ref_model

    def _model_inputs(self, queries: list[torch.Tensor], responses: list[torch.Tensor]) -> ModelInputs:
        """``query + response`` sequences, or for an encoder-decoder the queries and ``start + response``."""
        start = self.decoder_start_token_id
        if start is not None and not self._warned_start_token:
            self._warned_start_token = warn_if_start_token_included(responses, start)
        return model_inputs(queries, responses, self.tokenizer.pad_token_id, start)

    # ---- the PPO step ------------------------------------------------------------------------------------------
    @quiet_deepspeed_collectives
    @with_tf32
    def step(self, queries: list[torch.Tensor], responses: list[torch.Tensor], scores: list[torch.Tensor],
             response_masks: list[torch.Tensor] | None = None) -> dict[str, Any]:
        """One PPO update from ``batch_size`` (query, response, score) triples; returns the stats."""
        cfg, timing, t_start = self.config, {}, time.perf_counter()
        # 1. check inputs (a bad input on any process raises on all), move them to the device, scale and clip scores
        queries, responses, scores, response_masks = on_every_process(
            self._group, checked_step_inputs, cfg.batch_size, queries, responses, scores, response_masks,
            self.current_device)
        if cfg.num_generations > 1:  # every G consecutive samples answer one prompt (the estimators' groups)
            on_every_process(self._group, check_prompt_groups, queries, cfg.num_generations)
        scores = scale_scores(scores, self.running if cfg.use_score_scaling else None, cfg.use_score_norm,
                              cfg.score_clip, self._group.gather)
        # 2. legacy push_to_hub_if_best_kwargs: the policy that sampled these responses, if they score best so far
        if cfg.push_to_hub_if_best_kwargs:
            push_to_hub_if_best(self, scores)
        # 3. no-grad passes of policy and reference (the reference's only where its KL has a coefficient)
        inputs = self._model_inputs(queries, responses)
        mask = build_response_masks(response_masks, inputs)
        with_reference = self._reference_in_use()
        with timed(timing, "time/ppo/forward_pass"):
            old, ref = rollout_passes(self.model, self.reference_policy, inputs, cfg.mini_batch_size,
                                      self._forward_precision, self._kl.estimator == "full", with_reference,
                                      cfg.temperature)
        # 4-5. per-token KL, KL-shaped rewards, advantages and returns (GAE, or a critic-free estimator)
        # DAPO's overlong shaping of the scores, where set: by the responses' lengths, whatever the masks leave out
        penalties = overlong_penalties(cfg, lengths(responses).to(mask.device))
        scores_in = scores if penalties is None else scores + penalties.to(scores.dtype)
        shaped, adv = self._advantages(inputs, mask, old, ref, scores_in, with_reference, timing)
        cut = truncated(responses, self.tokenizer.eos_token_id) if cfg.mask_truncated_completions else None
        trained = loss_mask(cfg, mask, scores_in, cut)  # the tokens the loss trains on: all, or fewer
        weights, sampling = self._sampling_correction(inputs, mask, old.logprobs, timing)  # with rollout_correction
        rollout = Rollout(inputs, trained, old.logprobs, old.values, ref.logprobs, adv.advantages, adv.returns,
                          self._norm_length(mask), weights)
        # 6. PPO epochs over shuffled mini-batches
        with timed(timing, "time/ppo/optimize_step"):
            train_stats = self._optimize(rollout)
        # 7. statistics
        with timed(timing, "time/ppo/calc_stats"):
            stats = self._step_stats(rollout, mask, scores, scores_in, shaped, penalties, queries, responses,
                                     train_stats, with_reference) | sampling
        warn_if_nothing_trained(stats, len(train_stats), self.step_count + 1)
        # 8. KL controller, scheduler, step counter
        # the controller moves only where it sets the coefficient in effect, from a KL that was measured
        self._end_step(float(stats["objective/kl"]) if with_reference and not self._kl.in_loss else None)
        timing["time/ppo/total"] = time.perf_counter() - t_start
        return convert_to_scalar(stats | timing)

    def _sampling_correction(self, inputs: ModelInputs, mask: torch.Tensor, old_logprobs: torch.Tensor,
                             timing: dict[str, float]) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """With ``rollout_correction``: the ``(B, R)`` importance weights of the samples, the policy's probability of
        each sampled token over the rollout copy's (``algo.rollout_correction``), and their ``sampling/*`` stats (TRL's
        names). The copy's log-probs come from one no-grad pass of the copy as it sampled them (synced again only
        where the policy's weights changed since generate(), which within the loop they have not). Else ``(None, {})``.
        """
        cfg = self.config
        if cfg.rollout_correction is None:
            return None, {}
        with timed(timing, "time/ppo/sampling_pass"), torch.no_grad():
            self._rollout_lm()  # the copy synced first: its scorer is a view of it
            sampling = chunked_outputs(self._rollout.scorer(), inputs, cfg.mini_batch_size,
                                       temperature=cfg.temperature).logprobs.float()
        weights = sampling_weights(old_logprobs, sampling, mask, cfg.rollout_correction, cfg.rollout_correction_cap)
        if not self._warned_unweighted_loss and (overrides(self, "loss") or overrides(self, "train_minibatch")):
            self._warned_unweighted_loss = True
            warnings.warn("PPOTrainer: rollout_correction weights ppo_core's policy loss, but this trainer's own "
                          "loss (or train_minibatch) computes it, in legacy's signature, which has no place for the "
                          "importance weights: they do not reach the loss (the sampling/* stats are still reported).",
                          stacklevel=3)
        s = sampling_stats(old_logprobs, sampling, weights, mask, self._group.sum_across, self._group.gather)
        return weights, {"sampling/sampling_logp_difference/mean": s.logprob_diff_mean,
                         "sampling/sampling_logp_difference/max": s.logprob_diff_max,
                         "sampling/importance_sampling_ratio/min": s.weight_min,
                         "sampling/importance_sampling_ratio/mean": s.weight_mean,
                         "sampling/importance_sampling_ratio/max": s.weight_max}

    def _norm_length(self, mask: torch.Tensor):
        """Dr. GRPO's constant (``algo.advantages.norm_length``), with a warning, once, where it is not one."""
        cfg = self.config
        length = norm_length(cfg, mask, self._group, self._generated_max_new_tokens)
        if isinstance(length, torch.Tensor) and not self._warned_norm_length:
            self._warned_norm_length = True
            warnings.warn("PPOTrainer: loss_aggregation 'seq-mean-token-sum-norm' (Dr. GRPO) divides by a constant, "
                          "the responses' length limit, which neither max_completion_length nor a generate() call "
                          "with max_new_tokens gave: each step divides by its longest response instead, so a token's "
                          "weight changes from step to step. Set max_completion_length.")
        return length

    def _reward_kl_coef(self) -> float:
        """The KL's coefficient in the rewards (0 where the KL is in the loss instead)."""
        return self._kl.reward_coef(self.kl_ctl)

    def _advantages(self, inputs: ModelInputs, mask: torch.Tensor, old: PolicyOutputs, ref: PolicyOutputs,
                    scores: torch.Tensor, with_reference: bool,
                    timing: dict[str, float]) -> tuple[ShapedRewards, Advantages]:
        """The step's shaped rewards and its advantages and returns, all ``(B, R)``, over the global batch, from the
        ``(B,)`` scores: through a subclass's legacy hooks where it overrides them."""
        if self._step_hooks:  # its compute_rewards / _kl_penalty / compute_advantages, in legacy's order
            return hooked_advantages(self, scores, old.logprobs, ref.logprobs, old.values, mask, timing)
        with timed(timing, "time/ppo/compute_rewards"):  # in the reward, or, with kl_in "loss", in the loss instead
            kls = (kl_per_token(self._kl.estimator, self.model, self.reference_policy, inputs, old, ref,
                                self.config.temperature) if with_reference else torch.zeros_like(old.logprobs))
        with timed(timing, "time/ppo/compute_advantages"):
            return step_advantages(self.config, scores, kls, old.values, mask, self._reward_kl_coef(), self._group)

    def _step_stats(self, rollout: Rollout, mask, scores, scores_in, shaped: ShapedRewards, penalties, queries,
                    responses, train_stats: list[dict], with_reference: bool) -> dict[str, Any]:
        """The step's stats over every process's samples (``step.stats.step_summary``), host values."""
        cfg = self.config
        stats = step_stats(self._reward_kl_coef(), scores, rollout.old_logprobs, rollout.ref_logprobs,
                           shaped.non_score_rewards, shaped.kls, mask, lengths(queries), lengths(responses),
                           rollout.advantages, train_stats, cfg.mini_batch_size, self._group,
                           cfg.gradient_accumulation_steps)
        self._warned_negative_kl = warn_if_negative_kl(stats, self._warned_negative_kl)
        stats = step_summary(stats, cfg, self._group, with_reference, self.estimator.needs_groups, mask, rollout.mask,
                             scores_in, penalties)
        stats["ppo/learning_rate"] = self.optimizer.param_groups[0]["lr"]
        if self._updates.loss_scaled:  # fp16: the scale after this step's updates
            stats["ppo/loss_scale"] = loss_scale(self.accelerator, self.model)
        return stats

    def _end_step(self, mean_kl: float | None) -> None:
        """After a step's update: the KL controller (where the KL was measured) and the lr scheduler move on, the step
        is counted."""
        if mean_kl is not None:
            self.kl_ctl.update(mean_kl, self.sizes.global_batch_size)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.step_count += 1
        update.warn_if_schedule_ended(self.config, self.step_count)
        if self.config.optimize_device_cache:
            free_device_cache()

    def _reference_in_use(self) -> bool:
        """Whether this step's rewards or loss use the reference policy: not where its KL's coefficient is 0 (Dr.
        GRPO's default; an adaptive controller at 0 stays there), where the reference pass would only feed the KL
        stats (TRL's GRPOTrainer skips it at ``beta=0`` too). A subclass's legacy reward hooks always get it."""
        return bool(self._step_hooks) or self._kl.uses_reference(self.kl_ctl)

    def _optimize(self, rollout: Rollout) -> list[dict]:
        """``ppo_epochs`` passes over shuffled mini-batches of ``rollout``; returns the per-mini-batch stats.

        Each accumulation window (``gradient_accumulation_steps`` consecutive mini-batches, one backward batch) divides
        its means by its own global counts (``step.update.window_divisors``): its update is the one its backward
        batch gives as a single mini-batch on one process, however it is split."""
        cfg, all_stats = self.config, []
        batch_size, window = len(rollout.mask), self.sizes.backward_batch_size
        # accelerate counts mini-batches to find a window's end: from 0 at each step, whatever an interrupted step left
        self.accelerator.step = 0
        for _ in range(cfg.ppo_epochs):
            host_order = torch.randperm(batch_size, generator=self._shuffle)  # on the host, as its sizes are
            order = host_order.to(rollout.inputs.input_ids.device, non_blocking=True)
            for start in range(0, batch_size, cfg.mini_batch_size):
                if start % window == 0:  # a window starts: its counts, in one collective
                    divisors = window_divisors(rollout.mask[order[start:start + window]], self._group,
                                               cfg.gradient_accumulation_steps)
                mb = rollout.minibatch(*(o[start:start + cfg.mini_batch_size] for o in (order, host_order)))  # (b, R_b)
                with self.accelerator.accumulate(self.model):
                    self.model.train()
                    with self._forward_precision():
                        out = policy_outputs(self.model, mb.inputs, with_entropy=True, temperature=cfg.temperature)
                    if overrides(self, "train_minibatch"):  # a user's, called in legacy's argument order
                        stats = legacy_train_minibatch(self, mb, out, len(all_stats), divisors)
                    else:
                        stats = self._update_minibatch(mb, out, len(all_stats), divisors)
                all_stats.append(stats)
            if cfg.early_stopping and self._early_stop(window_mean(all_stats, "policy/policykl",
                                                                   cfg.gradient_accumulation_steps)):
                break
        return all_stats

    def _update_minibatch(self, mb: Rollout, out: PolicyOutputs, index: int,
                          divisors: Divisors | None) -> dict[str, torch.Tensor]:
        """Loss, backward, clipping and optimizer step of the mini-batch ``mb`` (``Rollout.minibatch``, ``(b, R)``)
        under its training pass ``out``: the ``index``-th of its step (for the error a failure raises), its means
        divided by ``divisors`` (its accumulation window's; None: the mini-batch is the window). The loss is
        ``step.update.ppo_loss`` (or a user's override of the legacy ``loss``), the rest ``Updates.apply``."""
        if overrides(self, "loss"):
            loss_p, loss_v, stats = legacy_loss(self, mb, out, divisors)
        else:
            loss_p, loss_v, stats = ppo_loss(self.config, self._group, mb, out, divisors)
        failed = functools.partial(minibatch_failure, self.step_count + 1, index)
        return self._updates.apply(loss_p + loss_v, stats, self.config.ratio_threshold, self._group, failed)

    def _early_stop(self, policykl: torch.Tensor) -> bool:
        """Stop the epochs when the mean policy KL of the epoch's last window (this process's share of it, see
        ``window_mean``; averaged across processes here) exceeds 1.5 * target_kl (legacy read its last mini-batch's:
        the same where a window is one mini-batch)."""
        policykl = mean_across(policykl, self._group)
        if policykl > 1.5 * self.config.target_kl:
            self.optimizer.zero_grad()  # bare, as legacy's (see Updates.step)
            return True
        return False

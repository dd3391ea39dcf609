"""``PPOTrainer``: the legacy TRL user-loop API (``generate`` -> score anything -> ``step``) on accelerate.

This module is the loop: building the trainer, ``generate``, and ``step`` in numbered steps with its PPO epochs
over mini-batches (``train_minibatch``, ``loss``). The rest lives beside it: the math in ``ppo_math`` (pure
functions), the batching, input checks, log-probabilities and the :class:`~ppo_core.step.rollout.Rollout` the epochs
consume in ``rollout``/``logprobs``, a mini-batch's backward and optimizer step in ``update``, mixed precision in
``precision``, the statistics in ``stats``, the other processes and the Accelerator in ``distributed``, the
checkpoint format in ``checkpoint``, the models and their surgery in ``modeling``, the reference policy in
``reference``, and the legacy methods in ``legacy``. Differences from legacy TRL, all deliberate fixes:

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

Under N processes (``accelerate launch``), ``step`` on each process's ``batch_size`` samples gives what
one process gives on the ``N * batch_size`` samples (``global_batch_size``), process 0's first, up to
float rounding, whenever the mini-batches are the same (one mini-batch per epoch, or the per-process
mini-batches of one index making up the global one): advantages and ``whiten_rewards`` are whitened
over the global batch, the losses are token means over the global mini-batch (see ``loss``), the
ratio-threshold skip is decided on the global mini-batch, and the stats and histograms are those of the
global batch (legacy TRL whitened and averaged per process, and averaged per-process token means). Each
process shuffles its own samples (seed ``seed + process_index``), samples with its own RNG seed (the
same offset), and a bad input or a non-finite loss on any process raises on all of them.

Under DeepSpeed (accelerate's DeepSpeed plugin, ZeRO-2 or ZeRO-3) the same holds, and the engine accumulates,
clips (``max_grad_norm``) and steps inside ``accelerator.backward``, with the settings of ``PPOConfig``. Under
ZeRO-3 the LM head is gathered for the scoring forward, generation gathers the policy once per call and the
reference is sharded too: see ``runtime.zero``. A checkpoint (``save_checkpoint``) has the same layout then, with
DeepSpeed's own checkpoint of the engine (every process's shards) in place of the state dicts: see
``ppo_core.runtime.checkpoint``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from .algo.advantages import kl_loss, loss_mask, loss_reduction, overlong_penalties, step_advantages
from .algo.estimators import check_prompt_groups, zero_std_groups
from .algo.functional import convert_to_scalar, entropy_from_logits, flatten_dict, stats_to_np
from .algo.kl_control import AdaptiveKLController, FixedKLController, RunningMoments, scale_scores
from .algo.ppo_math import kl_penalty, policy_loss, value_loss
from .algo.registry import get_estimator, policy_loss_kind
from .config import PPOConfig
from .legacy import LegacyMethods, check_arguments, default_optimizer, overridden_step_hooks
from .models.cpu_attention import float32_attention_on_cpu
from .models.generation import check_group_sampling
from .models.modeling import PreTrainedModelWrapper, decoder_start_token_id, disable_dropout
from .models.reference import frozen_reference, placed_reference, reference_policy
from .runtime import checkpoint
from .runtime.distributed import (
    accelerator_for,
    deprecated_collectives_ignored,
    mean_across,
    on_every_process,
    process_group,
    quiet_deepspeed_collectives,
    raise_if_any,
    tokens_per_process,
)
from .runtime.precision import floating_dtype, loss_scale, prepare_dtypes, with_tf32
from .runtime.utils import free_device_cache, keep_freed_memory_for_reuse, set_seed, timed
from .runtime.zero import configure_engine, gathered, is_zero3
from .step.rollout import (
    ModelInputs,
    PolicyOutputs,
    Rollout,
    build_response_masks,
    checked_step_inputs,
    chunked_outputs,
    full_kl_per_token,
    model_inputs,
    policy_outputs,
    warn_if_start_token_included,
)
from .step.stats import REFERENCE_STATS, minibatch_stats, non_finite_stat
from .step.update import Updates, minibatch_decision


class PPOTrainer(LegacyMethods):
    """Proximal Policy Optimisation for language models, with TRL's legacy ``PPOTrainer`` API.

    Args: as the legacy class. ``model`` is an :class:`AutoModelForCausalLMWithValueHead` or an
    :class:`AutoModelForSeq2SeqLMWithValueHead`. Without ``ref_model``, the reference is the policy
    with its adapter disabled when it is a PEFT model (``ref_model`` stays None: one copy of the base
    weights, and only the adapter and the value head are optimised), else a frozen copy sharing its
    first ``num_shared_layers`` layers.

    Process-wide effects of building one: it seeds the global RNGs (legacy behaviour; ``seed + process_index``
    under N processes); alone, it resets accelerate's process-wide state left by an earlier ``Accelerator``
    (:func:`~ppo_core.runtime.distributed.reset_single_process_accelerate_state` says why); on the CPU it lets glibc's
    malloc keep large freed blocks for reuse (:func:`~ppo_core.runtime.utils.keep_freed_memory_for_reuse`: a faster
    mini-batch, and the process keeps its peak heap), which ``PPO_CORE_TUNE_MALLOC=0`` in the environment turns
    off. The warnings filters are left as they are: under DeepSpeed, torch's deprecation warning on DeepSpeed's
    collectives is ignored only while a trainer method runs.
    """

    def __init__(self, config: PPOConfig | None = None, model: PreTrainedModelWrapper | None = None,
                 ref_model: torch.nn.Module | None = None, tokenizer: PreTrainedTokenizerBase | None = None,
                 dataset=None, optimizer: torch.optim.Optimizer | None = None, data_collator: Callable | None = None,
                 num_shared_layers: int | None = None, lr_scheduler=None, training_data_collator=None):
        config = config if config is not None else PPOConfig()
        check_arguments(config, model, ref_model, tokenizer, training_data_collator)
        self.config = config
        self._step_hooks = overridden_step_hooks(self)  # a subclass's legacy hooks, which step() then calls
        set_seed(config.seed)  # legacy behaviour: the trainer seeds the global RNGs (sampling uses them)

        # 1. accelerator, derived batch sizes, the other processes
        self.accelerator = accelerator_for(config)
        config.world_size = self.accelerator.num_processes
        config.global_backward_batch_size = config.backward_batch_size * config.world_size
        config.global_batch_size = config.batch_size * config.world_size
        config.is_encoder_decoder, config.is_peft_model = model.is_encoder_decoder, model.is_peft_model
        self.is_distributed = self.accelerator.num_processes > 1
        # DeepSpeed accumulates, clips and steps the optimizer inside accelerator.backward (see ``train_minibatch``)
        self.is_deepspeed = self.accelerator.state.deepspeed_plugin is not None
        self._zero3 = is_zero3(self.accelerator)  # weights sharded too (see ``ppo_core.runtime.zero``)
        self._group = process_group(self.accelerator)  # the one path to the other processes (alone: to itself)
        if self.is_distributed:  # independent sampling noise per process (the weights are synced by DDP)
            set_seed(config.seed + self.accelerator.process_index)
        if config.log_with is not None:
            self.accelerator.init_trackers(config.tracker_project_name, config=flatten_dict(config.to_dict()),
                                           init_kwargs=config.tracker_kwargs)

        # 2. tokenizer, models
        self.tokenizer = tokenizer
        if tokenizer.pad_token_id is None:
            warnings.warn("PPOTrainer: the tokenizer has no pad token; using its EOS token as pad token.")
            tokenizer.pad_token = tokenizer.eos_token
        if config.disable_dropout:
            disable_dropout(model)
        if config.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        self.decoder_start_token_id = decoder_start_token_id(model) if model.is_encoder_decoder else None
        ref_model = frozen_reference(model, ref_model, num_shared_layers, self._zero3)  # None: the PEFT policy's
        prepare_dtypes(self.accelerator, model, ref_model)  # frozen weights in the autocast dtype; half weights warned
        self.estimator = get_estimator(config.advantage_estimator)  # what the step computes (ppo_core.algo.registry)
        self._policy_loss = policy_loss_kind(config)  # "clip" or "cispo"
        if not self.estimator.uses_critic:  # critic-free: the value head is neither used nor trained, and is
            model.v_head.requires_grad_(False)  # frozen so that DDP does not wait for its gradient

        # 3. data, optimiser, KL controller
        self.dataset = dataset
        self.data_collator = data_collator
        self.dataloader = self._initial_dataloader(dataset, data_collator)  # None without a dataset (warned)
        if optimizer is None:
            optimizer = default_optimizer(model.parameters(), config.learning_rate)
        self.kl_ctl = (AdaptiveKLController(config.init_kl_coef, config.target, config.horizon) if config.adap_kl_ctrl
                       else FixedKLController(config.init_kl_coef))
        self.running = RunningMoments()

        # 4. accelerate: device placement, mixed precision, DDP or DeepSpeed
        configure_engine(self.accelerator, model, config.mini_batch_size, config.gradient_accumulation_steps,
                         config.max_grad_norm)
        with deprecated_collectives_ignored(self.is_deepspeed):
            (self.model, self.optimizer, self.dataloader, self.lr_scheduler) = self.accelerator.prepare(
                model, optimizer, self.dataloader, lr_scheduler)
            # under DeepSpeed the reference takes the dtype the engine gave the policy's weights
            self.ref_model = placed_reference(ref_model, self.accelerator, self._zero3,
                                              floating_dtype(self.model) if self.is_deepspeed else None)
        self.current_device = self.accelerator.device
        if self.current_device.type == "cpu":  # (N, V) blocks reused, not page-faulted in at every mini-batch
            keep_freed_memory_for_reuse()
        self.current_step = 0  # logging step, advanced by log_stats (legacy)
        self.step_count = 0  # completed step() calls
        self._shuffle = torch.Generator().manual_seed(config.seed + self.accelerator.process_index)
        self._warned_negative_kl = self._warned_start_token = False
        # the backward, clipping and optimizer step of each mini-batch; under DDP and DeepSpeed the last backward of
        # a window all-reduces or applies its gradients
        self._updates = Updates(self.accelerator, self.model, self.optimizer, config.max_grad_norm,
                                config.max_consecutive_overflows, self.is_deepspeed or self.is_distributed)
        self._best_score = -math.inf

    # ---- generation (the sampling itself: ``_generate_batched``) ------------------------------------
    def generate(self, query_tensor, length_sampler: Callable[[], int] | None = None, batch_size: int = 4,
                 return_prompt: bool = True, generate_ref_response: bool = False, **generation_kwargs):
        """Sample responses: a 1-D query tensor gives a ``(1, L)`` tensor; a list gives a list of 1-D tensors.

        Lists are generated ``batch_size`` at a time, left-padded, with the KV cache; padding is
        stripped and each response is cut after its first EOS (the EOS kept). An encoder-decoder gets
        right-padded queries and returns the response alone (whatever ``return_prompt``), without the
        decoder start token. ``generate_ref_response`` also samples from the reference (for a PEFT
        policy without ``ref_model``: the adapter-disabled model) and returns both.
        """
        check_group_sampling(self.config, generation_kwargs,
                             self.accelerator.unwrap_model(self.model).pretrained_model.generation_config)

        def sample(model):
            return self._generate_batched(model, query_tensor, length_sampler, batch_size, return_prompt,
                                          **generation_kwargs)

        outputs = sample(self.model)
        if not generate_ref_response:
            return outputs
        with self._reference() as ref_model:
            return outputs, sample(ref_model)

    @contextlib.contextmanager
    def whole_policy(self):
        """The policy (unwrapped: the value-head model) with every weight whole on this process, for the block, e.g.
        to save it; read-only. Under ZeRO-3 the shards are gathered from every process: every process must enter
        the block, even where only one of them saves."""
        model = self.accelerator.unwrap_model(self.model)
        with deprecated_collectives_ignored(self.is_deepspeed), gathered(model.parameters()):
            yield model

    @contextlib.contextmanager
    def _forward_precision(self):
        """The scoring passes' precision: accelerate's autocast, and float32 attention for bf16 on the CPU
        (faster there, see ``cpu_attention``). Rollout and loss passes both use it, so that the first ratio of
        a step stays exactly 1; sampling keeps plain autocast (forward only, where bf16 attention is faster)."""
        with self.accelerator.autocast(), float32_attention_on_cpu(self.current_device.type == "cpu"):
            yield

    def _reference(self):
        """The reference policy, for a block (see ``ppo_core.models.reference``)."""
        return reference_policy(self.model, self.ref_model, self.accelerator.unwrap_model)

    def _model_inputs(self, queries: list[torch.Tensor], responses: list[torch.Tensor]) -> ModelInputs:
        """``query + response`` sequences, or for an encoder-decoder the queries and ``start + response``."""
        start = self.decoder_start_token_id
        if start is not None and not self._warned_start_token:
            self._warned_start_token = warn_if_start_token_included(responses, start)
        return model_inputs(queries, responses, self.tokenizer.pad_token_id, start)

    # ---- the PPO step --------------------------------------------------------------------------------
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
        self._push_to_hub_if_best(scores)
        # 3. no-grad passes of policy and reference (the reference's only where its KL has a coefficient)
        inputs = self._model_inputs(queries, responses)
        mask = build_response_masks(response_masks, inputs)
        with_reference = self._reference_in_use()
        reward_kl_coef = self.kl_ctl.value if cfg.kl_in == "reward" else 0.0  # the KL's coefficient in the rewards
        with timed(timing, "time/ppo/forward_pass"):
            old, ref = self._rollout_passes(inputs, with_reference)
        penalties = overlong_penalties(cfg, mask)  # DAPO's overlong shaping of the scores, where set
        scores_in = scores if penalties is None else scores + penalties.to(scores.dtype)
        if self._step_hooks:  # 4-5 through a subclass's compute_rewards / _kl_penalty / compute_advantages
            shaped, adv = self._hooked_advantages(scores, old.logprobs, ref.logprobs, old.values, mask, timing)
        else:
            # 4. per-token KL (in the reward, or, with kl_in "loss", in the loss instead)
            with timed(timing, "time/ppo/compute_rewards"):
                kls = self._kl_per_token(inputs, old, ref) if with_reference else torch.zeros_like(old.logprobs)
            # 5. KL-shaped rewards, advantages and returns (GAE, or a critic-free estimator), over the global batch
            with timed(timing, "time/ppo/compute_advantages"):
                shaped, adv = step_advantages(cfg, scores_in, kls, old.values, mask, reward_kl_coef, self._group)
        norm_length = None  # Dr. GRPO's constant: the global batch's longest response, the same on every process
        if cfg.loss_aggregation == "seq-mean-token-sum-norm":
            norm_length = self._group.gather(mask.sum(dim=1)).max()
        trained = mask  # the tokens the loss trains on: all, or fewer (truncated responses, groups of one score)
        if cfg.mask_truncated_completions or cfg.dynamic_sampling:
            trained = loss_mask(cfg, mask, scores_in, self._truncated(responses))
        rollout = Rollout(inputs, trained, old.logprobs, old.values, ref.logprobs, adv.advantages, adv.returns,
                          norm_length)
        # 6. PPO epochs over shuffled mini-batches
        with timed(timing, "time/ppo/optimize_step"):
            train_stats = self._optimize(rollout)
        # 7. statistics
        with timed(timing, "time/ppo/calc_stats"):
            stats = stats_to_np(self.gather_stats(self.record_step_stats(
                kl_coef=reward_kl_coef, scores=scores, logprobs=rollout.old_logprobs,
                ref_logprobs=rollout.ref_logprobs, non_score_reward=shaped.non_score_rewards, kls=shaped.kls,
                masks=mask, queries=queries, responses=responses, train_stats=train_stats,
                advantages=rollout.advantages)))
        if cfg.kl_in == "loss":  # the coefficient in effect there (objective/kl_coef is the rewards': 0)
            stats["objective/kl_loss_coef"] = cfg.kl_loss_coef
        if not with_reference:  # no reference pass: the KL to it was not measured (not 0)
            stats |= {key: np.full_like(stats[key], np.nan, dtype=float) for key in REFERENCE_STATS}
        if self.estimator.needs_groups:  # groups with one score for all: no learning signal
            flat = self._group.gather(zero_std_groups(scores_in, cfg.num_generations))  # (global prompts,)
            stats["ppo/frac_reward_zero_std"] = float(flat.mean())
        if penalties is not None:
            stats["ppo/overlong_penalty_mean"] = float(self._group.gather(penalties).mean())
        if trained is not mask:  # the share of the (global) batch's responses the loss left out
            left_out = (trained.sum(dim=1) == 0) & (mask.sum(dim=1) > 0)
            stats["ppo/frac_responses_left_out"] = float(self._group.gather(left_out.float()).mean())
        # 8. KL controller, scheduler, step counter
        stats["ppo/learning_rate"] = self.optimizer.param_groups[0]["lr"]
        if self._updates.loss_scaled:  # fp16: the scale after this step's updates
            stats["ppo/loss_scale"] = loss_scale(self.accelerator, self.model)
        # the controller moves only where it sets the coefficient in effect, from a KL that was measured
        self._end_step(float(stats["objective/kl"]) if with_reference and cfg.kl_in == "reward" else None)
        timing["time/ppo/total"] = time.perf_counter() - t_start
        return convert_to_scalar(stats | timing)

    def _truncated(self, responses: list[torch.Tensor]) -> torch.Tensor:
        """``(B,)`` bool: the responses that do not end with the EOS token (cut at the length limit)."""
        last = torch.stack([r[-1] for r in responses])
        return last != self.tokenizer.eos_token_id

    def _kl_per_token(self, inputs: ModelInputs, old: PolicyOutputs, ref: PolicyOutputs) -> torch.Tensor:
        """``(B, R)`` the KL penalty of each response token: from the sampled tokens' log-probabilities, or over the
        whole vocabulary (``kl_penalty="full"``)."""
        if self.config.kl_penalty != "full":
            return kl_penalty(old.logprobs, ref.logprobs, self.config.kl_penalty)
        with self._reference() as ref_model:
            return full_kl_per_token(self.model, old.hidden, ref_model, ref.hidden, inputs)

    def _end_step(self, mean_kl: float | None) -> None:
        """After a step's update: the KL controller (where the KL was measured) and the lr scheduler move on, the step
        is counted."""
        if mean_kl is not None:
            self.kl_ctl.update(mean_kl, self.config.batch_size * self.accelerator.num_processes)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.step_count += 1
        if self.config.optimize_device_cache:
            free_device_cache()

    def _reference_in_use(self) -> bool:
        """Whether this step's rewards or loss use the reference policy: not where its KL's coefficient is 0 (Dr.
        GRPO's default; an adaptive controller at 0 stays there), where the reference pass would only feed the KL
        stats (TRL's GRPOTrainer skips it at ``beta=0`` too). A subclass's legacy reward hooks always get it."""
        cfg = self.config
        return bool(self._step_hooks) or (cfg.kl_loss_coef if cfg.kl_in == "loss" else self.kl_ctl.value) != 0

    @torch.no_grad()
    def _rollout_passes(self, inputs: ModelInputs, with_reference: bool = True) -> tuple[PolicyOutputs, PolicyOutputs]:
        """The policy's and the reference's outputs on ``inputs``, in eval mode, ``mini_batch_size`` samples at a
        time (with the hidden states for ``kl_penalty="full"``). Without the reference, the policy's stand in for
        it: a KL of exactly 0, which its coefficient of 0 multiplies anyway."""
        self.model.eval()

        def outputs(model):
            with self._forward_precision():
                return chunked_outputs(model, inputs, self.config.mini_batch_size, self.config.kl_penalty == "full")

        old = outputs(self.model)
        if not with_reference:
            return old, old
        with self._reference() as ref_model:
            return old, outputs(ref_model)

    def _optimize(self, rollout: Rollout) -> list[dict]:
        """``ppo_epochs`` passes over shuffled mini-batches of ``rollout``; returns the per-mini-batch stats."""
        cfg, all_stats = self.config, []
        batch_size = len(rollout.mask)
        for _ in range(cfg.ppo_epochs):
            host_order = torch.randperm(batch_size, generator=self._shuffle)  # on the host, as its sizes are
            order = host_order.to(rollout.inputs.input_ids.device, non_blocking=True)
            for start in range(0, batch_size, cfg.mini_batch_size):
                mb = rollout.minibatch(*(o[start:start + cfg.mini_batch_size] for o in (order, host_order)))  # (b, R_b)
                with self.accelerator.accumulate(self.model):
                    self.model.train()
                    with self._forward_precision():
                        out = policy_outputs(self.model, mb.inputs, with_entropy=True)
                    stats = self.train_minibatch(mb.old_logprobs, mb.old_values, out.logprobs, None, out.values,
                                                 mb.mask, mb.advantages, mb.returns, entropy=out.entropy,
                                                 ref_logprobs=mb.ref_logprobs, norm_length=mb.norm_length,
                                                 minibatch_index=len(all_stats))
                all_stats.append(stats)
            if cfg.early_stopping and self._early_stop(all_stats[-1]["policy/policykl"]):
                break
        return all_stats

    def train_minibatch(self, old_logprobs, values, logprobs, logits, vpreds, mask, advantages, returns,
                        entropy=None, ref_logprobs=None, norm_length=None,
                        minibatch_index: int = 0) -> dict[str, torch.Tensor]:
        """Loss, backward, clipping and optimizer step of one mini-batch (all tensors ``(b, R)``): the
        ``minibatch_index``-th of its step (for the error a failure raises)."""
        loss_p, loss_v, stats = self.loss(old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns,
                                          entropy=entropy, ref_logprobs=ref_logprobs, norm_length=norm_length)
        failed = functools.partial(self._failed, minibatch_index)
        # one host read: the mean ratio and whether any stat is non-finite, over the global mini-batch (every process
        # skips, backpropagates or raises together)
        decision = minibatch_decision(stats, self.config.ratio_threshold, self._group)
        if decision.non_finite:  # every process raises the failing process's error
            bad = non_finite_stat(stats)  # e.g. "ppo/loss/value (inf)", or None on a process whose stats are finite
            raise_if_any(None if bad is None else failed(f"non-finite {bad}"), self._group)
        stats["policy/skipped"] = decision.skipped_flag
        if decision.skipped:  # the ratio exploded: no update from this mini-batch (counted in the stats)
            warnings.warn(f"PPOTrainer: mean ratio of a mini-batch ({decision.ratio_mean:.2f}) exceeds "
                          f"ratio_threshold ({self.config.ratio_threshold}); skipping its update.")
        self._updates.backward(loss_p + loss_v, decision.skipped)
        overflowed = self.accelerator.sync_gradients and self._updates.step(failed)
        if self._updates.loss_scaled:  # fp16: the loss scaler skipped this update (counted in the stats)
            stats["policy/overflowed"] = torch.full((), float(overflowed), device=self.current_device)
        return stats

    def _failed(self, done: int, what: str, advice: str = "") -> FloatingPointError:
        """The error of this step's mini-batch ``done`` (0-based) failing before its update: where, what, and what the
        weights hold (the updates of the step's earlier mini-batches)."""
        held = "the weights were not updated" if done == 0 else \
            f"the weights hold this step's first {done} mini-batch update{'s' if done > 1 else ''}, not this one"
        return FloatingPointError(f"PPO step {self.step_count + 1}, mini-batch {done + 1}: {what} before the update; "
                                  f"{held}.{advice}")

    def loss(self, old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns, entropy=None,
             ref_logprobs=None, norm_length=None):
        """Clipped policy loss (plus the KL loss term with ``kl_in="loss"``) and ``vf_coef`` times the clipped value
        loss (critic-free estimators: none, and no ``val/*`` stats), with legacy stats.

        ``logits`` (``(b, R, V)``) is accepted for API compatibility; the trainer passes the per-token
        ``entropy`` instead, computed without materialising the logits. ``norm_length``: Dr. GRPO's constant (the
        step's ``Rollout.norm_length``; None: the mini-batch's width).

        Under N processes each token mean divides this process's sum by the global mini-batch's token count over N
        (:func:`~ppo_core.runtime.distributed.tokens_per_process`, which says why); the stats are per-process shares
        (the variances excepted) that ``gather_stats`` averages into the global values.
        """
        cfg = self.config
        n_tokens = tokens_per_process(mask, self._group)
        if cfg.mask_truncated_completions or cfg.dynamic_sampling:  # a mini-batch may have no token left: loss 0
            n_tokens = mask.sum() if n_tokens is None else n_tokens
            n_tokens = torch.where(n_tokens > 0, n_tokens, torch.ones_like(n_tokens))
        norm_length = mask.shape[1] if norm_length is None else norm_length
        pg = policy_loss(logprobs, old_logprobs, advantages, mask, cfg.cliprange, n_tokens,
                         loss_reduction(cfg, mask, n_tokens, norm_length), cliprange_high=cfg.epsilon_high,
                         level=cfg.importance_sampling_level, kind=self._policy_loss)
        critic = self.estimator.uses_critic
        vf = value_loss(vpreds, values, returns, mask, cfg.cliprange_value, n_tokens) if critic else None
        kl = kl_loss(cfg, logprobs, ref_logprobs, mask, n_tokens, norm_length)
        if entropy is None and logits is not None:
            entropy = entropy_from_logits(logits)
        with torch.no_grad():
            stats = minibatch_stats(pg, vf, cfg.vf_coef, mask, advantages, returns, vpreds, values, entropy, n_tokens,
                                    self._group, kl)
        loss_p = pg.loss if kl is None else pg.loss + cfg.kl_loss_coef * kl
        return loss_p, (cfg.vf_coef * vf.loss if critic else torch.zeros_like(pg.loss)), stats

    def _early_stop(self, policykl: torch.Tensor) -> bool:
        """Stop the epochs when the mean policy KL (across processes) exceeds 1.5 * target_kl."""
        policykl = mean_across(policykl, self._group)
        if policykl > 1.5 * self.config.target_kl:
            self.optimizer.zero_grad()  # bare, as legacy's (see Updates.step)
            return True
        return False

    # ---- checkpoints (not in legacy TRL: resume was its most requested missing feature) ----------------
    @quiet_deepspeed_collectives
    def save_checkpoint(self, path: str, extra: dict[str, Any] | None = None) -> None:
        """Write the whole training state to the directory ``path`` atomically (what it holds and its layout:
        ``runtime.checkpoint``), with ``extra`` as given (plain Python values or tensors, e.g. the caller's data
        position); see ``load_checkpoint``. Every process calls it, and returns once the directory is in place."""
        self.accelerator.wait_for_everyone()
        processes = self._group.gather_object({"shuffle": self._shuffle.get_state(), "rng": checkpoint.rng_state()})
        state = {"kl_ctl": self.kl_ctl.state_dict(), "running": self.running.state_dict(),
                 "current_step": self.current_step, "step_count": self.step_count,
                 "config": flatten_dict(self.config.to_dict()), "extra": extra or {}, "processes": processes,
                 "overflows": self._updates.overflows.state_dict()}
        checkpoint.save(path, state, self._checkpointed_engine(), self.accelerator, tag=str(self.step_count))

    @quiet_deepspeed_collectives
    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore what ``save_checkpoint`` wrote (each process its own shuffling and RNG states); return its
        ``extra`` dict. Every process calls it; the number of processes, and DeepSpeed and its ZeRO stage (or their
        absence), must be the checkpoint's (a ValueError says what to do otherwise)."""
        state = checkpoint.load(path, self._checkpointed_engine(), self.accelerator.num_processes)
        own = state["processes"][self.accelerator.process_index]
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.running.load_state_dict(state["running"])
        self._shuffle.set_state(own["shuffle"])
        self.current_step, self.step_count = state["current_step"], state["step_count"]
        self._updates.overflows.load_state_dict(state.get("overflows", {"in_a_row": 0}))
        checkpoint.set_rng_state(own["rng"])
        return state["extra"]

    def _checkpointed_engine(self):
        return checkpoint.engine_state(self.accelerator, self.model, self.optimizer, self.lr_scheduler,
                                       self.accelerator.scaler)


"""The update of one mini-batch in the PPO epochs: whether it is skipped, its backward, and at the end of a
gradient-accumulation window the clipping, the checks and the optimizer step.

A GPU runs ahead of Python until Python reads a value back, and every read waits for all the work queued before it
(a host sync). A mini-batch reads once (:func:`minibatch_decision`: the global mean ratio, whether to skip, whether
a statistic is non-finite on some process, from one collective), and the end of a window once more (the gradient
norm, in :meth:`Updates.step`).

Under N processes every decision is the same on every process: the skip is decided on the global mini-batch, and the
gradients of a window are all-reduced (DDP) or applied (DeepSpeed) in the backward of its last mini-batch, so a
skipped last mini-batch still runs a zero-loss backward when the window has gradients.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from ..algo.advantages import kl_loss, loss_reduction
from ..algo.kl_control import KLPlacement
from ..algo.ppo_math import Divisors, policy_loss, value_loss
from ..algo.registry import settings
from ..runtime.distributed import raise_if_any
from ..runtime.master_weights import MasterAdam, has_masters
from ..runtime.precision import OverflowGuard, loss_scaled
from .rollout import PolicyOutputs, Rollout
from .stats import minibatch_stats, non_finite_count, non_finite_stat


def default_optimizer(params: Iterable[torch.nn.Parameter], lr: float, masters: bool = False) -> torch.optim.Optimizer:
    """Adam over the trainable parameters, as legacy TRL, with torch's fused kernel where it has one; with ``masters``
    over float32 master copies of the half-precision ones (``MasterAdam``: ``PPOConfig.weights_dtype``).

    The fused kernel updates each tensor in one pass, where the default (foreach) Adam makes about ten
    elementwise passes: on a 2-core CPU and 10M parameters that is 3x faster per optimizer step.
    """
    params = [p for p in params if p.requires_grad]
    if masters:  # fused where its masters' device has the kernel, chosen at its first step
        return MasterAdam(params, lr=lr)
    try:
        return torch.optim.Adam(params, lr=lr, fused=True)
    except RuntimeError:  # a device or dtype without a fused kernel
        return torch.optim.Adam(params, lr=lr)


def run_optimizer(given, params: Iterable[torch.nn.Parameter], config, deepspeed: bool,
                  mixed_precision: str) -> torch.optim.Optimizer:
    """The run's optimizer: ``given`` (PPOTrainer's ``optimizer``), else :func:`default_optimizer`'s. Under
    ``config.weights_dtype`` a ValueError where nothing would keep the float32 masters (a given optimizer without
    them), or where something else holds the weights' precision (DeepSpeed, fp16's loss scaler)."""
    if config.weights_dtype is not None:
        where = ("under DeepSpeed, whose engine keeps float32 masters itself (set bf16 in its config instead)"
                 if deepspeed else "with mixed_precision fp16, whose loss scaler unscales the optimizer's gradients, "
                 "not the weights'" if mixed_precision == "fp16" else None)
        if where is None and given is not None and not has_masters(given):
            where = (f"with the optimizer passed ({type(given).__name__}), which would write its updates into the "
                     "bf16 weights (pass ppo_core.runtime.master_weights.MasterAdam or MasterAdamW, or none)")
        if where is not None:
            raise ValueError(f"PPOTrainer: weights_dtype={config.weights_dtype!r} trains bf16 weights through float32 "
                             f"masters, which it cannot keep {where}.")
    return given if given is not None else default_optimizer(params, config.learning_rate,
                                                             masters=config.weights_dtype is not None)


def run_scheduler(given, optimizer: torch.optim.Optimizer, config, deepspeed: bool, num_processes: int):
    """The run's lr scheduler: ``given`` (PPOTrainer's ``lr_scheduler``), else ``config.lr_scheduler_type``'s, None
    for "constant" (legacy: none); a ValueError where both set one."""
    if given is not None:
        if config.lr_scheduler_type != "constant":
            raise ValueError(f"PPOTrainer: an lr_scheduler was passed and PPOConfig.lr_scheduler_type is "
                             f"{config.lr_scheduler_type!r}: two schedules for one rate; pass one of them (set "
                             "lr_scheduler_type='constant' to keep yours).")
        return given
    # accelerate steps a prepared scheduler once per process in each call; DeepSpeed at every optimizer step
    ticks = config.ppo_epochs * config.batch_size // config.backward_batch_size if deepspeed else num_processes
    return default_scheduler(optimizer, config, ticks)


def default_scheduler(optimizer: torch.optim.Optimizer, config, ticks_per_step: int):
    """The schedule of ``config.lr_scheduler_type`` (transformers' ``get_scheduler``) over the run's
    ``config.total_ppo_epochs`` step() calls, its warmup ``ceil(warmup_ratio * that)`` of them; None for "constant".
    ``ticks_per_step``: how often the prepared scheduler is stepped in one step() call, so that the schedule spans the
    run however many processes or mini-batches it has."""
    if config.lr_scheduler_type == "constant":
        return None
    from transformers import get_scheduler

    steps = config.total_ppo_epochs
    return get_scheduler(config.lr_scheduler_type, optimizer,
                         num_warmup_steps=math.ceil(config.warmup_ratio * steps) * ticks_per_step,
                         num_training_steps=steps * ticks_per_step)


DECAYING = ("linear", "cosine")


def warn_if_schedule_ended(config, steps_done: int) -> None:
    """Warn once, after the run's last scheduled step() call, that a decaying schedule has reached 0 (further calls
    would not train: linear stays at 0 and cosine would rise again)."""
    if steps_done == config.total_ppo_epochs + 1 and config.lr_scheduler_type in DECAYING:
        warnings.warn(f"PPOTrainer: {steps_done} step() calls, past the {config.total_ppo_epochs} that "
                      f"lr_scheduler_type {config.lr_scheduler_type!r} spans (ceil(steps / batch_size)): the "
                      "learning rate has run its schedule; set PPOConfig.steps to the rollouts you train on.",
                      UserWarning, stacklevel=4)


def window_divisors(mask: torch.Tensor, group, accumulation_steps: int) -> Divisors:
    """The :class:`~ppo_core.algo.ppo_math.Divisors` of the mini-batches of one accumulation window, from the mask
    ``(w, R)`` of this process's samples in it: the window's global counts of tokens and of sequences with a token,
    over ``N * accumulation_steps`` (one collective, no host read). Alone with one mini-batch per window, None: each
    mean divides by its own count, as it always did. A window without any token divides by 1 (its sums are 0)."""
    if group.num_processes == 1 and accumulation_steps == 1:
        return Divisors(None, None)
    counts = torch.stack([mask.sum(), (mask.sum(dim=1) > 0).sum()]).float()  # (2,)
    counts = group.sum_across(counts) / (group.num_processes * accumulation_steps)
    return Divisors(*torch.where(counts > 0, counts, torch.ones_like(counts)).unbind())


def window_mean(minibatch_stats: list[dict[str, torch.Tensor]], key: str, accumulation_steps: int) -> torch.Tensor:
    """The mean of ``key`` over the last accumulation window of ``minibatch_stats`` (this process's share of the
    global window's: average it across processes), from its mini-batches' shares: a token mean's share divides the
    mini-batch's sum by the window's count over ``N * accumulation_steps`` (:func:`window_divisors`), so the window's
    mean is the sum of its shares over ``accumulation_steps``. With one mini-batch per window, its own value."""
    window = minibatch_stats[-accumulation_steps:]
    return torch.stack([s[key] for s in window]).sum() / accumulation_steps if accumulation_steps > 1 \
        else window[0][key]


def ppo_loss(config, group, mb: Rollout, out: PolicyOutputs,
             divisors: Divisors | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``(policy loss, value loss, stats)`` of the mini-batch ``mb`` (its ``(b, R)`` tensors, from
    :meth:`Rollout.minibatch`) under the training pass's ``out`` (``(b, R)`` log-probabilities, values and entropies):
    the registered policy loss (plus ``kl_loss_coef`` times the KL loss term with the KL in the loss) and ``vf_coef``
    times the clipped value loss (zero without a critic, and no ``val/*`` stats). What it trains with is
    ``config``'s resolved settings (``algo.registry.settings``). ``mb.inputs`` is not read: a legacy call has none.

    ``divisors``: what its token and sequence means divide by, its accumulation window's (:func:`window_divisors`;
    the trainer's PPO epochs pass them). None, for a mini-batch alone (legacy's ``loss`` called by hand): the window is
    the mini-batch. Under N processes the token means are this process's shares of the global window's (the stats
    too, the variances excepted); the step averages them into the global values.
    """
    cfg, resolved, mask = config, settings(config), mb.mask
    divisors = window_divisors(mask, group, 1) if divisors is None else divisors
    n_tokens = divisors.tokens  # None alone: each mean its own count's (``token_mean``: 1 where the mask has none)
    norm_length = mask.shape[1] if mb.norm_length is None else mb.norm_length  # Dr. GRPO's constant
    pg = policy_loss(out.logprobs, mb.old_logprobs, mb.advantages, mask, resolved.cliprange, n_tokens,
                     loss_reduction(resolved, mask, divisors, norm_length), cliprange_high=resolved.epsilon_high,
                     level=resolved.importance_sampling_level, kind=resolved.policy_loss,
                     weights=mb.sampling_weights, **resolved.policy_loss_kwargs)
    critic = resolved.uses_critic
    vf = value_loss(out.values, mb.old_values, mb.returns, mask, cfg.cliprange_value, n_tokens) if critic else None
    kl = kl_loss(resolved, out.logprobs, mb.ref_logprobs, mask, divisors, norm_length)
    with torch.no_grad():
        stats = minibatch_stats(pg, vf, cfg.vf_coef, mask, mb.advantages, mb.returns, out.values, mb.old_values,
                                out.entropy, n_tokens, group, kl)
        # what the skip decision reads: the mini-batch's own token count and its ratio's sum share (the stat divides
        # by the window's count)
        stats["policy/tokens"] = mask.sum().to(pg.ratio_mean.dtype)
        stats["policy/ratio_sum"] = pg.ratio_mean * (stats["policy/tokens"] if n_tokens is None else n_tokens)
    loss_p = pg.loss if kl is None else pg.loss + KLPlacement.of(resolved).loss_coef * kl
    return loss_p, (cfg.vf_coef * vf.loss if critic else torch.zeros_like(pg.loss)), stats


def minibatch_failure(step: int, done: int, what: str, advice: str = "") -> FloatingPointError:
    """The error of step ``step``'s (1-based) mini-batch ``done`` (0-based) failing before its update: where, what, and
    what the weights hold (the updates of the step's earlier mini-batches)."""
    held = "the weights were not updated" if done == 0 else \
        f"the weights hold this step's first {done} mini-batch update{'s' if done > 1 else ''}, not this one"
    return FloatingPointError(f"PPO step {step}, mini-batch {done + 1}: {what} before the update; {held}.{advice}")


class Decision(NamedTuple):
    """What one host read tells about a mini-batch, before its backward."""

    ratio_mean: float  # the global mini-batch's mean probability ratio
    skipped: bool  # the ratio exceeds ratio_threshold: no update from this mini-batch
    empty: bool  # the global mini-batch has no token to train on: no backward from it
    non_finite: bool  # some statistic of the mini-batch is non-finite, on some process
    skipped_flag: torch.Tensor  # 0-d float on the device: ``skipped``, for the mini-batch's stats
    empty_flag: torch.Tensor  # 0-d float on the device: ``empty``


def minibatch_decision(stats: dict[str, torch.Tensor], ratio_threshold: float, group) -> Decision:
    """The mini-batch's :class:`Decision` from its ``stats`` (``policy/ratio_sum`` and ``policy/tokens``, this
    process's, see :func:`ppo_loss`): one collective and one host read, on every process alike. The stats of a user's
    own ``loss`` (a legacy override) have neither: its ``policy/ratio_mean`` shares are averaged, as legacy's were,
    and it is never empty."""
    if "policy/ratio_sum" in stats:
        ratio_sum, tokens = stats["policy/ratio_sum"].detach(), stats["policy/tokens"]
    else:
        ratio_sum = stats["policy/ratio_mean"].detach()
        tokens = torch.ones_like(ratio_sum)
    dtype = torch.promote_types(ratio_sum.dtype, torch.float32)
    summed = group.sum_across(torch.stack([ratio_sum.to(dtype), non_finite_count(stats).to(dtype),
                                           tokens.to(dtype)]))  # (3,)
    tokens = summed[2]
    ratio_mean = summed[0] / torch.where(tokens > 0, tokens, torch.ones_like(tokens))
    skipped, empty = ratio_mean > ratio_threshold, tokens == 0  # compared on the device, in the ratio's dtype
    mean, skip, bad, none = torch.stack([ratio_mean, skipped.to(dtype), summed[1], empty.to(dtype)]).tolist()
    return Decision(mean, bool(skip), bool(none), bad > 0, skipped.float(), empty.float())


class Updates:
    """The optimizer updates of a run, one gradient-accumulation window at a time.

    Args:
        accelerator, model, optimizer: the trainer's (``model`` and ``optimizer`` prepared).
        max_grad_norm: the clipping norm (None: the norm is measured, not clipped).
        max_consecutive_overflows: loss-scale overflows in a row that count as divergence (fp16 only).
        sync_in_backward: DDP or DeepSpeed: the last backward of a window all-reduces or applies its gradients.
    """

    def __init__(self, accelerator, model, optimizer, max_grad_norm: float | None, max_consecutive_overflows: int,
                 sync_in_backward: bool):
        self.accelerator, self.model, self.optimizer = accelerator, model, optimizer
        self.max_grad_norm, self.sync_in_backward = max_grad_norm, sync_in_backward
        self.loss_scaled = loss_scaled(accelerator, model)  # fp16: an overflow is a skipped update, not an error
        self.overflows = OverflowGuard(max_consecutive_overflows)
        self.window_has_gradients = False  # a backward ran in the current window

    def apply(self, loss: torch.Tensor, stats: dict[str, torch.Tensor], ratio_threshold: float, group,
              failed: Callable[[str, str], Exception]) -> dict[str, torch.Tensor]:
        """One mini-batch after its loss: skip it (its mean ratio over ``ratio_threshold``, counted in the stats),
        raise ``failed(what)`` on every process where a statistic is non-finite on any, else its backward, and at the
        end of a window the optimizer step (:meth:`step`). A mini-batch with no token on any process is skipped too.
        Returns ``stats`` with ``policy/skipped`` and ``policy/empty`` (and under fp16 ``policy/overflowed``)."""
        # one host read: the mean ratio and whether any stat is non-finite, over the global mini-batch (every process
        # skips, backpropagates or raises together)
        decision = minibatch_decision(stats, ratio_threshold, group)
        # every process raises the failing process's error; a mini-batch without a token has nothing to fail (its
        # variances, over no token, are NaN: "not measured", left out of the step's means by ``training_stats``)
        if decision.non_finite and not decision.empty:
            bad = non_finite_stat(stats)  # e.g. "ppo/loss/value (inf)", or None on a process whose stats are finite
            raise_if_any(None if bad is None else failed(f"non-finite {bad}"), group)
        stats.pop("policy/ratio_sum", None), stats.pop("policy/tokens", None)  # the decision's, not the step's
        stats["policy/skipped"], stats["policy/empty"] = decision.skipped_flag, decision.empty_flag
        if decision.skipped:  # the ratio exploded: no update from this mini-batch (counted in the stats)
            warnings.warn(f"PPOTrainer: mean ratio of a mini-batch ({decision.ratio_mean:.2f}) exceeds "
                          f"ratio_threshold ({ratio_threshold}); skipping its update.")
        # no token (response_masks, truncation or dynamic sampling masked all): no gradient, and a window of only such
        # mini-batches makes no optimizer step (Adam would still move the weights on its momentum)
        self.backward(loss, decision.skipped or decision.empty)
        overflowed = self.accelerator.sync_gradients and self.step(failed)
        if self.loss_scaled:  # fp16: the loss scaler skipped this update (counted in the stats)
            stats["policy/overflowed"] = torch.full((), float(overflowed), device=loss.device)
        return stats

    def backward(self, loss: torch.Tensor, skipped: bool) -> None:
        """The mini-batch's backward, or for a skipped one nothing, except at the end of a window that has
        gradients under DDP or DeepSpeed: a zero-loss backward, which adds no gradient but runs DDP's all-reduce of
        the window's gradients (without it each process would step with its own) and closes DeepSpeed's window
        (without it, they would go into the next window's update)."""
        if not skipped:
            self.accelerator.backward(loss)
            self.window_has_gradients = True
        elif self.sync_in_backward and self.accelerator.sync_gradients and self.window_has_gradients:
            self.accelerator.backward(loss * 0.0)

    def step(self, failed: Callable[[str, str], Exception]) -> bool:
        """The end of a window (``accelerator.sync_gradients``): clip, check the gradient norm, step the optimizer, and
        return whether the loss scaler skipped the update for an overflow. A window without gradients (every
        mini-batch skipped) steps nothing: a loss scaler would find no gradient to check. A non-finite norm without
        loss scaling, or the ``max_consecutive_overflows``-th overflow in a row, raises ``failed(what, advice)`` before
        the optimizer writes anything (DeepSpeed has stepped already, in the backward: it skips an update whose norm is
        not finite, and ``clip_grad_norm_`` returns that norm)."""
        has_gradients, self.window_has_gradients = self.window_has_gradients, False
        if not has_gradients:
            return False
        # clipping with an infinite bound only measures the norm (with a loss scaler: after unscaling the gradients)
        norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.max_grad_norm or math.inf)
        finite = norm is None or bool(torch.isfinite(torch.as_tensor(norm)))  # the window's host read
        overflowed = not finite and self.loss_scaled
        if not finite and not overflowed:
            self.optimizer.zero_grad()
            raise failed(f"non-finite gradient norm ({float(norm)})",
                         " Lower learning_rate, set max_grad_norm, or check the scores.")
        if self.overflows.record(overflowed):
            self.optimizer.zero_grad()
            raise failed(f"{self.overflows.limit} loss-scale overflows in a row (max_consecutive_overflows; the loss "
                         "scaler skipped those updates)",
                         " The gradients overflow float16 whatever the scale: lower learning_rate, set max_grad_norm, "
                         "check the scores, or train in bf16.")
        self.optimizer.step()  # the loss scaler skips an update that overflowed, and lowers its scale
        # a bare call, as legacy's: torch's default frees the gradients, and a user's patched zero_grad (TRL's own
        # tests keep them with set_to_none=False, to see which weights trained) still decides
        self.optimizer.zero_grad()
        return overflowed

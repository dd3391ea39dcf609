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
from collections.abc import Callable
from typing import NamedTuple

import torch

from ..runtime.precision import OverflowGuard, loss_scaled
from .stats import non_finite_count


class Decision(NamedTuple):
    """What one host read tells about a mini-batch, before its backward."""

    ratio_mean: float  # the global mini-batch's mean probability ratio
    skipped: bool  # the ratio exceeds ratio_threshold: no update from this mini-batch
    non_finite: bool  # some statistic of the mini-batch is non-finite, on some process
    skipped_flag: torch.Tensor  # 0-d float on the device: ``skipped``, for the mini-batch's stats


def minibatch_decision(stats: dict[str, torch.Tensor], ratio_threshold: float, group) -> Decision:
    """The mini-batch's :class:`Decision` from its ``stats`` (``policy/ratio_mean`` a per-process share, see
    ``PPOTrainer.loss``): one collective and one host read, on every process alike."""
    ratio = stats["policy/ratio_mean"].detach()
    dtype = torch.promote_types(ratio.dtype, torch.float32)
    summed = group.sum_across(torch.stack([ratio.to(dtype), non_finite_count(stats).to(dtype)]))  # (2,)
    ratio_mean = summed[0] / group.num_processes
    skipped = ratio_mean > ratio_threshold  # compared on the device, in the ratio's dtype
    mean, skip, bad = torch.stack([ratio_mean, skipped.to(dtype), summed[1]]).tolist()  # the one host read
    return Decision(mean, bool(skip), bad > 0, skipped.float())


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

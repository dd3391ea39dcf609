"""Mixed precision: what the trainer does differently under fp16 and bf16.

* **fp16 loss scaling** (torch's ``GradScaler`` through accelerate, or DeepSpeed's fp16 optimizer) overflows on
  purpose: the scaled gradients of an update become infinite, the scaler skips that update and lowers its scale.
  That is ordinary, not divergence: :func:`loss_scaled` says whether a run scales its loss, and
  :class:`OverflowGuard` counts the overflows in a row and says when so many came in a row that the run has
  diverged (``PPOConfig.max_consecutive_overflows``). The scaler's state is checkpointed (``ppo_core.checkpoint``).
"""

from __future__ import annotations


def loss_scaled(accelerator, model) -> bool:
    """Whether the run scales its loss (fp16): accelerate's ``GradScaler``, or a DeepSpeed engine with fp16 on."""
    if accelerator.scaler is not None:
        return True
    fp16_enabled = getattr(model, "fp16_enabled", None)  # a DeepSpeedEngine's method
    return bool(fp16_enabled()) if callable(fp16_enabled) else False


def loss_scale(accelerator, model) -> float | None:
    """The current loss scale (a host read), or None when the run scales no loss or its engine does not say."""
    if accelerator.scaler is not None:
        return float(accelerator.scaler.get_scale())
    scale = getattr(getattr(model, "optimizer", None), "loss_scale", None) if loss_scaled(accelerator, model) else None
    return float(scale) if isinstance(scale, (int, float)) else None


class OverflowGuard:
    """Loss-scale overflows in a row: each is an ordinary skipped update, ``limit`` of them in a row is divergence.

    A dynamic loss scale starts high (2^16 in torch and DeepSpeed) and halves at every overflow, so the first
    updates of a run often overflow a few times in a row; once the scale is that many halvings lower, a gradient
    that still overflows float16 is not a scaling artefact.
    """

    def __init__(self, limit: int):
        self.limit, self.in_a_row = limit, 0

    def record(self, overflowed: bool) -> bool:
        """Fold one optimizer update in; True when it is the ``limit``-th overflow in a row."""
        self.in_a_row = self.in_a_row + 1 if overflowed else 0
        return self.in_a_row >= self.limit

    def state_dict(self) -> dict[str, int]:
        return {"in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.in_a_row = int(state["in_a_row"])

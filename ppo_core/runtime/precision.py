"""Mixed precision: what the trainer does differently under fp16 and bf16.

* **fp16 loss scaling** (torch's ``GradScaler`` through accelerate, or DeepSpeed's fp16 optimizer) overflows on
  purpose: the scaled gradients of an update become infinite, the scaler skips that update and lowers its scale.
  That is ordinary, not divergence: :func:`loss_scaled` says whether a run scales its loss, and
  :class:`OverflowGuard` counts the overflows in a row and says when so many came in a row that the run has
  diverged (``PPOConfig.max_consecutive_overflows``). The scaler's state is checkpointed (``runtime.checkpoint``).
* **Frozen weights in the compute dtype**: autocast casts a matmul's float32 weight to bf16/fp16 at every use and
  caches the cast only for weights that require grad, so a frozen float32 base (LoRA, the reference) would be cast
  again at every matmul of every generated token; :func:`cast_frozen_matmul_weights` casts those weights once, in
  place: the model keeps them rounded to that dtype, and a LoRA policy merged and saved afterwards carries the rounded
  base.
* **The reference in the policy's dtype**: DeepSpeed's bf16/fp16 engines hold the policy's weights in that dtype; a
  float32 reference beside it would cost twice the memory, run float32 matmuls and show a false KL at step 0
  (:func:`floating_dtype`, used by ``ppo_core.models.reference.placed_reference``).
* **TF32**: the trainer's ``generate`` and ``step`` let float32 matmuls use TF32 on GPUs that have it
  (:func:`with_tf32`; ``PPOConfig.tf32``).
* **A half-precision policy outside DeepSpeed** trains without float32 master weights: Adam's updates below the
  dtype's resolution vanish (:func:`warn_if_half_trainable`; ``from_pretrained`` loads float32 by default).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from .utils import tf32_matmuls

HALF = (torch.float16, torch.bfloat16)
_MATMUL_MODULES = (nn.Linear, Conv1D)  # weights that autocast only ever feeds to a matmul (linear, addmm)


def compute_dtype(accelerator) -> torch.dtype | None:
    """The dtype accelerate's autocast computes in (bf16 or fp16), or None without autocast (float32, or DeepSpeed,
    whose engine holds the weights in its dtype instead)."""
    if not accelerator.native_amp:
        return None
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)


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


def cast_frozen_matmul_weights(model: nn.Module, dtype: torch.dtype, keep: list[nn.Parameter] = ()) -> int:
    """Cast to ``dtype``, in place, the frozen float32 weights and biases of ``model``'s ``nn.Linear`` and GPT-2
    ``Conv1D`` layers; return how many tensors were cast.

    Under autocast to ``dtype`` every matmul casts these to ``dtype`` anyway, so its result is the same bits; the
    cast is simply done once instead of at every use. A tensor that another kind of module also owns (an embedding
    tied to the LM head: the lookup would then return ``dtype``) and those in ``keep`` (what is read outside
    autocast, e.g. the LM head by the whole-vocabulary KL) keep their dtype.
    """
    owners: dict[int, list[nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    kept = {id(p) for p in keep}
    cast = 0
    for param in {id(p): p for p in model.parameters()}.values():
        matmul_only = all(isinstance(m, _MATMUL_MODULES) for m in owners.get(id(param), [None]))
        if (param.requires_grad or param.dtype != torch.float32 or not matmul_only or id(param) in kept):
            continue
        param.data = param.data.to(dtype)
        cast += 1
    return cast


def prepare_dtypes(accelerator, policy: nn.Module, reference: nn.Module | None, masters: bool = False) -> None:
    """Before ``accelerator.prepare``: under autocast, the frozen matmul weights of the value-head models ``policy`` and
    ``reference`` (None: the PEFT policy's) in the compute dtype, their LM heads excepted
    (:func:`cast_frozen_matmul_weights`); outside DeepSpeed and without ``masters`` (an optimizer that keeps float32
    masters: ``PPOConfig.weights_dtype``), a warning if the policy trains half-precision weights."""
    dtype = compute_dtype(accelerator)
    for model in (policy, reference) if dtype is not None else ():
        if model is not None:
            cast_frozen_matmul_weights(model, dtype, keep=model.lm_head_parameters())
    if accelerator.state.deepspeed_plugin is None and not masters:  # DeepSpeed keeps float32 masters in its optimizer
        warn_if_half_trainable(policy)


def floating_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of ``model``'s first floating-point parameter (None: it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def warn_if_half_trainable(model: nn.Module) -> None:
    """Warn when ``model`` trains half-precision weights itself (outside DeepSpeed, which keeps float32 master weights
    in its optimizer): Adam then writes every update into bf16/fp16, and those below its resolution vanish."""
    dtypes = sorted({str(p.dtype) for p in model.parameters() if p.requires_grad and p.dtype in HALF})
    if dtypes:
        warnings.warn(f"PPOTrainer: the policy trains {'/'.join(dtypes)} weights, with no float32 master copy: "
                      "updates below their resolution (common at learning rates around 1e-5) are lost. Load it in "
                      "float32 (ppo_core's from_pretrained does by default) and set accelerator_kwargs="
                      "{'mixed_precision': 'bf16'} to compute in bf16, or set weights_dtype='bfloat16' to train bf16 "
                      "weights through float32 masters.", stacklevel=3)


def with_tf32(method: Callable) -> Callable:
    """Decorate a ``PPOTrainer`` method: it runs within :func:`~ppo_core.runtime.utils.tf32_matmuls` (``config.tf32`` on
    ``self.current_device``), so torch's matmul precision is as it was once the method returns."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with tf32_matmuls(self.config.tf32, self.current_device):
            return method(self, *args, **kwargs)

    return run

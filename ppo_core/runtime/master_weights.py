"""Half-precision weights trained through float32 master copies (``PPOConfig.weights_dtype``).

Autocast over float32 weights casts each weight to bf16 at every use: on a GPU those casts are thousands of small
kernels a step, and the weights take twice the memory they compute in. Large-model trainers hold the weights in bf16
instead and keep a float32 *master* copy of each in the optimizer (DeepSpeed's and Megatron's bf16 optimizers, FSDP's
mixed precision): the passes compute in bf16 with nothing to cast, and Adam's updates, most of them far below bf16's
resolution at learning rates around 1e-5 (bf16 keeps 8 bits of mantissa), accumulate in float32 until they show.

:class:`MasterAdam` and :class:`MasterAdamW` are torch's Adam and AdamW over those masters: ``step`` takes each
weight's gradient onto its master in float32, updates the masters (torch's fused kernel where the device has one),
and writes them back into the weights, rounded to nearest. A float32 weight beside them (the value head) is its own
master, updated in place. Their ``state_dict`` carries the masters, so a run resumed from a checkpoint continues from
the float32 values, not from the rounded weights.
"""

from __future__ import annotations

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from .precision import HALF


class MasterWeights:
    """The masters' bookkeeping, mixed in before a torch optimizer class (``class MasterSGD(MasterWeights,
    torch.optim.SGD)``): the optimizer's parameters are the masters, its ``weights`` the tensors the model computes
    with. See the module's docstring.

    The optimizer may be built before the model is cast to bf16 and moved to its device (the seed's loop builds it
    before the trainer, which does both under ``weights_dtype``): a weight cast to half precision before the first
    step gets its master then, and the masters follow their weights' devices."""

    def __init__(self, params, **kwargs):
        self.weights = [p for p in params if p.requires_grad]
        # a half weight's master is a float32 copy; a float32 weight is its own
        self.masters = [w.detach().float().clone() if w.dtype in HALF else w for w in self.weights]
        super().__init__(self.masters, **kwargs)

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(weight, master) for the half weights: those with a master of their own."""
        self._adopt_cast_weights()
        return [(w, m) for w, m in zip(self.weights, self.masters) if m is not w]

    def _adopt_cast_weights(self) -> None:
        """A master for each weight that was float32 (its own master) when the optimizer was built and is half now,
        in its place in the param groups; a ValueError if the optimizer has stepped it in float32 already."""
        for i, (w, m) in enumerate(zip(self.weights, self.masters)):
            if m is w and w.dtype in HALF:
                if self.state.get(w):
                    raise ValueError(f"{type(self).__name__}: weight {i} was cast to {w.dtype} after the optimizer "
                                     "stepped it in float32; cast the model before its first step.")
                self.masters[i] = w.detach().float().clone()
                for group in self.param_groups:
                    group["params"] = [self.masters[i] if p is w else p for p in group["params"]]

    def _follow_weights(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Masters (of ``pairs``, :meth:`_pairs`') onto their weights' devices (the same tensors, so the param groups
        and state still hold them), and torch's fused kernel for a group that chose no kernel and whose masters are on
        one device that has it."""
        for w, m in pairs:
            if m.device != w.device:
                m.data = m.data.to(w.device)
        fused_devices = _get_fused_kernels_supported_devices()
        for group in self.param_groups:
            kinds = {p.device.type for p in group["params"]}
            chose = group.get("fused") is not None or group.get("foreach")
            if not chose and len(kinds) == 1 and kinds <= set(fused_devices):
                group["fused"] = True

    @torch.no_grad()
    def step(self, closure=None):
        pairs = self._pairs()
        self._follow_weights(pairs)
        for w, m in pairs:
            m.grad = None if w.grad is None else w.grad.float()
        loss = super().step(closure)
        if pairs:
            torch._foreach_copy_([w for w, _ in pairs], [m for _, m in pairs])  # rounded to nearest
        for _, m in pairs:
            m.grad = None  # the weights' gradients are the ones a caller clears and reads
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for w in self.weights:
            if w.grad is not None:
                if set_to_none:
                    w.grad = None
                else:
                    w.grad.zero_()
        super().zero_grad(set_to_none)

    def state_dict(self) -> dict:
        """torch's state dict plus ``"masters"``: the float32 masters of the half weights, in the weights' order."""
        self._adopt_cast_weights()
        state = super().state_dict()
        state["masters"] = [m for _, m in self._pairs()]
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, then the masters (and from them the weights) from ``state_dict["masters"]``; a state dict of a
        plain optimizer (no masters) keeps the masters the weights' values."""
        state_dict = dict(state_dict)
        saved = state_dict.pop("masters", None)
        self._adopt_cast_weights()  # torch's state goes onto the masters, not onto weights cast since construction
        super().load_state_dict(state_dict)
        pairs = self._pairs()
        if saved is None:
            return
        if len(saved) != len(pairs):
            raise ValueError(f"{type(self).__name__}.load_state_dict: the state holds {len(saved)} masters, the "
                             f"optimizer has {len(pairs)} half-precision weights; was it saved for another model?")
        with torch.no_grad():
            for (w, m), s in zip(pairs, saved):
                m.copy_(s)
                w.copy_(m)


class MasterAdam(MasterWeights, torch.optim.Adam):
    """``torch.optim.Adam`` (legacy TRL's optimizer, ppo_core's default) over float32 masters of half weights."""


class MasterAdamW(MasterWeights, torch.optim.AdamW):
    """``torch.optim.AdamW`` over float32 masters of half weights."""


def has_masters(optimizer) -> bool:
    """Whether ``optimizer`` (or the optimizer accelerate wrapped) keeps float32 masters of half weights."""
    return isinstance(getattr(optimizer, "optimizer", optimizer), MasterWeights)

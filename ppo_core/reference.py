"""The reference policy of the KL penalty: which model it is, where it lives, and how a pass runs it.

Without a ``ref_model`` the reference is the policy with its adapter disabled when the policy is a PEFT model (one
copy of the base weights; only the adapter and the value head are trained), else a frozen copy of the policy that
shares its first ``num_shared_layers`` layers (``modeling.create_reference_model``). It is never optimised. Under
ZeRO-3 it is sharded as the policy is, in a DeepSpeed engine without optimizer (``zero.prepare_reference``);
elsewhere it is whole on the process's device.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel

from .modeling import (
    AutoModelForCausalLMWithValueHead,
    AutoModelForSeq2SeqLMWithValueHead,
    PreTrainedModelWrapper,
    create_reference_model,
)
from .zero import check_reference_copy, prepare_reference


def frozen_reference(model: PreTrainedModelWrapper, ref_model: torch.nn.Module | None, num_shared_layers: int | None,
                     zero3: bool) -> torch.nn.Module | None:
    """The frozen, eval-mode reference of the policy ``model``, or None for a PEFT policy without ``ref_model`` (its
    reference is the policy itself, adapter disabled: see :func:`reference_policy`). A plain transformers
    ``ref_model`` is wrapped in the policy's value-head class. Call it before the policy is sharded (``zero3``)."""
    if ref_model is None and model.is_peft_model:
        if num_shared_layers is not None:
            warnings.warn("PPOTrainer: num_shared_layers is ignored for a PEFT policy (its reference is the "
                          "adapter-disabled model, which shares every base weight).")
    elif ref_model is None:
        if zero3:
            check_reference_copy(model, num_shared_layers)
        ref_model = create_reference_model(model, num_shared_layers=num_shared_layers)
    elif num_shared_layers is not None:
        warnings.warn("PPOTrainer: num_shared_layers is ignored when a ref_model is passed.")
    if isinstance(ref_model, PreTrainedModel):
        ref_model = (AutoModelForSeq2SeqLMWithValueHead if model.is_encoder_decoder
                     else AutoModelForCausalLMWithValueHead)(ref_model)
    if ref_model is not None:
        ref_model.requires_grad_(False).eval()
    return ref_model


def placed_reference(ref_model: torch.nn.Module | None, accelerator, zero3: bool):
    """The frozen reference on this process: whole on its device (DDP, ZeRO-2, whose policy weights are whole
    too), or under ZeRO-3 sharded as the policy is (a DeepSpeed engine without optimizer); None stays None."""
    if ref_model is None:
        return None
    if zero3:
        return prepare_reference(ref_model, accelerator.state.deepspeed_plugin.deepspeed_config)
    return ref_model.to(accelerator.device)


@contextlib.contextmanager
def reference_policy(policy: torch.nn.Module, ref_model: torch.nn.Module | None,
                     unwrap: Callable[[torch.nn.Module], torch.nn.Module]) -> Iterator[torch.nn.Module]:
    """The model a reference pass runs: ``ref_model``, or (None) the prepared ``policy`` with its PEFT adapter
    disabled for the block; ``unwrap`` gives the value-head model inside ``policy``'s wrappers."""
    if ref_model is not None:
        yield ref_model
        return
    with unwrap(policy).pretrained_model.disable_adapter():
        yield policy

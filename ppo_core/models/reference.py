"""The reference policy of the KL penalty: which model it is, where it lives, and how a pass runs it.

Without a ``ref_model`` the reference is the policy with its adapter disabled when the policy is a PEFT model (one
copy of the base weights; only the adapter and the value head are trained), else a frozen copy of the policy that
shares its first ``num_shared_layers`` layers (:func:`create_reference_model`). It is never optimised. Under
ZeRO-3 it is sharded as the policy is, in a DeepSpeed engine without optimizer (``zero.prepare_reference``);
elsewhere it is whole on the process's device.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

from ..runtime.zero import check_reference_copy, prepare_reference
from .modeling import (
    AutoModelForCausalLMWithValueHead,
    AutoModelForSeq2SeqLMWithValueHead,
    PreTrainedModelWrapper,
)

# Where the i-th transformer block lives, per architecture family (legacy LAYER_PATTERNS).
LAYER_PATTERNS = ("transformer.h.{layer}", "model.decoder.layers.{layer}", "gpt_neox.layers.{layer}",
                  "model.layers.{layer}", "transformer.layers.{layer}", "model.transformer.h.{layer}")


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


def placed_reference(ref_model: torch.nn.Module | None, accelerator, zero3: bool, dtype: torch.dtype | None = None):
    """The frozen reference on this process: whole on its device (DDP, ZeRO-2, whose policy weights are whole
    too), or under ZeRO-3 sharded as the policy is (a DeepSpeed engine without optimizer); None stays None.

    ``dtype``: the floating dtype the policy's weights have in their engine (DeepSpeed's bf16 or fp16 engines cast
    them; ZeRO-3 casts the reference's in its own engine): a float32 reference beside a bf16 policy would cost twice
    the memory and, computing in float32, give a KL that is not zero at step 0 although both hold the same weights.
    """
    if ref_model is None:
        return None
    if zero3:
        return prepare_reference(ref_model, accelerator.state.deepspeed_plugin.deepspeed_config)
    return ref_model.to(accelerator.device) if dtype is None else ref_model.to(accelerator.device, dtype)


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


def _shared_parameter_names(model: nn.Module, num_shared_layers: int, pattern: str | None) -> list[str]:
    """Names of the parameters before the first block ``num_shared_layers`` (embeddings and blocks < k)."""
    names = [n for n, _ in model.named_parameters()]
    candidates = [pattern] if pattern else list(LAYER_PATTERNS)
    for candidate in candidates:
        prefix = candidate.format(layer=num_shared_layers) + "."
        first = next((i for i, n in enumerate(names) if prefix in n), None)
        if first is not None:
            return names[:first]
    raise ValueError(f"create_reference_model: no layer {num_shared_layers} found with pattern "
                     f"{pattern or LAYER_PATTERNS}; pass pattern='...{{layer}}' matching the model's block names "
                     f"(e.g. {names[len(names) // 2]!r}) or fewer shared layers.")


def create_reference_model(model: nn.Module, num_shared_layers: int | None = None,
                           pattern: str | None = None) -> nn.Module:
    """A frozen, eval-mode copy of ``model`` for the KL penalty.

    With ``num_shared_layers=k``, the embeddings and the first ``k`` blocks are *the same tensors* in
    both models (one copy in memory) and are frozen in the trained model too, as the legacy function
    intended. (Legacy TRL froze them but deep-copied them anyway, duplicating the memory; fixed here.)
    """
    if num_shared_layers is None:
        shared: list[str] = []
    else:
        shared = _shared_parameter_names(model, num_shared_layers, pattern)
    params = dict(model.named_parameters())
    # deepcopy consults the memo first: pre-seeding it with the shared Parameters makes the copy reuse them.
    memo = {id(params[name]): params[name] for name in shared}
    ref_model = copy.deepcopy(model, memo)
    for name in shared:
        params[name].requires_grad_(False)
    for param in ref_model.parameters():
        param.requires_grad_(False)
    return ref_model.eval()

"""The policy made ready for PPO, in place, before the trainer wraps it: pad token, dropout, gradient checkpointing,
and the value head of a critic-free estimator."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from .modeling import PreTrainedModelWrapper


def prepare_for_training(model: PreTrainedModelWrapper, tokenizer, no_dropout: bool, gradient_checkpointing: bool,
                         uses_critic: bool, weights_dtype: str | None = None) -> None:
    """``tokenizer`` gets its EOS token as pad token where it has none (warned); ``model`` loses its dropout
    (``no_dropout``: the first ratio of every step is then exactly 1), gets gradient checkpointing where asked,
    without a critic a frozen value head: neither used nor trained, and frozen so that DDP does not wait for its
    gradient; with ``weights_dtype`` (``PPOConfig``'s) its LM's floating-point weights in that dtype, the value head
    kept float32 (its small weights and the values' precision cost nothing to keep)."""
    if weights_dtype is not None:
        model.pretrained_model.to(getattr(torch, weights_dtype))
    if tokenizer.pad_token_id is None:
        warnings.warn("PPOTrainer: the tokenizer has no pad token; using its EOS token as pad token.", stacklevel=3)
        tokenizer.pad_token = tokenizer.eos_token
    if no_dropout:
        disable_dropout(model)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    if not uses_critic:
        model.v_head.requires_grad_(False)


def disable_dropout(model: nn.Module) -> None:
    """Zero every dropout: ``nn.Dropout`` modules and the float rates that attention implementations
    read at call time (e.g. Llama's and GPT-NeoX's ``attention_dropout``)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name, value in vars(module).items():
            if "dropout" in name and isinstance(value, float):
                setattr(module, name, 0.0)

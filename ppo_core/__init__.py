"""ppo_core: TRL's legacy PPOTrainer API (generate -> score anything -> step), correct and fast,
on current transformers and torch.

The names below are imported on first use, so that ``from ppo_core import PPOConfig`` (or validating a
params file) does not pay for importing transformers and accelerate.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "PPOConfig": "config", "LengthSampler": "core", "PPOTrainer": "trainer", "set_seed": "utils",
    "AutoModelForCausalLMWithValueHead": "modeling", "AutoModelForSeq2SeqLMWithValueHead": "modeling",
    "PreTrainedModelWrapper": "modeling", "SUPPORTED_ARCHITECTURES": "modeling", "create_reference_model": "reference",
    "register_estimator": "registry",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"

if TYPE_CHECKING:
    from .config import PPOConfig
    from .core import LengthSampler
    from .modeling import (
        SUPPORTED_ARCHITECTURES,
        AutoModelForCausalLMWithValueHead,
        AutoModelForSeq2SeqLMWithValueHead,
        PreTrainedModelWrapper,
    )
    from .reference import create_reference_model
    from .registry import register_estimator
    from .trainer import PPOTrainer
    from .utils import set_seed


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ppo_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

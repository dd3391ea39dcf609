"""ppo_core: TRL's legacy PPOTrainer API (generate -> score anything -> step), correct and fast,
on current transformers and torch.

The package in layers (docs/library.md, "ppo_core's layout"; ``tests/test_layers.py`` holds each to its allowed
imports):
``algo`` the math (pure tensor functions, the estimators' registry), ``runtime`` the processes, ZeRO, precision
and checkpoints, ``models`` the value-head models, log-probabilities, sampling and the reference, ``step`` what one
``step()`` runs on them (the rollout passes, the update, the stats, the data), and on top ``config``, ``trainer``
and the legacy surface (``legacy``, ``core``).

The names below are imported on first use, so that ``from ppo_core import PPOConfig`` (or validating a
params file) does not pay for importing transformers and accelerate. The modules' paths from before the layers
(``ppo_core.ppo_math``, ``ppo_core.modeling``, ...) still import, as the same module objects (``_MOVED``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
from typing import TYPE_CHECKING

_EXPORTS = {
    "PPOConfig": "config", "LengthSampler": "core", "PPOTrainer": "trainer", "set_seed": "runtime.utils",
    "AutoModelForCausalLMWithValueHead": "models.modeling", "AutoModelForSeq2SeqLMWithValueHead": "models.modeling",
    "PreTrainedModelWrapper": "models.modeling", "SUPPORTED_ARCHITECTURES": "models.modeling",
    "create_reference_model": "models.reference", "register_estimator": "algo.registry",
    "response_logprobs": "step.rollout",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"

# a module's path before the package had layers -> its path now
_MOVED = {
    **{name: f"algo.{name}" for name in ("advantages", "choices", "estimators", "kl_control", "ppo_math", "registry")},
    **{name: f"models.{name}" for name in ("adapters", "cpu_attention", "generation", "logprobs", "modeling",
                                           "reference", "reward_adapter", "weights")},
    **{name: f"runtime.{name}" for name in ("checkpoint", "distributed", "precision", "utils", "zero")},
    **{name: f"step.{name}" for name in ("rollout", "stats", "update")},
}

if TYPE_CHECKING:
    from .algo.registry import register_estimator
    from .config import PPOConfig
    from .core import LengthSampler
    from .models.modeling import (
        SUPPORTED_ARCHITECTURES,
        AutoModelForCausalLMWithValueHead,
        AutoModelForSeq2SeqLMWithValueHead,
        PreTrainedModelWrapper,
    )
    from .models.reference import create_reference_model
    from .runtime.utils import set_seed
    from .step.rollout import response_logprobs
    from .trainer import PPOTrainer


def __getattr__(name: str):
    if name in _MOVED:  # ``ppo_core.ppo_math`` as an attribute, before any import of it
        return importlib.import_module(f"{__name__}.{name}")
    if name not in _EXPORTS:
        raise AttributeError(f"module 'ppo_core' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``ppo_core.<old name>`` as the module now at ``ppo_core.<layer>.<name>`` (the same object, so that a
    patch through either path reaches the code), on first use: importing ``ppo_core`` imports none of them."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, name = fullname.rpartition(".")
        if prefix != __name__ or name not in _MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def __init__(self):
        self._specs = {}

    def create_module(self, spec):
        module = importlib.import_module(f"{__name__}.{_MOVED[spec.name.rpartition('.')[2]]}")
        self._specs[module.__name__] = module.__spec__  # the import machinery sets the alias's next
        return module

    def exec_module(self, module):
        # the module ran when it was imported under its own path; it keeps its own spec (its relative imports
        # resolve against it)
        module.__spec__ = self._specs.pop(module.__name__)


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())

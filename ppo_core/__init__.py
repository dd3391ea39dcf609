"""ppo_core: TRL's legacy PPOTrainer API (generate -> score anything -> step), correct and fast,
on current transformers and torch."""

from .config import PPOConfig
from .core import LengthSampler
from .modeling import (AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, PreTrainedModelWrapper,
                       create_reference_model)
from .trainer import PPOTrainer
from .utils import set_seed

__all__ = ["AutoModelForCausalLMWithValueHead", "AutoModelForSeq2SeqLMWithValueHead", "LengthSampler", "PPOConfig",
           "PPOTrainer", "PreTrainedModelWrapper", "create_reference_model", "set_seed"]
__version__ = "0.1.0"

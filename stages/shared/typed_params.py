"""`Params`: a params file typed, section by section (stages/shared/param_sections.py), and its `ppo` section made into
ppo_core's PPOConfig (`Params.ppo_config`: the labels the pipeline fills, the seed, the length limit, the precision).
`load_params` (stages/shared/params.py) reads and checks a file into one; these names import from there too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ppo_core.fields import ConfigError
from stages.shared import auto
from stages.shared.param_sections import (
    ChatParams,
    CheckpointParams,
    DataParams,
    EvaluateParams,
    GenerationParams,
    ModelParams,
    NumericsParams,
    RewardParams,
    ScorerParams,
    SFTParams,
    TokenizeParams,
    WatchParams,
)
from stages.shared.runtime import ParamsError

if TYPE_CHECKING:
    from ppo_core.config import PPOConfig

# Legacy PPOConfig fields that only label a run: the pipeline decides what they name, so a value of a user's own
# would read as if it acted. Each: the artifact the ppo stage reads, the param that picks what it holds (a label
# naming either is right), and what the stage does.
PIPELINE_LABELS = {
    "model_name": ("data/models/sft", "model.name_or_path", "starts from the sft stage's model (model.name_or_path "
                   "picks what sft starts from)"),
    "reward_model": ("data/models/reward", "scorer.name", "scores with scorer.source (its reward model is the "
                     "reward stage's)"),
    "query_dataset": ("data/tokenized/train.parquet", "data.prompts.source", "draws its prompts from the tokenize "
                      "stage's (data.prompts.source picks them)"),
}


SECTIONS: dict[str, type] = {
    "seed": int,
    "data": DataParams,
    "model": ModelParams,
    "chat": ChatParams,
    "sft": SFTParams,
    "reward": RewardParams,
    "tokenize": TokenizeParams,
    "scorer": ScorerParams,
    "generation": GenerationParams,
    "ppo": dict,
    "evaluate": EvaluateParams,
    "watch": WatchParams,
    "checkpoint": CheckpointParams,
    "numerics": NumericsParams,
}


@dataclass(frozen=True)
class Params:
    path: Path
    """The params file these values came from (named in error messages)."""
    seed: int
    """The seed of a run: each stage seeds once from it (the ppo stage too, unless ppo.seed is set)."""
    data: DataParams
    model: ModelParams
    chat: ChatParams
    sft: SFTParams
    reward: RewardParams
    tokenize: TokenizeParams
    scorer: ScorerParams
    generation: GenerationParams
    ppo: dict[str, Any]
    """The section as the file gives it: PPOConfig keyword arguments, what the checkpoint fingerprints record and
    compare (stages/shared/resume.py) as dvc.yaml tracks them. The stages use `ppo_config`, built from it."""
    evaluate: EvaluateParams
    watch: WatchParams
    checkpoint: CheckpointParams
    numerics: NumericsParams

    @functools.cached_property
    def ppo_config(self) -> PPOConfig:
        """The `ppo` section as ppo_core's PPOConfig, built and checked once (by `load_params`, for a loaded file):
        `ppo.seed: null` is the top-level seed, `ppo.max_completion_length: null` generation.max_new_tokens (DAPO's
        L_max: the responses' length limit), `ppo.temperature: null` generation.temperature (another is refused: the
        stage samples at that one), and model.mixed_precision accelerate's `mixed_precision`. The fields
        PPOConfig derives (`DERIVED`) are refused: the trainer would overwrite them. A ParamsError names the file."""
        return ppo_config(self)


def ppo_config(params: Params) -> PPOConfig:
    """`Params.ppo_config`'s value (see there)."""
    from ppo_core.config import DERIVED, PPOConfig

    derived = next((key for key in params.ppo if key in DERIVED), None)
    if derived is not None:
        raise ParamsError(f"{params.path}: ppo.{derived} is derived ({DERIVED[derived]}), not set; remove it")
    kwargs = dict(params.ppo)
    for key, (path, picker, what) in PIPELINE_LABELS.items():
        given, picked = kwargs.get(key), functools.reduce(getattr, picker.split("."), params)
        if given is None:
            kwargs[key] = path
        elif str(given) not in (path, str(picked)):
            raise ParamsError(f"{params.path}: ppo.{key} is {given!r}, but the ppo stage {what}; remove ppo.{key} "
                              f"or set it to {path}")
    if kwargs.get("seed") is None:
        kwargs["seed"] = params.seed
    if kwargs.get("max_completion_length") is None:
        kwargs["max_completion_length"] = params.generation.max_new_tokens
    sampled = sampled_temperature(params.generation)
    if kwargs.get("temperature") is None:  # step() scores at the temperature the stage samples at
        kwargs["temperature"] = sampled
    elif kwargs["temperature"] != sampled:
        raise ParamsError(f"{params.path}: ppo.temperature is {kwargs['temperature']}, but the ppo stage samples at "
                          f"{sampled} (generation.temperature, do_sample {params.generation.do_sample}); remove "
                          f"ppo.temperature or set it to {sampled}")
    # model.mixed_precision auto resolved for this machine (stages/shared/auto.py); the rollout's auto is PPOConfig's
    precision = auto.mixed_precision(params.model.mixed_precision, params.numerics.kernels, auto.machine())[0]
    if precision is not None:  # accelerate's autocast, as the legacy accelerator_kwargs would ask it
        given = (kwargs.get("accelerator_kwargs") or {}).get("mixed_precision", precision)
        if given != precision:
            raise ParamsError(f"{params.path}: ppo.accelerator_kwargs.mixed_precision ({given}) differs from "
                              f"model.mixed_precision ({precision}); set one of them")
        kwargs["accelerator_kwargs"] = {**(kwargs.get("accelerator_kwargs") or {}), "mixed_precision": precision}
    try:
        return PPOConfig(**kwargs)
    except ConfigError as err:
        raise ParamsError(f"{params.path}: {err.message('ppo.')}") from None


def sampled_temperature(generation: GenerationParams) -> float:
    """The temperature the stages sample at, what their log-probabilities divide the logits by: 1.0 when greedy."""
    return generation.temperature if generation.do_sample else 1.0

"""PEFT adapters (LoRA and other layer-injecting tuners) on the value-head models, with ``peft`` optional.

A PEFT policy keeps one copy of the base weights: the adapter is trained, and the reference policy is the
same model inside ``disable_adapter()``. ``peft`` is imported only when an adapter is asked for, so the
engine runs without it (``pip install peft``, or the project's ``lora`` extra).
"""

from __future__ import annotations

import copy
import json
import os
import sys

from torch import nn

ADAPTER_CONFIG_FILE = "adapter_config.json"  # what peft's save_pretrained writes next to the adapter weights


def require_peft(where: str):
    """The ``peft`` module, or a ValueError saying how to install it."""
    try:
        import peft
    except ImportError as err:
        raise ValueError(f"{where} needs the 'peft' package: pip install peft (or the project's 'lora' extra: "
                         "pip install -e '.[lora]').") from err
    return peft


def is_peft_model(model) -> bool:
    """True for a ``peft.PeftModel``. Without ``peft`` imported, nothing can be one (and it is not imported)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def is_adapter_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, ADAPTER_CONFIG_FILE))


def add_adapter(model, peft_config):
    """``get_peft_model(model, peft_config)``: a fresh adapter on a transformers model (base weights frozen)."""
    peft = require_peft("from_pretrained(..., peft_config=...)")
    if not isinstance(peft_config, peft.PeftConfig):
        raise ValueError("from_pretrained: peft_config must be a peft.PeftConfig (e.g. LoraConfig(r=16, "
                         f"lora_alpha=16)), got {type(peft_config).__name__}.")
    if is_peft_model(model):
        raise ValueError("from_pretrained: the model already has a PEFT adapter; drop peft_config to train it, "
                         "or pass the base model to start a new adapter.")
    return peft.get_peft_model(model, peft_config)


def load_adapter(parent_class, path: str, is_trainable: bool, *model_args, **kwargs):
    """The base model named in ``path/adapter_config.json``, loaded with ``parent_class``, with the adapter."""
    peft = require_peft(f"Loading the adapter in {path}")
    with open(os.path.join(path, ADAPTER_CONFIG_FILE)) as fh:
        base_path = json.load(fh).get("base_model_name_or_path")
    if not base_path:
        raise ValueError(f"{os.path.join(path, ADAPTER_CONFIG_FILE)} names no base_model_name_or_path; load the base "
                         f"model yourself and pass peft.PeftModel.from_pretrained(base, {path!r}).")
    base = parent_class.from_pretrained(base_path, *model_args, **kwargs)
    return peft.PeftModel.from_pretrained(base, path, is_trainable=is_trainable)


def check_supported(model) -> nn.Module:
    """The transformers model inside a ``PeftModel``, after checking that ppo_core can train its adapter.

    ppo_core calls the transformer body and applies the LM head itself (``ppo_core.models.logprobs``), so the
    adapter must live in the body's layers: prompt-learning methods (which act in ``PeftModel.forward``)
    and adapters on the LM head itself are rejected.
    """
    require_peft("A PEFT policy")
    from peft.tuners.tuners_utils import BaseTunerLayer
    try:  # peft >= 0.15: the base of ModulesToSaveWrapper and its siblings
        from peft.utils.other import AuxiliaryTrainingWrapper as ModuleWrapper
    except ImportError:
        from peft.utils.other import ModulesToSaveWrapper as ModuleWrapper

    config = model.active_peft_config
    if config.is_prompt_learning:
        raise ValueError(f"PEFT policy: prompt-learning adapters ({config.peft_type}) are not supported; use an "
                         "adapter on the model's layers, e.g. LoraConfig.")
    inner = model.get_base_model()
    head = inner.get_output_embeddings()
    if isinstance(head, (BaseTunerLayer, ModuleWrapper)):
        raise ValueError(f"PEFT policy: an adapter on the LM head ({type(head).__name__}) is not supported; leave the "
                         "LM head out of target_modules and modules_to_save (adapt the transformer blocks).")
    return inner


def merged_copy(model) -> nn.Module:
    """A plain transformers model with the adapter merged into a *copy* of the base weights.

    ``model`` is untouched (its base weights stay bit-identical, the reference policy depends on them);
    the copy costs the memory of a second set of weights while it lives. A model of mixed float dtypes (under
    autocast the trainer keeps frozen matmul weights in bf16 or fp16: ``precision.cast_frozen_matmul_weights``) is
    merged and returned in float32, the dtype of its adapter and of the weights it trains.
    """
    merged = copy.deepcopy(model)
    if len({p.dtype for p in merged.parameters() if p.is_floating_point()}) > 1:
        merged.float()
    return merged.merge_and_unload()


SET_VALUED = ("target_modules", "exclude_modules", "modules_to_save")  # sets in peft's configs, lists in its JSON


def canonical_adapter_configs(directory: str) -> None:
    """Rewrite every ``adapter_config.json`` under ``directory`` with its set-valued fields sorted.

    peft keeps ``target_modules`` as a Python set and writes it in the set's iteration order, which for strings
    depends on the process's hash seed (``PYTHONHASHSEED``, random per process): the same adapter saved by two runs
    gave two files, so a LoRA run's outputs never reproduced byte for byte. Written back as peft writes it
    (``json.dumps(indent=2, sort_keys=True)``).
    """
    for root, _, files in os.walk(directory):
        if "adapter_config.json" not in files:
            continue
        path = os.path.join(root, "adapter_config.json")
        with open(path) as fh:
            config = json.load(fh)
        for key in SET_VALUED:
            if isinstance(config.get(key), list) and all(isinstance(v, str) for v in config[key]):
                config[key] = sorted(config[key])
        with open(path, "w") as fh:
            fh.write(json.dumps(config, indent=2, sort_keys=True))

"""The value-head models' weights: how ``from_pretrained`` loads them, what their state dicts hold, where the value
head is saved, and pushing what ``save_pretrained`` writes.

* **Loading kwargs** (:func:`loading_kwargs`): float32 master weights unless the caller asks for a dtype (``dtype``,
  or legacy TRL's ``torch_dtype``); quantised loading (``load_in_8bit``, ``load_in_4bit``, ``quantization_config``)
  is refused with one error saying what to do instead.
* **State-dict keys** (:class:`LegacyStateDict`, mixed into the value-head models; :func:`unprefixed`,
  :func:`prefixed`): legacy TRL's ``state_dict`` held the wrapped transformers model's own keys plus ``v_head.*``,
  where ``nn.Module`` would put ``pretrained_model.`` before the model's. The value-head models give the legacy keys
  and load either form.
* **The value head on disk** (:data:`VALUE_HEAD_FILE`, :func:`save_value_head`, :func:`load_value_head_state`): ours
  beside the model's weights, legacy TRL's inside them.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch

VALUE_HEAD_FILE = "value_head.safetensors"
INNER = "pretrained_model."  # the wrapped model's attribute in the value-head models, as a key prefix
HEAD = "v_head."
QUANTISED_LOADING = ("load_in_8bit", "load_in_4bit", "quantization_config")


def loading_kwargs(owner: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The transformers ``from_pretrained`` kwargs for ``kwargs`` (a copy): ``torch_dtype`` (legacy, deprecated in
    transformers 5) renamed ``dtype``, float32 unless a dtype is given, and a ValueError for quantised loading.

    Without a dtype transformers 5 loads the weights in their saved dtype, and a bf16 checkpoint would then train bf16
    weights without a float32 master copy; a dtype given (e.g. ``torch.bfloat16`` to halve the memory of a policy
    trained under DeepSpeed, or of a LoRA policy's frozen base) is the caller's choice.
    """
    kwargs = dict(kwargs)
    if "torch_dtype" in kwargs and "dtype" not in kwargs:
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    kwargs.setdefault("dtype", torch.float32)
    asked = [name for name in QUANTISED_LOADING if kwargs.get(name) not in (None, False)]
    if asked:
        raise ValueError(f"{owner}.from_pretrained: {', '.join(asked)}: quantised policies are not supported "
                         "(ppo_core trains and scores the model's own weights; bitsandbytes' 8- and 4-bit loading also "
                         "needs a CUDA GPU). Load the model unquantised, in bf16 to halve its memory "
                         "(dtype=torch.bfloat16), and train a LoRA adapter (peft_config=LoraConfig(...)): the "
                         "reference is then the same weights with the adapter disabled, held once.")
    for name in QUANTISED_LOADING:  # load_in_8bit=False and the like: transformers 5 no longer takes them
        kwargs.pop(name, None)
    return kwargs


# ---- state-dict keys -------------------------------------------------------------------------------------------
def _renamed(key: str, prefix: str, rename: Callable[[str], str]) -> str:
    """``key`` with the part after ``prefix`` renamed (unchanged when it is not under ``prefix``)."""
    return prefix + rename(key[len(prefix):]) if key.startswith(prefix) else key


def _drop_inner(rest: str) -> str:
    return rest[len(INNER):] if rest.startswith(INNER) else rest


def _add_inner(rest: str, own: tuple[str, ...]) -> str:
    return rest if rest.startswith((INNER, *own)) else INNER + rest


def heads(model) -> tuple[str, ...]:
    """The key prefixes of a value-head model's own modules beside the wrapped model: ``v_head.``, and ``score.``
    with a reward adapter (``ppo_core.models.reward_adapter``)."""
    return tuple(f"{name}." for name, _ in model.named_children() if name != INNER[:-1])


def unprefixed(state: Mapping[str, Any], prefix: str = "", into: dict | None = None) -> dict:
    """``state``, a value-head model's ``nn.Module`` state dict (its keys under ``prefix``), with the wrapped model's
    keys as the model itself names them: ``{prefix}pretrained_model.{k}`` -> ``{prefix}{k}``, the ``v_head.*`` keys
    kept; the module metadata (``_metadata``, by module name) renamed alike. Written into ``into`` when given."""
    out = OrderedDict() if into is None else into
    for key, value in state.items():
        out[_renamed(key, prefix, _drop_inner)] = value
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        if getattr(out, "_metadata", None) is None:
            out._metadata = OrderedDict()
        for name, value in metadata.items():  # "pretrained_model" itself becomes the root, as in the model's own
            out._metadata[_renamed(name + ".", prefix, _drop_inner)[:-1]] = value
    return out


def prefixed(state: dict, prefix: str, own: tuple[str, ...]) -> None:
    """The inverse of :func:`unprefixed`, in place, on the keys under ``prefix``: a key that is neither the wrapped
    model's (``pretrained_model.``) nor one of the value-head model's ``own`` modules (:func:`heads`: ``v_head.``, ...)
    gets ``pretrained_model.`` after ``prefix``. Either form (or a mix) then loads into the value-head model."""
    for key in [k for k in state if k.startswith(prefix)]:
        module_key = _renamed(key, prefix, lambda rest: _add_inner(rest, own))
        if module_key != key and module_key not in state:
            state[module_key] = state.pop(key)


def prefixed_metadata(metadata: Mapping[str, Any], own: tuple[str, ...]) -> OrderedDict:
    """The ``_metadata`` of a state dict for :func:`prefixed` (at the root): module names renamed as its keys are."""
    return OrderedDict((_add_inner(name + ".", own)[:-1] if name else INNER[:-1], value)
                       for name, value in metadata.items())


def module_keys(module, state_dict: dict, prefix: str, *_) -> None:
    """Load-state-dict pre-hook of the value-head models: their keys under ``prefix`` as ``nn.Module`` names them
    (:func:`prefixed`). It runs too when a wrapper (DDP, a DeepSpeed engine) loads its own state dict."""
    prefixed(state_dict, prefix, heads(module))


class LegacyStateDict:
    """Mixed into the value-head models (before ``nn.Module``): legacy TRL's ``state_dict`` keys, the loading of
    either form, ``post_init`` and ``push_to_hub``. Reads ``v_head`` and ``save_pretrained``."""

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """The wrapped model's state dict under its own keys (``AutoModelForCausalLM``'s, or for a PEFT policy the
        ``PeftModel``'s: base weights and adapter) plus the value head's as ``v_head.*``, as legacy TRL gave it
        (without ``nn.Module``'s ``pretrained_model.`` prefix). :meth:`load_state_dict` takes it, or the prefixed
        keys."""
        own = super().state_dict(prefix=prefix, keep_vars=keep_vars)
        return unprefixed(own, prefix, into=destination)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """``nn.Module.load_state_dict`` of a :meth:`state_dict`, of a legacy TRL one (the same keys), of the wrapped
        model's own (``strict=False`` then: no ``v_head.*``) or of one with ``pretrained_model.``-prefixed keys."""
        metadata = getattr(state_dict, "_metadata", None)
        state_dict = OrderedDict(state_dict)
        prefixed(state_dict, "", heads(self))
        if metadata is not None:
            state_dict._metadata = prefixed_metadata(metadata, heads(self))
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def post_init(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load the value head from the ``v_head.*`` entries of ``state_dict`` (the others are ignored), as legacy
        TRL's ``from_pretrained`` did with a checkpoint's weights."""
        self.v_head.load_state_dict({k[len(HEAD):]: v for k, v in state_dict.items() if k.startswith(HEAD)},
                                    strict=False)

    def push_to_hub(self, repo_id: str, **kwargs):
        """Upload what ``save_pretrained`` writes (the model and its value head, as legacy TRL pushed them) to the
        hub repository ``repo_id``: ``max_shard_size``, ``safe_serialization`` and ``merge_adapter`` go to
        ``save_pretrained``, the rest as :func:`push_saved` says."""
        saving = {k: kwargs.pop(k) for k in ("max_shard_size", "safe_serialization", "merge_adapter") if k in kwargs}
        kwargs.pop("use_temp_dir", None)  # transformers' option: a temporary directory is what is uploaded anyway
        return push_saved(lambda directory: self.save_pretrained(directory, **saving), repo_id, **kwargs)


# ---- the value head on disk --------------------------------------------------------------------------------------
def load_value_head_state(path: str) -> dict[str, torch.Tensor] | None:
    """Value head weights saved with a model: ours (``value_head.safetensors``) or TRL's legacy ones
    (``v_head.*`` keys inside the model's own weights file, possibly sharded). Local directories only."""
    if not os.path.isdir(path):
        return None
    files = [VALUE_HEAD_FILE, "model.safetensors", "pytorch_model.bin"]
    for index_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        index_file = os.path.join(path, index_name)
        if os.path.isfile(index_file):
            with open(index_file) as fh:
                weight_map = json.load(fh)["weight_map"]
            files += sorted({shard for key, shard in weight_map.items() if key.startswith(HEAD)})
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(file, framework="pt") as fh:
                state = {k: fh.get_tensor(k) for k in fh.keys() if k.startswith(HEAD)}
        else:
            state = {k: v for k, v in torch.load(file, map_location="cpu", weights_only=True).items()
                     if k.startswith(HEAD)}
        if state:
            return {k[len(HEAD):]: v for k, v in state.items()}
    return None


def save_value_head(v_head: torch.nn.Module, directory: str) -> None:
    """``v_head``'s weights as :data:`VALUE_HEAD_FILE` in ``directory``, under legacy's keys (``v_head.summary.*``),
    on the CPU: what :func:`load_value_head_state` reads back."""
    from safetensors.torch import save_file

    state = {f"{HEAD}{k}": v.detach().contiguous().cpu() for k, v in v_head.state_dict().items()}
    save_file(state, os.path.join(directory, VALUE_HEAD_FILE))


def push_saved(save: Callable[[str], Any], repo_id: str, upload: bool = True, **kwargs) -> Any:
    """Upload to the hub repository ``repo_id`` (created if missing) what ``save(directory)`` writes; with
    ``upload=False`` only run ``save`` (the processes other than the main one, when ``save`` is a collective).

    ``token`` and ``private`` go to ``HfApi.create_repo``, ``token`` and the rest (``commit_message``, ``revision``,
    ``create_pr``, ...) to ``HfApi.upload_folder``.
    """
    from huggingface_hub import HfApi

    token, private = kwargs.pop("token", None), kwargs.pop("private", None)
    with tempfile.TemporaryDirectory() as directory:
        save(directory)
        if not upload:
            return None
        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        return api.upload_folder(repo_id=repo_id, folder_path=directory, **kwargs)

"""Causal LMs with a scalar value head, and frozen reference copies that genuinely share layers.

``AutoModelForCausalLMWithValueHead`` wraps any ``transformers.AutoModelForCausalLM`` (GPT-2, Llama,
Qwen2, GPT-NeoX, OPT, ...). Besides the legacy ``forward`` (full logits), it exposes the two pieces
the trainer's fast path needs: the backbone's last hidden states and the LM head (``lm_head()``),
so log-probabilities can be computed at response positions only (see ``ppo_core.logprobs``).
"""

from __future__ import annotations

import copy
import json
import logging
import os

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from .logprobs import LMHead

logger = logging.getLogger(__name__)

VALUE_HEAD_FILE = "value_head.safetensors"
_VALUE_HEAD_KWARGS = ("summary_dropout_prob", "v_head_initializer_range", "v_head_init_strategy")
# Where the i-th transformer block lives, per architecture family (legacy LAYER_PATTERNS).
LAYER_PATTERNS = ("transformer.h.{layer}", "model.decoder.layers.{layer}", "gpt_neox.layers.{layer}",
                  "model.layers.{layer}", "transformer.layers.{layer}", "model.transformer.h.{layer}")


class ValueHead(nn.Module):
    """``hidden (..., H) -> value (..., 1)``: optional dropout, then a linear layer kept in float32."""

    def __init__(self, hidden_size: int, summary_dropout_prob: float | None = 0.1):
        super().__init__()
        self.dropout = nn.Dropout(summary_dropout_prob) if summary_dropout_prob else nn.Identity()
        self.summary = nn.Linear(hidden_size, 1)  # state-dict keys v_head.summary.{weight,bias}, as in TRL

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.dropout(hidden_states)
        return self.summary(out.to(self.summary.weight.dtype))


def _hidden_size(config) -> int:
    for name in ("word_embed_proj_dim", "hidden_size", "n_embd", "d_model"):  # OPT projects before the head
        if getattr(config, name, None):
            return getattr(config, name)
    text_config = getattr(config, "get_text_config", lambda: None)()
    if text_config is not None and text_config is not config:
        return _hidden_size(text_config)
    raise ValueError(f"Cannot find the hidden size in the config of {config.model_type!r}; "
                     "pass a model whose config has hidden_size.")


class AutoModelForCausalLMWithValueHead(nn.Module):
    """A causal LM plus a value head on its last hidden state (TRL's legacy class, same API).

    ``forward(input_ids, past_key_values=None, attention_mask=None, return_past_key_values=False, **kw)``
    returns ``(lm_logits, loss, values)`` with ``lm_logits`` ``(B, T, V)`` float32 and ``values`` ``(B, T)``.
    """

    transformers_parent_class = AutoModelForCausalLM
    supported_args = _VALUE_HEAD_KWARGS

    def __init__(self, pretrained_model: PreTrainedModel, summary_dropout_prob: float | None = 0.1,
                 v_head_initializer_range: float = 0.2, v_head_init_strategy: str | None = None):
        super().__init__()
        if not isinstance(pretrained_model, PreTrainedModel):
            raise ValueError(f"AutoModelForCausalLMWithValueHead wraps a transformers PreTrainedModel, "
                             f"got {type(pretrained_model).__name__}.")
        self.pretrained_model = pretrained_model
        self.v_head = ValueHead(_hidden_size(pretrained_model.config), summary_dropout_prob)
        self.v_head.to(pretrained_model.device)
        if v_head_init_strategy == "normal":
            nn.init.normal_(self.v_head.summary.weight, mean=0.0, std=v_head_initializer_range)
            nn.init.zeros_(self.v_head.summary.bias)
        elif v_head_init_strategy is not None:
            raise ValueError(f"v_head_init_strategy must be None or 'normal', got {v_head_init_strategy!r}.")
        self.is_encoder_decoder = False
        self.is_peft_model = False
        self.is_sequential_parallel = False
        self.supports_rm_adapter = False

    # ---- construction and persistence -------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load (or wrap) a causal LM and restore its value head when one was saved with it.

        Args:
            pretrained_model_name_or_path: a hub id, a local directory, or an already built
                ``PreTrainedModel``.
            **kwargs: ``summary_dropout_prob``, ``v_head_initializer_range``, ``v_head_init_strategy``
                go to the value head; the rest to ``AutoModelForCausalLM.from_pretrained``.
        """
        head_kwargs = {k: kwargs.pop(k) for k in _VALUE_HEAD_KWARGS if k in kwargs}
        for unsupported in ("peft_config", "reward_adapter", "load_in_8bit", "load_in_4bit"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(f"AutoModelForCausalLMWithValueHead.from_pretrained: '{unsupported}' is not "
                                 "supported yet (LoRA/quantised policies are planned); load the full model.")
            kwargs.pop(unsupported, None)
        kwargs.pop("is_trainable", None)
        if isinstance(pretrained_model_name_or_path, PreTrainedModel):
            return cls(pretrained_model_name_or_path, **head_kwargs)
        path = str(pretrained_model_name_or_path)
        if os.path.exists(path) and not os.path.isdir(path):
            raise ValueError(f"Model path '{path}' is a file; pass the directory written by save_pretrained.")
        base = cls.transformers_parent_class.from_pretrained(path, *model_args, **kwargs)
        model = cls(base, **head_kwargs)
        head_state = _load_value_head_state(path)
        if head_state is not None:
            model.v_head.load_state_dict(head_state)
        else:
            logger.info("No value head weights in %s; the value head is freshly initialised "
                        "(expected unless you are resuming PPO training).", path)
        return model

    def save_pretrained(self, save_directory: str, **kwargs) -> None:
        """Write the LM as plain transformers does, and the value head beside it (``value_head.safetensors``)."""
        from safetensors.torch import save_file

        self.pretrained_model.save_pretrained(save_directory, **kwargs)
        state = {f"v_head.{k}": v.detach().contiguous().cpu() for k, v in self.v_head.state_dict().items()}
        save_file(state, os.path.join(save_directory, VALUE_HEAD_FILE))

    def push_to_hub(self, *args, **kwargs):
        return self.pretrained_model.push_to_hub(*args, **kwargs)

    # ---- model API -------------------------------------------------------------------------------
    @property
    def config(self):
        return self.pretrained_model.config

    @property
    def device(self) -> torch.device:
        return self.pretrained_model.device

    def forward(self, input_ids=None, past_key_values=None, attention_mask=None, return_past_key_values=False,
                **kwargs):
        """Legacy forward: ``(lm_logits float32 (B, T, V), loss or None, values (B, T))``.

        With ``hidden_only=True`` (used by the trainer) it skips the LM head and returns
        ``(last_hidden_states (B, T, H), values (B, T))``; going through ``forward`` keeps wrappers
        such as DDP in the loop.
        """
        if kwargs.pop("hidden_only", False):
            hidden = self.backbone_hidden_states(input_ids, attention_mask, kwargs.get("position_ids"))
            return hidden, self.v_head(hidden).squeeze(-1)
        kwargs["output_hidden_states"] = True
        out = self.pretrained_model(input_ids=input_ids, past_key_values=past_key_values,
                                    attention_mask=attention_mask, **kwargs)
        values = self.v_head(out.hidden_states[-1]).squeeze(-1)
        lm_logits = out.logits.float()
        if return_past_key_values:
            return lm_logits, out.loss, values, out.past_key_values
        return lm_logits, out.loss, values

    def generate(self, *args, **kwargs):
        return self.pretrained_model.generate(*args, **kwargs)

    def gradient_checkpointing_enable(self, **kwargs):
        # transformers 5 renamed it (the old name warns and goes away in v6).
        enable = getattr(self.pretrained_model, "activation_checkpointing_enable", None) \
            or self.pretrained_model.gradient_checkpointing_enable
        enable(**kwargs)
        self.pretrained_model.enable_input_require_grads()

    def backbone_hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Last hidden states of the transformer body, ``(B, T) -> (B, T, H)``, without the LM head."""
        backbone = self.pretrained_model.base_model
        if backbone is self.pretrained_model:  # no separate body: fall back to the full model
            return self.pretrained_model(input_ids=input_ids, attention_mask=attention_mask,
                                         position_ids=position_ids, output_hidden_states=True).hidden_states[-1]
        out = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False)
        return out[0]

    def lm_head(self) -> LMHead:
        """The output projection and the logit transforms this architecture applies after it."""
        head = self.pretrained_model.get_output_embeddings()
        config = self.pretrained_model.config
        scale = float(getattr(config, "logit_scale", None) or 1.0)  # Cohere multiplies
        if getattr(config, "logits_scaling", None):  # Granite divides
            scale /= float(config.logits_scaling)
        softcap = getattr(config, "final_logit_softcapping", None)
        return LMHead(head.weight, getattr(head, "bias", None), scale, softcap)


def _load_value_head_state(path: str) -> dict[str, torch.Tensor] | None:
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
            files += sorted({shard for key, shard in weight_map.items() if key.startswith("v_head.")})
    for name in files:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        if file.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(file, framework="pt") as fh:
                state = {k: fh.get_tensor(k) for k in fh.keys() if k.startswith("v_head.")}
        else:
            state = {k: v for k, v in torch.load(file, map_location="cpu", weights_only=True).items()
                     if k.startswith("v_head.")}
        if state:
            return {k[len("v_head."):]: v for k, v in state.items()}
    return None


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

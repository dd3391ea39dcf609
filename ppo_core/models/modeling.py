"""Language models with a scalar value head (TRL's legacy classes), and the decoder start token of an encoder-decoder.

``AutoModelForCausalLMWithValueHead`` wraps any ``transformers.AutoModelForCausalLM`` (GPT-2, Llama, Qwen2, GPT-NeoX,
OPT, ...), ``AutoModelForSeq2SeqLMWithValueHead`` any ``AutoModelForSeq2SeqLM`` (T5, BART, ...); either may hold a
PEFT adapter (``models.adapters``). Besides the legacy ``forward`` (full logits), their ``forward(...,
score_positions=, score_targets=)`` returns the trainer's per-token outputs (:class:`TokenScores`) computed at the
response positions only, from the last hidden states and the LM head (``lm_head()``, see ``models.logprobs``), inside
``forward`` so that a wrapper sees the LM head used there: DDP, and DeepSpeed ZeRO-3, which gathers a sharded weight
only for a module that owns it or has it registered (``lm_head_parameters()``, see ``runtime.zero``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import NamedTuple

import torch
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM, PreTrainedModel

from . import adapters, reward_adapter, weights
from .logprobs import (
    LMHead,
    decoder_output_scale,
    lm_head_of,
    lm_head_parameters,
    selected_logprobs,
    selected_logprobs_and_entropy,
)
from .weights import VALUE_HEAD_FILE  # noqa: F401 (imported from here, as before weights saved the value head)

logger = logging.getLogger(__name__)

_VALUE_HEAD_KWARGS = ("summary_dropout_prob", "v_head_initializer_range", "v_head_init_strategy")
_FROM_CONFIG = object()  # summary_dropout_prob not given: the wrapped model's config.summary_dropout_prob, else 0.1


class ValueHead(nn.Module):
    """``hidden (..., H) -> value (..., 1)``: optional dropout, then a linear layer kept in float32."""

    def __init__(self, hidden_size: int, summary_dropout_prob: float | None = 0.1):
        super().__init__()
        self.dropout = nn.Dropout(summary_dropout_prob) if summary_dropout_prob else nn.Identity()
        self.summary = nn.Linear(hidden_size, 1)  # state-dict keys v_head.summary.{weight,bias}, as in TRL

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.dropout(hidden_states)
        return self.summary(out.to(self.summary.weight.dtype))


class TokenScores(NamedTuple):
    """What ``forward(..., score_positions=..., score_targets=...)`` returns. ``N`` scored tokens."""

    logprobs: torch.Tensor  # (N,) log p(target) at each scored position (float32; differentiable)
    entropy: torch.Tensor | None  # (N,) entropy of the next-token distribution there, with score_entropy (no grad)
    values: torch.Tensor  # (B, T) the value head at every position
    hidden: torch.Tensor | None  # (N, H) the (detached) hidden states at the scored positions, with score_hidden


def _hidden_size(config) -> int:
    for name in ("word_embed_proj_dim", "hidden_size", "n_embd", "d_model"):  # OPT projects before the head
        if getattr(config, name, None):
            return getattr(config, name)
    text_config = getattr(config, "get_text_config", lambda: None)()
    if text_config is not None and text_config is not config:
        return _hidden_size(text_config)
    raise ValueError(f"Cannot find the hidden size in the config of {config.model_type!r}; "
                     "pass a model whose config has hidden_size.")


class PreTrainedModelWrapper(weights.LegacyStateDict, nn.Module):
    """A transformers LM, optionally inside a PEFT adapter, plus a scalar value head (legacy TRL's base class).

    The shared half of :class:`AutoModelForCausalLMWithValueHead` and
    :class:`AutoModelForSeq2SeqLMWithValueHead`: construction, persistence and the LM head. With a
    ``peft.PeftModel`` inside (``is_peft_model``), only the adapter and the value head are trainable and
    the reference policy is the same model under ``pretrained_model.disable_adapter()``.
    """

    transformers_parent_class = None  # the transformers Auto class that loads the LM
    lm_head_namings = ["lm_head", "embed_out"]  # legacy TRL's names of an LM head (ppo_core asks the model for it)
    supported_args = _VALUE_HEAD_KWARGS  # the from_pretrained kwargs that go to the value head
    supported_modules = ("v_head",)  # legacy TRL's name; the state-dict code asks the model (weights.heads)
    is_encoder_decoder = False

    def __init__(self, pretrained_model: PreTrainedModel, summary_dropout_prob: float | None = _FROM_CONFIG,
                 v_head_initializer_range: float = 0.2, v_head_init_strategy: str | None = None):
        """``summary_dropout_prob`` (the value head's dropout; None or 0: none), when not given, is the wrapped model's
        ``config.summary_dropout_prob`` if it has one, else 0.1 (legacy TRL read the config first)."""
        super().__init__()
        name = type(self).__name__
        self.is_peft_model = adapters.is_peft_model(pretrained_model)
        lm = adapters.check_supported(pretrained_model) if self.is_peft_model else pretrained_model
        if not isinstance(lm, PreTrainedModel):
            raise ValueError(f"{name} wraps a transformers PreTrainedModel (or a peft.PeftModel of one), "
                             f"got {type(lm).__name__}.")
        if bool(getattr(lm.config, "is_encoder_decoder", False)) != self.is_encoder_decoder:
            kind, other = (("not an encoder-decoder", "AutoModelForCausalLMWithValueHead") if self.is_encoder_decoder
                           else ("an encoder-decoder", "AutoModelForSeq2SeqLMWithValueHead"))
            raise ValueError(f"{name}: {type(lm).__name__} is {kind} model; wrap it with {other}.")
        if lm.get_output_embeddings() is None:
            raise ValueError(f"{name}: {type(lm).__name__} has no language-model head (a bare transformer body, such "
                             f"as GPT2Model or model.transformer); pass the model with its head, as "
                             f"{self.transformers_parent_class.__name__}.from_pretrained loads it.")
        self.pretrained_model = pretrained_model
        if summary_dropout_prob is _FROM_CONFIG:
            summary_dropout_prob = getattr(lm.config, "summary_dropout_prob", 0.1)
        self.v_head = ValueHead(_hidden_size(lm.config), summary_dropout_prob)
        self.v_head.to(lm.device)
        self._init_weights(v_head_initializer_range=v_head_initializer_range, v_head_init_strategy=v_head_init_strategy)
        self.is_sequential_parallel = False  # legacy TRL's (set for device_map models there): user code may read it
        # legacy attributes that user code reads: quantisation flags, and the adapters `compute_reward_score` switches
        self.is_loaded_in_8bit = bool(getattr(lm, "is_loaded_in_8bit", False))
        self.is_loaded_in_4bit = bool(getattr(lm, "is_loaded_in_4bit", False))
        self.supports_rm_adapter, self.rm_adapter_name, self.policy_adapter_name = False, None, "default"
        self.register_load_state_dict_pre_hook(weights.module_keys)  # legacy keys, also when DDP/DeepSpeed load

    def _init_weights(self, v_head_initializer_range: float = 0.2, v_head_init_strategy: str | None = None) -> None:
        """The value head's initialisation: torch's default (``None``), or ``"normal"``: weight ~ N(0,
        ``v_head_initializer_range``), bias 0."""
        if v_head_init_strategy == "normal":
            nn.init.normal_(self.v_head.summary.weight, mean=0.0, std=v_head_initializer_range)
            nn.init.zeros_(self.v_head.summary.bias)
        elif v_head_init_strategy is not None:
            raise ValueError(f"v_head_init_strategy must be None or 'normal', got {v_head_init_strategy!r}.")

    # ---- construction and persistence -------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load (or wrap) an LM, optionally add or load a PEFT adapter, and restore a saved value head.

        Args:
            pretrained_model_name_or_path: a hub id, a local directory (a full model, or an adapter written
                by ``save_pretrained`` of a PEFT policy: its base model is loaded from the path in its
                ``adapter_config.json``), a ``PreTrainedModel`` or a ``peft.PeftModel``.
            peft_config: a ``peft.PeftConfig`` (e.g. ``LoraConfig(r=16, lora_alpha=16)``): add a fresh
                adapter to the loaded model, freezing its base weights (needs ``peft``).
            is_trainable: whether a loaded adapter is trained (default True; legacy TRL's and peft's default is
                False, which left PPO training the value head alone); ignored when no adapter is loaded.
            reward_adapter, reward_adapter_name: a PEFT reward model's directory (``task_type="SEQ_CLS"``, trained on
                the same base), loaded frozen beside the policy's adapter as ``reward_adapter_name`` (default
                ``"reward_adapter"``) for ``compute_reward_score`` (``models.reward_adapter``; needs a PEFT policy).
            **kwargs: ``summary_dropout_prob``, ``v_head_initializer_range``, ``v_head_init_strategy``
                go to the value head; the rest to the transformers ``from_pretrained``. Without a ``dtype`` (or
                ``torch_dtype``) the weights load in float32: transformers 5 would load them in their saved dtype,
                and a bf16 checkpoint would then train bf16 weights without a float32 master copy.
                ``load_in_8bit``, ``load_in_4bit`` and ``quantization_config`` raise a ValueError saying what to do
                instead (``ppo_core.models.weights.loading_kwargs``).
        """
        head_kwargs = {k: kwargs.pop(k) for k in _VALUE_HEAD_KWARGS if k in kwargs}
        peft_config = kwargs.pop("peft_config", None)
        is_trainable = kwargs.pop("is_trainable", True)
        reward = kwargs.pop("reward_adapter", None), kwargs.pop("reward_adapter_name", "reward_adapter")
        kwargs = weights.loading_kwargs(cls.__name__, kwargs)  # float32 unless a dtype is given; no quantisation
        source, path = pretrained_model_name_or_path, None
        if isinstance(source, PreTrainedModel) or adapters.is_peft_model(source):
            model = source
        else:
            path = str(source)
            if os.path.exists(path) and not os.path.isdir(path):
                raise ValueError(f"Model path '{path}' is a file; pass the directory written by save_pretrained.")
            if adapters.is_adapter_dir(path):
                if peft_config is not None:
                    raise ValueError(f"{cls.__name__}.from_pretrained: {path} already holds an adapter; drop "
                                     "peft_config to load it, or pass its base model to start a new one.")
                model = adapters.load_adapter(cls.transformers_parent_class, path, is_trainable, *model_args, **kwargs)
            else:
                model = cls.transformers_parent_class.from_pretrained(path, *model_args, **kwargs)
        if peft_config is not None:
            model = adapters.add_adapter(model, peft_config)
        wrapped = cls(model, **head_kwargs)
        if reward[0] is not None:  # a frozen reward model on the same base weights (ppo_core.models.reward_adapter)
            reward_adapter.attach(wrapped, *reward)
        head_state = weights.load_value_head_state(path) if path is not None else None
        if head_state is not None:
            wrapped.v_head.load_state_dict(head_state)
        elif path is not None:
            logger.info("No value head weights in %s; the value head is freshly initialised "
                        "(expected unless you are resuming PPO training).", path)
        return wrapped

    def save_pretrained(self, save_directory: str, merge_adapter: bool = False, **kwargs) -> None:
        """Write the LM and the value head beside it (``value_head.safetensors``).

        A plain model is written as transformers does. A PEFT policy writes its adapter
        (``adapter_config.json`` + weights, loadable with ``peft.PeftModel.from_pretrained(base, dir)``
        or this class's ``from_pretrained(dir)``); with ``merge_adapter=True`` it writes instead a plain
        transformers model with the adapter merged into a copy of the base weights (loadable without
        peft; the model in memory is unchanged, the copy costs a second set of weights while saving).
        """
        if merge_adapter and not self.is_peft_model:
            raise ValueError("save_pretrained: merge_adapter=True needs a PEFT policy; this model has no adapter.")
        lm = adapters.merged_copy(self.pretrained_model) if merge_adapter else self.pretrained_model
        lm.save_pretrained(save_directory, **kwargs)
        adapters.canonical_adapter_configs(save_directory)  # the same adapter, the same bytes, in every process
        weights.save_value_head(self.v_head, save_directory)

    compute_reward_score = reward_adapter.compute_reward_score  # with from_pretrained(..., reward_adapter=DIR)

    # ---- model API -------------------------------------------------------------------------------
    @property
    def transformers_model(self) -> PreTrainedModel:
        """The transformers model: ``pretrained_model``, or the one inside its PEFT adapter (layers adapted)."""
        return self.pretrained_model.get_base_model() if self.is_peft_model else self.pretrained_model

    @property
    def config(self):
        return self.transformers_model.config

    @property
    def device(self) -> torch.device:
        return self.transformers_model.device

    def generate(self, *args, **kwargs):
        return self.pretrained_model.generate(*args, **kwargs)

    def prepare_inputs_for_generation(self, *args, **kwargs):
        return self.pretrained_model.prepare_inputs_for_generation(*args, **kwargs)

    def gradient_checkpointing_enable(self, **kwargs):
        model = self.transformers_model
        # transformers 5 renamed it (the old name warns and goes away in v6).
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable(**kwargs)
        model.enable_input_require_grads()

    def gradient_checkpointing_disable(self):
        model = self.transformers_model
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()

    def enable_input_require_grads(self):
        self.transformers_model.enable_input_require_grads()

    def _has_lm_head(self) -> bool:
        """Whether the wrapped model has an output projection (legacy: a module named in ``lm_head_namings``)."""
        return self.transformers_model.get_output_embeddings() is not None

    def lm_head(self, temperature: float = 1.0) -> LMHead:
        """The output projection and the logit transforms this architecture applies after it (``lm_head_of``), the
        logits divided by ``temperature`` (the sampling's: ``PPOConfig.temperature``)."""
        return dataclasses.replace(lm_head_of(self.transformers_model), temperature=temperature)

    def lm_head_parameters(self) -> list[nn.Parameter]:
        """The parameters ``lm_head()`` reads (its weight, and its bias if a parameter): what ZeRO-3 must gather
        for the scoring forward, which uses them outside the head module's own forward (``final_logits_bias``
        is a buffer, never sharded)."""
        return lm_head_parameters(self.transformers_model)

    def _values(self, hidden: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``(B, T, H) -> (B, T)`` on ``device``. With the model across GPUs (``device_map``) the hidden states come
        from the last shard and the value head sits on the first (where legacy TRL put it): each has its device."""
        return self.v_head(hidden.to(self.v_head.summary.weight.device)).squeeze(-1).to(device)

    def forward(self, input_ids=None, past_key_values=None, attention_mask=None, return_past_key_values=False, *,
                score_positions=None, score_targets=None, score_entropy=False, score_hidden=False,
                score_chunk_size=None, score_temperature=1.0, **kwargs):
        """Legacy forward: ``(lm_logits float32 (B, T, V), loss or None, values (B, T))`` (plus the past key values
        with ``return_past_key_values``); for an encoder-decoder ``T`` is the decoder's length.

        The trainer's path, through the same call so that DDP's and DeepSpeed's wrappers see it: with
        ``score_positions`` (``(N, 2)``: row and position of each scored token) and ``score_targets`` (``(N,)``: the
        token whose log-probability is wanted there, the next one in the sequence) it skips the full logits and
        returns :class:`TokenScores` instead; ``score_entropy`` adds the entropies, ``score_hidden`` the hidden
        states, ``score_chunk_size`` bounds the rows per LM-head chunk, ``score_temperature`` divides the logits.
        """
        if score_positions is not None:
            hidden = self.last_hidden_states(input_ids, attention_mask, **kwargs)
            return self._token_scores(hidden, score_positions, score_targets, score_entropy, score_hidden,
                                      score_chunk_size, score_temperature)
        kwargs["output_hidden_states"] = True
        if past_key_values is not None:  # passed only when given: transformers 5 deprecates the name, even as None
            kwargs["past_key_values"] = past_key_values
        out = self.pretrained_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        hidden = out.decoder_hidden_states if self.is_encoder_decoder else out.hidden_states
        values = self._values(hidden[-1], out.logits.device)
        lm_logits = out.logits.float()
        if return_past_key_values:
            return lm_logits, out.loss, values, out.past_key_values
        return lm_logits, out.loss, values

    def last_hidden_states(self, input_ids, attention_mask=None, **kwargs) -> torch.Tensor:
        """The last hidden states ``(B, T, H)`` (the decoder's for an encoder-decoder), without the LM head."""
        raise NotImplementedError

    def _token_scores(self, hidden: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
                      with_entropy: bool, keep_hidden: bool, chunk_size: int | None,
                      temperature: float = 1.0) -> TokenScores:
        """``hidden (B, T, H)`` -> :class:`TokenScores` at ``positions`` ``(N, 2)`` (row, position) for ``targets``
        ``(N,)``, on the device of ``positions`` (the inputs').

        The LM head runs on the ``N`` selected hidden states only, chunk by chunk (``models.logprobs``), on its own
        device: across GPUs (``device_map``) the hidden states, the value head and the LM head may each have another.
        On one device every move is a no-op.
        """
        device = positions.device
        values = self._values(hidden, device)  # (B, T)
        selected = hidden[positions[:, 0].to(hidden.device), positions[:, 1].to(hidden.device)]  # (N, H)
        head = self.lm_head(temperature)
        selected, targets = selected.to(head.weight.device), targets.to(head.weight.device)
        if with_entropy:
            logprobs, entropy = selected_logprobs_and_entropy(selected, head, targets, chunk_size)
            entropy = entropy.to(device)
        else:
            logprobs, entropy = selected_logprobs(selected, head, targets, chunk_size), None
        return TokenScores(logprobs.to(device), entropy, values, selected.detach() if keep_hidden else None)


class AutoModelForCausalLMWithValueHead(PreTrainedModelWrapper):
    """A causal LM plus a value head on its last hidden state (TRL's legacy class, same API; ``forward``: see
    :meth:`PreTrainedModelWrapper.forward`)."""

    transformers_parent_class = AutoModelForCausalLM

    def last_hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                           **kwargs) -> torch.Tensor:
        return self.backbone_hidden_states(input_ids, attention_mask, kwargs.get("position_ids"))

    def backbone_hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                               position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Last hidden states of the transformer body, ``(B, T) -> (B, T, H)``, without the LM head.

        With a PEFT adapter the body's adapted layers run as they are (adapter on, or off under
        ``disable_adapter()``).
        """
        model = self.transformers_model
        backbone = model.base_model
        if backbone is model:  # no separate body: fall back to the full model
            return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         output_hidden_states=True).hidden_states[-1]
        out = backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False)
        return out[0]


class AutoModelForSeq2SeqLMWithValueHead(PreTrainedModelWrapper):
    """An encoder-decoder LM (T5, BART, ...) plus a value head on the decoder's last hidden state.

    Queries go to the encoder (``input_ids``), responses to the decoder (``decoder_input_ids``, starting
    with the model's ``decoder_start_token_id``). ``forward(input_ids, past_key_values=None,
    attention_mask=None, return_past_key_values=False, decoder_input_ids=..., **kw)`` returns
    ``(lm_logits (B, T_dec, V) float32, loss or None, values (B, T_dec))`` (see :meth:`PreTrainedModelWrapper.forward`).
    """

    transformers_parent_class = AutoModelForSeq2SeqLM
    lm_head_namings = ["lm_head", "embed_out", "output_projection"]
    is_encoder_decoder = True

    def last_hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                           **kwargs) -> torch.Tensor:
        return self.decoder_hidden_states(input_ids, attention_mask, kwargs["decoder_input_ids"],
                                          kwargs.get("decoder_attention_mask"))

    def decoder_hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                              decoder_input_ids: torch.Tensor,
                              decoder_attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder ``(B, S)`` then decoder ``(B, T)`` -> the decoder's last hidden states ``(B, T, H)``."""
        model = self.transformers_model
        encoder_hidden = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)[0]  # (B, S, H)
        out = model.get_decoder()(input_ids=decoder_input_ids, attention_mask=decoder_attention_mask,
                                  encoder_hidden_states=encoder_hidden, encoder_attention_mask=attention_mask,
                                  use_cache=False)
        return out[0]

    def lm_head(self, temperature: float = 1.0) -> LMHead:
        """As the base class, plus T5's rescaling of the decoder output (folded into the logit scale:
        the head has no bias, so ``W (s h) = s (W h)``)."""
        head = super().lm_head(temperature)
        scale = decoder_output_scale(self.config)
        return head if scale == 1.0 else dataclasses.replace(head, scale=head.scale * scale)


SUPPORTED_ARCHITECTURES = (AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead)  # legacy name


def scoring_view(lm: nn.Module) -> PreTrainedModelWrapper:
    """A plain transformers LM (causal or encoder-decoder) in its value-head class, for a no-grad scoring pass
    (``step.rollout.policy_outputs``): the head it adds is never read, is made without drawing from the global RNG, and
    sits on the LM's device (its values would otherwise bring every hidden state to the CPU)."""
    wrapper = AutoModelForSeq2SeqLMWithValueHead if lm.config.is_encoder_decoder else AutoModelForCausalLMWithValueHead
    with torch.random.fork_rng(devices=[]):
        model = wrapper(lm, summary_dropout_prob=None).eval()
    model.v_head.to(lm.device)
    return model


def decoder_start_token_id(model: PreTrainedModelWrapper) -> int:
    """The token an encoder-decoder ``model``'s decoder starts from: its config's, else its generation config's."""
    lm = model.transformers_model
    start = getattr(lm.config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(lm.generation_config, "decoder_start_token_id", None)
    if start is None:
        raise ValueError(f"PPOTrainer: the encoder-decoder policy ({type(lm).__name__}) has no decoder_start_token_id "
                         "in its config or generation_config; set model.config.decoder_start_token_id.")
    return int(start)

"""A reward model on the policy's own base weights: legacy TRL's multi-adapter RL (``reward_adapter``).

A reward model trained as a PEFT adapter on the policy's base model (``task_type="SEQ_CLS"``: LoRA on the transformer
layers, and its ``score`` head saved in full through ``modules_to_save``) is loaded into the PEFT policy as a second,
frozen adapter, its score head beside the value head (:func:`attach`, called by ``from_pretrained(...,
reward_adapter=DIR)``). :func:`compute_reward_score` runs the transformer body with that adapter active, applies the
head at every position and makes the policy's adapter active again, so one copy of the base weights serves the
policy, the reference (every adapter disabled) and the reward model. Nothing of the reward model requires grad:
PPO trains the policy's adapter and the value head only.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from . import adapters

SCORE_MODULES = ("score",)  # the name of the sequence-classification head (legacy TRL's ``supported_rm_modules``)


def attach(model, path, adapter_name: str = "reward_adapter") -> None:
    """Load the reward adapter saved in ``path`` into the PEFT policy ``model`` (a value-head model) as
    ``adapter_name``, frozen, and its score head as ``model.score`` (a frozen ``nn.Linear(H, num_labels)``); the
    policy's adapter stays the active one. Sets ``model.supports_rm_adapter``, ``rm_adapter_name`` and
    ``policy_adapter_name`` (legacy names)."""
    where = f"{type(model).__name__}.from_pretrained(..., reward_adapter={path!r})"
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"{where}: reward_adapter must be the directory of a saved PEFT reward adapter "
                         f"(a str or path), got {type(path).__name__}.")
    if not model.is_peft_model:
        raise ValueError(f"{where}: a reward adapter needs a PEFT policy, whose base weights it shares; pass "
                         "peft_config=LoraConfig(...) too (or a peft.PeftModel, or a saved policy adapter).")
    if model.is_encoder_decoder:
        raise ValueError(f"{where}: reward adapters are supported on causal LMs only; score with a separate reward "
                         "model (AutoModelForSequenceClassification) instead.")
    path = os.fspath(path)
    if not adapters.is_adapter_dir(path):
        raise ValueError(f"{where}: no {adapters.ADAPTER_CONFIG_FILE} in {path}; pass the directory that "
                         "save_pretrained of the PEFT reward model (task_type='SEQ_CLS') wrote.")
    peft = adapters.require_peft("reward_adapter")
    from peft.utils import load_peft_weights

    lm = model.pretrained_model
    if adapter_name in lm.peft_config:
        raise ValueError(f"{where}: the policy already has an adapter named {adapter_name!r}; pass another "
                         "reward_adapter_name.")
    if peft.PeftConfig.from_pretrained(path).is_prompt_learning:
        raise ValueError(f"{where}: a prompt-learning reward adapter is not supported; train it as a LoRA "
                         "(or another adapter on the model's layers).")
    head = _score_head(load_peft_weights(path, device="cpu"), path, model)
    policy_adapter, training = lm.active_adapter, lm.training
    loaded = lm.load_adapter(path, adapter_name, is_trainable=False)  # the score head is ours: unexpected to peft
    lm.train(training)  # peft leaves the model in eval mode after loading a frozen adapter
    missing = [key for key in loaded.missing_keys if f".{adapter_name}." in key]  # peft's filter is a substring
    if missing:
        raise ValueError(f"{where}: the adapter in {path} does not fit the policy's base model (missing "
                         f"{missing[0]}); train the reward adapter on the policy's base model.")
    last = model.transformers_model.get_output_embeddings().weight  # the last hidden states' device (device_map)
    model.score = head.to(last.device, model.transformers_model.dtype).requires_grad_(False)
    model.supports_rm_adapter, model.rm_adapter_name, model.policy_adapter_name = True, adapter_name, policy_adapter


def _score_head(state: dict[str, torch.Tensor], path: str, model) -> nn.Linear:
    """The score head in a saved adapter's weights (``...score.weight``, optional ``...score.bias``) as a Linear."""
    head = {name.split(".")[-1]: tensor for name, tensor in state.items()
            if name.count(".") and name.split(".")[-2] in SCORE_MODULES}  # base_model.model.score.weight
    if "weight" not in head:
        raise ValueError(f"reward_adapter={path!r}: the adapter holds no score head "
                         f"({'/'.join(SCORE_MODULES)}.weight); train the reward model with "
                         "LoraConfig(task_type='SEQ_CLS'), which saves its head (modules_to_save), and save it "
                         "with save_pretrained.")
    num_labels, hidden = head["weight"].shape
    expected = model.transformers_model.get_output_embeddings().weight.shape[-1]
    if hidden != expected:
        raise ValueError(f"reward_adapter={path!r}: its score head reads {hidden}-wide hidden states, the policy's "
                         f"are {expected}-wide; train the reward adapter on the policy's base model.")
    linear = nn.Linear(hidden, num_labels, bias="bias" in head)
    linear.load_state_dict(head)
    return linear


def compute_reward_score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                         **kwargs) -> torch.Tensor:
    """The reward adapter's score at every position: ``input_ids (B, T) -> (B, T, num_labels)`` float32, no grad.

    The transformer body runs with the reward adapter active (``kwargs`` go to it, e.g. ``position_ids``), the
    score head on its last hidden states, as the reward model's own classifier computes them before pooling: the
    reward of a sequence is the row at its last token. Afterwards the policy's adapter is active again and the
    model is in its former train/eval mode, every ``requires_grad`` as it was. Legacy TRL left the model in eval
    mode. Under autocast-cast frozen weights (``PPOTrainer`` with bf16 or fp16 casts them) the pass runs in that
    autocast dtype.
    """
    if not getattr(self, "supports_rm_adapter", False):
        raise ValueError("This model does not support reward modeling adapter: load it with from_pretrained(..., "
                         "peft_config=..., reward_adapter=<directory of a PEFT SEQ_CLS reward adapter>).")
    lm = self.pretrained_model
    requires_grad = [(p, p.requires_grad) for p in lm.parameters()]  # peft's set_adapter changes them
    training = lm.training
    dtype = self.score.weight.dtype
    half = dtype in (torch.float16, torch.bfloat16)
    try:
        lm.set_adapter(self.rm_adapter_name)
        lm.eval()
        with torch.no_grad(), (torch.autocast(input_ids.device.type, dtype) if half else contextlib.nullcontext()):
            body = self.transformers_model.base_model
            hidden = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)[0]  # (B,T,H)
            scores = self.score(hidden.to(self.score.weight.device))  # (B, T, num_labels)
    finally:
        lm.set_adapter(self.policy_adapter_name)
        lm.train(training)
        for param, flag in requires_grad:
            param.requires_grad_(flag)
    return scores.to(input_ids.device, torch.float32)

"""TRL's legacy ``trl.core``, at the path its users import it from: ``from ppo_core.core import whiten``.

The math and the stats-dict helpers live in :mod:`ppo_core.algo.functional` and the KL controllers in
:mod:`ppo_core.algo.kl_control` (the engine imports them from there); this module re-exports them beside the legacy
helpers that only user code calls: ``LengthSampler``, the sampling helpers (which call the model or tokenizer they
are given) and ``PPODecorators``.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from .algo.functional import (
    WANDB_PADDING,
    add_suffix,
    average_torch_dicts,
    clip_by_value,
    convert_to_scalar,
    entropy_from_logits,
    flatten_dict,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_variances,
    masked_whiten,
    stack_dicts,
    stats_to_np,
    whiten,
)
from .algo.kl_control import AdaptiveKLController, FixedKLController
from .runtime.utils import free_device_cache, set_seed

__all__ = [
    "WANDB_PADDING",
    "AdaptiveKLController",
    "FixedKLController",
    "LengthSampler",
    "PPODecorators",
    "add_suffix",
    "average_torch_dicts",
    "build_bert_batch_from_txt",
    "clip_by_value",
    "convert_to_scalar",
    "entropy_from_logits",
    "flatten_dict",
    "logprobs_from_logits",
    "masked_mean",
    "masked_var",
    "masked_variances",
    "masked_whiten",
    "pad_to_size",
    "randn_tensor",
    "respond_to_batch",
    "set_seed",
    "stack_dicts",
    "stats_to_np",
    "top_k_top_p_filtering",
    "whiten",
]


class LengthSampler:
    """Uniform sampler of integer lengths in ``[min_value, max_value)`` (legacy semantics).

    Takes an optional ``seed`` so that query/response lengths are reproducible without touching the
    global ``random`` state.
    """

    def __init__(self, min_value: int, max_value: int, seed: int | None = None):
        if max_value <= min_value:
            raise ValueError(f"LengthSampler: max_value ({max_value}) must be > min_value ({min_value}).")
        self.values = list(range(min_value, max_value))
        self._rng = random.Random(seed) if seed is not None else random

    def __call__(self) -> int:
        return self._rng.choice(self.values)


# ---- the rest of legacy ``trl.core``: small helpers that user code and older examples import ----------------



# ---- the rest of legacy ``trl.core``: small helpers that user code and older examples import ----------------


def pad_to_size(tensor: torch.Tensor, size: int, dim: int = 1, padding: int = 50256) -> torch.Tensor:
    """Right-pad the last dimension of ``tensor`` with ``padding`` to ``size`` (legacy: ``dim`` is read only to
    measure, the padding always goes on the last dimension; GPT-2's EOS id by default)."""
    t_size = tensor.size()[dim]
    return tensor if t_size == size else F.pad(tensor, (0, size - t_size), "constant", padding)


def top_k_top_p_filtering(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, filter_value: float = -float("inf"),
                          min_tokens_to_keep: int = 1) -> torch.Tensor:
    """``(B, V)`` logits with every token outside the ``top_k`` most likely, then outside the nucleus of
    probability ``top_p``, set to ``filter_value``; at least ``min_tokens_to_keep`` stay (transformers' warpers,
    as legacy did)."""
    from transformers import TopKLogitsWarper, TopPLogitsWarper

    if top_k > 0:
        logits = TopKLogitsWarper(top_k=top_k, filter_value=filter_value,
                                  min_tokens_to_keep=min_tokens_to_keep)(None, logits)
    if 0 <= top_p <= 1.0:
        logits = TopPLogitsWarper(top_p=top_p, filter_value=filter_value,
                                  min_tokens_to_keep=min_tokens_to_keep)(None, logits)
    return logits


def respond_to_batch(model, queries: torch.Tensor, txt_len: int = 20, top_k: int = 0,
                     top_p: float = 1.0) -> torch.Tensor:
    """Sample ``txt_len`` tokens after ``queries`` ``(B, L)`` (unpadded, equal lengths) -> ``(B, txt_len)``: the
    legacy README's quick start, one full forward per token (no cache, no EOS stop). ``model`` returns logits
    first (a transformers LM, or a value-head model). Prefer ``PPOTrainer.generate`` for real work."""
    input_ids = queries
    with torch.no_grad():
        for _ in range(txt_len):
            next_token_logits = model(input_ids)[0][:, -1, :]
            next_token_logits = top_k_top_p_filtering(next_token_logits, top_k=top_k, top_p=top_p)
            next_token = torch.multinomial(F.softmax(next_token_logits, dim=-1), num_samples=1)
            input_ids = torch.cat([input_ids, next_token], dim=-1)
    return input_ids[:, -txt_len:]


def build_bert_batch_from_txt(text_list: list[str], tokenizer, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention masks ``(B, L)`` of ``text_list``, right-padded with 0 (for a BERT classifier)."""
    tensors = [tokenizer.encode(text, return_tensors="pt").to(device) for text in text_list]
    max_len = max(t.size()[1] for t in tensors)
    ids = torch.cat([pad_to_size(t, max_len, padding=0) for t in tensors])
    masks = torch.cat([pad_to_size(torch.ones(t.size(), device=device), max_len, padding=0) for t in tensors])
    return ids, masks


def randn_tensor(shape: tuple[int, ...] | list[int], generator: torch.Generator | list[torch.Generator] | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 layout: torch.layout | None = None) -> torch.Tensor:
    """Standard normal noise of ``shape``, drawn with ``generator`` (one per batch row when a list) on the
    generator's device and moved to ``device`` (legacy, from diffusers: the same draws on every device)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    layout = layout or torch.strided
    if isinstance(generator, list):
        rows = [torch.randn((1, *shape[1:]), generator=g, device=g.device, dtype=dtype, layout=layout)
                for g in generator]
        return torch.cat(rows, dim=0).to(device)
    rand_device = generator.device if generator is not None else device
    return torch.randn(tuple(shape), generator=generator, device=rand_device, dtype=dtype, layout=layout).to(device)


class PPODecorators:
    """Legacy: ``@PPODecorators.empty_device_cache()`` frees the GPU allocator's cached blocks after the decorated
    call when ``PPODecorators.optimize_device_cache`` is set (``PPOConfig.optimize_device_cache`` does this for the
    trainer's own steps)."""

    optimize_device_cache = False

    @classmethod
    @contextlib.contextmanager
    def empty_device_cache(cls) -> Iterator[None]:
        yield
        if cls.optimize_device_cache:
            free_device_cache()

"""Pure tensor helpers with the names and semantics of TRL's legacy ``trl.core``.

A user migrating from ``trl<=0.11`` imports these from ``ppo_core.core`` unchanged. Everything here
takes tensors (or plain dicts) and returns tensors; nothing reads a config or a file (the legacy sampling
helpers at the end call the model or tokenizer they are given).

Notation: ``B`` batch, ``T`` sequence (or response) length, ``V`` vocabulary size.
Mask convention everywhere: ``mask`` is 1 (or True) for a valid token and 0 for padding.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .kl_control import AdaptiveKLController, FixedKLController  # re-exported: legacy lived here too
from .utils import free_device_cache, set_seed  # re-exported: legacy lived here too

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

WANDB_PADDING = -1  # legacy: value that fills ragged histograms in stacked stats


def flatten_dict(nested: Mapping[str, Any], sep: str = "/") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a/b": 1}``."""
    flat: dict[str, Any] = {}

    def walk(prefix: str, node: Mapping[str, Any]) -> None:
        for key, value in node.items():
            name = f"{prefix}{sep}{key}" if prefix else str(key)
            if isinstance(value, Mapping):
                walk(name, value)
            else:
                flat[name] = value

    walk("", nested)
    return flat


def stack_dicts(stats_dicts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack a list of stats dicts key by key: ``[{k: (n_i,)}, ...]`` -> ``{k: (len, max n_i)}``.

    Ragged 1-D entries are padded with ``WANDB_PADDING``, as in the legacy helper.
    """
    stacked = {}
    for key in stats_dicts[0]:
        rows = [torch.as_tensor(d[key]).flatten() for d in stats_dicts]
        stacked[key] = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=WANDB_PADDING)
    return stacked


def stats_to_np(stats: Mapping[str, Any]) -> dict[str, Any]:
    """Tensors -> numpy (float32 for floating point); 0-d results become Python-like numpy scalars.

    The floating tensors of each device come to the host in one copy: a copy per statistic would be a host sync each
    on a GPU.
    """
    by_device: dict[torch.device, list[str]] = {}
    for key, value in stats.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.device.type != "cpu":
            by_device.setdefault(value.device, []).append(key)
    host: dict[str, torch.Tensor] = {}
    for keys in by_device.values():
        flat = torch.cat([stats[k].detach().float().reshape(-1) for k in keys]).cpu()
        host |= {k: part.view(stats[k].shape) for k, part in zip(keys, flat.split([stats[k].numel() for k in keys]))}
    out: dict[str, Any] = {}
    for key, value in stats.items():
        if isinstance(value, torch.Tensor):
            value = host[key] if key in host else value.detach()
            value = value.cpu() if value.device.type != "cpu" else value
            if value.is_floating_point():
                value = value.float()
            value = value.numpy()
            if value.ndim == 0:
                value = value[()]
        out[key] = value
    return out


def convert_to_scalar(stats: Mapping[str, Any]) -> dict[str, Any]:
    """Single-element arrays/tensors -> Python scalars (what tensorboard-like trackers want)."""
    out: dict[str, Any] = {}
    for key, value in stats.items():
        size = value.numel() if isinstance(value, torch.Tensor) else getattr(value, "size", None)
        out[key] = value.item() if size == 1 and hasattr(value, "item") else value
    return out


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, gather: bool = True) -> torch.Tensor:
    """Log-probabilities of ``labels`` under ``logits``.

    Args:
        logits: ``(..., V)``.
        labels: ``(...)`` token ids.
        gather: if False, return the full ``(..., V)`` log-softmax (legacy flag).

    Returns:
        ``(...)`` log p(label), computed in float32 at least.
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    # log p(y) = logit_y - logsumexp(logits): avoids materialising a second (..., V) tensor.
    if not gather:
        return F.log_softmax(logits, dim=-1)
    picked = torch.gather(logits, -1, labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution given by ``logits``: ``(..., V)`` -> ``(...)``.

    # H = logsumexp(z) - sum_v softmax(z)_v * z_v
    """
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


SumAcross = Callable[[torch.Tensor], torch.Tensor]  # element-wise sum over processes (ppo_core.distributed)


def _masked_sum_and_count(values: torch.Tensor, mask: torch.Tensor, sum_across: SumAcross | None):
    """``(sum of values where mask, number of such positions)``, over every process when ``sum_across`` is given."""
    total, count = (values * mask).sum(), mask.sum()
    if sum_across is not None:
        total, count = sum_across(torch.stack([total, count]))  # one collective for both
    return total, count


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None,
                sum_across: SumAcross | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1 (all of them, or along ``axis``).

    ``sum_across`` (a cross-process sum, e.g. ``ProcessGroup.sum_across``) makes it the mean over the masked
    positions of every process: ``sum_p sum(x_p * m_p) / sum_p sum(m_p)``.
    """
    mask = mask.to(values.dtype)
    if axis is None:
        total, count = _masked_sum_and_count(values, mask, sum_across)
        return total / count
    if sum_across is not None:
        raise ValueError("masked_mean: sum_across reduces over every position; it cannot be combined with axis.")
    return (values * mask).sum(axis=axis) / mask.sum(axis=axis)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True,
               sum_across: SumAcross | None = None) -> torch.Tensor:
    """Variance of ``values`` over the masked positions (Bessel-corrected when ``unbiased``); over every
    process's masked positions when ``sum_across`` is given (two passes: the global mean, then the deviations).

    An empty mask, or a single valid token when ``unbiased``, is a ValueError saying what to change: reading the
    count costs a host sync (on a GPU), so the trainer's per-mini-batch statistics use :func:`masked_variances`."""
    variances, n = _masked_variances([values], mask, unbiased, sum_across)
    if unbiased:
        if n == 0:
            raise ValueError(
                "masked_var: the mask is empty (no valid token); this happens with mini_batch_size=1 and an "
                "empty response. Increase mini_batch_size or make sure responses are non-empty."
            )
        if n == 1:
            raise ValueError(
                "masked_var: the mask has one valid token, so the unbiased variance is undefined; "
                "this happens with mini_batch_size=1 and one-token responses. Increase mini_batch_size."
            )
    return variances[0]


def masked_variances(values: list[torch.Tensor], mask: torch.Tensor,
                     sum_across: SumAcross | None = None) -> torch.Tensor:
    """``(k,)`` the unbiased :func:`masked_var` of each of ``k`` tensors shaped like ``mask``, with two collectives
    in all and no host sync: an empty mask, or a single valid token, gives NaN (no error; the caller checks)."""
    return _masked_variances(values, mask, True, sum_across)[0]


def _masked_variances(values: list[torch.Tensor], mask: torch.Tensor, unbiased: bool,
                      sum_across: SumAcross | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``((k,) variances, the valid-token count)``; the sums of every tensor (and the count) go through one
    collective per pass, and the arithmetic per tensor is :func:`masked_var`'s, op for op."""
    mask = mask.to(values[0].dtype)
    # mean = sum(x * m) / sum(m) ;  var = sum((x - mean)^2 * m) / n  (* n / (n - 1) when unbiased)
    first = torch.stack([*((x * mask).sum() for x in values), mask.sum()])  # (k + 1,)
    first = sum_across(first) if sum_across is not None else first
    means, count = first[:-1] / first[-1], first[-1]
    second = torch.stack([*(((x - m) ** 2 * mask).sum() for x, m in zip(values, means)), mask.sum()])
    second = sum_across(second) if sum_across is not None else second
    squares, n = second[:-1], second[-1]
    variances = squares / n
    if unbiased:
        variances = variances * n / (n - 1)
    return variances, count


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  sum_across: SumAcross | None = None) -> torch.Tensor:
    """Standardise ``values`` with the masked mean and (unbiased) variance.

    # x' = (x - mean) / sqrt(var + 1e-8)    (+ mean again when ``shift_mean`` is False)

    ``shift_mean=False`` keeps the original mean (used for reward whitening, legacy semantics).
    Masked-out positions are transformed too; callers multiply by the mask where it matters.
    With ``sum_across``, mean and variance are those of every process's masked positions.
    """
    mean = masked_mean(values, mask, sum_across=sum_across)
    var = masked_var(values, mask, sum_across=sum_across)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def whiten(values: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Unmasked :func:`masked_whiten` (unbiased variance, as ``torch.var``)."""
    mean, var = values.mean(), values.var()
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor | float, tensor_max: torch.Tensor | float) -> torch.Tensor:
    """Element-wise ``min(max(x, tensor_min), tensor_max)``; bounds may be tensors."""
    return torch.max(torch.min(x, torch.as_tensor(tensor_max, dtype=x.dtype, device=x.device)),
                     torch.as_tensor(tensor_min, dtype=x.dtype, device=x.device))


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


def add_suffix(input_dict: Mapping[str, Any], suffix: str) -> dict[str, Any]:
    """``{key + suffix: value}``."""
    return {k + suffix: v for k, v in input_dict.items()}


def average_torch_dicts(list_of_dicts: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per key, the mean of the dicts' tensors (same shapes) over the list: ``{key: mean_i d_i[key]}``."""
    return {key: torch.mean(torch.stack([d[key] for d in list_of_dicts]), dim=0) for key in list_of_dicts[0]}


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

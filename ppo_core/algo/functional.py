"""Pure tensor functions with the names and semantics of TRL's legacy ``trl.core``: log-probabilities and entropies
from logits, masked statistics and whitening (optionally summed over processes by a function the caller passes), and
the stats-dict helpers. Nothing here reads a config, a model or a file; ``ppo_core.core`` re-exports all of it.

Notation: ``B`` batch, ``T`` sequence (or response) length, ``V`` vocabulary size.
Mask convention everywhere: ``mask`` is 1 (or True) for a valid token and 0 for padding.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F

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


def add_suffix(input_dict: Mapping[str, Any], suffix: str) -> dict[str, Any]:
    """``{key + suffix: value}``."""
    return {k + suffix: v for k, v in input_dict.items()}


def average_torch_dicts(list_of_dicts: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per key, the mean of the dicts' tensors (same shapes) over the list: ``{key: mean_i d_i[key]}``."""
    return {key: torch.mean(torch.stack([d[key] for d in list_of_dicts]), dim=0) for key in list_of_dicts[0]}

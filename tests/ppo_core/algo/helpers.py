"""Helpers of the algo math tests (``test_ppo_math.py``, ``test_functional.py``): float64 tensors, the hypothesis
settings, random right-padded masks and hypothesis strategies for (rows x tokens) arrays and masks."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

HYPO = settings(max_examples=40, deadline=None)
f64 = torch.float64


def t(x, dtype=f64):
    return torch.tensor(x, dtype=dtype)


def random_mask(batch: int, length: int, gen: torch.Generator, holes: bool = True) -> torch.Tensor:
    """Right-padded rows of random lengths >= 1, optionally with random holes (user response masks)."""
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0] = length  # at least one full row
    mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    if holes:
        mask = mask * (torch.rand(batch, length, generator=gen) > 0.2).double()
        mask[0, :2] = 1.0  # at least two valid tokens in the batch
    return mask


def row_arrays(min_value=-5.0, max_value=5.0, shape=(3, 6)):
    return arrays(np.float64, shape, elements=st.floats(min_value, max_value, allow_nan=False))


def mask_arrays(shape=(3, 6)):
    # at least two valid tokens (position 0 of rows 0 and 1) so that unbiased variances exist
    return arrays(np.bool_, shape, elements=st.booleans()).map(
        lambda m: np.where(np.isin(np.arange(m.size).reshape(m.shape), [0, shape[1]]), True, m))

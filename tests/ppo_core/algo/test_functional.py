"""ppo_core.algo.functional (trl.core's math, re-exported by ``ppo_core.core``): masked statistics, whitening, entropy
and log-probabilities from logits.

Three kinds of test: (a) tiny cases with the arithmetic in comments, (b) the function against a plain
loop / plain log-softmax, (c) hypothesis properties. Expected values never come from the function under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given

from ppo_core.core import entropy_from_logits, logprobs_from_logits, masked_mean, masked_var, masked_whiten, whiten
from tests.ppo_core.algo.helpers import HYPO, f64, mask_arrays, random_mask, row_arrays, t

torch.set_num_threads(1)  # tiny tensors: extra threads only add spin-up cost


# ---------------------------------------------------------------------------------------------------
# (a) tiny cases computed by hand
# ---------------------------------------------------------------------------------------------------
def test_masked_mean_var_by_hand():
    values = t([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    # valid entries 1, 2, 4: mean = 7/3
    torch.testing.assert_close(masked_mean(values, mask), t(7 / 3))
    # per row: (1 + 2) / 2 = 1.5 ; 4 / 1 = 4
    torch.testing.assert_close(masked_mean(values, mask, axis=1), t([1.5, 4.0]))
    # deviations -4/3, -1/3, 5/3 -> squares 16/9 + 1/9 + 25/9 = 42/9
    # biased var = 42/9 / 3 = 14/9 ; unbiased = 42/9 / 2 = 7/3
    torch.testing.assert_close(masked_var(values, mask, unbiased=False), t(14 / 9))
    torch.testing.assert_close(masked_var(values, mask), t(7 / 3))


def test_masked_var_rejects_empty_and_single_token_masks():
    values = t([[1.0, 2.0]])
    with pytest.raises(ValueError, match="mini_batch_size"):
        masked_var(values, t([[0, 0]]))
    with pytest.raises(ValueError, match="mini_batch_size"):
        masked_var(values, t([[1, 0]]))


def test_masked_whiten_by_hand():
    values = t([[1.0, 3.0, 100.0]])
    mask = t([[1, 1, 0]])
    # mean = 2, unbiased var = ((1-2)^2 + (3-2)^2) / 1 = 2
    # whitened = (x - 2) / sqrt(2 + 1e-8)
    s = math.sqrt(2 + 1e-8)
    out = masked_whiten(values, mask)
    torch.testing.assert_close(out[:, :2], t([[-1 / s, 1 / s]]), atol=1e-12, rtol=0)
    # shift_mean=False adds the mean back: 2 -+ 1/sqrt(2)
    out = masked_whiten(values, mask, shift_mean=False)
    torch.testing.assert_close(out[:, :2], t([[2 - 1 / s, 2 + 1 / s]]), atol=1e-12, rtol=0)
    # unmasked whiten: same on [1, 3]
    torch.testing.assert_close(whiten(t([1.0, 3.0])), t([-1 / s, 1 / s]), atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------------
# (b) equivalence with naive versions
# ---------------------------------------------------------------------------------------------------
def naive_entropy(logits):
    # H = -sum_v p_v log p_v
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def test_entropy_from_logits_matches_naive_entropy():
    logits = torch.randn(3, 4, 17, generator=torch.Generator().manual_seed(3), dtype=f64) * 3
    torch.testing.assert_close(entropy_from_logits(logits), naive_entropy(logits), atol=1e-10, rtol=0)
    # a uniform distribution over V tokens has entropy log V
    torch.testing.assert_close(entropy_from_logits(torch.zeros(2, 17, dtype=f64)), torch.full((2,), math.log(17),
                               dtype=f64))


def test_logprobs_from_logits_matches_log_softmax_gather():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 6, 19, generator=gen, dtype=f64) * 4
    labels = torch.randint(0, 19, (2, 6), generator=gen)
    want = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(logprobs_from_logits(logits, labels), want, atol=1e-12, rtol=0)
    torch.testing.assert_close(logprobs_from_logits(logits, labels, gather=False), torch.log_softmax(logits, -1),
                               atol=1e-12, rtol=0)
    # half-precision logits come back in float32
    out = logprobs_from_logits(logits.bfloat16(), labels)
    assert out.dtype == torch.float32
    want_bf16 = torch.log_softmax(logits.bfloat16().float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    torch.testing.assert_close(out, want_bf16, atol=1e-5, rtol=0)


@pytest.mark.parametrize("seed", range(4))
def test_masked_stats_match_plain_stats_of_the_unmasked_slice(seed):
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(4, 7, generator=gen, dtype=f64)
    mask = random_mask(4, 7, gen)
    sel = values[mask.bool()]
    torch.testing.assert_close(masked_mean(values, mask), sel.mean(), atol=1e-12, rtol=0)
    torch.testing.assert_close(masked_var(values, mask), sel.var(unbiased=True), atol=1e-12, rtol=0)
    torch.testing.assert_close(masked_var(values, mask, unbiased=False), sel.var(unbiased=False), atol=1e-12, rtol=0)
    rows = [values[i][mask[i].bool()].mean() for i in range(4) if mask[i].sum() > 0]
    per_row = masked_mean(values, mask, axis=1)[mask.sum(1) > 0]
    torch.testing.assert_close(per_row, torch.stack(rows), atol=1e-12, rtol=0)
    # bool and float masks agree
    torch.testing.assert_close(masked_mean(values, mask.bool()), sel.mean(), atol=1e-12, rtol=0)


# ---------------------------------------------------------------------------------------------------
# (c) properties
# ---------------------------------------------------------------------------------------------------
@HYPO
@given(values=row_arrays(-100.0, 100.0), mask=mask_arrays())
def test_masked_whiten_standardises_the_valid_entries(values, mask):
    v, m = torch.from_numpy(values), torch.from_numpy(mask).double()
    sel = v[m.bool()]
    if sel.var().item() < 1e-3:  # (nearly) constant: the 1e-8 guard dominates, nothing to standardise
        return
    out = masked_whiten(v, m)[m.bool()]
    assert out.mean().item() == pytest.approx(0.0, abs=1e-9)
    assert out.var(unbiased=True).item() == pytest.approx(1.0, abs=1e-5)

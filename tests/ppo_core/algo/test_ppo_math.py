"""ppo_core.algo.ppo_math, the pure PPO math: KL penalties, reward shaping, GAE, the clipped losses; hand-computed
cases, naive-version equivalences, properties. The masked statistics it builds on are ``test_functional.py``, the KL
controllers ``test_kl_control.py``, the LM head's log-probabilities ``tests/ppo_core/models/test_logprobs.py``.

Three kinds of test: (a) tiny cases with the arithmetic in comments, (b) the vectorised
or fused function against a plain loop / plain log-softmax, (c) hypothesis properties. Expected values
never come from the function under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ppo_core.algo.ppo_math import discount_matrix, gae_advantages, kl_penalty, policy_loss, shape_rewards, value_loss
from ppo_core.core import masked_mean, masked_var, masked_whiten
from tests.ppo_core.algo.helpers import HYPO, f64, mask_arrays, random_mask, row_arrays, t

torch.set_num_threads(1)  # tiny tensors: extra threads only add spin-up cost


# ---------------------------------------------------------------------------------------------------
# (a) tiny cases computed by hand
# ---------------------------------------------------------------------------------------------------
def test_kl_penalty_modes_by_hand():
    logprobs, ref = t([[-1.0, -2.0]]), t([[-1.5, -1.0]])
    # diff = logp - ref = [0.5, -1.0]
    torch.testing.assert_close(kl_penalty(logprobs, ref, "kl"), t([[0.5, -1.0]]))
    torch.testing.assert_close(kl_penalty(logprobs, ref, "abs"), t([[0.5, 1.0]]))
    # mse = 0.5 * diff^2 = [0.125, 0.5]
    torch.testing.assert_close(kl_penalty(logprobs, ref, "mse"), t([[0.125, 0.5]]))
    for bad in ("full", "KL", "l2"):
        with pytest.raises(ValueError, match="mode"):
            kl_penalty(logprobs, ref, bad)


def test_shape_rewards_puts_score_on_last_valid_token():
    scores = t([2.0, -1.0])
    kls = t([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]])
    mask = t([[1, 1, 1], [1, 1, 0]])  # row 1: 2-token response, padded
    out = shape_rewards(scores, kls, mask, kl_coef=0.5)
    # non-score = -0.5 * kl * mask
    torch.testing.assert_close(out.non_score_rewards, t([[-0.05, -0.1, -0.15], [-0.2, -0.25, 0.0]]))
    # row 0: -0.15 + 2 = 1.85 on token 2 ; row 1: -0.25 - 1 = -1.25 on token 1 (its last valid one)
    torch.testing.assert_close(out.rewards, t([[-0.05, -0.1, 1.85], [-0.2, -1.25, 0.0]]))
    torch.testing.assert_close(out.kls, t([[0.1, 0.2, 0.3], [0.4, 0.5, 0.0]]))


def test_shape_rewards_with_response_mask_zeroing_the_last_token():
    # a 4-token response whose user mask drops token 1 and the last token 3: last valid token is 2
    kls = t([[1.0, 1.0, 1.0, 1.0]])
    mask = t([[1, 0, 1, 0]])
    out = shape_rewards(t([5.0]), kls, mask, kl_coef=0.1)
    # non-score = -0.1 * [1, 0, 1, 0]; the score 5 goes on position 2: -0.1 + 5 = 4.9
    torch.testing.assert_close(out.rewards, t([[-0.1, 0.0, 4.9, 0.0]]))


def test_gae_three_tokens_by_hand():
    values, rewards, mask = t([[1.0, 2.0, 3.0]]), t([[0.0, 0.0, 1.0]]), t([[1, 1, 1]])
    # gamma = 1, lam = 0.5, V_3 = 0:
    # delta_2 = 1 + 0 - 3 = -2 ; delta_1 = 0 + 3 - 2 = 1 ; delta_0 = 0 + 2 - 1 = 1
    # A_2 = -2 ; A_1 = 1 + 0.5 * -2 = 0 ; A_0 = 1 + 0.5 * 0 = 1
    # returns = A + V = [2, 2, 1]
    out = gae_advantages(values, rewards, mask, gamma=1.0, lam=0.5)
    torch.testing.assert_close(out.returns, t([[2.0, 2.0, 1.0]]))
    # whiten A = [1, 0, -2]: mean -1/3, unbiased var (16/9 + 1/9 + 25/9) / 2 = 7/3
    s = math.sqrt(7 / 3 + 1e-8)
    torch.testing.assert_close(out.advantages, t([[4 / 3 / s, 1 / 3 / s, -5 / 3 / s]]), atol=1e-12, rtol=0)

    # gamma = 0.5, lam = 1: returns are the discounted rewards-to-go
    # delta_2 = 1 - 3 = -2 ; delta_1 = 0 + 0.5 * 3 - 2 = -0.5 ; delta_0 = 0 + 0.5 * 2 - 1 = 0
    # A_2 = -2 ; A_1 = -0.5 + 0.5 * -2 = -1.5 ; A_0 = 0 + 0.5 * -1.5 = -0.75
    # returns = [0.25, 0.5, 1.0]  (= 0.25 * 1, 0.5 * 1, 1)
    out = gae_advantages(values, rewards, mask, gamma=0.5, lam=1.0)
    torch.testing.assert_close(out.returns, t([[0.25, 0.5, 1.0]]))


def test_gae_ignores_padding():
    # token 2 is padding with garbage value and reward: same as the 2-token problem values [1, 2], rewards [0, 1]
    values, rewards, mask = t([[1.0, 2.0, 100.0]]), t([[0.0, 1.0, 50.0]]), t([[1, 1, 0]])
    # gamma = 1, lam = 0.5: delta_1 = 1 + 0 - 2 = -1 ; delta_0 = 0 + 2 - 1 = 1
    # A_1 = -1 ; A_0 = 1 + 0.5 * -1 = 0.5 ; returns = [1.5, 1.0] ; padding: A = 0, V = 0 -> 0
    out = gae_advantages(values, rewards, mask, gamma=1.0, lam=0.5)
    torch.testing.assert_close(out.returns, t([[1.5, 1.0, 0.0]]))
    # whiten [0.5, -1]: mean -0.25, unbiased var 0.75^2 * 2 = 1.125
    s = math.sqrt(1.125 + 1e-8)
    torch.testing.assert_close(out.advantages, t([[0.75 / s, -0.75 / s, 0.0]]), atol=1e-12, rtol=0)


def test_policy_loss_clip_cases_by_hand():
    e = math.exp
    # tokens: (A, log ratio): ratio e^0.5 = 1.6487 and e^-0.5 = 0.6065 lie outside [0.8, 1.2]
    adv = t([[1.0, 1.0, -1.0, -1.0, 2.0, 7.0]])
    log_ratio = t([[0.5, -0.5, 0.5, -0.5, math.log(1.1), 3.0]])
    mask = t([[1, 1, 1, 1, 1, 0]])  # the last token is padding and must not count
    old = t([[-1.0, -2.0, -3.0, -1.5, -0.7, -2.0]])
    out = policy_loss(old + log_ratio, old, adv, mask, cliprange=0.2)
    # A=+1, r=1.6487: max(-1.6487, -1.2)  = -1.2      clipped branch
    # A=+1, r=0.6065: max(-0.6065, -0.8)  = -0.6065   unclipped
    # A=-1, r=1.6487: max(1.6487, 1.2)    = 1.6487    unclipped
    # A=-1, r=0.6065: max(0.6065, 0.8)    = 0.8       clipped branch
    # A=+2, r=1.1:    max(-2.2, -2.2)     = -2.2      inside the range: not clipped
    expected = (-1.2 - e(-0.5) + e(0.5) + 0.8 - 2.2) / 5
    torch.testing.assert_close(out.loss, t(expected))
    torch.testing.assert_close(out.clipfrac, t(2 / 5))
    # approxkl = 0.5 * mean(log_ratio^2) = 0.5 * (4 * 0.25 + log(1.1)^2) / 5
    torch.testing.assert_close(out.approxkl, t(0.5 * (1.0 + math.log(1.1) ** 2) / 5))
    # policykl = mean(-log_ratio) = -log(1.1) / 5
    torch.testing.assert_close(out.policykl, t(-math.log(1.1) / 5))
    torch.testing.assert_close(out.ratio_mean, t((2 * e(0.5) + 2 * e(-0.5) + 1.1) / 5))


def test_value_loss_clip_cases_by_hand():
    old = t([[0.0, 0.0, 0.0, 0.0]])
    vpreds = t([[1.0, 1.0, 0.1, 9.0]])
    returns = t([[1.0, -1.0, 0.5, 9.0]])
    mask = t([[1, 1, 1, 0]])
    out = value_loss(vpreds, old, returns, mask, cliprange_value=0.2)
    # v=1,  R=1:   v_clip=0.2: (1-1)^2 = 0,     (0.2-1)^2 = 0.64 -> 0.64 (clipped larger)
    # v=1,  R=-1:  v_clip=0.2: (1+1)^2 = 4,     (0.2+1)^2 = 1.44 -> 4
    # v=.1, R=0.5: inside:     (0.1-0.5)^2 = 0.16 both         -> 0.16 (not counted as clipped)
    # loss = 0.5 * (0.64 + 4 + 0.16) / 3 = 0.8 ; clipfrac = 1/3
    torch.testing.assert_close(out.loss, t(0.8))
    torch.testing.assert_close(out.clipfrac, t(1 / 3))


# ---------------------------------------------------------------------------------------------------
# (b) equivalence with naive versions
# ---------------------------------------------------------------------------------------------------
def naive_gae(values, rewards, mask, gamma, lam, whiten_rewards=False):
    """The legacy trainer's ``compute_advantages``: a reverse Python loop, then whitening of the valid entries.

    Returns ``(whitened advantages, returns, raw advantages)``.
    """
    values, rewards = values * mask, rewards * mask
    valid = mask.bool()
    if whiten_rewards:
        sel = rewards[valid]
        rewards = ((rewards - sel.mean()) / torch.sqrt(sel.var(unbiased=True) + 1e-8) + sel.mean()) * mask
    length = values.shape[1]
    lastgaelam, reversed_adv = 0.0, []
    for step in reversed(range(length)):
        nextvalues = values[:, step + 1] if step < length - 1 else 0.0
        delta = rewards[:, step] + gamma * nextvalues - values[:, step]
        lastgaelam = delta + gamma * lam * lastgaelam
        reversed_adv.append(lastgaelam)
    advantages = torch.stack(reversed_adv[::-1], dim=1)
    returns = advantages + values
    sel = advantages[valid]
    whitened = (advantages - sel.mean()) / torch.sqrt(sel.var(unbiased=True) + 1e-8)
    return whitened, returns, advantages


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("whiten_rewards", [False, True])
def test_vectorised_gae_matches_reverse_loop(seed, whiten_rewards):
    gen = torch.Generator().manual_seed(seed)
    batch, length = 5, 9
    gamma = float(torch.rand((), generator=gen)) * 0.5 + 0.5
    lam = float(torch.rand((), generator=gen))
    values = torch.randn(batch, length, generator=gen, dtype=f64)
    rewards = torch.randn(batch, length, generator=gen, dtype=f64)
    mask = random_mask(batch, length, gen)
    out = gae_advantages(values, rewards, mask, gamma, lam, whiten_rewards=whiten_rewards)
    exp_adv, exp_returns, _ = naive_gae(values, rewards, mask, gamma, lam, whiten_rewards)
    valid = mask.bool()
    torch.testing.assert_close(out.advantages[valid], exp_adv[valid], atol=1e-10, rtol=0)
    torch.testing.assert_close(out.returns, exp_returns, atol=1e-10, rtol=0)
    assert torch.all(out.advantages[~valid] == 0)


# ---------------------------------------------------------------------------------------------------
# (c) properties
# ---------------------------------------------------------------------------------------------------
@HYPO
@given(logprobs=row_arrays(-10.0, 0.0), adv=row_arrays(), mask=mask_arrays(), cliprange=st.floats(0.01, 0.5))
def test_no_clipping_and_zero_kl_when_the_policy_is_unchanged(logprobs, adv, mask, cliprange):
    lp, m = torch.from_numpy(logprobs), torch.from_numpy(mask).double()
    out = policy_loss(lp, lp.clone(), torch.from_numpy(adv), m, cliprange)
    assert out.clipfrac.item() == 0.0
    assert out.approxkl.item() == 0.0
    assert out.policykl.item() == 0.0
    assert out.ratio_mean.item() == 1.0
    # with ratio 1 the loss is -E[A]
    assert out.loss.item() == pytest.approx(-adv[mask].mean(), abs=1e-12)


@HYPO
@given(log_ratio=st.floats(1e-4, math.log(1.19)), adv=row_arrays(), mask=mask_arrays(), delta=st.floats(0.01, 3.0))
def test_policy_loss_decreases_as_advantage_increases(log_ratio, adv, mask, delta):
    # ratio fixed in (1, 1 + cliprange): the clip is inactive and L = -E[A * ratio] falls as A rises
    m = torch.from_numpy(mask).double()
    old = torch.zeros(3, 6, dtype=f64)
    new = old + log_ratio
    low = policy_loss(new, old, torch.from_numpy(adv), m, cliprange=0.2)
    high = policy_loss(new, old, torch.from_numpy(adv) + delta, m, cliprange=0.2)
    assert high.loss.item() < low.loss.item()
    assert high.loss.item() == pytest.approx(low.loss.item() - delta * math.exp(log_ratio), abs=1e-9)


@HYPO
@given(values=row_arrays(), noise=row_arrays(-1e3, 1e3), mask=mask_arrays())
def test_masked_stats_ignore_masked_positions(values, noise, mask):
    v, m = torch.from_numpy(values), torch.from_numpy(mask).double()
    other = torch.where(m.bool(), v, torch.from_numpy(noise))  # same valid entries, different padding
    valid = m.bool()
    assert masked_mean(v, m).item() == pytest.approx(masked_mean(other, m).item(), abs=1e-12)
    assert masked_var(v, m).item() == pytest.approx(masked_var(other, m).item(), abs=1e-12)
    torch.testing.assert_close(masked_whiten(v, m)[valid], masked_whiten(other, m)[valid], atol=1e-9, rtol=0)
    zeros = torch.zeros_like(v)
    # log-probabilities at padding stay in a log-probability's range: exp() of a garbage +700 is inf, and
    # inf * 0 is NaN in any multiply-by-mask mean (the trainer itself writes 0 there)
    other_logprobs = torch.where(m.bool(), v, -torch.from_numpy(noise).abs() / 50)
    pairs = [(lambda x: policy_loss(x, zeros, v, m, 0.2).loss, other_logprobs),  # new logprobs at padding
             (lambda x: policy_loss(zeros, x, v, m, 0.2).loss, other_logprobs),  # old logprobs at padding
             (lambda x: policy_loss(zeros, zeros, x, m, 0.2).loss, other),  # advantages at padding
             (lambda x: value_loss(x, zeros, v, m, 0.2).loss, other),  # value predictions at padding
             (lambda x: value_loss(v, x, v, m, 0.2).loss, other),  # old values at padding
             (lambda x: value_loss(v, zeros, x, m, 0.2).loss, other)]  # returns at padding
    for fn, changed in pairs:
        assert fn(v).item() == pytest.approx(fn(changed).item(), abs=1e-9)
    a, b = gae_advantages(v, v, m, 0.9, 0.95), gae_advantages(other, other, m, 0.9, 0.95)
    torch.testing.assert_close(a.advantages, b.advantages, atol=1e-9, rtol=0)
    torch.testing.assert_close(a.returns, b.returns, atol=1e-9, rtol=0)


@HYPO
@given(values=row_arrays(), rewards=row_arrays(), mask=mask_arrays(), gamma=st.floats(0.5, 1.0),
       lam=st.floats(0.0, 1.0))
def test_whitened_advantages_have_zero_mean_and_unit_variance(values, rewards, mask, gamma, lam):
    v, r, m = torch.from_numpy(values), torch.from_numpy(rewards), torch.from_numpy(mask).double()
    valid = m.bool()
    sel = gae_advantages(v, r, m, gamma, lam).advantages[valid]
    raw_var = naive_gae(v, r, m, gamma, lam)[2][valid].var(unbiased=True).item()
    assert sel.mean().item() == pytest.approx(0.0, abs=1e-9)
    # var(whitened) = var / (var + 1e-8): 1 up to the guard, unless the raw advantages are constant
    assert sel.var(unbiased=True).item() == pytest.approx(raw_var / (raw_var + 1e-8), abs=1e-9)
    if raw_var > 1e-3:
        assert sel.var(unbiased=True).item() == pytest.approx(1.0, abs=1e-5)


@HYPO
@given(x=arrays(np.float64, (2, 7), elements=st.floats(-10, 10)), discount=st.floats(0.0, 1.0))
def test_discount_matrix_product_is_the_reverse_discounted_cumsum(x, discount):
    got = torch.from_numpy(x) @ discount_matrix(7, discount, f64, "cpu")
    # y_t = x_t + discount * y_{t+1}, y_7 = 0
    want = np.zeros_like(x)
    running = np.zeros(2)
    for step in reversed(range(7)):
        running = x[:, step] + discount * running
        want[:, step] = running
    np.testing.assert_allclose(got.numpy(), want, atol=1e-10, rtol=0)


def test_gae_with_a_user_mask_and_whitened_rewards_by_hand():
    """One sample, three response tokens, the last masked out by the user; gamma 1, lam 0.5, whiten_rewards on."""
    values = torch.tensor([[0.5, 1.0, 9.0]], dtype=torch.float64)
    rewards = torch.tensor([[1.0, 3.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    out = gae_advantages(values, rewards, mask, gamma=1.0, lam=0.5, whiten_rewards=True)
    # masked: V = [0.5, 1, 0], r = [1, 3, 0]. Rewards whitened over the two valid tokens, their mean kept:
    #   mean 2, unbiased var ((1-2)^2 + (3-2)^2) / 1 = 2  ->  r = [2 - 1/sqrt(2), 2 + 1/sqrt(2), 0]
    s = 1 / math.sqrt(2)
    r0, r1 = 2 - s, 2 + s
    # deltas: d0 = r0 + V1 - V0 = r0 + 0.5 ; d1 = r1 + 0 - V1 = r1 - 1 ; d2 = 0
    d0, d1 = r0 + 0.5, r1 - 1.0
    # A1 = d1 ; A0 = d0 + 0.5 * A1 ; returns = A + V
    a1 = d1
    a0 = d0 + 0.5 * a1
    torch.testing.assert_close(out.returns, torch.tensor([[a0 + 0.5, a1 + 1.0, 0.0]], dtype=torch.float64))
    # advantages whitened over the two valid tokens: two values always become -+1/sqrt(2) (a0 > a1 here), 0 at the mask
    torch.testing.assert_close(out.advantages, torch.tensor([[s, -s, 0.0]], dtype=torch.float64), atol=1e-8, rtol=0)

"""The pure PPO math of ppo_core: hand-computed cases, naive-version equivalences, properties.

Three kinds of test (see STYLE.md): (a) tiny cases with the arithmetic in comments, (b) the vectorised
or fused function against a plain loop / plain log-softmax, (c) hypothesis properties. Expected values
never come from the function under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

import ppo_core.models.logprobs as logprobs_module
from ppo_core.algo.kl_control import AdaptiveKLController, FixedKLController, RunningMoments
from ppo_core.algo.ppo_math import discount_matrix, gae_advantages, kl_penalty, policy_loss, shape_rewards, value_loss
from ppo_core.core import entropy_from_logits, logprobs_from_logits, masked_mean, masked_var, masked_whiten, whiten
from ppo_core.models.logprobs import LMHead, full_kl, selected_entropy, selected_logprobs, selected_logprobs_and_entropy

torch.set_num_threads(1)  # tiny tensors: extra threads only add spin-up cost
HYPO = settings(max_examples=40, deadline=None)
f64 = torch.float64


def t(x, dtype=f64):
    return torch.tensor(x, dtype=dtype)


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


def test_adaptive_kl_controller_arithmetic():
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000)
    ctl.update(current=9.0, n_steps=128)
    # err = clip(9/6 - 1, -0.2, 0.2) = 0.2 ; value = 0.2 * (1 + 0.2 * 128 / 10000) = 0.2 * 1.00256
    assert ctl.value == pytest.approx(0.2 * 1.00256, abs=1e-15)
    ctl.update(current=6.0, n_steps=128)  # err = 0: unchanged
    assert ctl.value == pytest.approx(0.2 * 1.00256, abs=1e-15)
    ctl.update(current=3.0, n_steps=100)
    # err = clip(3/6 - 1) = clip(-0.5) = -0.2 ; factor = 1 - 0.2 * 100 / 10000 = 0.998
    assert ctl.value == pytest.approx(0.2 * 1.00256 * 0.998, abs=1e-15)
    ctl.update(current=6.6, n_steps=1000)
    # err = 6.6/6 - 1 = 0.1 (inside the clip) ; factor = 1 + 0.1 * 0.1 = 1.01
    assert ctl.value == pytest.approx(0.2 * 1.00256 * 0.998 * 1.01, abs=1e-15)

    restored = AdaptiveKLController(1.0, 1.0, 1.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.state_dict() == ctl.state_dict()


def test_fixed_kl_controller_is_constant():
    ctl = FixedKLController(0.05)
    for current in (0.0, 100.0, -5.0):
        ctl.update(current, n_steps=64)
    assert ctl.value == 0.05
    restored = FixedKLController(1.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == 0.05


def test_running_moments_match_numpy_over_several_batches():
    rng = np.random.default_rng(0)
    running, seen = RunningMoments(), []
    for size, loc, scale in [(5, 1.0, 2.0), (17, -3.0, 0.5), (2, 10.0, 1.0), (40, 0.0, 3.0)]:
        batch = rng.normal(loc, scale, size)
        seen.extend(batch)
        batch_mean, batch_std = running.update(torch.tensor(batch))
        assert batch_mean == pytest.approx(np.mean(batch), abs=1e-10)
        assert batch_std == pytest.approx(np.std(batch, ddof=1), abs=1e-10)
        assert running.mean == pytest.approx(np.mean(seen), abs=1e-10)
        assert running.var == pytest.approx(np.var(seen), abs=1e-10)
        assert running.std == pytest.approx(np.std(seen, ddof=1), abs=1e-10)
    restored = RunningMoments()
    restored.load_state_dict(running.state_dict())
    assert restored.state_dict() == running.state_dict()


# ---------------------------------------------------------------------------------------------------
# (b) equivalence with naive versions
# ---------------------------------------------------------------------------------------------------
def random_mask(batch: int, length: int, gen: torch.Generator, holes: bool = True) -> torch.Tensor:
    """Right-padded rows of random lengths >= 1, optionally with random holes (user response masks)."""
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    lengths[0] = length  # at least one full row
    mask = (torch.arange(length)[None, :] < lengths[:, None]).double()
    if holes:
        mask = mask * (torch.rand(batch, length, generator=gen) > 0.2).double()
        mask[0, :2] = 1.0  # at least two valid tokens in the batch
    return mask


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


def naive_logprobs(hidden, weight, bias, targets, scale=1.0, softcap=None):
    # logits = softcap * tanh(scale * (h @ W^T + b) / softcap)
    logits = scale * (hidden @ weight.T + (bias if bias is not None else 0.0))
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


HEAD_CASES = [  # (scale, softcap, bias?, chunk size)
    (1.0, None, True, None),
    (1.0, None, False, 3),  # 3 does not divide N = 11
    (0.25, None, True, 4),
    (1.0, 2.0, True, 5),
    (2.0, 1.5, False, 1),
    (1.0, None, True, 64),  # one chunk larger than N
]


@pytest.fixture(params=["saved-probs", "recomputed"])
def backward_path(request, monkeypatch):
    """The backward either reuses the forward's probabilities (when they fit) or recomputes each chunk."""
    if request.param == "recomputed":
        monkeypatch.setattr(logprobs_module, "_SAVE_PROBS_ELEMENTS", 0)
    return request.param


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("scale,softcap,with_bias,chunk", HEAD_CASES)
def test_selected_logprobs_values_and_grads_match_log_softmax(dtype, atol, scale, softcap, with_bias, chunk,
                                                              backward_path):
    gen = torch.Generator().manual_seed(0)
    n, hidden_size, vocab = 11, 8, 23
    hidden = torch.randn(n, hidden_size, generator=gen, dtype=dtype).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=dtype).requires_grad_()
    bias = torch.randn(vocab, generator=gen, dtype=dtype).requires_grad_() if with_bias else None
    targets = torch.randint(0, vocab, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen, dtype=dtype)
    leaves = [hidden, weight] + ([bias] if with_bias else [])

    got = selected_logprobs(hidden, LMHead(weight, bias, scale, softcap), targets, chunk_size=chunk)
    want = naive_logprobs(hidden, weight, bias, targets, scale, softcap)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    got_grads = torch.autograd.grad((got * upstream).sum(), leaves)
    want_grads = torch.autograd.grad((want * upstream).sum(), leaves)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=atol, rtol=0)


@pytest.mark.parametrize("with_bias", [False, True])
def test_selected_logprobs_under_autocast_match_autograd_under_autocast(with_bias, backward_path):
    """Under bf16 autocast the head casts its inputs once and runs in bf16 with float32 softmax, exactly what
    autocast does to a plain ``linear`` + float32 ``log_softmax``: the same values, and float32 gradients for
    the float32 leaves that agree to bf16 rounding."""
    gen = torch.Generator().manual_seed(3)
    n, hidden_size, vocab = 12, 16, 50
    hidden = torch.randn(n, hidden_size, generator=gen).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=gen).requires_grad_()
    bias = torch.randn(vocab, generator=gen).requires_grad_() if with_bias else None
    targets = torch.randint(0, vocab, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen)
    leaves = [hidden, weight] + ([bias] if with_bias else [])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = selected_logprobs(hidden, LMHead(weight, bias), targets, chunk_size=5)
        logits = torch.nn.functional.linear(hidden, weight, bias)
        assert logits.dtype == torch.bfloat16  # the reference really runs in bf16
        want = torch.log_softmax(logits.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    got_grads = torch.autograd.grad((got * upstream).sum(), leaves)
    want_grads = torch.autograd.grad((want * upstream).sum(), leaves)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)


def test_selected_logprobs_passes_gradcheck(backward_path):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 4, generator=gen, dtype=f64, requires_grad=True)
    weight = torch.randn(7, 4, generator=gen, dtype=f64, requires_grad=True)
    bias = torch.randn(7, generator=gen, dtype=f64, requires_grad=True)
    targets = torch.randint(0, 7, (5,), generator=gen)
    fn = lambda h, w, b: selected_logprobs(h, LMHead(w, b, 0.5, 3.0), targets, chunk_size=2)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


@pytest.mark.parametrize("with_entropy", [False, True])
def test_selected_logprobs_are_bit_identical_with_and_without_grad(with_entropy, backward_path):
    """The rollout's no-grad pass (trainable or frozen weights) and the loss pass give the very same numbers:
    a policy and its identical reference have a KL of exactly 0, and the first PPO ratio is exactly 1.
    (Only for the same rows in one chunk: a matmul's rounding depends on how many rows it is given.)"""
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(13, 16, generator=gen)
    weight = torch.randn(300, 16, generator=gen)
    targets = torch.randint(0, 300, (13,), generator=gen)
    fn = selected_logprobs_and_entropy if with_entropy else lambda *a, **k: (selected_logprobs(*a, **k),)
    frozen = fn(hidden, LMHead(weight), targets)
    with torch.no_grad():
        no_grad = fn(hidden, LMHead(weight.clone().requires_grad_()), targets)
    with_grad = fn(hidden.clone().requires_grad_(), LMHead(weight.clone().requires_grad_()), targets)
    for a, b, c in zip(frozen, no_grad, with_grad):
        assert torch.equal(a, b) and torch.equal(a, c.detach())


def naive_entropy(logits):
    # H = -sum_v p_v log p_v
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("scale,softcap,chunk", [(1.0, None, 3), (0.5, 2.0, 4), (1.0, None, None)])
def test_selected_entropy_matches_entropy_of_full_logits(scale, softcap, chunk):
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(10, 6, generator=gen, dtype=f64)
    weight = torch.randn(13, 6, generator=gen, dtype=f64)
    bias = torch.randn(13, generator=gen, dtype=f64)
    head = LMHead(weight, bias, scale, softcap)
    logits = scale * (hidden @ weight.T + bias)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    got = selected_entropy(hidden, head, chunk_size=chunk)
    torch.testing.assert_close(got, naive_entropy(logits), atol=1e-10, rtol=0)
    torch.testing.assert_close(got, entropy_from_logits(logits), atol=1e-10, rtol=0)
    targets = torch.randint(0, 13, (10,), generator=gen)
    logprobs, entropy = selected_logprobs_and_entropy(hidden, head, targets, chunk_size=chunk)
    torch.testing.assert_close(entropy, naive_entropy(logits), atol=1e-10, rtol=0)
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1),
                               atol=1e-10, rtol=0)


def test_entropy_from_logits_matches_naive_entropy():
    logits = torch.randn(3, 4, 17, generator=torch.Generator().manual_seed(3), dtype=f64) * 3
    torch.testing.assert_close(entropy_from_logits(logits), naive_entropy(logits), atol=1e-10, rtol=0)
    # a uniform distribution over V tokens has entropy log V
    torch.testing.assert_close(entropy_from_logits(torch.zeros(2, 17, dtype=f64)), torch.full((2,), math.log(17),
                               dtype=f64))


@pytest.mark.parametrize("chunk", [None, 3])
def test_full_kl_matches_kl_div(chunk):
    gen = torch.Generator().manual_seed(4)
    hidden, ref_hidden = torch.randn(7, 5, generator=gen, dtype=f64), torch.randn(7, 5, generator=gen, dtype=f64)
    weight, ref_weight = torch.randn(11, 5, generator=gen, dtype=f64), torch.randn(11, 5, generator=gen, dtype=f64)
    got = full_kl(hidden, LMHead(weight), ref_hidden, LMHead(ref_weight), chunk_size=chunk)
    logp = torch.log_softmax(hidden @ weight.T, -1)
    logq = torch.log_softmax(ref_hidden @ ref_weight.T, -1)
    # KL(p || q) = sum_v p_v (log p_v - log q_v) = kl_div(input=log q, target=log p)
    want = F.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    # identical distributions: zero
    same = full_kl(hidden, LMHead(weight), hidden, LMHead(weight), chunk_size=chunk)
    torch.testing.assert_close(same, torch.zeros(7, dtype=f64), atol=1e-12, rtol=0)


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
def row_arrays(min_value=-5.0, max_value=5.0, shape=(3, 6)):
    return arrays(np.float64, shape, elements=st.floats(min_value, max_value, allow_nan=False))


def mask_arrays(shape=(3, 6)):
    # at least two valid tokens (position 0 of rows 0 and 1) so that unbiased variances exist
    return arrays(np.bool_, shape, elements=st.booleans()).map(
        lambda m: np.where(np.isin(np.arange(m.size).reshape(m.shape), [0, shape[1]]), True, m))


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
@given(values=row_arrays(-100.0, 100.0), mask=mask_arrays())
def test_masked_whiten_standardises_the_valid_entries(values, mask):
    v, m = torch.from_numpy(values), torch.from_numpy(mask).double()
    sel = v[m.bool()]
    if sel.var().item() < 1e-3:  # (nearly) constant: the 1e-8 guard dominates, nothing to standardise
        return
    out = masked_whiten(v, m)[m.bool()]
    assert out.mean().item() == pytest.approx(0.0, abs=1e-9)
    assert out.var(unbiased=True).item() == pytest.approx(1.0, abs=1e-5)


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

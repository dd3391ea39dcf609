"""ppo_core.models.logprobs: the chunked log-probabilities, entropy and full KL of an LM head with a fused backward,
against a plain log-softmax of the full logits (values and gradients, both backward paths, under autocast, gradcheck).

As for the math (``tests/ppo_core/algo/test_ppo_math.py``): the fused function against a plain version, expected values
never from the function under test.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ppo_core.models.logprobs as logprobs_module
from ppo_core.core import entropy_from_logits
from ppo_core.models.logprobs import LMHead, full_kl, selected_entropy, selected_logprobs, selected_logprobs_and_entropy

torch.set_num_threads(1)  # tiny tensors: extra threads only add spin-up cost
f64 = torch.float64


def naive_logits(hidden, weight, bias, scale=1.0, softcap=None, temperature=1.0):
    # logits = softcap * tanh(scale * (h @ W^T + b) / softcap) / temperature  (the sampling's logits processor last)
    logits = scale * (hidden @ weight.T + (bias if bias is not None else 0.0))
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits / temperature


def naive_logprobs(hidden, weight, bias, targets, scale=1.0, softcap=None, temperature=1.0):
    logits = naive_logits(hidden, weight, bias, scale, softcap, temperature)
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


HEAD_CASES = [  # (scale, softcap, temperature, bias?, chunk size)
    (1.0, None, 1.0, True, None),
    (1.0, None, 1.0, False, 3),  # 3 does not divide N = 11
    (0.25, None, 1.0, True, 4),
    (1.0, 2.0, 1.0, True, 5),
    (2.0, 1.5, 1.0, False, 1),
    (1.0, None, 1.0, True, 64),  # one chunk larger than N
    (1.0, None, 0.7, True, 3),  # a sampling temperature: below 1 sharpens, above flattens
    (0.25, None, 1.6, False, None),
    (2.0, 1.5, 0.5, True, 4),  # after the soft cap, as the logits processor divides what the model outputs
]


@pytest.fixture(params=["saved-probs", "recomputed"])
def backward_path(request, monkeypatch):
    """The backward either reuses the forward's probabilities (when they fit) or recomputes each chunk."""
    if request.param == "recomputed":
        monkeypatch.setattr(logprobs_module, "_SAVE_PROBS_ELEMENTS", 0)
    return request.param


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("scale,softcap,temperature,with_bias,chunk", HEAD_CASES)
def test_selected_logprobs_values_and_grads_match_log_softmax(dtype, atol, scale, softcap, temperature, with_bias,
                                                              chunk, backward_path):
    gen = torch.Generator().manual_seed(0)
    n, hidden_size, vocab = 11, 8, 23
    hidden = torch.randn(n, hidden_size, generator=gen, dtype=dtype).requires_grad_()
    weight = torch.randn(vocab, hidden_size, generator=gen, dtype=dtype).requires_grad_()
    bias = torch.randn(vocab, generator=gen, dtype=dtype).requires_grad_() if with_bias else None
    targets = torch.randint(0, vocab, (n,), generator=gen)
    upstream = torch.randn(n, generator=gen, dtype=dtype)
    leaves = [hidden, weight] + ([bias] if with_bias else [])

    got = selected_logprobs(hidden, LMHead(weight, bias, scale, softcap, temperature), targets, chunk_size=chunk)
    want = naive_logprobs(hidden, weight, bias, targets, scale, softcap, temperature)
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


@pytest.mark.parametrize("softcap,temperature", [(3.0, 1.0), (3.0, 0.6)])  # (a soft cap: the chunked forward)
def test_selected_logprobs_passes_gradcheck(softcap, temperature, backward_path):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(5, 4, generator=gen, dtype=f64, requires_grad=True)
    weight = torch.randn(7, 4, generator=gen, dtype=f64, requires_grad=True)
    bias = torch.randn(7, generator=gen, dtype=f64, requires_grad=True)
    targets = torch.randint(0, 7, (5,), generator=gen)
    head = lambda w, b: LMHead(w, b, 0.5, softcap, temperature)  # noqa: E731
    fn = lambda h, w, b: selected_logprobs(h, head(w, b), targets, chunk_size=2)  # noqa: E731
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


@pytest.mark.parametrize("scale,softcap,temperature,chunk",
                         [(1.0, None, 1.0, 3), (0.5, 2.0, 1.0, 4), (1.0, None, 1.0, None), (0.5, 2.0, 0.7, 4)])
def test_selected_entropy_matches_entropy_of_full_logits(scale, softcap, temperature, chunk):
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(10, 6, generator=gen, dtype=f64)
    weight = torch.randn(13, 6, generator=gen, dtype=f64)
    bias = torch.randn(13, generator=gen, dtype=f64)
    head = LMHead(weight, bias, scale, softcap, temperature)
    logits = naive_logits(hidden, weight, bias, scale, softcap, temperature)
    got = selected_entropy(hidden, head, chunk_size=chunk)
    torch.testing.assert_close(got, naive_entropy(logits), atol=1e-10, rtol=0)
    torch.testing.assert_close(got, entropy_from_logits(logits), atol=1e-10, rtol=0)
    targets = torch.randint(0, 13, (10,), generator=gen)
    logprobs, entropy = selected_logprobs_and_entropy(hidden, head, targets, chunk_size=chunk)
    torch.testing.assert_close(entropy, naive_entropy(logits), atol=1e-10, rtol=0)
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1),
                               atol=1e-10, rtol=0)


@pytest.mark.parametrize("chunk,temperature", [(None, 1.0), (3, 1.0), (3, 0.7)])
def test_full_kl_matches_kl_div(chunk, temperature):
    gen = torch.Generator().manual_seed(4)
    hidden, ref_hidden = torch.randn(7, 5, generator=gen, dtype=f64), torch.randn(7, 5, generator=gen, dtype=f64)
    weight, ref_weight = torch.randn(11, 5, generator=gen, dtype=f64), torch.randn(11, 5, generator=gen, dtype=f64)
    got = full_kl(hidden, LMHead(weight, temperature=temperature), ref_hidden,
                  LMHead(ref_weight, temperature=temperature), chunk_size=chunk)
    logp = torch.log_softmax(hidden @ weight.T / temperature, -1)
    logq = torch.log_softmax(ref_hidden @ ref_weight.T / temperature, -1)
    # KL(p || q) = sum_v p_v (log p_v - log q_v) = kl_div(input=log q, target=log p)
    want = F.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)
    # identical distributions: zero
    same = full_kl(hidden, LMHead(weight), hidden, LMHead(weight), chunk_size=chunk)
    torch.testing.assert_close(same, torch.zeros(7, dtype=f64), atol=1e-12, rtol=0)

"""Token log-probabilities and entropies straight from hidden states, without full-vocabulary logits.

A plain forward pass materialises ``(B, T, V)`` logits (and often a float32 copy) for every position,
query and padding included, although PPO needs one number per *response* token. On a 32k vocabulary
that tensor dominates the step. Here the LM head is applied chunk by chunk to the ``N`` valid response
positions only, the log-softmax is reduced on the fly, and the backward pass works chunk by chunk too,
so peak extra memory is ``chunk_size x V`` (as in fused linear cross-entropy kernels).

Notation: ``N`` selected positions, ``H`` hidden size, ``V`` vocabulary, ``C`` chunk size.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

# Keep the (C, V) float32 logits block of a chunk within ~32 MB (fits a CPU's last-level cache's
# neighbourhood and is negligible on a GPU); at V = 32k that is 256 rows.
_CHUNK_ELEMENTS = 1 << 23
# Keep the softmax probabilities for the backward up to 256 MB (float32); beyond, recompute them.
_SAVE_PROBS_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class LMHead:
    """The output projection of a causal LM, with the logit transforms some architectures apply.

    # logits = softcap * tanh(scale * (h @ W^T + b) / softcap)   (softcap optional, scale default 1)
    """

    weight: torch.Tensor  # (V, H)
    bias: torch.Tensor | None = None  # (V,)
    scale: float = 1.0  # e.g. Cohere's logit_scale
    softcap: float | None = None  # e.g. Gemma-2's final_logit_softcapping

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` -> ``(..., V)`` float32 logits."""
        out = _project(hidden, self.weight, self.bias)
        return _transform(out, self.scale, self.softcap)


def _project(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # The matmul runs in the autocast dtype when one is active (bf16 on CPU/GPU); the result is
    # upcast to float32 chunk by chunk, never as a whole (N, V) tensor.
    out = torch.nn.functional.linear(hidden, weight, bias)
    return out.to(_acc_dtype(out.dtype))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, else unchanged (float64 stays float64 for exact tests)."""
    return torch.promote_types(dtype, torch.float32)


def _transform(logits: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits


def _chunk_size(vocab: int, requested: int | None) -> int:
    return requested or max(16, _CHUNK_ELEMENTS // max(vocab, 1))


class _LinearLogProb(torch.autograd.Function):
    """``log softmax(head(h))[target]`` for each row, differentiable w.r.t. ``h``, ``W`` and ``b``;
    also returns the (non-differentiable) entropy of each row's distribution from the same logits.

    # d logp_n / d z_n = onehot(y_n) - softmax(z_n)
    # grad_h = g * (onehot - p) @ W ;  grad_W = ((onehot - p) * g)^T @ h ;  grad_b = sum over rows
    When the ``(N, V)`` probabilities fit in ``_SAVE_PROBS_ELEMENTS`` they are kept for the backward
    (three matmuls in all, like plain autograd); otherwise each chunk's logits are recomputed there
    (one more matmul, but memory stays at one ``(C, V)`` block).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, softcap, chunk):
        n, vocab = hidden.shape[0], weight.shape[0]
        acc = _acc_dtype(hidden.dtype)
        logprobs = torch.empty(n, dtype=acc, device=hidden.device)
        lse, entropy = torch.empty_like(logprobs), torch.empty_like(logprobs)
        save_probs = softcap is None and n * vocab <= _SAVE_PROBS_ELEMENTS
        probs = torch.empty(n, vocab, dtype=acc, device=hidden.device) if save_probs else None
        for start in range(0, n, chunk):
            sl = slice(start, start + chunk)
            logits = _transform(_project(hidden[sl], weight, bias), scale, softcap)  # (C, V)
            lse[sl] = torch.logsumexp(logits, dim=-1)
            logprobs[sl] = logits.gather(1, targets[sl, None]).squeeze(1) - lse[sl]
            p = torch.exp(logits - lse[sl, None], out=probs[sl] if save_probs else None)
            entropy[sl] = lse[sl] - (p * logits).sum(-1)  # H = logsumexp(z) - sum_v p_v z_v
        ctx.save_for_backward(hidden, weight, bias, targets, lse, probs)
        ctx.scale, ctx.softcap, ctx.chunk = scale, softcap, chunk
        ctx.mark_non_differentiable(entropy)
        # A recomputing backward must use the precision the forward used (autocast or not).
        device_type = hidden.device.type
        ctx.amp = (device_type, torch.get_autocast_dtype(device_type)) if torch.is_autocast_enabled(device_type) else None
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy):
        hidden, weight, bias, targets, lse, probs = ctx.saved_tensors
        amp = torch.autocast(ctx.amp[0], dtype=ctx.amp[1]) if ctx.amp else contextlib.nullcontext()
        with amp:
            grads = _linear_logprob_backward(hidden, weight, bias, targets, lse, probs, grad_out.to(lse.dtype),
                                             ctx.scale, ctx.softcap, ctx.chunk, ctx.needs_input_grad[:3])
        return (*grads, None, None, None, None)


def _linear_logprob_backward(hidden, weight, bias, targets, lse, probs, grad_out, scale, softcap, chunk, needs):
    need_h, need_w, need_b = needs
    acc = lse.dtype
    grad_h = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
    grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
    for start in range(0, hidden.shape[0], chunk):
        sl = slice(start, start + chunk)
        h, g = hidden[sl], grad_out[sl]
        if probs is not None:
            grad_z = probs[sl] * -g[:, None]
        else:
            logits = _transform(_project(h, weight, bias), scale, softcap)  # recomputed (C, V)
            grad_z = torch.exp(logits - lse[sl, None]).mul_(-g[:, None])
        # grad w.r.t. the transformed logits: g * (onehot - p)
        grad_z[torch.arange(h.shape[0], device=h.device), targets[sl]] += g
        if softcap is not None:  # d/dx [c * tanh(x / c)] = 1 - tanh^2
            grad_z.mul_(1.0 - (logits / softcap).square())
        if scale != 1.0:
            grad_z.mul_(scale)
        # torch.mm runs in the autocast dtype when the forward did; results accumulate in float32.
        if need_h:
            grad_h[sl] = torch.mm(grad_z.to(weight.dtype), weight).to(acc)
        if need_w:
            grad_w += torch.mm(grad_z.T.to(h.dtype), h).to(acc)
        if need_b:
            grad_b += grad_z.sum(0)
    return (grad_h.to(hidden.dtype) if need_h else None,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(bias.dtype) if need_b else None)


def selected_logprobs(hidden: torch.Tensor, head: LMHead, targets: torch.Tensor,
                      chunk_size: int | None = None) -> torch.Tensor:
    """``log p(targets)`` for selected positions, ``(N, H)``, ``(N,)`` -> ``(N,)`` float32, with grad."""
    return selected_logprobs_and_entropy(hidden, head, targets, chunk_size)[0]


def selected_logprobs_and_entropy(hidden: torch.Tensor, head: LMHead, targets: torch.Tensor,
                                  chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(targets), entropy)`` at selected positions from one pass over the vocabulary, ``(N,)`` each.

    Only the log-probabilities carry gradients; the entropy is a statistic.
    """
    chunk = _chunk_size(head.weight.shape[0], chunk_size)
    return _LinearLogProb.apply(hidden, head.weight, head.bias, targets, head.scale, head.softcap, chunk)


@torch.no_grad()
def selected_entropy(hidden: torch.Tensor, head: LMHead, chunk_size: int | None = None) -> torch.Tensor:
    """Entropy of the next-token distribution at each selected position, ``(N, H)`` -> ``(N,)``.

    # H = logsumexp(z) - sum_v softmax(z)_v z_v
    """
    chunk = _chunk_size(head.weight.shape[0], chunk_size)
    out = torch.empty(hidden.shape[0], dtype=_acc_dtype(hidden.dtype), device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        logits = head.logits(hidden[start:start + chunk].detach())
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        out[start:start + chunk] = lse.squeeze(1) - (torch.exp(logits - lse) * logits).sum(-1)
    return out


@torch.no_grad()
def full_kl(hidden: torch.Tensor, head: LMHead, ref_hidden: torch.Tensor, ref_head: LMHead,
            chunk_size: int | None = None) -> torch.Tensor:
    """``KL(p || p_ref)`` over the whole vocabulary at each selected position, ``(N, H)`` x2 -> ``(N,)``.

    # KL = sum_v p_v (log p_v - log q_v)   (the legacy ``kl_penalty="full"``)
    """
    chunk = _chunk_size(head.weight.shape[0], chunk_size)
    out = torch.empty(hidden.shape[0], dtype=_acc_dtype(hidden.dtype), device=hidden.device)
    for start in range(0, hidden.shape[0], chunk):
        sl = slice(start, start + chunk)
        logp = torch.log_softmax(head.logits(hidden[sl]), dim=-1)
        logq = torch.log_softmax(ref_head.logits(ref_hidden[sl]), dim=-1)
        out[sl] = (logp.exp() * (logp - logq)).sum(-1)
    return out

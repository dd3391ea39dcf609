"""Token log-probabilities and entropies straight from hidden states, without full-vocabulary logits.

A plain forward pass materialises ``(B, T, V)`` logits (and often a float32 copy) for every position,
query and padding included, although PPO needs one number per *response* token. On a 32k vocabulary
that tensor dominates the step. Here the LM head is applied chunk by chunk to the ``N`` valid response
positions only, the log-softmax is reduced on the fly, and the backward pass works chunk by chunk too,
so peak extra memory is ``chunk_size x V`` (as in fused linear cross-entropy kernels).

The head itself is an :class:`LMHead`: an architecture's projection and logit transforms (:func:`lm_head_of`).

Notation: ``N`` selected positions, ``H`` hidden size, ``V`` vocabulary, ``C`` chunk size.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

# Keep the (C, V) float32 logits block of a chunk within ~128 MB (1024 rows at V = 32k): large enough
# for efficient matmuls, small next to the (N, V) tensors a plain forward would hold.
_CHUNK_ELEMENTS = 1 << 25
# Keep the softmax probabilities for the backward up to 256 MB (float32); beyond, recompute them.
_SAVE_PROBS_ELEMENTS = 1 << 26


@dataclass(frozen=True)
class LMHead:
    """The output projection of a causal LM, with the logit transforms some architectures apply.

    # logits = softcap * tanh(scale * (h @ W^T + b) / softcap) / temperature
    #   (softcap optional; scale and temperature default 1: the temperature divides what the model outputs, as
    #    sampling's logits processor does, so the log-probabilities are those of the distribution sampled)
    """

    weight: torch.Tensor  # (V, H)
    bias: torch.Tensor | None = None  # (V,)
    scale: float = 1.0  # e.g. Cohere's logit_scale
    softcap: float | None = None  # e.g. Gemma-2's final_logit_softcapping
    temperature: float = 1.0  # the sampling temperature (PPOConfig.temperature)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``(..., H)`` -> ``(..., V)`` float32 logits."""
        out = _project(hidden, self.weight, self.bias)
        return _transform(out, self.scale, self.softcap, self.temperature)


def lm_head_of(model) -> LMHead:
    """The output projection of a transformers LM ``model`` and the logit transforms its architecture applies after
    it: Cohere's logit scale, Granite's logits scaling, Gemma-2's soft cap, a BART-style ``final_logits_bias``."""
    head, config = model.get_output_embeddings(), model.config
    scale = float(getattr(config, "logit_scale", None) or 1.0)  # Cohere multiplies
    if getattr(config, "logits_scaling", None):  # Granite divides
        scale /= float(config.logits_scaling)
    softcap = getattr(config, "final_logit_softcapping", None)
    bias = getattr(head, "bias", None)
    final_bias = getattr(model, "final_logits_bias", None)  # BART-style encoder-decoders add a (1, V) buffer
    if final_bias is not None:
        bias = final_bias[0] if bias is None else bias + final_bias[0]
    return LMHead(head.weight, bias, scale, softcap)


def lm_head_parameters(model) -> list[torch.nn.Parameter]:
    """The parameters :func:`lm_head_of` reads of ``model``: the head's weight, and its bias if a parameter."""
    head = model.get_output_embeddings()
    return [p for p in (head.weight, getattr(head, "bias", None)) if isinstance(p, torch.nn.Parameter)]


def decoder_output_scale(config) -> float:
    """T5-family models multiply the decoder output by ``d_model ** -0.5`` before the (tied) LM head."""
    flag = getattr(config, "scale_decoder_outputs", None)  # T5, LongT5, Pop2Piano (transformers 5)
    if flag is None and config.model_type in ("umt5", "switch_transformers"):
        flag = config.tie_word_embeddings
    return float(config.d_model) ** -0.5 if flag else 1.0


def _project(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # The matmul runs in the autocast dtype when one is active (bf16 on CPU/GPU); the result is
    # upcast to float32 chunk by chunk, never as a whole (N, V) tensor.
    out = torch.nn.functional.linear(hidden, weight, bias)
    return out.to(_acc_dtype(out.dtype))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types, else unchanged (float64 stays float64 for exact tests)."""
    return torch.promote_types(dtype, torch.float32)


def _transform(logits: torch.Tensor, scale: float, softcap: float | None, temperature: float) -> torch.Tensor:
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if temperature != 1.0:  # skipped at 1: the legacy bytes
        logits = logits / temperature
    return logits


def _chunk_size(vocab: int, requested: int | None) -> int:
    return requested or max(16, _CHUNK_ELEMENTS // max(vocab, 1))


class _LinearLogProb(torch.autograd.Function):
    """``log softmax(head(h))[target]`` for each row, differentiable w.r.t. ``h``, ``W`` and ``b``;
    also returns the (non-differentiable) entropy of each row's distribution from the same logits.

    # d logp_n / d z_n = onehot(y_n) - softmax(z_n)
    # grad_h = g * (onehot - p) @ W ;  grad_W = ((onehot - p) * g)^T @ h ;  grad_b = sum over rows
    When the ``(N, V)`` probabilities fit in ``_SAVE_PROBS_ELEMENTS`` they are kept for the backward,
    unnormalised with their row sums (three matmuls in all, like plain autograd); otherwise each chunk's
    logits are recomputed there (one more matmul, but memory stays at one ``(C, V)`` block).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, scale, softcap, temperature, chunk, with_entropy):
        n, vocab = hidden.shape[0], weight.shape[0]
        if softcap is None and n * vocab <= _SAVE_PROBS_ELEMENTS:
            logprobs, entropy, lse, exps, sums = _forward_keeping_exps(hidden, weight, bias, targets, scale,
                                                                       temperature, with_entropy)
        else:
            logprobs, entropy, lse = _forward_chunked(hidden, weight, bias, targets, scale, softcap, temperature,
                                                      chunk, with_entropy)
            exps = sums = None
        ctx.save_for_backward(hidden, weight, bias, targets, lse, exps, sums)
        ctx.scale, ctx.softcap, ctx.temperature, ctx.chunk = scale, softcap, temperature, chunk
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_out, _grad_entropy):
        hidden, weight, bias, targets, lse, exps, sums = ctx.saved_tensors
        grads = _linear_logprob_backward(hidden, weight, bias, targets, lse, exps, sums, grad_out.to(lse.dtype),
                                         ctx.scale, ctx.softcap, ctx.temperature, ctx.chunk, ctx.needs_input_grad[:3])
        return (*grads, None, None, None, None, None, None)


def _row_log_softmax(z, targets, with_entropy):
    """Row statistics of a ``(C, V)`` logits block, which is overwritten with ``z - max``.

    # m = max_v z ;  e = exp(z - m) ;  s = sum_v e ;  log p(y) = (z_y - m) - log s
    # lse = m + log s ;  H = log s - sum_v e_v (z_v - m) / s
    Returns ``(log p(targets), entropy or zeros, lse, e, s)``; with the entropy, ``z`` ends up holding
    ``e * (z - m)``. Every path (no-grad, kept probabilities, recomputed chunks) goes through this one
    formula, so they agree bit for bit on the same logits: a policy and its identical reference give a
    KL of exactly 0, and the first PPO ratio is exactly 1.
    """
    m = z.amax(dim=-1, keepdim=True)
    z.sub_(m)
    e = torch.exp(z)
    s = e.sum(-1)
    log_s = s.log()
    logprobs = z.gather(1, targets[:, None]).squeeze(1) - log_s
    # in place, as z is not needed any more: vecdot(e, z) would allocate a (C, V) product first
    entropy = log_s - z.mul_(e).sum(-1) / s if with_entropy else torch.zeros_like(logprobs)
    return logprobs, entropy, m.squeeze(1) + log_s, e, s


def _forward_keeping_exps(hidden, weight, bias, targets, scale, temperature, with_entropy):
    """All ``N`` rows at once, keeping what the backward needs: ``e = exp(z - m)`` ``(N, V)`` and its row
    sums ``s`` ``(N,)`` (the probabilities are ``e / s``; the division is folded into the backward)."""
    z = _project(hidden, weight, bias)  # (N, V)
    if scale != 1.0:
        z.mul_(scale)
    if temperature != 1.0:
        z.div_(temperature)
    logprobs, entropy, lse, e, s = _row_log_softmax(z, targets, with_entropy)
    del z
    return logprobs, entropy, lse, e, s


def _forward_chunked(hidden, weight, bias, targets, scale, softcap, temperature, chunk, with_entropy):
    """``(C, V)`` logits at a time: bounded memory for large ``N * V``, and the no-grad passes."""
    n = hidden.shape[0]
    logprobs = torch.empty(n, dtype=_acc_dtype(hidden.dtype), device=hidden.device)
    lse, entropy = torch.empty_like(logprobs), torch.zeros_like(logprobs)
    for start in range(0, n, chunk):
        sl = slice(start, start + chunk)
        logits = _transform(_project(hidden[sl], weight, bias), scale, softcap, temperature)  # (C, V)
        logprobs[sl], entropy[sl], lse[sl], _, _ = _row_log_softmax(logits, targets[sl], with_entropy)
    return logprobs, entropy, lse


def _linear_logprob_backward(hidden, weight, bias, targets, lse, exps, sums, grad_out, scale, softcap, temperature,
                             chunk, needs):
    need_h, need_w, need_b = needs
    if exps is not None:  # one shot over all rows (no softcap); the saved exponentials become the gradient in place
        grad_z = _logit_grad(exps, targets, grad_out, scale / temperature, sums)
        return _grads_from_logit_grad(grad_z, hidden, weight, needs)
    acc = lse.dtype
    grad_h = torch.empty(hidden.shape, dtype=acc, device=hidden.device) if need_h else None
    grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
    grad_b = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
    for start in range(0, hidden.shape[0], chunk):
        sl = slice(start, start + chunk)
        h = hidden[sl]
        raw = _project(h, weight, bias)  # recomputed (C, V)
        logits = _transform(raw, scale, softcap, temperature)
        probs_chunk = torch.exp(logits - lse[sl, None])
        grad_z = _logit_grad(probs_chunk, targets[sl], grad_out[sl], 1.0)
        if softcap is not None:  # d/dx [c * tanh(x / c)] = 1 - tanh^2, tanh = logits * temperature / c
            grad_z.mul_(1.0 - (logits * temperature / softcap).square())
        if scale / temperature != 1.0:
            grad_z.mul_(scale / temperature)
        g_h, g_w, g_b = _grads_from_logit_grad(grad_z, h, weight, needs)
        if need_h:
            grad_h[sl] = g_h.to(acc)
        if need_w:
            grad_w += g_w.to(acc)
        if need_b:
            grad_b += g_b.to(acc)
    return (grad_h.to(hidden.dtype) if need_h else None,
            grad_w.to(weight.dtype) if need_w else None,
            grad_b.to(weight.dtype) if need_b else None)


def _logit_grad(exps, targets, grad_out, scale, sums=None):
    """``g * (onehot(y) - e / s) * scale``, written into ``exps`` ``(C, V)`` (which is consumed); without
    ``sums`` ``(C,)`` the rows of ``exps`` are already probabilities."""
    coef = grad_out if sums is None else grad_out / sums
    grad_z = exps.mul_(-coef[:, None])
    grad_z[torch.arange(len(targets), device=targets.device), targets] += grad_out
    return grad_z.mul_(scale) if scale != 1.0 else grad_z


def _grads_from_logit_grad(grad_z, hidden, weight, needs):
    """``(grad_h, grad_W, grad_b)`` from the gradient w.r.t. the logits, ``(N, V)`` float32.

    The matmuls run in the dtype of ``hidden`` and ``weight`` (one dtype, see `_apply`): ``grad_z`` is cast
    to it once for both.
    """
    need_h, need_w, need_b = needs
    low = grad_z.to(weight.dtype) if need_h or need_w else None
    grad_h = torch.mm(low, weight) if need_h else None
    grad_w = torch.mm(low.T, hidden) if need_w else None
    grad_b = grad_z.sum(0).to(weight.dtype) if need_b else None
    return grad_h, grad_w, grad_b


def _apply(hidden, head: LMHead, targets, chunk_size, with_entropy):
    chunk = _chunk_size(head.weight.shape[0], chunk_size)
    weight, bias = head.weight, head.bias
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # Cast to the autocast dtype once, here (differentiably), and run the head with autocast off: under
        # autocast every matmul of every chunk would cast the (V, H) weight again, and the backward would
        # cast each (C, V) logit gradient once per matmul.
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight, bias = (_autocast_input(t, dtype) for t in (hidden, weight, bias))
        with torch.autocast(device_type, enabled=False):
            return _apply(hidden, dataclasses.replace(head, weight=weight, bias=bias), targets, chunk, with_entropy)
    if bias is not None and bias.dtype != weight.dtype:
        bias = bias.to(weight.dtype)
    if hidden.dtype != weight.dtype:  # e.g. a float32 value-head trunk over a half LM head: match the head
        hidden = hidden.to(weight.dtype)
    args = (hidden, weight, bias, targets, head.scale, head.softcap, head.temperature, chunk, with_entropy)
    differentiable = any(t is not None and t.requires_grad for t in (hidden, weight, bias))
    if not (torch.is_grad_enabled() and differentiable):  # no backward will come: bounded chunks, nothing kept
        return _forward_chunked(*args)[:2]
    return _LinearLogProb.apply(*args)


def _autocast_input(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """What autocast would make of a matmul input: floating point (but float64) cast to ``dtype``."""
    if t is None or not t.is_floating_point() or t.dtype in (dtype, torch.float64):
        return t
    return t.to(dtype)


def selected_logprobs(hidden: torch.Tensor, head: LMHead, targets: torch.Tensor,
                      chunk_size: int | None = None) -> torch.Tensor:
    """``log p(targets)`` for selected positions, ``(N, H)``, ``(N,)`` -> ``(N,)`` float32, with grad."""
    return _apply(hidden, head, targets, chunk_size, with_entropy=False)[0]


def selected_logprobs_and_entropy(hidden: torch.Tensor, head: LMHead, targets: torch.Tensor,
                                  chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(targets), entropy)`` at selected positions from one pass over the vocabulary, ``(N,)`` each.

    Only the log-probabilities carry gradients; the entropy is a statistic.
    """
    return _apply(hidden, head, targets, chunk_size, with_entropy=True)


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

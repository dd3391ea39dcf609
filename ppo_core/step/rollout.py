"""A step's no-grad passes and what they fill: the policy's log-probabilities, values and entropies on the packed
inputs (``step.inputs``), chunk by chunk, the reference's, the whole-vocabulary KL, and the :class:`Rollout` that
the PPO epochs consume, response-aligned ``(B, R)``.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import NamedTuple

import torch
from accelerate.utils import extract_model_from_parallel

from ..algo.ppo_math import kl_penalty
from ..models.logprobs import full_kl
from ..models.modeling import scoring_view
from ..runtime.zero import gathered
from .inputs import ModelInputs, model_inputs


class PolicyOutputs(NamedTuple):
    """Response-aligned outputs of one pass, all ``(B, R)`` (zero at padding) except ``hidden``."""

    logprobs: torch.Tensor
    values: torch.Tensor
    entropy: torch.Tensor | None
    hidden: torch.Tensor | None  # (N, H) hidden states at the real response positions, for "full" KL


def policy_outputs(model, inputs: ModelInputs, with_entropy: bool = False, keep_hidden: bool = False,
                   chunk_size: int | None = None, temperature: float = 1.0) -> PolicyOutputs:
    """Log-probabilities of the response tokens, values, and optionally the entropies, in one pass, of the
    distribution at ``temperature`` (the logits divided by it: the sampling's, ``PPOConfig.temperature``).

    ``model`` is a value-head model, causal or encoder-decoder, possibly wrapped (DDP, a DeepSpeed engine): the
    per-token outputs come out of its ``forward`` (``score_positions``, see ``modeling``), so a wrapper sees
    everything the pass reads, the LM head included. Gradients flow when called outside ``torch.no_grad``.
    """
    sizes = inputs.sizes()  # from the host lengths: no device read
    seq_len = sizes.seq_len
    input_ids = inputs.input_ids[:, :seq_len]
    valid = inputs.response_mask(sizes.width)  # (B, R)
    offsets = torch.arange(valid.shape[1], device=valid.device)
    positions = (inputs.query_lens[:, None] - 1 + offsets[None, :]).clamp(max=seq_len - 1)  # (B, R)
    # the N real response tokens, row by row: N is known, so the indices come without a device read
    rows, cols = torch.nonzero_static(valid, size=sizes.n_tokens).unbind(1)  # (N,) each
    src = positions[rows, cols]
    score = dict(score_positions=torch.stack([rows, src], dim=1),  # (N, 2)
                 score_targets=input_ids[rows, src + 1],  # (N,)
                 score_entropy=with_entropy, score_hidden=keep_hidden, score_chunk_size=chunk_size,
                 score_temperature=temperature)
    # An all-ones mask is exact here (right padding, causal attention) and lets attention use its
    # causal fast path; passing one also tells transformers we did not forget the padding.
    if inputs.encoder_input_ids is None:
        out = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **score)
    else:
        enc_len = sizes.encoder_len
        out = model(input_ids=inputs.encoder_input_ids[:, :enc_len],
                    attention_mask=inputs.encoder_attention_mask[:, :enc_len],
                    decoder_input_ids=input_ids, decoder_attention_mask=torch.ones_like(input_ids), **score)
    logprobs = torch.zeros(valid.shape, dtype=out.logprobs.dtype, device=valid.device)
    logprobs = logprobs.index_put((rows, cols), out.logprobs)
    values = out.values.gather(1, positions).float() * valid
    entropy = None
    if with_entropy:
        entropy = torch.zeros(valid.shape, dtype=out.entropy.dtype, device=valid.device)
        entropy[rows, cols] = out.entropy
    return PolicyOutputs(logprobs, values, entropy, out.hidden)


@torch.no_grad()
def response_logprobs(model, queries: list[torch.Tensor], responses: list[torch.Tensor],
                      temperature: float = 1.0) -> torch.Tensor:
    """``log pi(response_t | query, response_<t)`` of every response token, in one no-grad pass: ``(B, R)``, R the
    longest response, 0 past each response's end. The pass ``step()`` scores rollouts with (the LM head at the
    response positions only, chunk by chunk: no ``(B, T, V)`` float32 logits), so a sum over a row is the sequence's
    log-probability as the trainer sees it, e.g. for a Monte Carlo KL between two policies on the same samples:
    ``(response_logprobs(policy, q, r) - response_logprobs(reference, q, r)).sum(-1)``.

    ``model``: a ppo_core value-head model, or a plain transformers LM (causal or encoder-decoder), which is wrapped in
    its value-head class for the pass (``models.modeling.scoring_view``: the head it adds is never read). ``queries``,
    ``responses``: 1-D token tensors on the model's device, as ``step()`` takes them; an encoder-decoder's responses
    without the decoder start token (it is prepended here). ``temperature``: the logits divided by it.
    """
    if not hasattr(model, "v_head"):
        model = scoring_view(model)
    config = model.pretrained_model.config
    start = config.decoder_start_token_id if config.is_encoder_decoder else None
    inputs = model_inputs(queries, responses, config.pad_token_id, start)
    return policy_outputs(model, inputs, temperature=temperature).logprobs


def concat_outputs(parts: list[PolicyOutputs], inputs: ModelInputs) -> PolicyOutputs:
    """Concatenate chunked ``PolicyOutputs`` along the batch, re-padding each ``(b, R_b)`` field to the batch's
    response length (the entropy too, where the parts have it; the hidden states are per token already)."""
    width = inputs.sizes().width

    def cat(field: str) -> torch.Tensor | None:
        tensors = [getattr(p, field) for p in parts]
        if tensors[0] is None:
            return None
        return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1])) for t in tensors])

    hidden = torch.cat([p.hidden for p in parts]) if parts[0].hidden is not None else None
    return PolicyOutputs(cat("logprobs"), cat("values"), cat("entropy"), hidden)


def chunked_outputs(model, inputs: ModelInputs, chunk_size: int, keep_hidden: bool = False,
                    temperature: float = 1.0) -> PolicyOutputs:
    """:func:`policy_outputs` of ``inputs``, ``chunk_size`` samples at a time (the activations of one chunk alive at
    once), concatenated: ``(B, R)`` each."""
    starts = range(0, len(inputs.query_lens), chunk_size)
    parts = [policy_outputs(model, inputs.rows(s, s + chunk_size), keep_hidden=keep_hidden, temperature=temperature)
             for s in starts]
    return concat_outputs(parts, inputs)


class Rollout(NamedTuple):
    """What the no-grad passes of a step produce and its PPO epochs consume: ``B`` samples, response-aligned.

    ``R`` is the longest response; every ``(B, R)`` tensor is zero (or ignored) past a sample's response.
    """

    inputs: ModelInputs | None  # the (query, response) sequences, (B, T); None in a legacy loss call
    mask: torch.Tensor  # (B, R) float, 1 = response token the loss trains on (dynamic sampling and
    # mask_truncated_completions leave whole responses out)
    old_logprobs: torch.Tensor  # (B, R) log-probabilities of the response tokens under the rollout policy
    old_values: torch.Tensor  # (B, R) the rollout policy's value predictions
    ref_logprobs: torch.Tensor  # (B, R) log-probabilities under the reference policy
    advantages: torch.Tensor  # (B, R) the estimator's advantages (GAE's whitened over the global batch)
    returns: torch.Tensor  # (B, R) the value target (GAE: advantages + values; critic-free: unused)
    norm_length: torch.Tensor | None = None  # 0-d: Dr. GRPO's constant, the global batch's longest response
    sampling_weights: torch.Tensor | None = None  # (B, R) the rollout correction's importance weights (None: off)

    def minibatch(self, idx: torch.Tensor, host_idx: torch.Tensor | None = None) -> Rollout:
        """The samples ``idx`` ``(b,)`` (``host_idx``: the same on the host), each ``(B, R)`` tensor trimmed to their
        longest response: ``(b, R_b)``; the step's sizes (``norm_length``) as they are."""
        inputs = self.inputs.index(idx, host_idx)
        width = inputs.sizes().width
        per_sample = (self.mask, self.old_logprobs, self.old_values, self.ref_logprobs, self.advantages, self.returns)
        weights = None if self.sampling_weights is None else self.sampling_weights[idx, :width]
        return Rollout(inputs, *(t[idx, :width] for t in per_sample), norm_length=self.norm_length,
                       sampling_weights=weights)


def full_kl_per_token(model, hidden: torch.Tensor, ref_model, ref_hidden: torch.Tensor,
                      inputs: ModelInputs, temperature: float = 1.0) -> torch.Tensor:
    """``(B, R)`` whole-vocabulary ``KL(policy || ref)`` at each real response token (zero at padding), both
    distributions at ``temperature``.

    No gradient, outside any forward: under ZeRO-3 both LM heads are gathered for it (every process calls it).
    """
    policy, ref = extract_model_from_parallel(model), extract_model_from_parallel(ref_model)
    valid = inputs.response_mask()  # a boolean mask: one device read (once per step, with the whole-vocabulary KL)
    kl = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
    with gathered(policy.lm_head_parameters() + ref.lm_head_parameters()):
        # each model's hidden states on its own head, both at the temperature sampled
        head, ref_head = policy.lm_head(temperature), ref.lm_head(temperature)
        kl[valid] = full_kl(hidden, head, ref_hidden.to(hidden.device), ref_head).float().to(kl.device)
    return kl


@torch.no_grad()
def rollout_passes(model, reference: Callable[[], AbstractContextManager], inputs: ModelInputs, chunk_size: int,
                   precision: Callable[[], AbstractContextManager], keep_hidden: bool = False,
                   with_reference: bool = True, temperature: float = 1.0) -> tuple[PolicyOutputs, PolicyOutputs]:
    """The policy's and the reference's outputs on ``inputs`` at ``temperature``, in eval mode, ``chunk_size`` samples
    at a time, each within ``precision()`` (with the hidden states for the whole-vocabulary KL). ``reference()`` gives
    the reference model for a block. Without the reference, the policy's outputs stand in for it: a KL of exactly 0,
    which its coefficient of 0 multiplies anyway."""
    model.eval()

    def outputs(scored):
        with precision():
            return chunked_outputs(scored, inputs, chunk_size, keep_hidden, temperature)

    old = outputs(model)
    if not with_reference:
        return old, old
    with reference() as ref_model:
        return old, outputs(ref_model)


def kl_per_token(kind: str, model, reference: Callable[[], AbstractContextManager], inputs: ModelInputs,
                 old: PolicyOutputs, ref: PolicyOutputs, temperature: float = 1.0) -> torch.Tensor:
    """``(B, R)`` the KL penalty ``kind`` (``config.kl_penalty``) of each response token: from the sampled tokens'
    log-probabilities, or (``"full"``) over the whole vocabulary from the passes' hidden states."""
    if kind != "full":
        return kl_penalty(old.logprobs, ref.logprobs, kind)
    with reference() as ref_model:
        return full_kl_per_token(model, old.hidden, ref_model, ref.hidden, inputs, temperature)

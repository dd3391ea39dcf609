"""The inputs of a step: the checks ``step`` applies to its queries, responses and scores, and their batching.

Sequences are packed *right-padded* (``query + response + pad``): with causal attention, padding at the
end cannot influence real tokens, so no attention mask and no position-id bookkeeping is needed, and
positions start at 0 exactly as in left-padded generation with position ids from the attention mask.
Every per-token tensor the trainer uses is response-aligned, ``(B, R)``: column ``j`` is response token
``j``, predicted from the hidden state at position ``query_len - 1 + j``.

Encoder-decoder policies use the same layout for the decoder: ``input_ids`` holds
``decoder_start + response + pad`` (so ``query_lens`` is 1: the start token) and the queries go to the
encoder, right-padded with an attention mask (``encoder_input_ids``, ``encoder_attention_mask``).

No host sync (a GPU waiting for Python to read a value back) in the passes over a batch: every size a pass needs
(the longest sequence, the number of response tokens) is read from a copy of the lengths kept on the host
(``ModelInputs.host_lens``), and the inputs of ``step`` reach the device in one copy per list.
"""

from __future__ import annotations

import numbers
import warnings
from typing import NamedTuple

import torch
from torch.nn.utils.rnn import pad_sequence

from ..runtime.utils import moved


class Sizes(NamedTuple):
    """The sizes of a batch that shape its tensors (Python ints)."""

    seq_len: int  # the longest query + response (decoder-only) or start + response (encoder-decoder)
    width: int  # R, the longest response
    n_tokens: int  # N, the response tokens in all
    encoder_len: int  # the longest encoder input (0 for decoder-only models)


class ModelInputs(NamedTuple):
    """A batch of ``query + response`` sequences (``decoder_start + response`` for encoder-decoders), right-padded."""

    input_ids: torch.Tensor  # (B, T) the sequences the LM head scores
    query_lens: torch.Tensor  # (B,) tokens before the response in input_ids
    response_lens: torch.Tensor  # (B,)
    encoder_input_ids: torch.Tensor | None = None  # (B, S) encoder-decoders: the queries
    encoder_attention_mask: torch.Tensor | None = None  # (B, S) 1 = real query token
    host_lens: torch.Tensor | None = None  # (B, 3) on the host: query, response, encoder lengths (None: read back)

    def index(self, idx: torch.Tensor, host_idx: torch.Tensor | None = None) -> ModelInputs:
        """The samples ``idx``; ``host_idx`` the same indices on the host (default: ``idx`` read back)."""
        host_idx = host_idx if host_idx is not None or self.host_lens is None else idx.cpu()
        device_fields = {name: getattr(self, name) for name in self._fields if name != "host_lens"}
        return ModelInputs(**{name: t[idx] if t is not None else None for name, t in device_fields.items()},
                           host_lens=self.host_lens[host_idx] if self.host_lens is not None else None)

    def rows(self, start: int, stop: int) -> ModelInputs:
        """The samples ``start:stop`` (views)."""
        return ModelInputs(*(t[start:stop] if t is not None else None for t in self))

    def sizes(self) -> Sizes:
        """The batch's :class:`Sizes`, from the host lengths (without them: read back from the device, one sync)."""
        lens = self.host_lens
        if lens is None:
            enc = self.encoder_attention_mask
            lens = torch.stack([self.query_lens, self.response_lens,
                                enc.sum(1) if enc is not None else torch.zeros_like(self.query_lens)], 1).cpu()
        lens = lens.numpy()  # (B, 3) on the host (numpy: which a device tensor could not be)
        return Sizes(int((lens[:, 0] + lens[:, 1]).max()), int(lens[:, 1].max()), int(lens[:, 1].sum()),
                     int(lens[:, 2].max()))

    def response_mask(self, width: int | None = None) -> torch.Tensor:
        """``(B, R)`` bool, True at real response tokens (``R``: ``width``, default the longest response)."""
        width = self.sizes().width if width is None else width
        positions = torch.arange(width, device=self.response_lens.device)
        return positions[None, :] < self.response_lens[:, None]


def _lengths(queries: list[torch.Tensor], responses: list[torch.Tensor], encoder: bool) -> torch.Tensor:
    """``(B, 3)`` host lengths of :class:`ModelInputs` (tensor shapes: no device read)."""
    return torch.tensor([[1 if encoder else len(q), len(r), len(q) if encoder else 0]
                         for q, r in zip(queries, responses)])


def build_model_inputs(queries: list[torch.Tensor], responses: list[torch.Tensor],
                       pad_token_id: int | None) -> ModelInputs:
    """Concatenate each query with its response and right-pad to the longest: ``(B, T)``."""
    device = queries[0].device
    sequences = [torch.cat([q, r]) for q, r in zip(queries, responses)]
    # Right padding is never attended to by real tokens (causal attention), so its value is irrelevant;
    # using a non-pad id keeps transformers from warning about a missing attention mask.
    filler = 0 if pad_token_id != 0 else 1
    input_ids = pad_sequence(sequences, batch_first=True, padding_value=filler)
    lens = _lengths(queries, responses, encoder=False)
    query_lens, response_lens = lens[:, :2].T.contiguous().to(device, non_blocking=True)
    return ModelInputs(input_ids, query_lens, response_lens, host_lens=lens)


def build_seq2seq_inputs(queries: list[torch.Tensor], responses: list[torch.Tensor], decoder_start_token_id: int,
                         pad_token_id: int | None) -> ModelInputs:
    """Queries to the encoder ``(B, S)`` with their mask; ``decoder_start + response`` to the decoder ``(B, 1 + R)``.

    Both are right-padded: the encoder masks its padding, and the decoder's causal attention never lets
    a real token see the padding after it.
    """
    device = queries[0].device
    pad = pad_token_id if pad_token_id is not None else 0
    encoder_input_ids = pad_sequence(queries, batch_first=True, padding_value=pad)
    encoder_attention_mask = pad_sequence([torch.ones_like(q) for q in queries], batch_first=True, padding_value=0)
    start = torch.full((1,), decoder_start_token_id, dtype=responses[0].dtype, device=device)
    decoder_ids = pad_sequence([torch.cat([start, r]) for r in responses], batch_first=True, padding_value=pad)
    lens = _lengths(queries, responses, encoder=True)
    query_lens, response_lens = lens[:, :2].T.contiguous().to(device, non_blocking=True)
    return ModelInputs(decoder_ids, query_lens, response_lens, encoder_input_ids, encoder_attention_mask, lens)


def model_inputs(queries: list[torch.Tensor], responses: list[torch.Tensor], pad_token_id: int | None,
                 decoder_start_token_id: int | None = None) -> ModelInputs:
    """``query + response`` sequences; for an encoder-decoder (a ``decoder_start_token_id``), the queries and
    ``start + response``."""
    if decoder_start_token_id is None:
        return build_model_inputs(queries, responses, pad_token_id)
    return build_seq2seq_inputs(queries, responses, decoder_start_token_id, pad_token_id)


def warn_if_start_token_included(responses: list[torch.Tensor], decoder_start_token_id: int) -> bool:
    """Warn, and return True, when every response starts with the decoder start token: a response built the legacy
    TRL way, whose start token would be scored as a response token."""
    starts = torch.stack([r[0] for r in responses])
    if not bool((starts == decoder_start_token_id).all()):
        return False
    warnings.warn(f"step: every response starts with the decoder start token ({decoder_start_token_id}). "
                  "ppo_core's responses are the generated tokens without it (generate strips it and step "
                  "prepends it); strip it from responses built the legacy TRL way, or it is scored as a token.")
    return True


def checked_step_inputs(batch_size: int, queries, responses, scores, masks, device: torch.device):
    """``step``'s inputs validated (lengths, types, shapes) and on ``device``: ``(queries, responses, scores (B,)
    float32, masks or None)``; otherwise a ValueError saying which input is wrong, and how."""
    for name, items in (("queries", queries), ("responses", responses), ("scores", scores)):
        if not isinstance(items, list):
            raise ValueError(f"step: {name} must be a list of tensors, got {type(items).__name__}.")
        if len(items) != batch_size:
            raise ValueError(f"step: batch size ({batch_size}) does not match number of {name} ({len(items)}); "
                             "pass exactly config.batch_size samples (drop_last=True in your dataloader).")
    if masks is not None and len(masks) != batch_size:
        raise ValueError(f"step: response_masks has {len(masks)} entries, expected {batch_size}.")
    queries = moved([_token_tensor(q, "queries", i) for i, q in enumerate(queries)], device)  # one copy per list
    responses = moved([_token_tensor(r, "responses", i) for i, r in enumerate(responses)], device)
    scores = torch.stack([_scalar_score(s, i) for i, s in enumerate(scores)])
    finite = torch.isfinite(scores)
    if not bool(finite.all()):  # one read for all the scores
        i = int((~finite).nonzero()[0])
        raise ValueError(f"step: scores[{i}] is {scores[i].item()}; scores must be finite numbers.")
    scores = scores.to(device, non_blocking=True)
    if masks is not None:
        masks = moved([torch.as_tensor(m) for m in masks], device)
        for i, (m, r) in enumerate(zip(masks, responses)):
            if m.shape != r.shape:
                raise ValueError(f"step: response_masks[{i}] has shape {tuple(m.shape)}, "
                                 f"but responses[{i}] has shape {tuple(r.shape)}.")
    return queries, responses, scores, masks


def _token_tensor(x, name: str, i: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or x.ndim != 1:
        raise ValueError(f"step: {name}[{i}] must be a 1-D tensor of token ids, "
                         f"got {type(x).__name__} of shape {tuple(getattr(x, 'shape', ()))}.")
    if x.numel() == 0:
        raise ValueError(f"step: {name}[{i}] is empty; every query and response needs at least one token.")
    return x.long()


def _scalar_score(s, i: int) -> torch.Tensor:
    if not isinstance(s, (torch.Tensor, numbers.Real)) or isinstance(s, bool):
        raise ValueError(f"step: scores[{i}] must be a number (a 0-d tensor), got {type(s).__name__} {s!r}.")
    s = torch.as_tensor(s)
    if s.numel() != 1 or s.ndim > 1:
        raise ValueError(f"step: scores[{i}] must be a scalar (0-d tensor), got shape {tuple(s.shape)}.")
    if not s.is_floating_point() and s.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"step: scores[{i}] must be a number, got dtype {s.dtype}.")
    return s.reshape(()).float()


def build_response_masks(response_masks: list[torch.Tensor] | None, inputs: ModelInputs) -> torch.Tensor:
    """The ``(B, R)`` float mask of tokens that count: real response tokens times the user's masks."""
    mask = inputs.response_mask().float()
    if response_masks is not None:
        user = pad_sequence([m.float() for m in response_masks], batch_first=True, padding_value=0.0)
        mask = mask * user.to(mask.device)[:, : mask.shape[1]]
    return mask

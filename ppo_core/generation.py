"""Batched sampling for the PPO rollout: KV-cached, padding stripped, cut after EOS.

Decoder-only models get left-padded queries (generation continues at the right end); encoder-decoders
get right-padded queries in the encoder (their position ids stay exact) and return only the decoder's
tokens after its start token.
"""

from __future__ import annotations

from typing import Any, Callable

import torch


def _pad(queries: list[torch.Tensor], pad_token_id: int, left: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``[(L_i,)] -> input_ids (B, L), attention_mask (B, L)`` with padding on the left (or the right)."""
    width = max(len(q) for q in queries)
    input_ids = torch.full((len(queries), width), pad_token_id, dtype=torch.long, device=queries[0].device)
    attention_mask = torch.zeros_like(input_ids)
    for i, q in enumerate(queries):
        span = slice(width - len(q), width) if left else slice(0, len(q))
        input_ids[i, span] = q
        attention_mask[i, span] = 1
    return input_ids, attention_mask


def cut_after_eos(tokens: torch.Tensor, eos_token_ids: set[int]) -> torch.Tensor:
    """Keep ``tokens`` up to and including the first EOS (all of it when there is none)."""
    if not eos_token_ids:
        return tokens
    is_eos = torch.isin(tokens, torch.tensor(sorted(eos_token_ids), device=tokens.device))
    hits = is_eos.nonzero()
    return tokens[: int(hits[0]) + 1] if len(hits) else tokens


def _eos_ids(generation_kwargs: dict[str, Any], tokenizer, model) -> set[int]:
    eos = generation_kwargs.get("eos_token_id", getattr(model.generation_config, "eos_token_id", None))
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in eos} if isinstance(eos, (list, tuple)) else {int(eos)}


def _clean_kwargs(generation_kwargs: dict[str, Any], tokenizer) -> dict[str, Any]:
    """Normalise legacy-style kwargs (``top_k=0.0`` as float) and fill ``pad_token_id``."""
    kwargs = dict(generation_kwargs)
    if isinstance(kwargs.get("top_k"), float):
        kwargs["top_k"] = int(kwargs["top_k"])
    if kwargs.get("min_length") == -1:  # legacy "no minimum": transformers wants a non-negative value
        kwargs.pop("min_length")
    kwargs.setdefault("pad_token_id", tokenizer.pad_token_id)
    return kwargs


@torch.no_grad()
def generate_batched(model, tokenizer, query_tensor, device, length_sampler: Callable[[], int] | None,
                     batch_size: int, return_prompt: bool, generation_kwargs: dict[str, Any],
                     is_encoder_decoder: bool = False):
    """Sample from ``model`` (a ``transformers`` LM) for one query or a list of queries.

    Returns a ``(1, L)`` tensor for a single 1-D query (legacy behaviour) and a list of 1-D tensors
    (prompt + response, or the response only when ``return_prompt`` is False) for a list. For an
    encoder-decoder the result is always the response alone (the prompt is not part of the decoder's
    sequence; legacy TRL ignored ``return_prompt`` there too), without the decoder start token.
    """
    kwargs = _clean_kwargs(generation_kwargs, tokenizer)
    eos = _eos_ids(kwargs, tokenizer, model)
    if isinstance(query_tensor, torch.Tensor):
        if query_tensor.ndim != 1:
            raise ValueError(f"generate: a tensor query must be 1-D (got shape {tuple(query_tensor.shape)}); "
                             "pass a list of 1-D tensors for a batch.")
        if length_sampler is not None:
            kwargs["max_new_tokens"] = length_sampler()
        query = query_tensor.to(device)
        out = model.generate(input_ids=query[None], attention_mask=torch.ones_like(query[None]), **kwargs)
        if is_encoder_decoder:
            return out[:, 1:]  # drop the decoder start token
        return out if return_prompt else out[:, len(query):]
    if not isinstance(query_tensor, (list, tuple)) or not query_tensor:
        raise ValueError("generate: query_tensor must be a 1-D tensor or a non-empty list of 1-D tensors.")
    outputs: list[torch.Tensor] = []
    for start in range(0, len(query_tensor), batch_size):
        queries = [q.to(device).long() for q in query_tensor[start:start + batch_size]]
        if length_sampler is not None:
            kwargs["max_new_tokens"] = length_sampler()
        input_ids, attention_mask = _pad(queries, kwargs["pad_token_id"], left=not is_encoder_decoder)
        generated = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        # decoder-only: (b, L + new) with the prompt; encoder-decoder: (b, 1 + new) after the start token
        new_tokens = generated[:, 1:] if is_encoder_decoder else generated[:, input_ids.shape[1]:]
        for query, response in zip(queries, new_tokens):
            response = cut_after_eos(response, eos)
            outputs.append(torch.cat([query, response]) if return_prompt and not is_encoder_decoder else response)
    return outputs

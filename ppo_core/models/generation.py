"""Batched sampling for the PPO rollout: KV-cached, padding stripped, cut after EOS.

Decoder-only models get left-padded queries (generation continues at the right end); encoder-decoders
get right-padded queries in the encoder (their position ids stay exact) and return only the decoder's
tokens after its start token. A batch's queries reach the device in one copy and its tokens come back to the host in
one copy, for the cuts after EOS (a copy or a read per response would be a host sync each on a GPU).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..algo.registry import get_estimator
from ..runtime.utils import moved, swapped

_torch_multinomial = torch.multinomial  # the original, restored after every sampling call


def sample_categorical(probs: torch.Tensor) -> torch.Tensor:
    """One index per row of ``probs`` ``(B, V)`` (non-negative, finite, positive row sums) -> ``(B, 1)``.

    Inverse-CDF sampling, one uniform draw per row:
    # c_i = sum_{j<=i} p_j ;  u ~ U[0, 1) * c_V ;  index = min{ i : c_i > u }
    The same distribution as ``torch.multinomial(probs, 1)``, whose CPU kernel draws one exponential per
    vocabulary entry: 48 ms for 64 x 32k on two cores, against 1.5 ms here. A zero-probability entry
    leaves ``c`` flat and is never chosen (``right=True``, and ``u`` is kept strictly below ``c_V``).
    """
    cdf = probs.cumsum(-1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, dtype=cdf.dtype, device=cdf.device) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # rounding must not reach c_V
    return torch.searchsorted(cdf, u, right=True)


def _multinomial(input, num_samples, replacement=False, *, generator=None, out=None):  # torch's own names
    """``torch.multinomial`` with :func:`sample_categorical` for what ``generate`` asks on the CPU (one
    sample per row of a 2-D float tensor, default generator); everything else, and any invalid row (so
    that its error is torch's own), goes to torch."""
    if (num_samples == 1 and generator is None and out is None and input.ndim == 2 and input.device.type == "cpu"
            and input.is_floating_point() and input.shape[-1] > 0):
        total = input.sum(-1)
        if bool((torch.isfinite(total) & (total > 0)).all()):
            return sample_categorical(input)
    return _torch_multinomial(input, num_samples, replacement, generator=generator, out=out)


def fast_cpu_sampling():
    """Within the block, ``transformers``' sampling step (``torch.multinomial(probs, num_samples=1)``) draws
    through :func:`sample_categorical` on the CPU. GPUs keep torch's kernel, which is fast there."""
    return swapped(torch, "multinomial", _torch_multinomial, _multinomial)


# Where transformers compiles the decoding step over a static cache (not on CPUs), queries are padded to a multiple of
# this width: the cache's length is the padded width plus max_new_tokens, and the step is compiled (and graph-captured)
# once per length, so prompts of every length share a few compiled steps instead of compiling one per batch.
STATIC_CACHE_WIDTH = 64


def pad_multiple(generation_kwargs: dict[str, Any], device: torch.device) -> int:
    """What a batch's padded width is a multiple of: ``STATIC_CACHE_WIDTH`` for a static cache on a device where
    transformers compiles the step over it, else 1 (the longest query; padding would only add work on a CPU)."""
    static = generation_kwargs.get("cache_implementation") == "static" and not generation_kwargs.get("disable_compile")
    return STATIC_CACHE_WIDTH if static and torch.device(device).type != "cpu" else 1


def _pad(queries: list[torch.Tensor], pad_token_id: int, left: bool = True,
         multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``[(L_i,)] -> input_ids (B, L), attention_mask (B, L)`` with padding on the left (or the right), ``L`` the
    longest query rounded up to a multiple of ``multiple``."""
    width = -(-max(len(q) for q in queries) // multiple) * multiple
    input_ids = torch.full((len(queries), width), pad_token_id, dtype=torch.long, device=queries[0].device)
    attention_mask = torch.zeros_like(input_ids)
    for i, q in enumerate(queries):
        span = slice(width - len(q), width) if left else slice(0, len(q))
        input_ids[i, span] = q
        attention_mask[i, span] = 1
    return input_ids, attention_mask


def distinct_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(B, L), (B, L) -> (U,), (B,)``: one row index for each distinct padded query (its ids and mask alike) and, for
    each row, the position of its own among them; None where every row is distinct."""
    _, inverse = torch.unique(torch.cat([input_ids, attention_mask], 1), dim=0, return_inverse=True)
    n_distinct = int(inverse.max()) + 1  # one host read per batch
    if n_distinct == len(inverse):
        return None
    rows = torch.arange(len(inverse), device=inverse.device)
    firsts = torch.full((n_distinct,), len(inverse), device=inverse.device).scatter_reduce(0, inverse, rows, "amin")
    return firsts, inverse


def shared_prompt_cache(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, distinct) -> dict[str, Any]:
    """The KV cache of each row's query but its last token ``(B, L - 1)``, computed once for each distinct query
    (``distinct_rows``' ``(firsts, inverse)``) and then copied to the rows that share it: ``generate`` given it
    computes only each row's last query token and what it samples. G samples of a prompt (a group estimator's, pass@k's)
    take one prefill, not G: a prompt is often longer than its response (a problem, a document), and on a CPU its
    prefill is a large share of sampling's work.
    Positions follow ``generate``'s own for left-padded rows (the mask's cumulative sum, 1 at padding). Returns the
    cache as the keyword that the forward and ``generate`` take it by: ``cache`` from transformers 5.24,
    ``past_key_values`` before (deprecated since, with a warning at every call)."""
    from transformers import DynamicCache

    firsts, inverse = distinct
    ids, mask = input_ids[firsts, :-1], attention_mask[firsts, :-1]
    position_ids = (mask.long().cumsum(-1) - 1).masked_fill_(mask == 0, 1)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT passes its kwargs to it
    accepted = set(inspect.signature(base.forward).parameters)
    cache = DynamicCache(config=model.config)
    given = {("cache" if "cache" in accepted else "past_key_values"): cache}
    only_last = {"logits_to_keep": 1} if "logits_to_keep" in accepted else {}  # the cache is the point, not the logits
    model(input_ids=ids, attention_mask=mask, position_ids=position_ids, use_cache=True, **given, **only_last)
    cache.batch_select_indices(inverse)
    return given


def can_share_prompts(model, generation_kwargs: dict[str, Any], is_encoder_decoder: bool) -> bool:
    """Whether ``shared_prompt_cache`` applies: a decoder-only model on transformers' dynamic cache, named in the call
    or by nothing (a static cache is allocated and compiled by ``generate`` itself, which takes no cache beside a
    ``cache_implementation``, even in the model's generation config; a cache the caller gives is theirs)."""
    configured = getattr(getattr(model, "generation_config", None), "cache_implementation", None)
    return not (is_encoder_decoder or generation_kwargs.get("cache_implementation") not in (None, "dynamic")
                or configured is not None or {"cache", "past_key_values"} & set(generation_kwargs))


def eos_cut(tokens: list[int], eos_token_ids: set[int]) -> int:
    """How many of ``tokens`` to keep: up to and including the first EOS (all of them when there is none)."""
    return next((i + 1 for i, token in enumerate(tokens) if token in eos_token_ids), len(tokens))


def cut_after_eos(tokens: torch.Tensor, eos_token_ids: set[int]) -> torch.Tensor:
    """Keep ``tokens`` ``(L,)`` up to and including the first EOS (all of it when there is none)."""
    return tokens[: eos_cut(tokens.tolist(), eos_token_ids)] if eos_token_ids else tokens


def _eos_ids(generation_kwargs: dict[str, Any], tokenizer, model) -> set[int]:
    """The tokens a response is cut after: the tokenizer's EOS (legacy TRL cut there whatever ``eos_token_id``
    the caller gave ``generate``: the stack-llama and T5 examples pass an id that never comes, to sample full
    length, then cut at the first real EOS) and those generation stopped at (what follows them is padding)."""
    stop = generation_kwargs.get("eos_token_id", getattr(model.generation_config, "eos_token_id", None))
    ids = set() if stop is None else {int(e) for e in stop} if isinstance(stop, (list, tuple)) else {int(stop)}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


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
                     is_encoder_decoder: bool = False, fast_sampling: bool = True, share_prompts: bool = False):
    """Sample from ``model`` (a ``transformers`` LM) for one query or a list of queries.

    Returns a ``(1, L)`` tensor for a single 1-D query (legacy behaviour) and a list of 1-D tensors
    (prompt + response, or the response only when ``return_prompt`` is False) for a list. For an
    encoder-decoder the result is always the response alone (the prompt is not part of the decoder's
    sequence; legacy TRL ignored ``return_prompt`` there too), without the decoder start token.
    ``fast_sampling=False`` keeps torch's own sampling kernel on the CPU (the draws ``transformers`` makes by
    itself) instead of :func:`fast_cpu_sampling`'s, which samples the same distribution with other random numbers.
    ``share_prompts`` prefills each distinct query of a batch once (:func:`shared_prompt_cache`): the same
    distribution, the same random draws, logits equal up to rounding (other shapes of the same sums).
    """
    sampling = fast_cpu_sampling if fast_sampling else contextlib.nullcontext
    kwargs = _clean_kwargs(generation_kwargs, tokenizer)
    eos = _eos_ids(kwargs, tokenizer, model)
    multiple = pad_multiple(kwargs, device)
    if isinstance(query_tensor, torch.Tensor):
        if query_tensor.ndim != 1:
            raise ValueError(f"generate: a tensor query must be 1-D (got shape {tuple(query_tensor.shape)}); "
                             "pass a list of 1-D tensors for a batch.")
        if length_sampler is not None:
            kwargs["max_new_tokens"] = length_sampler()
        query = query_tensor.to(device)
        input_ids, attention_mask = _pad([query.long()], kwargs["pad_token_id"], not is_encoder_decoder, multiple)
        with sampling():
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        if is_encoder_decoder:
            return out[:, 1:]  # drop the decoder start token
        response = out[:, input_ids.shape[1]:]  # (1, new): after the query and any padding
        return torch.cat([query[None].to(response.dtype), response], 1) if return_prompt else response
    if not isinstance(query_tensor, (list, tuple)) or not query_tensor:
        raise ValueError("generate: query_tensor must be a 1-D tensor or a non-empty list of 1-D tensors.")
    outputs: list[torch.Tensor] = []
    for start in range(0, len(query_tensor), batch_size):
        queries = [q.long() for q in moved(list(query_tensor[start:start + batch_size]), device)]
        if length_sampler is not None:
            kwargs["max_new_tokens"] = length_sampler()
        input_ids, attention_mask = _pad(queries, kwargs["pad_token_id"], not is_encoder_decoder, multiple)
        call = kwargs
        if share_prompts and input_ids.shape[1] > 1 and can_share_prompts(model, kwargs, is_encoder_decoder):
            if (distinct := distinct_rows(input_ids, attention_mask)) is not None:  # "dynamic" named: the one given
                call = {k: v for k, v in kwargs.items() if k != "cache_implementation"}
                call |= shared_prompt_cache(model, input_ids, attention_mask, distinct)
        with sampling():
            generated = model.generate(input_ids=input_ids, attention_mask=attention_mask, **call)
        # decoder-only: (b, L + new) with the prompt; encoder-decoder: (b, 1 + new) after the start token
        new_tokens = generated[:, 1:] if is_encoder_decoder else generated[:, input_ids.shape[1]:]
        kept = [eos_cut(row, eos) for row in new_tokens.tolist()]  # the batch's tokens on the host, in one copy
        for query, response, n in zip(queries, new_tokens, kept):
            response = response[:n]
            outputs.append(torch.cat([query, response]) if return_prompt and not is_encoder_decoder else response)
    return outputs


def generation_setting(name: str, generation_kwargs: dict, generation_config, default: Any) -> Any:
    """One setting ``generate`` decodes with: the call's kwargs first, else the model's generation config, else
    ``default``. A None, in the call or the config, is ``default``: transformers takes a None as the setting left unset
    (no temperature applied, greedy decoding)."""
    value = generation_kwargs.get(name, getattr(generation_config, name, None))
    return default if value is None else value


def check_group_sampling(config, generation_kwargs: dict, generation_config) -> None:
    """A group estimator compares ``num_generations`` samples of each prompt: refuse to generate them greedily (the
    kwargs' ``do_sample``, else the model's generation config), which makes them identical, every advantage 0."""
    do_sample = generation_setting("do_sample", generation_kwargs, generation_config, False)
    if get_estimator(config.advantage_estimator).needs_groups and not do_sample:
        raise ValueError(f"generate: greedy decoding (do_sample=False) gives num_generations={config.num_generations} "
                         f"identical responses to each prompt, so {config.advantage_estimator}'s advantages are all 0; "
                         "pass do_sample=True.")


def warn_if_temperature_differs(config, generation_kwargs: dict, generation_config) -> bool:
    """Warn, and return True, where ``generate`` samples at another temperature than ``config.temperature``, the one
    ``step`` divides the logits by: its log-probabilities, ratios and KL would not be those of the distribution the
    responses were drawn from (legacy TRL's way at its default of 1.0)."""
    do_sample = generation_setting("do_sample", generation_kwargs, generation_config, False)
    sampled = generation_setting("temperature", generation_kwargs, generation_config, 1.0)
    if not do_sample or float(sampled) == config.temperature:
        return False
    warnings.warn(f"generate: sampling at temperature {sampled}, and PPOConfig.temperature is {config.temperature}: "
                  f"step() scores the responses at {config.temperature} (their log-probabilities, the ratio, the KL), "
                  f"not at the temperature they were drawn at; set PPOConfig(temperature={sampled}).", stacklevel=3)
    return True

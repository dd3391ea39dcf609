"""A rollout copy: the policy's weights in a lower precision, kept for sampling only.

RL systems sample from a copy of the policy held in the inference engine's precision (veRL and OpenRLHF keep one in
vLLM, in bf16) and copy the trained weights into it after each update. Here the copy is a plain ``transformers`` LM
in bf16 (or fp16), synced from the policy before ``generate`` samples whenever the policy's weights have changed. Its
own dtype is what lets transformers' static cache compile the decoding step on a GPU (the static cache's buffers
take the weights' dtype; under autocast over float32 weights they do not match the keys).

What changes, and what does not: the step's old log-probabilities are the policy's own no-grad pass in ``step()``, as
without the copy, so the PPO ratio of the first mini-batch is still exactly 1; the responses are drawn from the copy's
distribution, the policy's up to the rounding of its weights (the "rollout-training mismatch" of systems that sample
with vLLM), which ``rollout_correction`` corrects for where it is set (``algo.rollout_correction``).
"""

from __future__ import annotations

import copy

import torch

from .modeling import scoring_view

ROLLOUT_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

AUTO_CORRECTION = "token_truncate"  # rollout_correction "auto" wherever a copy samples: TIS, capped per token


def rollout_choice(dtype: str | None, correction: str | None, device_type: str, cuda_bf16: bool,
                   zero3: bool, weights_dtype: str | None = None) -> tuple[str | None, str | None]:
    """``PPOConfig.rollout_dtype`` and ``rollout_correction`` as a run uses them, "auto" resolved: on a CUDA GPU with
    bf16 (and the weights whole: not ZeRO-3) a bf16 copy samples, elsewhere the policy, and wherever the policy's
    weights are bf16 already (``weights_dtype``) the policy: the copy would hold the same numbers; wherever a copy
    samples, "auto" corrects with ``AUTO_CORRECTION``. An explicit value wins; without a copy there is nothing to
    correct."""
    if dtype == "auto":
        gpu_bf16 = device_type == "cuda" and cuda_bf16 and not zero3
        dtype = "bfloat16" if gpu_bf16 and weights_dtype is None else None
    if dtype is None:
        return None, None
    return dtype, AUTO_CORRECTION if correction == "auto" else correction


def static_cache_by_default(generation_kwargs: dict, half_on_gpu: bool) -> dict:
    """generate()'s keyword arguments with ``cache_implementation`` "auto" (or not given) resolved: the static cache
    where weights in their own compute dtype sample on a GPU (a rollout copy, or the policy under
    ``PPOConfig.weights_dtype``: transformers compiles the decoding step), else transformers' default."""
    kwargs = dict(generation_kwargs)
    if kwargs.get("cache_implementation", "auto") == "auto":
        kwargs.pop("cache_implementation", None)
        if half_on_gpu:
            kwargs["cache_implementation"] = "static"
    return kwargs


def low_precision_copy(model: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """A copy of ``model`` whose floating-point parameters are ``dtype`` (unset: :func:`sync_weights` fills them),
    frozen and in eval mode, each on its parameter's device; tied parameters stay tied (one tensor).

    The float32 weights are never duplicated on the way (each parameter is allocated in ``dtype`` at once), and the
    buffers keep their dtype: rotary frequencies stay float32, as ``from_pretrained(dtype=torch.bfloat16)`` keeps them.
    """
    memo = {}
    for p in model.parameters():
        new = torch.empty_like(p, dtype=dtype) if p.is_floating_point() else p.detach().clone()
        memo[id(p)] = torch.nn.Parameter(new, requires_grad=False)
    lm = copy.deepcopy(model, memo)  # every module, buffer and config copied; the parameters are the memo's
    if getattr(lm, "config", None) is not None and hasattr(lm.config, "dtype"):
        lm.config.dtype = dtype
    return lm.requires_grad_(False).eval()


@torch.no_grad()
def sync_weights(lm: torch.nn.Module, model: torch.nn.Module) -> None:
    """Copy ``model``'s current parameters into ``lm``, a :func:`low_precision_copy` of it, rounding to its dtype.

    A PEFT copy gets its active adapters merged into its base weights after the copy (one matmul per weight, no LoRA
    branch in every generated token); the merge is undone first, so that each sync starts from the policy's own
    base weights and no rounding accumulates from one sync to the next.
    """
    peft = hasattr(lm, "merge_adapter")
    if peft and _merged(lm):
        lm.unmerge_adapter()
    source = dict(model.named_parameters())
    for name, p in lm.named_parameters():
        p.copy_(source[name])
    if peft:
        lm.merge_adapter()


def _merged(lm: torch.nn.Module) -> bool:
    """Whether any of a PEFT model's adapter layers has its adapter merged into its base weight."""
    return any(getattr(m, "merged", False) for m in lm.modules() if hasattr(m, "merged_adapters"))


def weights_stamp(model: torch.nn.Module) -> tuple[int, ...]:
    """A stamp that changes whenever any of ``model``'s parameters is written in place (an optimizer step,
    ``load_state_dict``, a user's edit): each parameter's version counter, which autograd bumps on every in-place
    write. Cheap: no data is read."""
    return tuple(p._version for p in model.parameters())


class RolloutCopy:
    """The policy's rollout copy, made at first use and synced lazily: :meth:`current` returns it up to date with
    the policy (``lm``, the unwrapped ``transformers`` model), copying the weights only when any of them has changed
    since the last sync (:func:`weights_stamp`, and ``step``: the trainer's count of updates, for engines that write the
    weights outside autograd's view, as DeepSpeed does)."""

    def __init__(self, dtype_name: str):
        self.dtype = ROLLOUT_DTYPES[dtype_name]
        self.lm: torch.nn.Module | None = None
        self._synced: tuple | None = None
        self._scorer: torch.nn.Module | None = None

    def current(self, lm: torch.nn.Module, step: int) -> torch.nn.Module:
        """The copy of ``lm`` (made on first call), its weights ``lm``'s as they are now."""
        if self.lm is None:
            self.lm = low_precision_copy(lm, self.dtype)
        stamp = (step, weights_stamp(lm))
        if stamp != self._synced:
            sync_weights(self.lm, lm)
            self._synced = stamp
        return self.lm

    def scorer(self) -> torch.nn.Module:
        """The copy (made by :meth:`current`) in its value-head class, for a scoring pass over its samples: the
        rollout correction's log-probabilities of the sampler."""
        if self._scorer is None:
            self._scorer = scoring_view(self.lm)
        return self._scorer

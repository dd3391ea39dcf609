"""DeepSpeed ZeRO-3 shards the weights: a parameter holds its full value only during the forward (and backward)
of a module that owns it, or that has it registered as an *external* parameter. A read outside any forward
(whole-vocabulary KL, legacy logits) gathers what it reads explicitly (:func:`gathered`).

deepspeed is imported only where one of these runs under ZeRO-3.
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch


def is_sharded(params: Iterable[torch.Tensor]) -> bool:
    """Whether any of ``params`` is a ZeRO-3 parameter (DeepSpeed tags each with a ``ds_id``)."""
    return any(hasattr(p, "ds_id") for p in params)


def gathered(params: Iterable[torch.nn.Parameter]):
    """A context in which the ZeRO-3 ``params`` hold their full values (read-only); a no-op for plain ones.

    A collective: every process must enter it with the same parameters.
    """
    params = list({id(p): p for p in params}.values())  # a PEFT policy is its own reference: same head twice
    if not is_sharded(params):
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params)

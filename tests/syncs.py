"""Counting host syncs on the CPU: the calls that make Python wait for a GPU.

A GPU runs ahead of Python until Python needs a value back: ``.item()``, ``bool()``, ``int()``, ``float()`` of a
tensor (all ``aten::_local_scalar_dense``), ``nonzero``, boolean-mask indexing and ``unique`` (their output size
depends on the data), and copies to the host (``.cpu()``, ``.tolist()``). On the CPU these cost nothing, but they are
the same calls, so counting them here counts the waits of a GPU run. Two limits: a copy between host and device is a
no-op here, so it is counted only where the code calls ``.cpu()`` or ``.tolist()`` (code that skips the copy for a
tensor already on the host is not counted); and a read of a tensor that is on the host by design is counted unless
the code reads it through numpy (``.numpy()``, which a device tensor could not do).
"""

from __future__ import annotations

import collections
import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "_unique", "_unique2", "unique_dim",
             "unique_consecutive"}
_MASK_INDEXING = {"index", "index_put", "index_put_", "_index_put_impl_"}  # with a boolean mask: a nonzero inside
_HOST_COPIES = {"cpu", "tolist"}


def _bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else []
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or [])


class _Ops(TorchDispatchMode):
    def __init__(self, counts: collections.Counter, paused: list[int]):
        super().__init__()
        self.counts, self.paused = counts, paused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused[0] and (name in _SYNC_OPS or name in _MASK_INDEXING and _bool_index(args)
                                   or name == "repeat_interleave" and not (kwargs or {}).get("output_size")):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class _Copies(TorchFunctionMode):
    def __init__(self, counts: collections.Counter, paused: list[int]):
        super().__init__()
        self.counts, self.paused = counts, paused

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not self.paused[0] and name in _HOST_COPIES and args and isinstance(args[0], torch.Tensor):
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class HostSyncs:
    """Count the host syncs of a block: ``with HostSyncs() as syncs: ...``; ``syncs.total``, ``syncs.counts`` (by op).

    ``outside(module)`` leaves a module's forward out of the count, ``outside(owner, "method")`` a method's calls
    (e.g. a transformers model's forward or ``generate``, whose own syncs are not this project's to remove).
    """

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self._paused = [0]
        self._stack = contextlib.ExitStack()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def outside(self, owner, method: str | None = None) -> None:
        if method is None:
            self._stack.callback(owner.register_forward_pre_hook(lambda *_: self._pause(1)).remove)
            self._stack.callback(owner.register_forward_hook(lambda *_: self._pause(-1)).remove)
            return
        original = getattr(owner, method)

        def paused(*args, **kwargs):
            self._pause(1)
            try:
                return original(*args, **kwargs)
            finally:
                self._pause(-1)

        setattr(owner, method, paused)
        self._stack.callback(lambda: delattr(owner, method) if method in vars(owner) else None)

    def _pause(self, step: int) -> None:
        self._paused[0] += step

    def __enter__(self) -> HostSyncs:
        self._stack.enter_context(_Copies(self.counts, self._paused))
        self._stack.enter_context(_Ops(self.counts, self._paused))
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

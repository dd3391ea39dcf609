"""What ``step`` needs from the other processes when PPO runs in N of them (``accelerate launch``, DDP).

Each process holds ``batch_size`` samples and ``step`` must give what one process gives over the
``N * batch_size`` samples of the global batch (process 0's first). Means and variances over samples
or tokens therefore need sums from every process, histograms need every process's values, and a
decision (skip a mini-batch, raise) must be taken the same on every process or the next collective hangs.

The helpers take a :class:`ProcessGroup` (or any object with its three methods: tests use threads
standing in for processes), and every caller passes ``None`` on one process, where nothing here runs.

Notation: ``N`` processes, ``n_p`` valid tokens on process ``p``, ``n = sum_p n_p``.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ProcessGroup:
    """The processes of the run (torch.distributed's default group) as the three collectives ``step`` uses.

    Every process must call each method, in the same order, with tensors of the same shape and dtype.
    """

    num_processes: int
    process_index: int
    device: torch.device  # where the backend communicates from (CPU for gloo, the process's GPU for NCCL)

    @classmethod
    def current(cls, device: torch.device | str) -> ProcessGroup | None:
        """The default group when torch.distributed runs more than one process, else None."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return None
        return cls(dist.get_world_size(), dist.get_rank(), torch.device(device))

    def sum_across(self, x: torch.Tensor) -> torch.Tensor:
        """Element-wise sum over processes; the same result on every process (on ``x``'s device)."""
        out = x.detach().to(self.device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out.to(x.device)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``(b, ...)`` per process -> ``(N * b, ...)``: the processes' tensors concatenated in process order."""
        x_dev = x.detach().to(self.device).contiguous()
        parts = [torch.empty_like(x_dev) for _ in range(self.num_processes)]
        dist.all_gather(parts, x_dev)
        return torch.cat(parts).to(x.device)

    def gather_object(self, obj: Any) -> list[Any]:
        """``[obj of process 0, ..., obj of process N-1]`` (objects ``torch.save`` can write)."""
        # all_gather_object's own pickling of tensors fails to unpickle them (torch 2.13, legacy storages);
        # torch.save's format does not, so the processes exchange torch.save bytes.
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        out: list[Any] = [None] * self.num_processes
        dist.all_gather_object(out, buffer.getvalue())
        return [torch.load(io.BytesIO(data), weights_only=False) for data in out]  # written by this run's processes


def mean_across(x: torch.Tensor, group) -> torch.Tensor:
    """Element-wise mean over processes."""
    return group.sum_across(x) / group.num_processes


def tokens_per_process(mask: torch.Tensor, group) -> torch.Tensor:
    """``n / N``: the global count of valid tokens, shared evenly among the processes.

    A process that divides its token sum by this instead of by its own ``n_p`` contributes ``N / n`` times
    its sum, so the *mean over processes* (what DDP does to gradients, and ``gather_stats`` to stats) is
    the token mean over the global batch, ``sum_p sum_t x / n``, whatever the ``n_p``.
    """
    return group.sum_across(mask.detach().float().sum()) / group.num_processes


def gather_ragged(x: torch.Tensor, group) -> torch.Tensor:
    """``(k, n_p)`` per process -> ``(k, n)``: concatenated along the last dim in process order (the ``n_p`` may differ)."""
    counts = group.gather(torch.tensor([x.shape[-1]], device=x.device)).tolist()
    padded = torch.nn.functional.pad(x, (0, max(counts) - x.shape[-1]))  # all_gather needs equal shapes
    parts = group.gather(padded[None])  # (N, k, max n_p)
    return torch.cat([part[..., :count] for part, count in zip(parts, counts)], dim=-1)


def raise_if_any(error: BaseException | None, group) -> None:
    """Raise on every process if ``error`` is set on any: with one process, ``error`` itself; with N, the first
    failing process's exception type and message, prefixed by its index, so that no process is left waiting
    in a collective for one that has stopped.
    """
    if group is None:
        if error is not None:
            raise error
        return
    failed = group.sum_across(torch.tensor([float(error is not None)]))
    if not failed.item():
        return
    reports = group.gather_object(None if error is None else (type(error), str(error)))
    index, (kind, message) = next((i, r) for i, r in enumerate(reports) if r is not None)
    message = f"process {index} of {group.num_processes}: {message}"
    try:
        exc = kind(message)
    except Exception:  # noqa: BLE001 - an exception class with another signature: keep the message
        exc = RuntimeError(f"{kind.__name__}: {message}")
    raise exc from error

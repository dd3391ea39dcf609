"""The other processes of a run: what ``step`` needs from them, and how they are launched and connected.

When PPO runs in N processes (``accelerate launch``: DDP or DeepSpeed), each process holds ``batch_size`` samples
and ``step`` must give what one process gives over the ``N * batch_size`` samples of the global batch (process
0's first). Means and variances over samples or tokens therefore need sums from every process, histograms need
every process's values, and a decision (skip a mini-batch, raise) must be taken the same on every process or the
next collective hangs.

The trainer talks to the other processes through one object with three collectives: a :class:`ProcessGroup`
(torch.distributed's default group), or :class:`SingleProcess` when it runs alone, whose collectives return
their input; the helpers below take either (or any object with the three methods: tests use threads standing
in for processes). Alone they give exactly the numbers of a one-process run: where the N-process way would round
differently or reword an error (:func:`tokens_per_process`, :func:`raise_if_any`, ``stats.gather_samples``), they
return early and say why. The rest is launch plumbing: building the run's ``Accelerator`` (:func:`accelerator_for`:
accelerate's process-wide state, the process-group backend accelerate does not pick under DeepSpeed on CPUs, the
check that accelerate counts every process) and torch's deprecation warning on DeepSpeed's collectives (ignored
within a block).

Notation: ``N`` processes, ``n_p`` valid tokens on process ``p``, ``n = sum_p n_p``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

__all__ = [
    "DEPRECATED_COLLECTIVES", "ProcessGroup", "SingleProcess", "accelerator_for", "check_process_count", "cpu_backend",
    "deepspeed_launched", "deprecated_collectives_ignored", "gather_ragged", "mean_across", "on_every_process",
    "process_group", "process_group_kwargs", "quiet_deepspeed_collectives", "raise_if_any",
    "reset_single_process_accelerate_state", "tokens_per_process",
]

T = TypeVar("T")


@dataclass(frozen=True)
class ProcessGroup:
    """The processes of the run (torch.distributed's default group) as the three collectives ``step`` uses.

    Every process must call each method, in the same order, with tensors of the same shape and dtype.
    """

    num_processes: int
    process_index: int
    device: torch.device  # where the backend communicates from (CPU for gloo, the process's GPU for NCCL)

    @classmethod
    def current(cls, device: torch.device | str) -> ProcessGroup | SingleProcess:
        """The default group when torch.distributed runs more than one process, else this process alone."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return SingleProcess(torch.device(device))
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


@dataclass(frozen=True)
class SingleProcess:
    """A run of one process, with :class:`ProcessGroup`'s collectives: a sum or a concatenation over one process
    is its input (a detached copy, as the group's), the gathered objects ``[obj]``."""

    device: torch.device
    num_processes: int = 1
    process_index: int = 0

    def sum_across(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().clone()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach().clone()

    def gather_object(self, obj: Any) -> list[Any]:
        return [obj]


def process_group(accelerator) -> ProcessGroup | SingleProcess:
    """The run's processes as ``accelerator`` counts them: torch.distributed's default group, or this one alone."""
    if accelerator.num_processes > 1:
        return ProcessGroup.current(accelerator.device)
    return SingleProcess(accelerator.device)


def on_every_process(group, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, on every process: an exception it raises on any process raises on all (:func:`raise_if_any`),
    so that none is left waiting in a later collective for one that has stopped."""
    result, error = None, None
    try:
        result = fn(*args)
    except Exception as exc:  # noqa: BLE001 - raised again by raise_if_any, on every process
        error = exc
    raise_if_any(error, group)
    return result


def mean_across(x: torch.Tensor, group) -> torch.Tensor:
    """Element-wise mean over processes."""
    return group.sum_across(x) / group.num_processes


def tokens_per_process(mask: torch.Tensor, group) -> torch.Tensor | None:
    """``n / N``: the global count of valid tokens, shared evenly among the processes; None for one process.

    A process that divides its token sum by this instead of by its own ``n_p`` contributes ``N / n`` times
    its sum, so the *mean over processes* (what DDP does to gradients, and ``gather_stats`` to stats) is
    the token mean over the global batch, ``sum_p sum_t x / n``, whatever the ``n_p``. Alone, a process divides
    by its own count (``token_mean``'s ``None``), counted in the dtype of the values: a float32 count could
    round differently for float64 values or fractional masks, and the one-process numbers must not move.
    """
    if group.num_processes == 1:
        return None
    return group.sum_across(mask.detach().float().sum()) / group.num_processes


def gather_ragged(x: torch.Tensor, group) -> torch.Tensor:
    """``(k, n_p)`` per process -> ``(k, n)``: concatenated along the last dim in process order (the ``n_p`` may
    differ). Alone: a detached copy of ``x``, as the collectives give (no count to read back)."""
    if group.num_processes == 1:
        return x.detach().clone()
    counts = group.gather(torch.tensor([x.shape[-1]], device=x.device)).tolist()
    padded = torch.nn.functional.pad(x, (0, max(counts) - x.shape[-1]))  # all_gather needs equal shapes
    parts = group.gather(padded[None])  # (N, k, max n_p)
    return torch.cat([part[..., :count] for part, count in zip(parts, counts)], dim=-1)


def raise_if_any(error: BaseException | None, group) -> None:
    """Raise on every process if ``error`` is set on any: with one process, ``error`` itself; with N, the first
    failing process's exception type and message, prefixed by its index, so that no process is left waiting
    in a collective for one that has stopped.
    """
    if group.num_processes == 1:  # nobody to tell: the error as raised, with its traceback
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


# ---- launch and backend plumbing ------------------------------------------------------------------------
def deepspeed_launched() -> bool:
    """Whether this process was started by ``accelerate launch`` with a DeepSpeed config."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true" and "LOCAL_RANK" in os.environ


def cpu_backend() -> str | None:
    """Under a DeepSpeed launch on a machine whose DeepSpeed accelerator is the CPU: the process-group backend
    accelerate does not pick (see :func:`process_group_kwargs`); None elsewhere, where accelerate picks it.

    accelerate picks a backend for GPUs and the other devices it knows, or with ``use_cpu`` (which turns DeepSpeed
    off); for DeepSpeed on a machine without them it picks none and then counts every process as process 0 of 1.
    DeepSpeed's CPU accelerator names its backend (gloo; oneCCL's ccl where installed). On CPUs this also marks
    DeepSpeed's shared-memory all-reduce op unbuildable before DeepSpeed starts its communication, which would
    otherwise compile it (about a minute on a fresh machine): only DeepSpeed's inference all-reduce (tensor-parallel
    inference) uses it, never ZeRO training.
    """
    if not deepspeed_launched():
        return None
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return None
    import deepspeed.ops

    shm_op = get_accelerator().get_op_builder("ShareMemCommBuilder")
    deepspeed.ops.__compatible_ops__[shm_op.NAME] = False  # what DeepSpeed's start-up reads before building it
    return get_accelerator().communication_backend_name()


def process_group_kwargs(accelerator_kwargs: dict) -> dict:
    """``accelerator_kwargs`` plus, under DeepSpeed on CPUs, the process-group backend accelerate does not pick
    (:func:`cpu_backend`). A backend given in ``kwargs_handlers`` is kept."""
    backend = cpu_backend()
    if backend is None:
        return accelerator_kwargs
    from accelerate.utils import InitProcessGroupKwargs

    handlers = list(accelerator_kwargs.get("kwargs_handlers") or [])
    if any(isinstance(h, InitProcessGroupKwargs) for h in handlers):
        return accelerator_kwargs
    return {**accelerator_kwargs, "kwargs_handlers": [*handlers, InitProcessGroupKwargs(backend=backend)]}


def accelerator_for(config):
    """The run's ``Accelerator`` from ``PPOConfig``'s settings: built after
    :func:`reset_single_process_accelerate_state`, with the backend accelerate does not pick under DeepSpeed on CPUs
    (:func:`process_group_kwargs`), and checked to count every process (:func:`check_process_count`)."""
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin, ProjectConfiguration

    reset_single_process_accelerate_state()
    # accelerate's default syncs every mini-batch while a prepared dataloader is on its last batch: step() would then
    # update at every mini-batch of the loader's last batch, however many accumulate (the trainer counts its windows)
    accumulation = GradientAccumulationPlugin(num_steps=config.gradient_accumulation_steps, sync_with_dataloader=False)
    accelerator = Accelerator(log_with=config.log_with, gradient_accumulation_plugin=accumulation,
                              project_config=ProjectConfiguration(**config.project_kwargs),
                              **process_group_kwargs(config.accelerator_kwargs))
    if accelerator.state.deepspeed_plugin is not None:
        check_process_count(accelerator)
    return accelerator


def check_process_count(accelerator) -> None:
    """Raise if accelerate counts fewer processes than torch.distributed runs (see :func:`process_group_kwargs`:
    a state created without a backend, before the trainer's): every process would train as if it were alone."""
    if dist.is_initialized() and dist.get_world_size() != accelerator.num_processes:
        raise ValueError(f"PPOTrainer: accelerate counts {accelerator.num_processes} process(es) but DeepSpeed runs "
                         f"{dist.get_world_size()}: accelerate's state was created without a process-group backend, "
                         "as happens on CPUs before the trainer's Accelerator; create the first Accelerator with "
                         "kwargs_handlers=[InitProcessGroupKwargs(backend='gloo')] (a PartialState with "
                         "backend='gloo'), or none.")


# the message of torch's FutureWarning on the collectives DeepSpeed calls, as a warnings filter regex
DEPRECATED_COLLECTIVES = r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated"


@contextlib.contextmanager
def deprecated_collectives_ignored(enabled: bool = True) -> Iterator[None]:
    """Within the block, torch's FutureWarning on the collectives DeepSpeed calls (``all_gather_into_tensor``,
    ``reduce_scatter_tensor``, renamed in torch 2.13) is ignored: it comes again at every step, on every process,
    and only a DeepSpeed release can act on it. The warnings filters are restored on the way out; a no-op when not
    ``enabled``."""
    if not enabled:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", DEPRECATED_COLLECTIVES, FutureWarning)
        yield


def quiet_deepspeed_collectives(method: Callable) -> Callable:
    """Decorate a ``PPOTrainer`` method: under DeepSpeed (``self.is_deepspeed``) the method runs within
    :func:`deprecated_collectives_ignored`, so the warnings filters are left as they were once it returns."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with deprecated_collectives_ignored(self.is_deepspeed):
            return method(self, *args, **kwargs)

    return run


def reset_single_process_accelerate_state() -> None:
    """Forget the settings of this process's previous ``Accelerator`` when the process runs alone; else a no-op.

    Why: accelerate keeps its state in process-wide singletons (``AcceleratorState``, ``GradientState``) that the
    first ``Accelerator`` of a process fills for good: a later one given another ``mixed_precision`` raises
    ("already been initialized and cannot be changed"), and one given none silently runs with the first one's (bf16
    after a bf16 trainer). A process that builds several trainers (a notebook, a sweep, the tests) would be stuck
    with the first one's settings. When: each ``PPOTrainer`` calls it before building its ``Accelerator``; it resets
    only an existing state, and only in a process that runs alone (``PartialState``, the process group itself, is
    kept): under ``accelerate launch`` the state belongs to the launch and is left alone. ``_reset_state`` is
    accelerate's private API (accelerate's own test scripts call it between Accelerators); a release that drops it
    breaks this function alone.
    """
    from accelerate.state import AcceleratorState, GradientState, PartialState

    if AcceleratorState._shared_state and PartialState().num_processes == 1:
        AcceleratorState._reset_state()
        GradientState._reset_state()

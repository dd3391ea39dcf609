"""Small utilities: seeding (legacy API), the CPU allocator setting the trainer applies by default, freeing the
device cache, TF32 matmuls on the GPUs that have them, a block timer, and a scoped swap of a library function (the CPU
fast paths of ``generation`` and ``cpu_attention``)."""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import os
import random
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
_KEEP_BYTES = 1 << 30


def set_seed(seed: int) -> None:
    """Seed Python's ``random``, NumPy and torch (all devices) for reproducible runs."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


def keep_freed_memory_for_reuse() -> bool:
    """Let glibc's malloc reuse large freed blocks instead of unmapping them; True if it was applied.

    glibc serves every allocation above its mmap threshold (32 MiB at most by default) with a fresh
    ``mmap`` and unmaps it on free, so a ``(N, V)`` logits block of a 32k vocabulary (48 MiB at N = 384)
    is faulted in again, page by page, each time a PPO mini-batch allocates it: 1.7 s of a 6.7 s step on
    two cores. Raising the mmap and trim thresholds to 1 GiB keeps such blocks in the heap for the next
    use (what PyTorch's CPU tuning guide gets from jemalloc or tcmalloc). The process keeps its peak heap
    (+90 MiB of RSS on the 32k benchmark). ``PPOTrainer`` applies it on the CPU by default, for the whole process
    (malloc has no per-object setting); ``PPO_CORE_TUNE_MALLOC=0`` in the environment turns it off. No-op off glibc.
    """
    if os.environ.get("PPO_CORE_TUNE_MALLOC", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (macOS, Windows, musl without mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES))


def free_device_cache() -> None:
    """Collect garbage and return the cached blocks of the GPU allocator to the device (``optimize_device_cache``)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def tf32_supported(device: torch.device | str) -> bool:
    """Whether float32 matmuls on ``device`` can use TF32: a CUDA GPU of compute capability 8.0 (Ampere) or newer,
    unless ``NVIDIA_TF32_OVERRIDE=0`` in the environment (NVIDIA's switch: cuBLAS and cuDNN then never use TF32)."""
    device = torch.device(device)
    if device.type != "cuda" or os.environ.get("NVIDIA_TF32_OVERRIDE") == "0" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] >= 8


@contextlib.contextmanager
def tf32_matmuls(enabled: bool, device: torch.device | str) -> Iterator[None]:
    """Within the block, float32 matmuls on CUDA use TF32 (inputs rounded to 10 mantissa bits, float32 accumulation:
    several times the float32 throughput of Ampere and Hopper GPUs) when ``enabled`` and ``device`` has it
    (:func:`tf32_supported`), and torch's setting is restored on the way out. Where the user has chosen a matmul
    precision already (torch's ``fp32_precision`` flags, or the legacy ``allow_tf32``), or elsewhere (CPUs), nothing
    changes. cuDNN's convolutions use TF32 by default in torch."""
    matmul = torch.backends.cuda.matmul
    if not (enabled and tf32_supported(device)) or (matmul.fp32_precision, torch.backends.fp32_precision) != (
            "none", "none"):
        yield
        return
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = "none"


def moved(tensors: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """``tensors`` on ``device`` in one copy, e.g. a batch's responses to the host: a copy per tensor is a host sync
    each on a GPU (a copy to the host waits for the GPU, and so does a blocking one to it). A list already there is
    returned as it is; one that mixes devices or dtypes is moved tensor by tensor."""
    device = torch.device(device)
    if all(t.device == device for t in tensors):
        return list(tensors)
    if len({(t.device, t.dtype) for t in tensors}) > 1:
        return [t.to(device) for t in tensors]
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(device, non_blocking=device.type != "cpu")
    return [part.view(t.shape) for part, t in zip(flat.split([t.numel() for t in tensors]), tensors)]


@contextlib.contextmanager
def timed(timing: dict[str, float], key: str) -> Iterator[None]:
    """``timing[key]``: the block's wall-clock seconds (not set when the block raises)."""
    start = time.perf_counter()
    yield
    timing[key] = time.perf_counter() - start


@contextlib.contextmanager
def swapped(owner: Any, name: str, original: Any, replacement: Any, enabled: bool = True) -> Iterator[None]:
    """Within the block ``owner.name`` is ``replacement``; ``original`` is put back after it, exceptions included.

    A no-op when not ``enabled``, or when ``owner.name`` is not ``original`` on entry: inside another such block
    (the outermost one restores it), or replaced by someone else (left alone).
    """
    if not enabled or getattr(owner, name) is not original:
        yield
        return
    setattr(owner, name, replacement)
    try:
        yield
    finally:
        setattr(owner, name, original)

"""Which floating-point kernels the stages compute with, so that the same inputs give the same bytes on every machine
the guarantee covers (README, "Same inputs, same bytes").

torch picks its CPU kernels when a process starts, by what the CPU offers: ATen's vectorised kernels by instruction
set (AVX-512 where the CPU has it, else AVX2; `ATEN_CPU_CAPABILITY` overrides), and Intel MKL, which computes every
float32 matrix product, by CPU model and vendor (its AVX-512 branch on Intel Xeons, a generic branch on AMD). Each
choice rounds differently: forcing either one on the default pipeline changes every trained artifact (measured, see
README). The stages therefore pin MKL to its COMPATIBLE branch, the one Intel documents to give the same results on
every Intel or compatible (AMD) CPU for a given number of threads; ATen's choice is left to the CPU, since both
vendors' AVX-512 CPUs get the same kernels and pinning AVX2 costs the default run about a quarter of its time.

`pin()` runs when the `stages` package is imported, before torch: a value already in the environment wins.
"""

from __future__ import annotations

import os
import platform

PINNED = {"MKL_CBWR": "COMPATIBLE"}
LOCK_THREADS = 2  # torch threads of the runs that wrote the committed dvc.lock (2-core machines)
X86 = ("x86_64", "AMD64")


def pin() -> None:
    """Set the `PINNED` environment defaults (x86 only: MKL is an x86 library). Call before importing torch."""
    if platform.machine() in X86:
        for key, value in PINNED.items():
            os.environ.setdefault(key, value)


def current() -> dict[str, object]:
    """What decides the bits of this process's float kernels (imports torch)."""
    import torch

    return {"machine": platform.machine(), "aten": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), **{key: os.environ.get(key) for key in PINNED}}


def covered(kernels: dict[str, object]) -> bool:
    """Whether a process with these `kernels` (see `current`) computes what the committed dvc.lock records: an x86
    CPU with AVX-512 (ATen's AVX512 kernels), MKL pinned, and the lock's number of threads."""
    return (kernels["machine"] in X86 and kernels["aten"] == "AVX512" and kernels["threads"] == LOCK_THREADS
            and all(kernels[key] == value for key, value in PINNED.items()))

"""Which floating-point kernels a stage computes with: what "same inputs, same bytes" depends on across machines.

torch picks its CPU kernels when a process starts, by what the CPU offers: ATen's vectorised kernels by instruction
set (AVX-512 where the CPU has it, else AVX2; `ATEN_CPU_CAPABILITY` overrides), and Intel MKL, which computes every
float32 matrix product, by CPU vendor and model (a generic branch on AMD, its AVX-512 branch on Intel Xeons;
`MKL_CBWR` overrides), and the parallel kernels split their work by the number of threads. Each choice rounds
differently: forcing another CPU's MKL branch, ATen's AVX2 kernels or one thread instead of two changes every trained
artifact of the default run (README, "Same inputs, same bytes"). Pinning them (`MKL_CBWR=COMPATIBLE`, the branch
Intel documents as vendor-independent) would make the bytes portable but costs the default run a third of its time
and the 32k-vocabulary benchmark 1.8x, so the stages leave the choice to the CPU: the bytes are guaranteed on
machines that choose the same kernels, which the committed dvc.lock records as `LOCK_KERNELS`.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

# The kernels of the machine that wrote the committed dvc.lock (2-core AMD EPYC, Zen 4). Regenerating the lock on
# another kind of machine means updating this too: tests/pipeline/test_default.py says so.
LOCK_KERNELS = {"machine": "x86_64", "vendor": "AuthenticAMD", "aten": "AVX512", "threads": 2,
                "MKL_CBWR": None, "ATEN_CPU_CAPABILITY": None}
OVERRIDES = ("MKL_CBWR", "ATEN_CPU_CAPABILITY")


def cpu_vendor() -> str | None:
    """The CPU's vendor id ("GenuineIntel", "AuthenticAMD"), from /proc/cpuinfo; None where there is none."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return None
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip()
    return None


def current() -> dict[str, object]:
    """What decides the bits of this process's float kernels (imports torch)."""
    import torch

    return {"machine": platform.machine(), "vendor": cpu_vendor(), "aten": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(), **{key: os.environ.get(key) or None for key in OVERRIDES}}


def covered(kernels: dict[str, object]) -> bool:
    """Whether a process with these `kernels` (see `current`) computes what the committed dvc.lock records."""
    return kernels == LOCK_KERNELS

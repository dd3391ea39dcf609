"""The `auto` values of params.yaml: the precision and the rollout engine this machine has, decided when a stage runs.

- `model.mixed_precision: auto`: bf16 autocast on a CUDA GPU with bf16 and on a CPU with native bf16 matrix units
  (AMX-BF16 or AVX-512 BF16; bf16 on aarch64), float32 elsewhere. A CPU without them emulates bf16: a 1024x1024 bf16
  matmul ran about 60x slower than float32 on a 2-core AMD EPYC with AVX2 only, an autocast `Linear` 5.6x slower.
  Under `numerics.kernels: portable` it is float32 on every CPU: the portable kernels are AVX2's, and the committed lock
  is float32 bytes that any x86-64 CPU reproduces.
- `ppo.rollout_dtype`, `ppo.rollout_correction` and `generation.cache_implementation: auto` are ppo_core's own
  (`PPOConfig`'s defaults; ppo_core/models/rollout_copy.py): on a CUDA GPU with bf16 a bf16 copy of the policy samples
  (1.30 s against 7.69 s for bench/gpu_real.sh's rollout on an H200) with the compiled static cache, its samples
  corrected by truncated importance weights (token_truncate); on a CPU the policy samples, with the dynamic cache.
  The ppo stage passes them as they are; evaluate samples its float32 policies with the dynamic cache.

The choices are pure functions of the facts (`Machine`), so a test can fake any machine; `machine()` reads this one.
An explicit value is always what is used.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from stages.shared.runtime import note, warning

AUTO = "auto"
NATIVE_BF16 = ("amx_bf16", "avx512_bf16")  # x86 /proc/cpuinfo flags; aarch64's feature is "bf16"


@dataclass(frozen=True)
class Machine:
    """What the `auto` choices depend on."""

    device: str
    """"cuda" or "cpu"."""
    cuda_bf16: bool
    """The GPU computes bf16 natively (Ampere and later)."""
    cpu_bf16: tuple[str, ...]
    """The CPU's native bf16 units, by their flag names (empty: none)."""


def cpu_bf16_units(cpuinfo: str | None = None, machine: str | None = None) -> tuple[str, ...]:
    """The native bf16 units the CPU reports (``cpuinfo``: /proc/cpuinfo's text; none there, as on macOS: none)."""
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        cpuinfo = path.read_text() if path.exists() else ""
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            flags |= set(line.partition(":")[2].split())
    wanted = ("bf16",) if (machine or platform.machine()) in ("aarch64", "arm64") else NATIVE_BF16
    return tuple(flag for flag in wanted if flag in flags)


def machine() -> Machine:
    """This process's machine (imports torch)."""
    import torch

    cuda = torch.cuda.is_available()
    return Machine("cuda" if cuda else "cpu", cuda and torch.cuda.is_bf16_supported(), cpu_bf16_units())


def mixed_precision(given: str | None, kernels: str, at: Machine) -> tuple[str | None, str]:
    """`model.mixed_precision` as used: ``given`` itself unless it is auto; and why, in words (auto's note)."""
    if given != AUTO:
        return given, "as params.yaml sets it"
    if at.device == "cuda":
        return ("bf16", "a CUDA GPU with bf16") if at.cuda_bf16 else (None, "a CUDA GPU without bf16")
    if kernels == "portable":
        return None, "numerics.kernels is portable: float32 bytes any x86-64 CPU reproduces"
    if at.cpu_bf16:
        return "bf16", f"this CPU has native bf16 ({', '.join(at.cpu_bf16)})"
    return None, "this CPU has no native bf16 (AMX-BF16 or AVX-512 BF16): it would emulate it, several times slower"


def precision_note(stage: str, given: str | None, kernels: str, at: Machine) -> None:
    """auto: one note saying what it chose and why. An explicit bf16 on a CPU without native bf16: one warning with
    its cost. The main process's alone."""
    used, why = mixed_precision(given, kernels, at)
    if os.environ.get("RANK", "0") != "0":  # under `accelerate launch`: the main process says it, once
        return
    if given == AUTO:
        note(f"{stage}: model.mixed_precision auto: {'bf16 autocast' if used else 'float32'} ({why})")
    elif given == "bf16" and at.device == "cpu" and not at.cpu_bf16:
        warning(f"{stage}: model.mixed_precision is bf16, but this CPU has no native bf16 (AMX-BF16 or AVX-512 BF16): "
                "autocast emulates it, about 5x slower than float32 for a linear layer (60x for a bare matmul); "
                "set it to auto (float32 here) unless you want bf16's numbers")


def generation(params) -> dict:
    """The `generation` section as keyword arguments for a sampler other than the trainer's (evaluate's float32
    policies): `cache_implementation: auto` is the dynamic cache there (the static one pays with a rollout copy, whose
    compiled decoding step ppo_core's generate() chooses itself)."""
    kwargs = dataclasses.asdict(params.generation)
    return kwargs | {"cache_implementation": "dynamic" if kwargs["cache_implementation"] == AUTO else
                     kwargs["cache_implementation"]}

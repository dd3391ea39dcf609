"""Which floating-point kernels a stage computes with: what "same inputs, same bytes" depends on across machines.

torch picks its CPU kernels when a process starts, by what the CPU offers: ATen's vectorised kernels by instruction
set (AVX-512 where the CPU has it, else AVX2; `ATEN_CPU_CAPABILITY` overrides), oneDNN's by instruction set
(`ONEDNN_MAX_CPU_ISA`), and Intel MKL, which computes every float32 matrix product and some elementwise functions
(its VML: `torch.sqrt` among them), by CPU vendor and model (`MKL_CBWR` overrides); the parallel kernels split their
sums by the number of threads. Each choice rounds differently.

`numerics.kernels` in params.yaml decides, before torch loads (`configure`, called by stages/__main__.py):

- **portable** (the default): MKL's COMPATIBLE branch (the one Intel documents as vendor-independent), ATen's and
  oneDNN's AVX2 kernels, and `numerics.threads` threads: the same bytes on any x86-64 CPU with AVX2, whatever its
  vendor or its AVX-512. Measured with `../shared/tools/kernel_probe.py`: under these settings an AMD EPYC (Zen 3)
  gives an Intel Xeon's (Sapphire Rapids) bytes for a matmul, a linear layer and attention. One function stays
  vendor-dependent even there, MKL's `sqrt` (VML: its result differs in the last bit between vendors, checked against
  a CPU that reports itself as an Intel one under QEMU), which the non-fused AdamW takes for its denominator: the
  training stages use torch's fused AdamW, whose `sqrt` is the CPU instruction (exact on every CPU).
- **native**: the kernels the CPU picks, and torch's thread count: faster (docs/reproducibility.md, "Same inputs, same
  bytes"), with bytes that only a machine picking the same kernels reproduces.

GPUs have no such mode: cuBLAS and cuDNN pick kernels by shape and card, and some kernels add in no fixed order.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

KERNELS = ("portable", "native")
PORTABLE_ENV = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
OVERRIDES = tuple(PORTABLE_ENV)
X86_64 = ("x86_64", "AMD64")
# What the committed dvc.lock was computed with: a run whose `current()` kernels match this reproduces it byte for
# byte. Portable, so it holds on any x86-64 CPU with AVX2 (tests/pipeline/test_default.py checks it).
LOCK_KERNELS = {"machine": "x86_64", "aten": "AVX2", "threads": 2, **PORTABLE_ENV}


def configure(kernels: str, threads: int | None) -> None:
    """Set this process's (and its children's) kernel choice as `numerics.kernels` and `numerics.threads` say.

    Must run before torch is imported: MKL, ATen and OpenMP read these variables once, when they load. "portable"
    overrides what the environment says (the lock's guarantee is the params', not the shell's); "native" leaves it.
    """
    if kernels == "portable" and platform.machine() in X86_64:
        os.environ.update(PORTABLE_ENV)
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)  # OpenMP's and MKL's when they load (torch caps it at the cores)


def set_threads(threads: int | None) -> None:
    """torch's intra-op threads as `numerics.threads` says (None: leave them), more than the cores included: a 1-core
    machine running 2 threads computes what a 2-core one does."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)


def configure_from(params_path: Path) -> None:
    """`configure` with the `numerics` section of a params file, read without checking it: a bad file is reported by
    the stage's own loading, later, and here falls back to the defaults (portable, 2 threads)."""
    from ruamel.yaml import YAML  # pure Python: no torch before the environment is set

    kernels, threads = "portable", 2
    try:
        section = YAML(typ="safe", pure=True).load(params_path.read_text()).get("numerics") or {}
        kernels = section.get("kernels", kernels) if section.get("kernels") in KERNELS else kernels
        threads = section.get("threads", threads)
        threads = threads if threads is None or (isinstance(threads, int) and threads > 0) else 2
    except Exception:  # noqa: BLE001 -- unreadable params: the stage says what is wrong with them
        pass
    configure(kernels, threads)


def params_path(argv: list[str]) -> Path:
    """The params file a stage command line names (`--params PATH` or `--params=PATH`), else params.yaml."""
    for i, arg in enumerate(argv):
        if arg == "--params" and i + 1 < len(argv):
            return Path(argv[i + 1])
        if arg.startswith("--params="):
            return Path(arg.partition("=")[2])
    return Path("params.yaml")


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
    return all(kernels.get(key) == value for key, value in LOCK_KERNELS.items())


def describe(kernels: dict[str, object]) -> str:
    """`current()`'s kernels in words: "AuthenticAMD x86_64, ATen AVX512, MKL's own branch, 2 threads"."""
    mkl = f"MKL {kernels['MKL_CBWR']}" if kernels.get("MKL_CBWR") else "MKL's own branch"
    return f"{kernels['vendor'] or 'unknown vendor'} {kernels['machine']}, ATen {kernels['aten']}, {mkl}, " \
           f"{threads(kernels['threads'])}"


def threads(n: object) -> str:
    return f"{n} thread" if n == 1 else f"{n} threads"


def kernels_note(kernels_param: str, device: str, kernels: dict[str, object] | None = None) -> str | None:
    """One line for the stage's summary when its outputs are not what the committed lock's kernels compute (None
    when they are): another CPU's own kernels, a portable setting this machine cannot honour, or a GPU."""
    if device != "cpu":
        return (f"numerics: computed on a GPU ({device}), whose kernels are not bitwise reproducible across cards or "
                "batch shapes: the trained outputs differ from dvc.lock's in their last bits")
    kernels = kernels if kernels is not None else current()
    if covered(kernels):
        return None
    if kernels_param == "native":
        return (f"numerics: native kernels ({describe(kernels)}): the trained outputs are this kind of CPU's bytes, "
                "not dvc.lock's; numerics.kernels: portable computes the same bytes on any x86-64 CPU with AVX2")
    why = ("not an x86-64 CPU" if kernels["machine"] not in X86_64 else
           "torch loaded before they were set: start stages as `rlhf` or `python3 -m stages`"
           if any(kernels.get(key) != value for key, value in PORTABLE_ENV.items()) else
           "no AVX2" if kernels["aten"] != "AVX2" else f"{threads(kernels['threads'])}, not {LOCK_KERNELS['threads']}")
    return (f"numerics: portable kernels could not be used here ({why}; {describe(kernels)}): the trained outputs "
            "differ from dvc.lock's in their last bits")

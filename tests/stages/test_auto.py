"""stages/shared/auto.py: the `auto` values resolve to each branch with the hardware faked, an explicit value wins, and
what auto chose is one note (an emulated bf16, one warning)."""

from __future__ import annotations

import pytest

from stages.shared import auto
from stages.shared.auto import Machine
from stages.shared.params import load_params

GPU = Machine("cuda", cuda_bf16=True, cpu_bf16=())
OLD_GPU = Machine("cuda", cuda_bf16=False, cpu_bf16=())  # a T4, a V100: no bf16
NATIVE_CPU = Machine("cpu", cuda_bf16=False, cpu_bf16=("avx512_bf16",))
AVX2_CPU = Machine("cpu", cuda_bf16=False, cpu_bf16=())


@pytest.mark.parametrize(("cpuinfo", "machine", "expected"), [
    ("flags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n", "x86_64", ("amx_bf16", "avx512_bf16")),
    ("flags\t\t: fpu avx2 avx512f avx512_vnni\n", "x86_64", ()),  # AVX-512 without its BF16 extension
    ("flags\t\t: fpu avx2\nflags\t\t: fpu avx2\n", "x86_64", ()),
    ("Features\t: fp asimd sve bf16 i8mm\n", "aarch64", ("bf16",)),  # a Graviton3, a Grace
    ("Features\t: fp asimd\n", "aarch64", ()),
    ("", "x86_64", ()),  # no /proc/cpuinfo (macOS): none known
])
def test_the_cpu_s_native_bf16_units_are_read_from_its_flags(cpuinfo, machine, expected):
    assert auto.cpu_bf16_units(cpuinfo, machine) == expected


@pytest.mark.parametrize(("at", "kernels", "expected"), [
    (GPU, "portable", "bf16"),  # a GPU's kernels are not numerics.kernels' business
    (OLD_GPU, "native", None),
    (NATIVE_CPU, "native", "bf16"),
    (NATIVE_CPU, "portable", None),  # the committed lock: float32 bytes on any x86-64 CPU
    (AVX2_CPU, "native", None),
    (AVX2_CPU, "portable", None),
])
def test_auto_precision_is_what_the_hardware_has(at, kernels, expected):
    assert auto.mixed_precision("auto", kernels, at)[0] == expected


@pytest.mark.parametrize("given", ["bf16", "fp16", None])
@pytest.mark.parametrize("at", [GPU, NATIVE_CPU, AVX2_CPU])
def test_an_explicit_precision_wins_everywhere(given, at):
    assert auto.mixed_precision(given, "native", at) == (given, "as params.yaml sets it")


@pytest.mark.parametrize(("given", "kernels", "at", "expected"), [
    ("auto", "native", GPU, "note: sft: model.mixed_precision auto: bf16 autocast (a CUDA GPU with bf16)\n"),
    ("auto", "native", NATIVE_CPU,
     "note: sft: model.mixed_precision auto: bf16 autocast (this CPU has native bf16 (avx512_bf16))\n"),
    ("auto", "native", AVX2_CPU, "note: sft: model.mixed_precision auto: float32 (this CPU has no native bf16 "
                                 "(AMX-BF16 or AVX-512 BF16): it would emulate it, several times slower)\n"),
    ("auto", "portable", NATIVE_CPU, "note: sft: model.mixed_precision auto: float32 (numerics.kernels is portable: "
                                     "float32 bytes any x86-64 CPU reproduces)\n"),
    ("bf16", "native", AVX2_CPU, "warning: sft: model.mixed_precision is bf16, but this CPU has no native bf16 "
                                 "(AMX-BF16 or AVX-512 BF16): autocast emulates it, about 5x slower than float32 for a "
                                 "linear layer (60x for a bare matmul); set it to auto (float32 here) unless you want "
                                 "bf16's numbers\n"),
    ("bf16", "native", NATIVE_CPU, ""),
    ("bf16", "native", GPU, ""),
    (None, "native", AVX2_CPU, ""),
])
def test_the_note_says_what_auto_chose_and_why_and_an_emulated_bf16_is_warned_of(given, kernels, at, expected, capsys):
    auto.precision_note("sft", given, kernels, at)
    assert capsys.readouterr().err == expected


def test_the_shipped_params_leave_the_rollout_to_ppo_core_and_evaluate_samples_with_the_dynamic_cache(monkeypatch):
    """The root params.yaml: the rollout's auto goes to PPOConfig as it is (ppo_core resolves it for the machine it
    runs on: tests/ppo_core/models/test_rollout_copy.py); bf16 autocast on a GPU, float32 on a CPU; evaluate's float32
    policies sample with the dynamic cache."""
    for at, precision in ((GPU, {"mixed_precision": "bf16"}), (AVX2_CPU, {}), (NATIVE_CPU, {})):  # portable kernels
        monkeypatch.setattr(auto, "machine", lambda at=at: at)
        params = load_params("params.yaml")
        config = params.ppo_config
        assert (config.rollout_dtype, config.rollout_correction) == ("auto", "auto")
        assert config.accelerator_kwargs == precision
        assert params.generation.cache_implementation == "auto"
        assert auto.generation(params)["cache_implementation"] == "dynamic"
    assert params.model.mixed_precision == "auto"  # what dvc.yaml tracks: the word


def test_under_several_processes_the_main_one_alone_says_it(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    auto.precision_note("ppo", "auto", "native", AVX2_CPU)
    auto.precision_note("ppo", "bf16", "native", AVX2_CPU)
    assert capsys.readouterr().err == ""

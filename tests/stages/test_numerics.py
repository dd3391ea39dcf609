"""stages/shared/numerics.py: the float kernels a stage computes with, set from params.yaml's `numerics` before torch
loads.

Whether the bytes then match across vendors is what tests/pipeline/test_default.py checks against the committed lock
(on whichever CPU runs it); here, that a stage process gets the kernels its params ask for whatever its environment
says, and what it says when its kernels are not the lock's.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from stages.shared import numerics
from tests.conftest import ROOT, write_params

PORTABLE = {"machine": "x86_64", "vendor": "GenuineIntel", "aten": "AVX2", "threads": 2, **numerics.PORTABLE_ENV}
FORCED_ELSEWHERE = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "AUTO", "ONEDNN_MAX_CPU_ISA": "ALL",
                    "OMP_NUM_THREADS": "1"}
x86_64 = pytest.mark.skipif(platform.machine() not in numerics.X86_64, reason="portable kernels are x86-64's")


def stage_kernels(params: Path, env: dict[str, str]) -> dict:
    """The kernels of a process started as `python3 -m stages ... --params PARAMS` starts (stages/__main__.py: the
    params' numerics set, then torch loaded), under `env`."""
    probe = ("import json, sys; from stages.shared import numerics; from stages.shared.params import load_params; "
             "path = numerics.params_path(sys.argv[1:]); numerics.configure_from(path); "
             "numerics.set_threads(load_params(path).numerics.threads); print(json.dumps(numerics.current()))")
    out = subprocess.run([sys.executable, "-c", probe, "sft", "--params", str(params)], cwd=ROOT, check=True,
                         capture_output=True, text=True, env={**os.environ, **env}).stdout
    return json.loads(out)


def params_with(tmp_path: Path, kernels: str, threads: int | None) -> Path:
    return write_params(tmp_path, {"numerics.kernels": kernels, "numerics.threads": threads})


@x86_64
def test_portable_params_give_the_lock_s_kernels_whatever_the_environment_forces(tmp_path):
    kernels = stage_kernels(params_with(tmp_path, kernels="portable", threads=2), FORCED_ELSEWHERE)
    assert numerics.covered(kernels), kernels
    assert kernels["aten"] == "AVX2" and kernels["threads"] == 2 and kernels["MKL_CBWR"] == "COMPATIBLE"


def test_native_params_leave_the_kernels_to_the_cpu_and_the_environment(tmp_path):
    kernels = stage_kernels(params_with(tmp_path, kernels="native", threads=None), FORCED_ELSEWHERE)
    assert kernels["aten"] == "DEFAULT" and kernels["threads"] == 1 and kernels["MKL_CBWR"] == "AUTO"
    assert not numerics.covered(kernels)


def test_numerics_threads_sets_the_thread_count_in_either_mode(tmp_path):
    for mode in ("portable", "native"):
        assert stage_kernels(params_with(tmp_path, kernels=mode, threads=3), {"OMP_NUM_THREADS": "1"})["threads"] == 3


@pytest.mark.parametrize("text", ["", "seed: [", "numerics: {kernels: fast, threads: -1}"])
def test_an_unreadable_numerics_section_falls_back_to_portable_with_two_threads(tmp_path, monkeypatch, text):
    """The stage's own loading reports a bad params file (one line, exit 2); until then the defaults hold."""
    path = tmp_path / "params.yaml"
    path.write_text(text)
    calls = []
    monkeypatch.setattr(numerics, "configure", lambda kernels, threads: calls.append((kernels, threads)))
    numerics.configure_from(path)
    numerics.configure_from(tmp_path / "missing.yaml")
    assert calls == [("portable", 2)] * 2


def test_the_params_path_is_the_command_line_s():
    assert numerics.params_path(["ppo"]) == Path("params.yaml")
    assert numerics.params_path(["ppo", "--params", "x/p.yaml"]) == Path("x/p.yaml")
    assert numerics.params_path(["ppo", "--params=y.yaml", "--debug"]) == Path("y.yaml")


def test_the_lock_s_kernels_are_covered_on_any_vendor_but_not_with_other_kernels():
    assert numerics.covered(PORTABLE) and numerics.covered({**PORTABLE, "vendor": "AuthenticAMD"})
    for other in ({"aten": "AVX512"}, {"threads": 4}, {"MKL_CBWR": None}, {"machine": "aarch64"}):
        assert not numerics.covered({**PORTABLE, **other}), other


def test_the_summary_says_when_and_why_the_outputs_are_not_the_lock_s():
    note = numerics.kernels_note
    assert note("portable", "cpu", PORTABLE) is None
    native = note("native", "cpu", {**PORTABLE, "aten": "AVX512", "MKL_CBWR": None, "ATEN_CPU_CAPABILITY": None})
    assert native.startswith("numerics: native kernels (GenuineIntel x86_64, ATen AVX512, MKL's own branch, 2 threads)")
    assert "not dvc.lock's" in native and "numerics.kernels: portable" in native
    assert "(not an x86-64 CPU;" in note("portable", "cpu", {**PORTABLE, "machine": "aarch64"})
    assert "torch loaded before they were set" in note("portable", "cpu", {**PORTABLE, "MKL_CBWR": None})
    assert "(no AVX2;" in note("portable", "cpu", {**PORTABLE, "aten": "DEFAULT"})
    assert "(1 thread, not 2;" in note("portable", "cpu", {**PORTABLE, "threads": 1})
    assert "on a GPU (cuda)" in note("portable", "cuda", PORTABLE)


@pytest.mark.slow
def test_a_stage_says_once_when_its_outputs_are_this_cpu_s_and_a_float_free_one_never(tmp_path):
    """With native kernels (the tiny params'), sft ends with one note saying so, beside its summary; prepare, which
    computes no floats, says nothing of kernels. With portable ones, neither does sft."""
    env = {**os.environ, "TQDM_DISABLE": "1"}

    def stage(name: str) -> str:
        run = subprocess.run([sys.executable, "-m", "stages", name], cwd=tmp_path, capture_output=True, text=True,
                             env=env)
        assert run.returncode == 0, run.stderr
        return run.stderr

    write_params(tmp_path, {})
    assert "numerics" not in stage("prepare")
    notes = [line for line in stage("sft").splitlines() if "numerics" in line]
    assert len(notes) == 1 and notes[0].startswith("note: sft: numerics: native kernels ("), notes
    if platform.machine() in numerics.X86_64:
        write_params(tmp_path, {"numerics.kernels": "portable", "numerics.threads": 2})
        assert "numerics" not in stage("sft")

"""bench/numerics_cost.py: the pipeline's stages from sft on, in portable and in native kernels, on the tiny params
(the default run it is written for takes 12 minutes)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT, TINY_PARAMS

sys.path.insert(0, str(ROOT / "bench"))
import numerics_cost


def test_each_mode_s_project_is_the_params_with_only_its_kernels_changed(tmp_path):
    params = yaml.safe_load(TINY_PARAMS.read_text())
    for mode in numerics_cost.MODES:
        project = numerics_cost.scratch(tmp_path, mode, params)
        got = yaml.safe_load((project / "params.yaml").read_text())
        assert got.pop("numerics") == {**params["numerics"], "kernels": mode}
        assert got == {k: v for k, v in params.items() if k != "numerics"}
        assert (project / "stages" / "shared" / "numerics.py").exists() and (project / "dvc.yaml").exists()


@pytest.mark.slow
def test_one_round_times_every_stage_and_says_whether_the_bytes_held(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "numerics_cost.py"), "--rounds", "1", "--params",
                          str(TINY_PARAMS), "--workdir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[1:]] == [*numerics_cost.TIMED, "all"]
    assert "portable: outputs the same bytes in every round" in out.stdout
    assert "native: outputs the same bytes in every round" in out.stdout

"""The Typer app (`rlhf` / `python -m stages`): help texts, a single-stage run, one-line errors with exit status 2."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stages.shared.cli import app

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "fixtures" / "params.tiny.yaml"
STAGES = ["sources", "prepare", "sft", "reward", "tokenize", "ppo", "evaluate", "report"]


def run_module(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    return subprocess.run([sys.executable, "-m", "stages", *args], cwd=cwd, env=env, capture_output=True, text=True)


def test_app_help_lists_every_stage():
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for stage in STAGES:
        assert stage in result.output


def test_app_help_gives_each_command_a_whole_summary_in_80_columns():
    """`rlhf --help` on an 80-column terminal: each command's line is a whole sentence (click cut longer ones with
    "..."), and no line runs past the terminal's width."""
    result = CliRunner().invoke(app, ["--help"], terminal_width=80)
    commands = result.output.split("Commands:\n")[1].splitlines()
    assert len(commands) >= len(STAGES), commands
    assert all(line.endswith(".") and not line.endswith("...") for line in commands), commands
    assert max(map(len, result.output.splitlines())) <= 80


@pytest.mark.parametrize("stage", STAGES)
def test_stage_help_says_what_it_reads_and_writes(stage):
    result = CliRunner().invoke(app, [stage, "--help"], terminal_width=200)
    assert result.exit_code == 0
    assert "Reads:" in result.output and "Writes:" in result.output and "--params" in result.output
    assert "--debug " in result.output and "<bool>" not in result.output  # flags look like flags


def test_single_stage_run_prints_a_summary(tmp_path):
    """The summary's peak RSS is the stage's own: here the parent holds 1.2 GiB, which Linux's ru_maxrss would carry
    into the child across fork and exec (a stage run from a large process reported its gigabytes)."""
    ballast = bytearray(1200 * 2**20)
    ballast[:: 4096] = b"\1" * len(range(0, len(ballast), 4096))  # touch every page: resident, not just reserved
    result = run_module("prepare", "--params", str(TINY), cwd=tmp_path)
    del ballast
    assert result.returncode == 0, result.stderr
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith("prepare: 160 SFT texts")
    assert re.search(r" \[\d+\.\d s, peak RSS 0\.\d\d GiB\]$", summary), summary  # its seconds and memory
    assert (tmp_path / "data" / "raw" / "sft.parquet").exists()


def test_bad_input_is_one_line_and_exit_2(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(TINY.read_text().replace("  n_eval_prompts: 8\n", "  n_eval_prompts: 8\n  n_eval_promts: 9\n"))
    result = run_module("prepare", "--params", str(params), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == (f"error: prepare: {params}: unknown key 'data.n_eval_promts'; did you mean "
                                     "'data.n_eval_prompts'?")
    assert "Traceback" not in result.stderr


def test_an_input_this_user_may_not_read_is_said_to_be_unreadable(tmp_path, monkeypatch):
    """A prompts file without read permission: one line naming it and asking to make it readable (not "cannot
    write there": that is an output's problem). The tests run as root, who reads any file, so the denial is the
    non-root user's: open raises what it raises for them, and os.access answers as for them."""
    import builtins

    from stages import prepare

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"query": "the film was"}\n' * 20)
    params = tmp_path / "params.yaml"
    params.write_text(TINY.read_text().replace("  prompts:\n    source: synthetic\n",
                                               "  prompts:\n    source: prompts.jsonl\n"))
    assert "source: prompts.jsonl" in params.read_text()

    def denied(path, *args, **kwargs):
        if Path(path).name == "prompts.jsonl":
            raise PermissionError(13, "Permission denied", str(path))
        return builtins.open(path, *args, **kwargs)

    access = os.access
    monkeypatch.setattr(prepare, "open", denied, raising=False)
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path).name != "prompts.jsonl" and access(path, mode))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["prepare", "--params", "params.yaml"])
    assert result.exit_code == 2 and result.stderr == (
        "error: prepare: prompts.jsonl: permission denied; cannot read it (make it readable by this user)\n")


@pytest.mark.slow
def test_missing_input_is_exit_2_and_debug_shows_the_traceback(tmp_path):
    result = run_module("sft", "--params", str(TINY), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "data/raw/sft.parquet: not found" in result.stderr
    debug = run_module("sft", "--params", str(TINY), "--debug", cwd=tmp_path)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


def lacks_the_project_packages(python: str | None) -> bool:
    return python is not None and subprocess.run([python, "-c", "import typer, torch"], capture_output=True).returncode


@pytest.mark.skipif(not lacks_the_project_packages(SYSTEM_PYTHON), reason="needs a python3 without the packages")
def test_a_python3_without_the_packages_reruns_itself_in_the_project_venv(tmp_path):
    """DVC runs `python3 -m stages ...` with whatever python3 the shell finds; with the project's .venv there, the
    stage runs in it (here: the system python3, an empty PATH, the checkout's .venv)."""
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([SYSTEM_PYTHON, "-m", "stages", "prepare", "--params", str(TINY)], cwd=tmp_path, env=env,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    summary = result.stdout.strip().splitlines()[-1]
    assert summary.startswith("prepare: 160 SFT texts")
    assert re.search(r" \[\d+\.\d s, peak RSS 0\.\d\d GiB\]$", summary), summary  # its seconds and memory


@pytest.mark.skipif(not lacks_the_project_packages(SYSTEM_PYTHON), reason="needs a python3 without the packages")
def test_without_a_venv_a_python3_lacking_the_packages_gets_a_one_line_hint(tmp_path):
    shutil.copytree(ROOT / "stages", tmp_path / "stages", ignore=shutil.ignore_patterns("__pycache__"))  # no .venv
    env = {"HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([SYSTEM_PYTHON, "-m", "stages", "prepare"], cwd=tmp_path, env=env, capture_output=True,
                            text=True)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.startswith(f"error: {SYSTEM_PYTHON} lacks the project's packages (typer, torch")
    assert len(result.stderr.splitlines()) == 1 and "source .venv/bin/activate" in result.stderr


def test_version_names_the_project_and_its_key_libraries():
    from importlib.metadata import version

    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output.startswith(f"rlhf {version('rlhf-pipeline')} (torch {version('torch')}, transformers ")


ENTRY = '''
import ctypes, sys
import stages.shared.cli as cli

def interrupted_in_c(stage, params_path):  # a KeyboardInterrupt raised in code a C extension runs (PyRun_String)
    run = ctypes.pythonapi.PyRun_String
    run.restype, run.argtypes = ctypes.py_object, [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object]
    run(b"raise KeyboardInterrupt", 257, {}, {})  # 257: Py_file_input

cli._run_stage = interrupted_in_c
from stages.__main__ import main
sys.argv = ["python3 -m stages", "prepare", "--params", "params.yaml"]
main()
'''


def test_an_interrupt_exits_130_even_where_a_c_extension_saw_it(tmp_path):
    """Once a KeyboardInterrupt has gone through code run by PyRun_* (as C extensions run code), CPython started with
    `-m` kills itself with SIGINT at exit whatever the exit code: `python3 -m stages` still ends with 130, the status
    a job scheduler reads (the CI saw -2 once: SIGTERM landed in such code)."""
    (tmp_path / "interrupted_entry.py").write_text(ENTRY)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    run = subprocess.run([sys.executable, "-m", "interrupted_entry"], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 130, (run.returncode, run.stderr[-2000:])
    assert run.stderr.startswith("interrupted: prepare: nothing was published") and run.stdout == ""

"""What a user does by hand at a terminal, tested as the user does it (real processes, real files): two runs of a
stage at once, a full disk, Ctrl-C or kill. Each either works or stops with one line; none passes silently or loses
data."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from stages import prepare, sft
from stages.ppo.checkpoints import WORK_ROLLOUTS, rollout_file
from stages.shared.artifacts import LOCKS, PPO_CHECKPOINTS, PPO_MODEL, PPO_ROLLOUTS, SFT_CHECKPOINTS
from stages.shared.cli import app
from stages.shared.runtime import StageError, stage_lock
from tests.conftest import ROOT, write_params
from tests.stages.test_resume import EXCLUDE, crash_at, digests, params_file, run_stage, upstream_of_ppo

PPO_24_STEPS = dict(ppo__steps=192, checkpoint__ppo_every=4)  # 24 steps of 8 rollouts, a checkpoint every 4


def wait_for(condition, proc: subprocess.Popen, what: str, timeout: float = 300) -> None:
    """Poll until ``condition()`` holds; fail naming ``what`` if ``proc`` ends first or the time runs out."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()[1][-2000:]}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.02)


def holds(lock: Path, pid: int) -> bool:
    try:
        return json.loads(lock.read_text())["pid"] == pid
    except (OSError, ValueError):
        return False


@pytest.mark.slow
def test_a_second_run_of_a_stage_stops_naming_the_first(tiny_run, tmp_path):
    """Two `python -m stages ppo` at once: the second stops with one line naming the first (pid, start, command) and
    exit status 2, touching nothing; the first finishes with all of its outputs."""
    root = upstream_of_ppo(tiny_run, tmp_path / "project")
    params = params_file(root, **PPO_24_STEPS)
    first = run_stage("ppo", params, root)
    lock = root / LOCKS / "ppo.lock"
    wait_for(lambda: holds(lock, first.pid), first, "the first run held the stage's lock")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    second = subprocess.run([sys.executable, "-m", "stages", "ppo", "--params", str(params)], cwd=root, env=env,
                            capture_output=True, text=True, timeout=300)
    assert first.poll() is None, "the first run ended before the second started: the test proves nothing"
    assert second.returncode == 2, second.stderr[-2000:]
    assert second.stdout == "" and len(second.stderr.splitlines()) == 1, second.stderr
    assert second.stderr.startswith(f"error: ppo: another ppo run holds data/.locks/ppo.lock: pid {first.pid}, "
                                    "started 20"), second.stderr
    assert f"-m stages ppo --params {params}`; wait for it to end (or stop it: kill {first.pid}), then rerun" \
           in second.stderr
    out, err = first.communicate(timeout=300)
    assert first.returncode == 0, err[-2000:]
    assert out.startswith("ppo: 24 steps, reward") and "resumed" not in out
    assert len(list((root / PPO_ROLLOUTS).iterdir())) == 24
    assert not (root / PPO_CHECKPOINTS).exists() and not lock.exists() and not lock.parent.exists()


HOLDER = """import sys, time
from pathlib import Path
from stages.shared.runtime import stage_lock
with stage_lock(Path(sys.argv[1]), sys.argv[2]):
    print("held", flush=True)
    time.sleep(120)
"""


def start_holder(lock: Path, stage: str) -> subprocess.Popen:
    """Another process holding ``stage``'s lock file ``lock`` (as a run of the stage does), until killed."""
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(lock), stage], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
    """The lock is the OS's (flock): a holder killed with SIGKILL holds nothing, and the next run takes the lock."""
    lock = tmp_path / "data" / ".locks" / "ppo.lock"
    holder = start_holder(lock, "ppo")
    try:
        with pytest.raises(StageError, match=rf"^another ppo run holds {lock}: pid {holder.pid}, started .*, command "
                                             r"`.*-c .*`; wait for it to end"):
            with stage_lock(lock, "ppo"):
                pass
    finally:
        holder.kill()
        holder.wait()
    assert lock.exists()  # what a killed holder leaves: a file, which locks nothing
    with stage_lock(lock, "ppo"):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists() and not lock.parent.exists()


def test_only_the_main_process_of_a_launch_takes_the_lock(tmp_path, monkeypatch):
    """Under `accelerate launch` the processes of one run are one holder: the main one (RANK 0)."""
    lock = tmp_path / "ppo.lock"
    monkeypatch.setenv("RANK", "1")
    with stage_lock(lock, "ppo"):
        assert not lock.exists()
    monkeypatch.setenv("RANK", "0")
    with stage_lock(lock, "ppo"):
        assert lock.exists()


def files_as_they_are(root: Path, *folders: str) -> dict[str, tuple[int, bytes]]:
    """{path: (inode, bytes)} of the files under ``folders``: a file rewritten with the same bytes is another inode."""
    return {str(p.relative_to(root)): (p.stat().st_ino, p.read_bytes())
            for folder in folders for p in sorted((root / folder).rglob("*")) if p.is_file()}


def temporaries(root: Path) -> list[Path]:
    """What atomic writers leave when they fail: `.NAME.tmp-PID`, `.NAME.old-PID`, ppo_core's `.tmp-state-N`."""
    return [*(root / "data").rglob(".*tmp-*"), *(root / "data").rglob(".*.old-*")]


OUTPUTS = ("data/ppo", str(PPO_MODEL))


@pytest.mark.parametrize("case", ["ppo-disk-full", "ppo-model-disk-full", "checkpoints-disk-full"])
def test_a_full_disk_leaves_the_previous_outputs_and_no_temporaries(case, tiny_run, tmp_path, monkeypatch):
    """The disk fills while ppo writes (each library failing as it does then) over a finished run's outputs: one line
    naming what could not be written, exit status 2, every previous output as it was (the same files, not rewritten),
    no temporary name left in data/; with space again, the rerun resumes from the last checkpoint and publishes."""
    from tests.stages.test_bad_input import CASES

    _, stage, _, _, setup, fragment = next(c for c in CASES if c[0] == case)
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root)
    write_params(root, {})
    monkeypatch.chdir(root)
    before = files_as_they_are(root, *OUTPUTS)
    undo = setup(root)
    try:
        result = CliRunner().invoke(app, [stage, "--params", "params.yaml"])
    finally:
        undo()
    assert result.exit_code == 2, result.output + str(result.exception)
    assert result.stderr == f"error: ppo: {fragment}\n"
    assert files_as_they_are(root, *OUTPUTS) == before
    assert not temporaries(root)
    result = CliRunner().invoke(app, [stage, "--params", "params.yaml"])
    assert result.exit_code == 0, result.stderr
    resumed = "note: ppo: resuming from data/checkpoints/ppo/state at step 2" in result.stderr
    assert resumed == (case != "checkpoints-disk-full")  # that one failed at the first checkpoint: nothing to resume
    assert digests(root, EXCLUDE).keys() == digests(tiny_run, EXCLUDE).keys()
    assert not (root / PPO_CHECKPOINTS).exists() and not temporaries(root)


@pytest.fixture
def tmpfs():
    """Mount a tmpfs of a given size on a folder (root only; the test is skipped where mounting is not permitted), and
    unmount it after the test."""
    mounted = []

    def mount(folder: Path, size: str) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True) if shutil.which("mount") else None
        if done is None or done.returncode:
            pytest.skip("mounting a tmpfs is not permitted here (" + (done.stderr.strip() if done else "no mount")
                        + "); the injected disk-full tests stand in")
        mounted.append(folder)
        return folder

    yield mount
    for folder in reversed(mounted):
        subprocess.run(["umount", "-l", str(folder)], check=False)


ONE_LINE_DISK_FULL = (r"error: ppo: (data/\S+): no space left on device; cannot write there "
                      r"\(make it writable, or free space\)\n")


@pytest.mark.slow
def test_a_full_tmpfs_for_the_checkpoints_stops_in_one_line(tiny_run, tmp_path, tmpfs):
    """data/checkpoints on a tmpfs too small for the PPO state: one line naming it, no traceback, no `.tmp-*`."""
    root = upstream_of_ppo(tiny_run, tmp_path / "project")
    tmpfs(root / "data" / "checkpoints", "128k")
    run = run_stage("ppo", params_file(root), root)
    out, err = run.communicate(timeout=300)
    assert run.returncode == 2, err[-2000:]
    assert re.fullmatch(ONE_LINE_DISK_FULL, err), err
    assert re.fullmatch(ONE_LINE_DISK_FULL, err)[1].startswith("data/checkpoints/ppo/")
    assert out == "" and not temporaries(root)


@pytest.mark.slow
def test_a_full_tmpfs_for_the_outputs_leaves_the_previous_ones(tiny_run, tmp_path, tmpfs):
    """data/ppo on a full tmpfs holding a finished run's outputs: one line naming the file, those outputs as they were
    (the rollouts not published alone), no temporary names left."""
    root = tmp_path / "project"
    shutil.copytree(tiny_run / "data", root / "data", ignore=shutil.ignore_patterns("ppo"))
    tmpfs(root / "data" / "ppo", "1m")
    shutil.copytree(tiny_run / "data" / "ppo", root / "data" / "ppo", dirs_exist_ok=True)
    filler = root / "data" / "ppo" / "filler"
    filler.write_bytes(b"\0" * (shutil.disk_usage(filler.parent).free - 8192))  # two pages left
    before = files_as_they_are(root, *OUTPUTS)
    run = run_stage("ppo", params_file(root), root)
    out, err = run.communicate(timeout=300)
    assert run.returncode == 2, err[-2000:]
    assert re.fullmatch(ONE_LINE_DISK_FULL, err), err
    assert re.fullmatch(ONE_LINE_DISK_FULL, err)[1].startswith("data/ppo/")
    assert out == "" and not temporaries(root)
    assert files_as_they_are(root, *OUTPUTS) == before


@pytest.mark.slow
def test_ctrl_c_says_where_the_run_stopped_and_a_rerun_resumes(tiny_run, tmp_path):
    """SIGINT mid-run (Ctrl-C): one line saying which step it stopped in and which step's state a rerun resumes from,
    exit status 130, no traceback, no temporary name or lock left; the rerun does resume from there."""
    root = upstream_of_ppo(tiny_run, tmp_path / "project")
    params = params_file(root, **PPO_24_STEPS)
    run = run_stage("ppo", params, root)
    wait_for(lambda: (root / WORK_ROLLOUTS / rollout_file(5)).exists(), run, "step 6 was written")
    run.send_signal(signal.SIGINT)
    out, err = run.communicate(timeout=300)
    assert run.returncode == 130, err[-2000:]
    stopped = re.fullmatch(r"interrupted: ppo: stopped during step (\d+)/24; data/checkpoints/ppo holds the state of "
                           r"step (\d+): rerunning the stage resumes from it\n", err)
    assert stopped, err
    during, saved = map(int, stopped.groups())
    assert during >= 6 and saved % 4 == 0 and 4 <= saved < during, err
    assert out == "" and not temporaries(root) and not (root / LOCKS).exists()
    rerun = run_stage("ppo", params, root)
    out, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-2000:]
    assert f"note: ppo: resuming from data/checkpoints/ppo/state at step {saved}\n" in err
    assert out.startswith(f"ppo: 24 steps, resumed at step {saved}, reward")


@pytest.mark.slow
def test_kill_stops_a_stage_as_ctrl_c_does(tiny_run, tmp_path):
    """SIGTERM (`kill`, a job scheduler) takes Ctrl-C's path: one line, exit status 130, no traceback. A stage without
    resumable state says nothing was published, and the previous outputs are as they were."""
    root = tmp_path / "project"
    shutil.copytree(tiny_run / "data", root / "data")
    params = params_file(root)
    before = files_as_they_are(root, "data/eval")
    run = run_stage("evaluate", params, root)
    wait_for(lambda: holds(root / LOCKS / "evaluate.lock", run.pid), run, "the run held its lock")
    run.send_signal(signal.SIGTERM)
    out, err = run.communicate(timeout=300)
    assert run.returncode == 130, err[-2000:]
    assert err == "interrupted: evaluate: nothing was published; rerun the stage\n" and out == ""
    assert files_as_they_are(root, "data/eval") == before and not temporaries(root)


def test_an_interrupted_trainer_stage_names_its_checkpoint(tiny_run, tmp_path, monkeypatch):
    """sft interrupted at its third optimiser step: the transformers checkpoint of step 2 is what a rerun resumes."""
    shutil.copytree(tiny_run / "data" / "raw", tmp_path / "data" / "raw")
    write_params(tmp_path, {})
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sft, "trainer_callback", crash_at(3))  # raises KeyboardInterrupt as step 3 ends
    result = CliRunner().invoke(app, ["sft", "--params", "params.yaml"])
    assert result.exit_code == 130, result.output
    # the tiny run's few texts are warned about first (stages/sft.py: too_little_data)
    warned, interrupted = result.stderr.splitlines()
    assert warned.startswith("warning: sft: 152 training texts (data.sft.n) for a model trained from scratch")
    assert interrupted == (f"interrupted: sft: stopped during step 3/5; {SFT_CHECKPOINTS} holds the state of step "
                           "2: rerunning the stage resumes from it")


def test_debug_keeps_the_traceback_of_an_interrupt(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_params(tmp_path, {})

    def interrupted(params, root=Path(".")):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare, "run", interrupted)
    result = CliRunner().invoke(app, ["prepare", "--params", "params.yaml", "--debug"])
    assert result.exit_code == 130
    assert result.stderr.startswith("Traceback") and "KeyboardInterrupt" in result.stderr
    assert "interrupted:" not in result.stderr

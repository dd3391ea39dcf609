"""What a user does by hand at a terminal, tested as the user does it (real processes, real files): two runs of a
stage at once. Each either works or stops with one line; none passes silently or loses data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stages.artifacts import LOCKS, PPO_CHECKPOINTS, PPO_ROLLOUTS
from stages.runtime import StageError, stage_lock
from tests.conftest import ROOT
from tests.test_stages_resume import params_file, run_stage, upstream_of_ppo

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
from stages.runtime import stage_lock
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

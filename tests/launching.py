"""`accelerate launch` from a test: N processes on the CPU, over gloo, under DDP or DeepSpeed.

One place for the command, the environment and the timeout, which kills the whole process tree and fails the test:
a hang must never hang the suite.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it, at once, as a job scheduler would: torchrun starts each worker
    in a session of its own, out of reach of a signal to the launcher's process group."""
    import psutil

    try:
        launcher = psutil.Process(proc.pid)
        processes = [launcher, *launcher.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


def start(target: list[str], num_processes: int = 2, config: str | None = None, cwd: Path = ROOT,
          env: dict[str, str] | None = None, mixed_precision: str = "no") -> subprocess.Popen:
    """`accelerate launch ... TARGET` in ``num_processes`` CPU processes, float32 (or ``mixed_precision``), output
    piped.

    ``config=None``: DDP over gloo (``ACCELERATE_USE_CPU=1``). ``config="zero2"``/``"zero3"``: DeepSpeed with
    ``configs/{config}.yaml``, gloo too (``DS_ACCELERATOR=cpu``; ``ACCELERATE_USE_CPU`` unset, as it turns DeepSpeed
    off). ``target`` is a script and its arguments, or ``["-m", module, ...]``.
    """
    how = (["--multi_gpu", "--num_machines", "1", "--dynamo_backend", "no"] if config is None
           else ["--config_file", str(ROOT / "configs" / f"{config}.yaml")])
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *how, "--num_processes", str(num_processes),
           "--mixed_precision", mixed_precision, "--main_process_port", str(free_port()), *target]
    environment = {k: v for k, v in os.environ.items() if k != "ACCELERATE_USE_CPU"}
    environment.update({"ACCELERATE_USE_CPU": "1"} if config is None else {"DS_ACCELERATOR": "cpu"})
    environment.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.Popen(cmd, cwd=cwd, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(proc: subprocess.Popen, timeout: float, what: str) -> tuple[int, str, float]:
    """Wait for a :func:`start`-ed launch: ``(exit code, output, seconds)``; still running after ``timeout`` seconds,
    it is killed (every process) and the test fails with its output."""
    started = time.monotonic()
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        output, _ = proc.communicate()
        pytest.fail(f"{what}: still running after {timeout} s (a hang):\n{output[-3000:]}")
    return proc.returncode, output, time.monotonic() - started

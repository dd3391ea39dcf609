"""What a stage says and where it runs: the error a user can fix, notes and warnings, the process it is, the lock
that makes it the only run of its stage.

A `StageError` is bad input a user can fix: its message is one line naming the file, key or column and what to
do, which the CLI prints without a traceback (exit status 2).
"""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path


class StageError(Exception):
    """Bad input a user can fix. The message is one line naming the file, key or column and what to do;
    the CLI prints it without a traceback and exits with status 2."""


class ParamsError(StageError):
    """A params file that is missing, malformed, or has an unknown key or a wrong type."""


def reason(err: BaseException, limit: int = 160) -> str:
    """A library's error message as part of one line: its first line, whitespace collapsed, cut at a word (with an
    ellipsis) rather than mid-word when longer than ``limit``."""
    text = " ".join((str(err).strip().splitlines() or [type(err).__name__])[0].split()) or type(err).__name__
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0].rstrip(" ,;:(") + " ..."


def untracked_hint(path: str | Path) -> str:
    """In a queued or `--temp` DVC experiment, which runs in a copy of the project under .dvc/tmp/exps holding only
    the files git tracks (staged ones included): how to give it ``path``. Elsewhere, nothing."""
    if ".dvc/tmp/exps/" not in f"{Path.cwd().as_posix()}/":
        return ""
    return (f"; queued experiments run in a copy of the project that holds only the files git tracks: `git add {path}`"
            f" (staging is enough), or pass `-C {path}` to `dvc exp run`")


def note(message: str) -> None:
    """Tell the user something they should know but that is not an error (one line, on stderr)."""
    print(f"note: {message}", file=sys.stderr, flush=True)


def warning(message: str) -> None:
    """Tell the user something that may give results they do not expect (one line, on stderr)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


@contextmanager
def stage_lock(path: Path, stage: str) -> Iterator[None]:
    """Run the block as the only run of ``stage``: hold an exclusive advisory lock (flock) on the file ``path``, which
    names its holder (pid, start, command) while held and is deleted on release. The OS releases the lock when its
    holder ends, however it ends: a SIGKILLed run leaves no stale lock. Another run of the stage stops with a
    StageError naming the holder, before it touches anything. Under `accelerate launch` the processes of one run are
    one holder: only the main one (RANK 0) takes it."""
    if os.environ.get("RANK", "0") != "0":
        yield
        return
    with lock_if_free(Path(path)) as held:
        if not held:
            raise StageError(f"another {stage} run holds {path}: {lock_holder(Path(path))}")
        yield


@contextmanager
def lock_if_free(path: Path) -> Iterator[bool]:
    """Hold the lock ``path`` (see :func:`stage_lock`) for the block when no other process does (True), else run the
    block without it (False)."""
    fd = take_lock(path)
    if fd is None:
        yield False
        return
    try:
        os.ftruncate(fd, 0)  # what a killed holder wrote
        os.write(fd, json.dumps(holder_info()).encode())
        yield True
    finally:
        release_lock(path, fd)


def take_lock(path: Path) -> int | None:
    """An open descriptor of ``path`` (created if missing) holding its exclusive flock, or None when another process
    holds it."""
    while True:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:  # its folder was removed by a holder's release meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        if _same_file(path, fd):
            return fd
        os.close(fd)  # locked the file a holder deleted on release: lock the one at ``path`` now


def release_lock(path: Path, fd: int) -> None:
    """Delete the lock file (while holding it, so no one holds a deleted one unseen) and its folder once empty."""
    if _same_file(path, fd):
        path.unlink()
    os.close(fd)
    try:
        path.parent.rmdir()
    except OSError:
        pass


def _same_file(path: Path, fd: int) -> bool:
    try:
        found, held = path.stat(), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (found.st_dev, found.st_ino) == (held.st_dev, held.st_ino)


def holder_info() -> dict:
    """Who holds a lock, for the message another run prints: this process's pid, start and command line."""
    command = reason(shlex.join(sys.orig_argv).replace("\n", " "), 200)  # one line (`python -c` code has several)
    command += " (run by dvc repro)" if os.environ.get("DVC_STAGE") else ""
    return {"pid": os.getpid(), "started": datetime.now().isoformat(sep=" ", timespec="seconds"), "command": command}


def lock_holder(path: Path, patience: float = 1.0) -> str:
    """What the holder of the lock ``path`` wrote into it, as the rest of a one-line error. A holder writes it as it
    takes the lock, so a reader waits up to ``patience`` seconds for it (an empty file, or a killed holder's pid)."""
    deadline = time.monotonic() + patience
    while True:
        try:
            info = json.loads(path.read_text())
            pid, started, command = info["pid"], info["started"], info["command"]
        except (OSError, ValueError, KeyError, TypeError):
            pid = None
        if pid is not None and _alive(pid):  # not the words of a killed holder
            return f"pid {pid}, started {started}, command `{command}`; wait for it to end (or stop it: kill {pid}), " \
                   "then rerun"
        if time.monotonic() > deadline:
            return "its process has not said which it is; wait for it to end, then rerun"
        time.sleep(0.05)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """In the block, SIGTERM (what `kill` and job schedulers send) raises KeyboardInterrupt, as Ctrl-C does: a stage
    stops the same way for both (temporaries removed, locks released, one line). Outside the main thread (where
    signals cannot be handled) the block runs as it is.

    Python runs a signal's handler between any two bytecodes, also inside a weakref callback or a ``__del__`` (the
    import system's module-lock callback, say), where a raised exception is printed as "Exception ignored" and the
    run goes on as if no signal had come. So a KeyboardInterrupt swallowed there is raised again 10 ms later, at
    the next point that can take it, and nothing is printed for it."""
    swallowed, received = sys.unraisablehook, []

    def interrupt(signum, frame):
        received.append(signum)
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def again(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and received and hasattr(signal, "setitimer"):
            signal.setitimer(signal.ITIMER_REAL, 0.01)  # SIGALRM: `interrupt` once more
        else:
            swallowed(unraisable)

    # Ctrl-C's too where Python's own handler has it (not where the process was started with SIGINT ignored, as a
    # background job is: that choice stays)
    signals = [signal.SIGTERM, *([signal.SIGINT] if signal.getsignal(signal.SIGINT) is signal.default_int_handler
                                 else [])]
    try:
        previous = {sig: signal.signal(sig, interrupt) for sig in signals}
    except ValueError:
        yield
        return
    if hasattr(signal, "setitimer"):
        previous[signal.SIGALRM] = signal.signal(signal.SIGALRM, lambda signum, frame: interrupt(received[-1], frame))
    sys.unraisablehook = again
    try:
        yield
    finally:
        sys.unraisablehook = swallowed
        if hasattr(signal, "setitimer"):
            signal.setitimer(signal.ITIMER_REAL, 0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def process_state():
    """accelerate's state of this process: one of several under `accelerate launch`, else the only one.
    On a machine without a GPU (or with ACCELERATE_USE_CPU=1) the processes talk over gloo on the CPU; under a
    DeepSpeed config, over the backend DeepSpeed names (`cpu=True` would turn DeepSpeed off)."""
    import torch
    from accelerate import PartialState

    from ppo_core.runtime.distributed import cpu_backend, deepspeed_launched

    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes")
    if deepspeed_launched() and not use_cpu:
        backend = cpu_backend()
        return PartialState(**({"backend": backend} if backend else {}))
    return PartialState(cpu=use_cpu or not torch.cuda.is_available())


def device() -> str:
    """"cuda" when a GPU is visible, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def tf32_on_gpu():
    """TF32 matmuls on GPUs that have them, for a block (NVIDIA_TF32_OVERRIDE=0 turns it off): ppo_core's switch."""
    from ppo_core.runtime.utils import tf32_matmuls

    return tf32_matmuls(True, device())


def tf32_arg() -> bool | None:
    """`TrainingArguments`' tf32: True on GPUs that have TF32 matmuls, None (torch's setting) elsewhere."""
    from ppo_core.runtime.utils import tf32_supported

    return tf32_supported(device()) or None


def to_host(tensors: list) -> list:
    """``tensors`` on the CPU in one copy (one per tensor would be a host sync each on a GPU)."""
    from ppo_core.runtime.utils import moved

    return moved(tensors, "cpu")


class Progress:
    """A stage's progress through its ``total`` steps: a bar on a terminal; elsewhere (a log, CI, `dvc repro` piped)
    one line every ``every`` seconds and at the end, e.g. ``ppo: step 8/24, 12 s, ETA 24 s, reward 0.52, kl 1.31``.
    Only the main process of a run reports; ``TQDM_DISABLE=1`` silences both. It also keeps, for the line an
    interrupted run prints (`stopped`), the steps done and the last step whose resumable state is saved (``saved``:
    the stage sets it; a run resumed at ``start`` has that one)."""

    latest: Progress | None = None  # the running stage's

    def __init__(self, name: str, total: int, start: int = 0, every: float = 15.0, main: bool = True):
        from tqdm.auto import tqdm

        self.name, self.total, self.start, self.every = name, total, start, every
        self.done, self.saved = start, start or None
        Progress.latest = self
        self.enabled = main and os.environ.get("TQDM_DISABLE", "").lower() not in ("1", "true", "yes")
        self.bar = tqdm(total=total, initial=start, desc=name, unit="step", dynamic_ncols=True) \
            if self.enabled and sys.stderr.isatty() else None
        self.began = self.last = time.monotonic()

    def update(self, done: int, **latest: float) -> None:
        """``done`` steps are complete; ``latest`` are values to show (the last step's reward, KL, ...)."""
        self.done = done
        if not self.enabled:
            return
        # NaN: not measured (the KL where no reference pass ran)
        shown = {key: "not measured" if value != value else f"{value:.3g}" for key, value in latest.items()}
        if self.bar is not None:
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(done - self.bar.n)
            return
        now = time.monotonic()
        if now - self.last < self.every and done < self.total:
            return
        self.last, elapsed = now, now - self.began
        rate = (done - self.start) / elapsed if elapsed > 0 and done > self.start else 0.0
        eta = f", ETA {(self.total - done) / rate:.0f} s" if rate and done < self.total else ""
        values = "".join(f", {key} {value}" for key, value in shown.items())
        print(f"{self.name}: step {done}/{self.total}, {elapsed:.0f} s{eta}{values}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def stopped(self) -> str:
        """Where the run stands, for an interrupted one: "stopped during step 6/24"."""
        if self.done < self.total:
            return f"stopped during step {self.done + 1}/{self.total}"
        return f"stopped after step {self.total}/{self.total}"


def trainer_progress(name: str):
    """A transformers Trainer callback reporting its optimiser steps through :class:`Progress` (the Trainer's own bar
    and its printed log dicts are turned off: ``disable_tqdm=True``, and ``quiet_trainer`` removes the printer)."""
    from transformers import TrainerCallback

    class ReportProgress(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            self.progress = Progress(name, state.max_steps, start=state.global_step, main=state.is_world_process_zero)

        def on_step_end(self, args, state, control, **kwargs):
            self.progress.update(state.global_step)

        def on_save(self, args, state, control, **kwargs):  # after the stage's mark: a checkpoint a rerun resumes
            self.progress.saved = state.global_step

        def on_train_end(self, args, state, control, **kwargs):
            self.progress.close()

    return ReportProgress()


def quiet_trainer(trainer):
    """``trainer`` without the callback that prints its metrics dicts (with ``disable_tqdm`` it prints them)."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    return trainer


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far, in bytes. On Linux, /proc's VmHWM: ru_maxrss would not do, as
    it carries over a forked parent's peak through exec (a stage run from pytest, or from a large parent, would
    report the parent's gigabytes). Elsewhere ru_maxrss (kilobytes, bytes on macOS)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024

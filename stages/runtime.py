"""What a stage says and where it runs: the error a user can fix, notes and warnings, the process it is.

A `StageError` is bad input a user can fix: its message is one line naming the file, key or column and what to
do, which the CLI prints without a traceback (exit status 2).
"""

from __future__ import annotations

import os
import sys


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


def note(message: str) -> None:
    """Tell the user something they should know but that is not an error (one line, on stderr)."""
    print(f"note: {message}", file=sys.stderr, flush=True)


def warning(message: str) -> None:
    """Tell the user something that may give results they do not expect (one line, on stderr)."""
    print(f"warning: {message}", file=sys.stderr, flush=True)


def process_state():
    """accelerate's state of this process: one of several under `accelerate launch`, else the only one.
    On a machine without a GPU (or with ACCELERATE_USE_CPU=1) the processes talk over gloo on the CPU; under a
    DeepSpeed config, over the backend DeepSpeed names (`cpu=True` would turn DeepSpeed off)."""
    import torch
    from accelerate import PartialState

    from ppo_core.distributed import cpu_backend, deepspeed_launched

    use_cpu = os.environ.get("ACCELERATE_USE_CPU", "false").lower() in ("1", "true", "yes")
    if deepspeed_launched() and not use_cpu:
        backend = cpu_backend()
        return PartialState(**({"backend": backend} if backend else {}))
    return PartialState(cpu=use_cpu or not torch.cuda.is_available())


def device() -> str:
    """"cuda" when a GPU is visible, else "cpu"."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"

"""Resumable PPO state: everything a step depends on, in one file written atomically (under DeepSpeed, one
directory renamed into place).

A checkpoint holds the policy and value head, the optimizer, the lr scheduler, the KL controller, the
running score moments, the trainer's shuffling generator and step counter, the RNG states of Python,
NumPy and torch (CPU and CUDA), the resolved config, and a caller's ``extra`` dict (e.g. the data
position); under N processes, every process's shuffling and RNG states. Under DeepSpeed the weights, the
optimizer and the scheduler are DeepSpeed's own checkpoint of the engine (each process writes its shards), in
``ENGINE_TAG/`` beside the trainer's file ``TRAINER_FILE``. Restoring it and continuing gives the same run as
never stopping (on CPU, bit for bit).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from typing import Any

import numpy as np
import torch

FORMAT_VERSION = 1
TRAINER_FILE = "trainer.pt"  # under DeepSpeed: the trainer's state, beside the engine's
ENGINE_TAG = "engine"  # under DeepSpeed: the tag (subdirectory) of DeepSpeed's checkpoint of the engine


def rng_state() -> dict[str, Any]:
    """The global RNG states, in a form ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.copy()), "pos": pos, "has_gauss": has_gauss,
                  "cached": cached},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state` captured."""
    python = state["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy(), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def atomic_torch_save(obj: Any, path: str) -> None:
    """``torch.save`` to a temporary file in the same directory, fsync, then rename over ``path``:
    a reader (or a killed writer) sees the old file or the new one, never a truncated one."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".pt")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load(path: str) -> dict[str, Any]:
    """Read a checkpoint written by :func:`atomic_torch_save`; a clear error for anything else."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same actionable message
        raise ValueError(f"checkpoint {path}: cannot be read ({exc.__class__.__name__}); delete it to start fresh.") \
            from exc
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path}: not a ppo_core checkpoint (format {FORMAT_VERSION}); delete it to "
                         "start fresh.")
    return state


def temporary_dir(path: str, tag: str) -> str:
    """An empty-to-be directory name beside ``path`` for assembling it, the same on every process given the same
    ``tag``; its ``.tmp-`` prefix is what the stages' clean-up of killed writers removes."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".tmp-{name}-{tag}")


def replace_dir(tmp: str, path: str) -> None:
    """Move the complete directory ``tmp`` onto ``path`` (its files fsynced first): the old ``path`` aside, ``tmp``
    in, the old one deleted. A reader sees the old checkpoint or the new one, never a partial one; a kill between
    the two renames leaves none (both lie under ``.tmp-`` names), so the run starts over rather than resuming."""
    for folder, _, files in os.walk(tmp):
        for name in files:
            with open(os.path.join(folder, name), "rb+") as fh:
                os.fsync(fh.fileno())
    old = f"{tmp}-old"
    shutil.rmtree(old, ignore_errors=True)  # left by a writer killed while deleting it
    if os.path.isdir(path):
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)

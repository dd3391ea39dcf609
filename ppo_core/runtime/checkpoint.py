"""Resumable PPO state: everything a step depends on, in one directory written atomically.

A checkpoint is a directory with one layout, with or without DeepSpeed:

* ``trainer.pt`` (:data:`TRAINER_FILE`): the KL controller, the running score moments, the step counters, the
  resolved config, a caller's ``extra`` dict (e.g. the data position), the fp16 overflows in a row, the DeepSpeed
  ZeRO stage (or None), and every process's mini-batch shuffling state and RNG states (Python, NumPy, torch CPU and
  CUDA), by process index;
* ``engine/`` (:data:`ENGINE_DIR`): the weights (policy and value head), the optimizer, the lr scheduler and the fp16
  loss scaler, as the engine that trains them writes them: ``state.pt`` (:data:`PLAIN_FILE`, their state dicts,
  written by the main process), or under DeepSpeed its own checkpoint directory (each process writes its shards, in
  the tag :data:`DEEPSPEED_TAG`, beside DeepSpeed's recovery scripts).

It is assembled under a temporary name beside its path and renamed into place once every process is done
(:func:`replace_dir`), so a reader sees the previous checkpoint or the new one, never a partial one; a write that
fails (a full disk) removes the temporary directory and raises, leaving the previous checkpoint as it was. Restoring it
and continuing gives the same run as never stopping (on CPU, bit for bit); it is refused, with a message saying
what to do, when the run has another number of processes or another ZeRO stage (or none), which lay out the
global batch and the engine's state.
"""

from __future__ import annotations

import os
import random
import shutil
from typing import Any

import numpy as np
import torch

FORMAT_VERSION = 2  # 1: one file without DeepSpeed, a directory of another layout with it
TRAINER_FILE = "trainer.pt"
ENGINE_DIR = "engine"  # the engine's state: the weights, the optimizer and the scheduler
PLAIN_FILE = "state.pt"  # without DeepSpeed, in engine/: the model's, optimizer's and scheduler's state dicts
DEEPSPEED_TAG = "shards"  # under DeepSpeed, in engine/: the tag (subdirectory) of DeepSpeed's checkpoint


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


class PlainEngine:
    """The engine's state without DeepSpeed: the state dicts of the (unwrapped) model, the optimizer and the lr
    scheduler (None: none), and under fp16 the loss scaler's (its scale and growth tracker), in one file the main
    process writes."""

    zero_stage = None

    def __init__(self, model: torch.nn.Module, optimizer, lr_scheduler, scaler=None):
        self.model, self.optimizer, self.lr_scheduler, self.scaler = model, optimizer, lr_scheduler, scaler

    def save(self, directory: str, is_main_process: bool) -> None:
        if is_main_process:  # the weights and the optimizer state are the same on every process
            os.makedirs(os.path.join(directory, ENGINE_DIR))
            state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                     "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None}
            if self.scaler is not None:  # else a resumed fp16 run would start again from the initial scale
                state["scaler"] = self.scaler.state_dict()
            torch.save(state, os.path.join(directory, ENGINE_DIR, PLAIN_FILE))

    def load(self, directory: str) -> None:
        state = _read(os.path.join(directory, ENGINE_DIR, PLAIN_FILE), directory)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.scaler is not None and "scaler" in state:  # a checkpoint of a run without one: the initial scale
            self.scaler.load_state_dict(state["scaler"])


class DeepSpeedEngine:
    """The state of a DeepSpeed engine (weights, optimizer, scheduler): DeepSpeed's own checkpoint directory, each
    process writing and reading its shards (a collective)."""

    def __init__(self, engine, zero_stage: int):
        self.engine, self.zero_stage = engine, zero_stage

    def save(self, directory: str, is_main_process: bool) -> None:
        self.engine.save_checkpoint(os.path.join(directory, ENGINE_DIR), tag=DEEPSPEED_TAG, save_latest=False)

    def load(self, directory: str) -> None:
        loaded, _ = self.engine.load_checkpoint(os.path.join(directory, ENGINE_DIR), tag=DEEPSPEED_TAG,
                                                load_optimizer_states=True, load_lr_scheduler_states=True)
        if loaded is None:  # DeepSpeed warns and returns None for a missing checkpoint
            raise ValueError(f"checkpoint {directory}: DeepSpeed found no engine state in it; delete it to start "
                             "fresh.")


def engine_state(accelerator, model, optimizer, lr_scheduler, scaler=None) -> PlainEngine | DeepSpeedEngine:
    """How a checkpoint holds the trainer's (prepared) ``model``, ``optimizer``, ``lr_scheduler`` and fp16 loss
    ``scaler`` (None: none): DeepSpeed's own checkpoint of the engine under DeepSpeed (its fp16 optimizer's state holds
    its loss scaler), else their state dicts."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        return DeepSpeedEngine(model, plugin.zero_stage)
    return PlainEngine(accelerator.unwrap_model(model), optimizer, lr_scheduler, scaler)


def save(path: str, trainer_state: dict[str, Any], engine: PlainEngine | DeepSpeedEngine, accelerator,
         tag: str) -> None:
    """Write the checkpoint directory ``path`` (see the module docstring); every process calls it, and returns
    once the directory is in place.

    ``trainer_state`` is what :data:`TRAINER_FILE` holds (the main process writes it); ``tag`` names the temporary
    directory, the same on every process (e.g. the step count). ``accelerator`` gives ``is_main_process`` and
    ``wait_for_everyone``.
    """
    tmp, main = temporary_dir(path, tag), accelerator.is_main_process
    try:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a writer killed at this very step
            os.makedirs(tmp)
        accelerator.wait_for_everyone()
        engine.save(tmp, main)
        if main:
            torch.save(trainer_state | {"format_version": FORMAT_VERSION, "zero_stage": engine.zero_stage},
                       os.path.join(tmp, TRAINER_FILE))
        accelerator.wait_for_everyone()
        if main:
            replace_dir(tmp, path)
    except BaseException:  # a write that failed (a full disk: torch.save's RuntimeError names no file) or an interrupt
        if main:
            _remove(tmp)  # leaves the previous checkpoint, and nothing half-written beside it
        raise
    accelerator.wait_for_everyone()  # every process may read the checkpoint once this returns


def load(path: str, engine: PlainEngine | DeepSpeedEngine, num_processes: int) -> dict[str, Any]:
    """Restore the engine's state from the checkpoint directory ``path`` and return the trainer's (what
    :func:`save` was given); every process calls it. Raises a ValueError saying what to do when ``path`` is not
    a checkpoint of this format, or was written by a run of another number of processes or ZeRO stage (or none)."""
    if not os.path.isdir(path):
        what = ("a file: ppo_core's old one-file format (checkpoints are directories now), or not a checkpoint"
                if os.path.exists(path) else "no such directory")
        raise ValueError(f"checkpoint {path}: cannot be read ({what}); delete it to start fresh.")
    state = _read(os.path.join(path, TRAINER_FILE), path)
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"checkpoint {path}: not a ppo_core checkpoint of format {FORMAT_VERSION} (written by "
                         "another version?); delete it to start fresh.")
    check_run(path, state, num_processes, engine.zero_stage)
    engine.load(path)
    return state


def check_run(path: str, state: dict[str, Any], num_processes: int, zero_stage: int | None) -> None:
    """Raise unless this run can continue the checkpoint's: as many processes (they define the global batch),
    and the same DeepSpeed ZeRO stage, or none (the weights and optimizer state are laid out by it)."""
    saved = len(state["processes"])
    if saved != num_processes:
        raise ValueError(f"checkpoint {path}: written by a run of {saved} process(es), this one has {num_processes}; "
                         f"the global batch (batch_size * processes) would change. Launch {saved} process(es) to "
                         "resume, or delete it to start fresh.")
    saved_stage = state["zero_stage"]
    if zero_stage != saved_stage:
        name = {None: "without DeepSpeed"} | {s: f"under DeepSpeed ZeRO-{s}" for s in (0, 1, 2, 3)}
        raise ValueError(f"checkpoint {path}: written by a run {name[saved_stage]}, this one runs {name[zero_stage]}; "
                         "launch it as the checkpoint's run was to resume, or delete it to start fresh.")


def _read(file: str, path: str) -> Any:
    """``torch.load`` of one of the checkpoint's files (tensors and plain values only), or a clear error."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # any unreadable file gets the same actionable message
        raise ValueError(f"checkpoint {path}: cannot be read ({os.path.basename(file)}: {exc.__class__.__name__}); "
                         "delete it to start fresh.") from exc


def temporary_dir(path: str, tag: str) -> str:
    """An empty-to-be directory name beside ``path`` for assembling it, the same on every process given the same
    ``tag``; its ``.tmp-`` prefix is what the stages' clean-up of killed writers removes."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".tmp-{name}-{tag}")


def replace_dir(tmp: str, path: str) -> None:
    """Move the complete directory ``tmp`` onto ``path`` (its files fsynced first): the old ``path`` aside, ``tmp``
    in, the old one deleted. A reader sees the old checkpoint or the new one, never a partial one; a kill between
    the two renames leaves none (both lie under ``.tmp-`` names), so the run starts over rather than resuming.
    A file at ``path`` (a checkpoint of the old one-file format) is replaced the same way."""
    for folder, _, files in os.walk(tmp):
        for name in files:
            with open(os.path.join(folder, name), "rb+") as fh:
                os.fsync(fh.fileno())
    old = f"{tmp}-old"
    _remove(old)  # left by a writer killed while deleting it
    if os.path.lexists(path):
        os.replace(path, old)
    os.replace(tmp, path)
    _remove(old)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)

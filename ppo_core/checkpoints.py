"""The trainer's checkpoints (not in legacy TRL: resume was its most requested missing feature): the whole training
state, the engine's (weights, optimizer, scheduler, loss scaler) and the loop's (KL controller, score moments, step
counters, each process's shuffling and RNG states), written and restored in ``runtime.checkpoint``'s layout.

:class:`Checkpoints` is mixed into :class:`~ppo_core.trainer.PPOTrainer`; the attributes its methods read are declared
on it (set by ``PPOTrainer.__init__``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .algo.functional import flatten_dict
from .algo.kl_control import AdaptiveKLController, FixedKLController, RunningMoments
from .config import PPOConfig
from .resolution import ResolvedConfig
from .runtime import checkpoint
from .runtime.distributed import quiet_deepspeed_collectives

if TYPE_CHECKING:
    from accelerate import Accelerator

    from .step.update import Updates


class Checkpoints:
    """``PPOTrainer.save_checkpoint`` and ``load_checkpoint`` (see the module docstring)."""

    # what the methods read, set by ``PPOTrainer.__init__``
    config: PPOConfig
    resolved: ResolvedConfig
    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    kl_ctl: AdaptiveKLController | FixedKLController
    running: RunningMoments
    current_step: int
    step_count: int
    _shuffle: torch.Generator
    _group: Any  # ``runtime.distributed.ProcessGroup`` or ``SingleProcess``
    _updates: Updates

    @quiet_deepspeed_collectives
    def save_checkpoint(self, path: str, extra: dict[str, Any] | None = None) -> None:
        """Write the whole training state to the directory ``path`` atomically (what it holds and its layout:
        ``runtime.checkpoint``), with ``extra`` as given (plain Python values or tensors, e.g. the caller's data
        position); see ``load_checkpoint``. Every process calls it, and returns once the directory is in place."""
        self.accelerator.wait_for_everyone()
        processes = self._group.gather_object({"shuffle": self._shuffle.get_state(), "rng": checkpoint.rng_state()})
        state = {"kl_ctl": self.kl_ctl.state_dict(), "running": self.running.state_dict(),
                 "current_step": self.current_step, "step_count": self.step_count,
                 "config": flatten_dict(self.config.to_dict()), "resolved": self.resolved.to_dict(),
                 "extra": extra or {}, "processes": processes,
                 "overflows": self._updates.overflows.state_dict()}
        checkpoint.save(path, state, self._checkpointed_engine(), self.accelerator, tag=str(self.step_count))

    @quiet_deepspeed_collectives
    def load_checkpoint(self, path: str) -> dict[str, Any]:
        """Restore what ``save_checkpoint`` wrote (each process its own shuffling and RNG states); return its
        ``extra`` dict. Every process calls it; the number of processes, and DeepSpeed and its ZeRO stage (or their
        absence), must be the checkpoint's (a ValueError says what to do otherwise)."""
        state = checkpoint.load(path, self._checkpointed_engine(), self.accelerator.num_processes)
        own = state["processes"][self.accelerator.process_index]
        self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.running.load_state_dict(state["running"])
        self._shuffle.set_state(own["shuffle"])
        self.current_step, self.step_count = state["current_step"], state["step_count"]
        self._updates.overflows.load_state_dict(state.get("overflows", {"in_a_row": 0}))
        checkpoint.set_rng_state(own["rng"])
        return state["extra"]

    def _checkpointed_engine(self):
        return checkpoint.engine_state(self.accelerator, self.model, self.optimizer, self.lr_scheduler,
                                       self.accelerator.scaler)


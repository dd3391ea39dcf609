"""A ppo run on disk: its work in progress, resuming it, and publishing it once finished.

The run works in data/checkpoints/ppo (not a DVC output, see stages/resume.py): each step writes its rollouts there
(rollouts/step-NNNNN.parquet) and rewrites the per-step tables (`StepTables`), so a run in progress (or one that
failed) can be inspected; every `checkpoint.ppo_every` steps the trainer's whole state goes to the directory
`state/` beside them (ppo_core's checkpoint, with or without DeepSpeed: the stage does not know its layout). Only
a finished run publishes its artifacts (data/ppo/*, data/models/ppo; the timings to data/logs/ppo, outside DVC's
hashes), all or none, then deletes its state: a failed run leaves no artifact, a finished one no state.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ppo_core import PPOTrainer
from stages.artifacts import (
    PPO_CHECKPOINTS,
    PPO_CURVES,
    PPO_METRICS,
    PPO_MODEL,
    PPO_ROLLOUTS,
    PPO_STATS,
    PPO_TIMINGS,
    PPO_TIMINGS_RUN,
    REWARD_MODEL,
    atomic_path,
    fresh_dir,
    publishing,
    remove_stale_temporaries,
    sha256_file,
    write_json,
    write_parquet,
    writing,
)
from stages.params import Params
from stages.pipeline import stage
from stages.ppo_tables import StepTables
from stages.resume import discard, fingerprint, open_checkpoint_dir
from stages.runtime import StageError, note
from stages.sources import scorer_origin

STATE = "state"  # the trainer's checkpoint directory (ppo_core's format, with or without DeepSpeed)

# The run in progress, inside the checkpoint directory: published to data/ppo only when the run has finished.
WORK_ROLLOUTS = PPO_CHECKPOINTS / "rollouts"
WORK_TABLES = {PPO_STATS: PPO_CHECKPOINTS / PPO_STATS.name, PPO_TIMINGS: PPO_CHECKPOINTS / PPO_TIMINGS.name,
               PPO_CURVES: PPO_CHECKPOINTS / PPO_CURVES.name}


def rollout_file(step: int) -> str:
    return f"step-{step:05d}.parquet"


def resume_run(trainer: PPOTrainer, params: Params, root: Path) -> tuple[int, StepTables]:
    """Restore the last checkpoint of a run with the same params, inputs and code, if there is one: the trainer's
    whole state (every process), the per-step tables and the rollout files of the steps it covers (later ones
    are removed). Returns (the first step to run, the tables); (0, empty tables) for a fresh run."""
    accelerator = trainer.accelerator
    directory, rollouts = root / PPO_CHECKPOINTS, root / WORK_ROLLOUTS
    state = directory / STATE
    spec = stage("ppo")  # what dvc.yaml says the stage tracks: a checkpoint is reused only for the same
    inputs = [path for path in spec.data if path != REWARD_MODEL or params.scorer.source == "reward_model"]
    expected = fingerprint(params, spec.params, inputs, root, spec.code)
    for kind, entries in scorer_origin(params).items():  # the user's reward code, or its package's version
        expected[kind] |= entries
    if accelerator.is_main_process:  # the main process owns the files; the others wait for its decision
        remove_stale_temporaries(directory, rollouts, root / PPO_ROLLOUTS.parent, root / PPO_MODEL.parent,
                                 root / PPO_TIMINGS.parent)
        if not open_checkpoint_dir(directory, expected, params, "ppo") or not state.exists():
            fresh_dir(rollouts)
            for work in WORK_TABLES.values():
                (root / work).unlink(missing_ok=True)
    accelerator.wait_for_everyone()
    if not state.exists():
        return 0, StepTables()
    try:
        extra = trainer.load_checkpoint(str(state))
    except ValueError as err:  # unreadable, or written by another number of processes or ZeRO stage
        raise StageError(str(err)) from None
    start = extra["step"]
    if accelerator.is_main_process:
        missing = [rollout_file(s) for s in range(start) if not (rollouts / rollout_file(s)).exists()]
        if missing:
            raise StageError(f"{rollouts}: {missing[0]} of the steps checkpointed in {directory} is missing; "
                             f"delete {directory} to start fresh")
        for path in rollouts.glob("step-*.parquet"):
            if path.name >= rollout_file(start):
                path.unlink()  # written after the checkpoint: the resumed run writes it again
        note(f"ppo: resuming from {state} at step {start}")
    return start, StepTables.from_state(extra["tables"])


def record(root: Path, step: int, rollouts: dict[str, list], tables: StepTables) -> None:
    """Write a finished step's rollouts and the tables so far into the run's work (main process)."""
    write_parquet(rollouts, root / WORK_ROLLOUTS / rollout_file(step))
    tables.write({final: root / work for final, work in WORK_TABLES.items()})


def save_run_checkpoint(trainer: PPOTrainer, root: Path, next_step: int, tables: StepTables) -> None:
    """The trainer's whole state, the data position and the tables (every process calls it): after the step's
    artifacts, so a resumed run never redoes a step it has written. A write that fails (a full disk) leaves the
    previous checkpoint, and an OSError naming the checkpoint."""
    state = root / PPO_CHECKPOINTS / STATE
    with writing(state):
        trainer.save_checkpoint(str(state), extra={"step": next_step, "tables": tables.state()})


def publish(trainer: PPOTrainer, root: Path, tables: StepTables, tokenizer) -> None:
    """The finished run's artifacts in data/ppo and data/models/ppo, all or none (every process calls it: under ZeRO-3
    each holds a shard of the weights), then its state deleted: a rerun trains from the start."""
    main = trainer.accelerator.is_main_process
    with publishing():
        if main:
            with atomic_path(root / PPO_ROLLOUTS) as tmp:
                shutil.copytree(root / WORK_ROLLOUTS, tmp)
            tables.write({final: root / final for final in WORK_TABLES})
        with trainer.whole_policy() as policy:
            if main:
                save_policy(root / PPO_MODEL, policy, tokenizer)
        if main:
            last = tables.curves[-1]
            write_json({"steps": len(tables.curves)} | {f"final_{k}": v for k, v in last.items() if k != "step"}
                       | {"resolved": trainer.resolved.to_dict()}, root / PPO_METRICS)  # what the run trained with
    if main:  # for the report: which results the timings are of (the curves, once in place)
        write_json({"curves_sha256": sha256_file(root / PPO_CURVES)}, root / PPO_TIMINGS_RUN)
    trainer.accelerator.wait_for_everyone()
    if main:
        discard(root / PPO_CHECKPOINTS)


def save_policy(path: Path, policy, tokenizer) -> None:
    """The policy as a plain transformers model (LoRA merged in), its value head, and with LoRA the adapter
    alone in `adapter/` (loadable with peft on the SFT model; not the reward adapter beside it), atomically."""
    with atomic_path(path) as tmp:
        policy.save_pretrained(tmp, merge_adapter=policy.is_peft_model)
        if policy.is_peft_model:
            policy.save_pretrained(tmp / "adapter", selected_adapters=[policy.pretrained_model.active_adapter])
        tokenizer.save_pretrained(tmp)

"""A ppo run on disk: its work in progress, resuming it, and publishing it once finished.

The run works in data/checkpoints/ppo (not a DVC output, see stages/shared/resume.py): each step writes its rollouts
there (rollouts/step-NNNNN.parquet) and rewrites the per-step tables (`StepTables`), so a run in progress (or one that
failed) can be inspected; every `checkpoint.ppo_every` steps the trainer's whole state goes to the directory `state/`
beside them (ppo_core's checkpoint, with or without DeepSpeed: the stage does not know its layout). Only a finished run
publishes its artifacts (data/ppo/*, data/models/ppo; the timings to data/logs/ppo, outside DVC's hashes), all or none,
then deletes its state: a failed run leaves no artifact, a finished one no state."""

from __future__ import annotations

import shutil
from pathlib import Path

from ppo_core import PPOTrainer
from stages.ppo.tables import StepTables
from stages.shared.artifacts import (
    PPO_CHECKPOINTS,
    PPO_CURVES,
    PPO_EVAL,
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
from stages.shared.origins import scorer_origin
from stages.shared.params import Params
from stages.shared.pipeline import stage
from stages.shared.resume import discard, fingerprint, open_checkpoint_dir
from stages.shared.runtime import StageError, note

STATE = "state"  # the trainer's checkpoint directory (ppo_core's format, with or without DeepSpeed)

# The run in progress, inside the checkpoint directory: published to data/ppo only when the run has finished.
WORK_ROLLOUTS = PPO_CHECKPOINTS / "rollouts"
WORK_TABLES = {PPO_STATS: PPO_CHECKPOINTS / PPO_STATS.name, PPO_TIMINGS: PPO_CHECKPOINTS / PPO_TIMINGS.name,
               PPO_CURVES: PPO_CHECKPOINTS / PPO_CURVES.name, PPO_EVAL: PPO_CHECKPOINTS / PPO_EVAL.name}
BEST = "best-step-"  # the policy watch.keep: best holds so far, saved at its step: best-step-NNNNN


def best_dir(step: int) -> Path:
    return PPO_CHECKPOINTS / f"{BEST}{step:05d}"


def keep_only_best(root: Path, step: int | None) -> None:
    """Remove the saved best policies but the one of ``step`` (None: all of them): the state's, or a newer run's."""
    for path in (root / PPO_CHECKPOINTS).glob(f"{BEST}*"):
        if step is None or path.name != best_dir(step).name:
            shutil.rmtree(path)


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
            keep_only_best(root, None)
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
    tables = StepTables.from_state(extra["tables"])
    if accelerator.is_main_process:  # a best saved after the checkpoint is the resumed run's to find again
        keep_only_best(root, tables.best and tables.best["step"])
    return start, tables


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


def save_best(trainer: PPOTrainer, root: Path, step: int, tokenizer) -> None:
    """The policy after ``step`` as the run's best so far (every process calls it), the previous best removed."""
    with trainer.whole_policy() as policy:
        if trainer.accelerator.is_main_process:
            save_policy(root / best_dir(step), policy, tokenizer)
            keep_only_best(root, step)


def publish(trainer: PPOTrainer, root: Path, tables: StepTables, tokenizer, watch) -> None:
    """The finished (or stopped) run's artifacts in data/ppo and data/models/ppo, all or none (every process calls it:
    under ZeRO-3 each holds a shard of the weights), then its state deleted: a rerun trains from the start. The policy
    published is the last step's, or with ``watch.keep`` best the best one saved."""
    main = trainer.accelerator.is_main_process
    best = tables.best if watch.keep == "best" else None
    with publishing():
        if main:
            with atomic_path(root / PPO_ROLLOUTS) as tmp:
                shutil.copytree(root / WORK_ROLLOUTS, tmp)
            tables.write({final: root / final for final in WORK_TABLES})
        if best is not None:
            if main:
                with atomic_path(root / PPO_MODEL) as tmp:
                    shutil.copytree(root / best_dir(best["step"]), tmp)
        else:
            with trainer.whole_policy() as policy:
                if main:
                    save_policy(root / PPO_MODEL, policy, tokenizer)
        if main:
            last = tables.curves[-1]
            write_json({"steps": len(tables.curves)} | {f"final_{k}": v for k, v in last.items() if k != "step"}
                       | watch_metrics(tables, watch)
                       | {"resolved": trainer.resolved.to_dict()}, root / PPO_METRICS)  # what the run trained with
    if main:  # for the report: which results the timings are of (the curves, once in place)
        write_json({"curves_sha256": sha256_file(root / PPO_CURVES)}, root / PPO_TIMINGS_RUN)
    trainer.accelerator.wait_for_everyone()
    if main:
        discard(root / PPO_CHECKPOINTS)


def watch_metrics(tables: StepTables, watch) -> dict:
    """data/ppo/metrics.json's account of watching the run: the policy kept (its step, and by what), the doctor's
    alerts (per check: how many steps, the first one and its message), where an alert stopped the run, and what the
    held-out evaluations were over (``heldout``: how many prompts, how many of them training prompts: none)."""
    last = int(tables.curves[-1]["step"])
    kept = {"policy": "last", "step": last}
    if watch.keep == "best" and tables.best is not None:
        kept = {"policy": "best", "step": tables.best["step"], "by": watch.best_by, "kl_price": watch.kl_price,
                "value": tables.best["value"]}
    alerts = {}
    for alert in tables.alerts:
        entry = alerts.setdefault(alert["check"], {"steps": 0, "first_step": alert["step"], "first": alert["message"]})
        entry["steps"] += 1
    return ({"kept": kept, "alerts": alerts} | ({"stopped": tables.stopped} if tables.stopped else {})
            | ({"heldout": tables.heldout} if getattr(tables, "heldout", None) else {}))


def save_policy(path: Path, policy, tokenizer) -> None:
    """The policy as a plain transformers model (LoRA merged in), its value head, and with LoRA the adapter
    alone in `adapter/` (loadable with peft on the SFT model; not the reward adapter beside it), atomically."""
    with atomic_path(path) as tmp:
        policy.save_pretrained(tmp, merge_adapter=policy.is_peft_model)
        if policy.is_peft_model:
            policy.save_pretrained(tmp / "adapter", selected_adapters=[policy.pretrained_model.active_adapter])
        tokenizer.save_pretrained(tmp)

"""Reproducible and resumable: same inputs give the same bytes; a stage killed at any moment and rerun ends with
the artifacts of an uninterrupted run; a finished run leaves no state, so a rerun trains again; a checkpoint written
for other params, inputs or code (the user's reward code included) is never silently reused."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from ruamel.yaml import YAML

from ppo_core import PPOTrainer
from stages import ppo, reward, sft
from stages.ppo import checkpoints
from stages.shared import resume
from stages.shared.artifacts import (
    PPO_CHECKPOINTS,
    PPO_MODEL,
    PPO_ROLLOUTS,
    REWARD_CHECKPOINTS,
    REWARD_METRICS,
    REWARD_MODEL,
    SFT_CHECKPOINTS,
    SFT_METRICS,
    SFT_MODEL,
)
from stages.shared.params import load_params
from stages.shared.pipeline import stage
from stages.shared.runtime import StageError
from tests.conftest import ROOT, TINY_PARAMS, params_per_stage, write_params

DVC_STAGES = YAML(typ="safe", pure=True).load((ROOT / "dvc.yaml").read_text())["stages"]


def digests(root: Path, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """{relative path: sha256} of every file under root/data, but those under an `exclude` prefix."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((root / "data").rglob("*")) if p.is_file()
            and not str(p.relative_to(root)).startswith(exclude)}


EXCLUDE = ("data/logs/", "data/checkpoints/")  # wall-clock timings; the state of a run in progress


def remove_outputs_as_dvc_does(root: Path, stage: str) -> None:
    """`dvc repro` deletes a stage's outputs before rerunning it."""
    for out in DVC_STAGES[stage]["outs"] + DVC_STAGES[stage].get("metrics", []):
        target = root / out
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)


def interrupted_after_publishing(tiny_run: Path, params, root: Path, monkeypatch) -> Path:
    """A copy of tiny_run whose ppo run was killed after publishing its outputs but before deleting its state:
    `data/checkpoints/ppo` holds the final checkpoint, and dvc (the stage never exited 0) reruns it."""
    shutil.copytree(tiny_run, root)
    remove_outputs_as_dvc_does(root, "ppo")
    with monkeypatch.context() as patch:
        patch.setattr(checkpoints, "discard", lambda directory: None)
        ppo.run(params, root)
    assert (root / PPO_CHECKPOINTS / checkpoints.STATE).exists()
    remove_outputs_as_dvc_does(root, "ppo")
    return root


def params_file(tmp_path: Path, **changes) -> Path:
    """The tiny params with `changes` ({"ppo__steps": 48} sets ppo.steps), written to tmp_path/params.yaml."""
    return write_params(tmp_path, {key.replace("__", "."): value for key, value in changes.items()})


def run_stage(stage: str, params: Path, cwd: Path) -> subprocess.Popen:
    """The stage as a terminal starts it: with SIGINT at its default, which a test run started in the background
    (`cmd &` in a script) would otherwise pass on as ignored, so that Ctrl-C's tests could not interrupt it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}
    return subprocess.Popen([sys.executable, "-m", "stages", stage, "--params", str(params)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def upstream_of_ppo(tiny_run: Path, root: Path) -> Path:
    """A project with everything the ppo stage reads (tiny_run's data) and none of its outputs."""
    shutil.copytree(tiny_run / "data", root / "data", ignore=shutil.ignore_patterns("ppo", "eval"))
    shutil.rmtree(root / PPO_MODEL, ignore_errors=True)
    return root


@pytest.mark.slow
def test_two_full_pipeline_runs_are_byte_identical_on_cpu(tiny_run, tmp_path):
    """Every Parquet file, model weight, tokenizer and metrics file; only wall-clock timings and the
    checkpoints (which hold the timings and the trainer's own state) are left out. The second run is another
    process with another hash seed, so nothing may depend on set or dict iteration order or process state. On CPUs:
    a GPU's kernels do not all give the same bits twice."""
    import torch

    stages = " ".join(DVC_STAGES)
    script = (f"import importlib, torch; from pathlib import Path; from stages.shared.params import load_params\n"
              f"torch.set_num_threads({torch.get_num_threads()})  # CPU kernels may round by thread count\n"
              f"params = load_params({str(TINY_PARAMS)!r})\n"
              f"for name in {stages!r}.split():\n"
              f"    importlib.import_module('stages.' + name).run(params, Path('.'))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1", "PYTHONHASHSEED": "12345"}
    second = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-2000:]
    first, other = digests(tiny_run, EXCLUDE), digests(tmp_path, EXCLUDE)
    assert first == other
    assert sum(name.endswith(".parquet") for name in first) >= 8 and sum(
        name.endswith(".safetensors") for name in first) >= 3


@pytest.mark.slow
def test_ppo_killed_at_a_random_moment_resumes_to_the_same_artifacts_on_cpu(tiny_run, tmp_path):
    """SIGKILL after a random step plus a random delay (mid-step, mid-write or mid-checkpoint), the outputs
    dvc deletes deleted, the stage rerun: every artifact equals an uninterrupted run's, byte for byte (on CPUs)."""
    params = params_file(tmp_path, ppo__steps=48, checkpoint__ppo_every=2)  # 6 steps, a checkpoint every 2
    whole, killed = upstream_of_ppo(tiny_run, tmp_path / "whole"), upstream_of_ppo(tiny_run, tmp_path / "killed")
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    after, delay = rng.randint(2, 4), rng.uniform(0.0, 0.2)
    where = f"(seed {seed}: killed {delay:.3f} s after step {after} was written)"

    proc = run_stage("ppo", params, killed)
    deadline = time.monotonic() + 300
    while not (killed / checkpoints.WORK_ROLLOUTS / checkpoints.rollout_file(after)).exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-2000:]
        time.sleep(0.01)
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f"the stage ended before the kill {where}"

    # killed before its state was deleted (the run may have published its outputs first): the rerun resumes; killed
    # after that (published, state deleted, not yet exited): nothing to resume, the rerun trains from the start
    interrupted = (killed / PPO_CHECKPOINTS / checkpoints.STATE).exists()
    remove_outputs_as_dvc_does(killed, "ppo")
    rerun = run_stage("ppo", params, killed)
    _, err = rerun.communicate()
    assert rerun.returncode == 0, err[-2000:]
    assert ("note: ppo: resuming from data/checkpoints/ppo/state at step" in err) == interrupted, where
    uninterrupted = run_stage("ppo", params, whole)
    _, err = uninterrupted.communicate()
    assert uninterrupted.returncode == 0, err[-2000:]

    expected = digests(whole, EXCLUDE)
    assert len([name for name in expected if "rollouts/step-" in name]) == 6
    assert digests(killed, EXCLUDE) == expected, where
    assert not (killed / PPO_CHECKPOINTS).exists(), "the finished run left its resumable state"
    assert not list(killed.rglob(".*tmp-*")), "a killed writer's temporary file was left behind"


def crash_at(step: int):
    """A Trainer callback factory: the stage's checkpoint marker, plus a crash when `step` ends."""

    def factory():
        marker = resume.trainer_callback()

        class Crash(type(marker)):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == step:
                    raise KeyboardInterrupt(f"crash at step {step}")

        return Crash()

    return factory


@pytest.mark.parametrize("stage, outputs", [
    (sft, (SFT_MODEL, SFT_METRICS, SFT_CHECKPOINTS)), (reward, (REWARD_MODEL, REWARD_METRICS, REWARD_CHECKPOINTS)),
])
def test_trainer_stages_resume_from_their_checkpoint(stage, outputs, tiny_run, tiny_params, tmp_path, monkeypatch,
                                                      capfd):
    """sft and reward crash after their first checkpoint (step 2) and rerun: same model and metrics."""
    model, metrics, checkpoints = outputs
    shutil.copytree(tiny_run / "data", tmp_path / "data")
    remove_outputs_as_dvc_does(tmp_path, stage.__name__.split(".")[1])
    assert not (tmp_path / checkpoints).exists()  # the finished run deleted its state
    params = params_per_stage(tiny_params)[stage.__name__.split(".")[1]]
    with monkeypatch.context() as patch:
        patch.setattr(stage, "trainer_callback", crash_at(3))
        with pytest.raises(KeyboardInterrupt):
            stage.run(params, tmp_path)
    assert [p.name for p in (tmp_path / checkpoints).glob("checkpoint-*")] == ["checkpoint-2"]
    assert not (tmp_path / model).exists()
    capfd.readouterr()
    stage.run(params, tmp_path)
    assert f"resuming from {tmp_path / checkpoints / 'checkpoint-2'}" in capfd.readouterr().err
    for path in [*sorted((tiny_run / model).iterdir()), tiny_run / metrics]:
        rel = path.relative_to(tiny_run)
        assert (tmp_path / rel).read_bytes() == path.read_bytes(), rel
    assert not (tmp_path / checkpoints).exists()


def test_checkpoint_from_other_params_restarts_or_stops(tiny_run, tiny_params, tmp_path, capfd, monkeypatch):
    root = interrupted_after_publishing(tiny_run, tiny_params, tmp_path / "project", monkeypatch)
    changed = dataclasses.replace(tiny_params, ppo={**tiny_params.ppo, "learning_rate": 0.0001})
    stop = dataclasses.replace(changed, checkpoint=dataclasses.replace(tiny_params.checkpoint, on_mismatch="stop"))
    before = digests(root)
    with pytest.raises(StageError, match=r"data/checkpoints/ppo: checkpoint written with other params "
                                         r"\(ppo.learning_rate: 0.0003 -> 0.0001\); delete the directory"):
        ppo.run(stop, root)
    assert digests(root) == before  # stopping touched nothing

    capfd.readouterr()
    ppo.run(changed, root)
    err = capfd.readouterr().err
    assert "data/checkpoints/ppo was written with other params (ppo.learning_rate: 0.0003 -> 0.0001); " \
           "starting fresh" in err and "resuming" not in err

    interrupted = interrupted_after_publishing(root, changed, tmp_path / "again", monkeypatch)
    (interrupted / SFT_MODEL / "model.safetensors").write_bytes(
        (tiny_run / PPO_MODEL / "model.safetensors").read_bytes())
    with pytest.raises(StageError, match=r"other inputs \(data/models/sft changed\)"):
        ppo.run(dataclasses.replace(changed, checkpoint=stop.checkpoint), interrupted)


def test_a_checkpoint_written_under_deepspeed_stops_a_run_without_it(tiny_run, tiny_params, tmp_path, monkeypatch):
    """Same params and code, another launch: its checkpoint (DeepSpeed's shards beside trainer.pt) cannot be read
    here, so the stage stops with ppo_core's message saying how to go on, and deletes nothing
    (tests/stages/test_distributed.py resumes real ones)."""
    root = interrupted_after_publishing(tiny_run, tiny_params, tmp_path / "project", monkeypatch)
    trainer_file = root / "data" / "checkpoints" / "ppo" / checkpoints.STATE / "trainer.pt"
    torch.save(torch.load(trainer_file, weights_only=True) | {"zero_stage": 3}, trainer_file)
    before = digests(root)
    with pytest.raises(StageError, match=r"data/checkpoints/ppo/state: written by a run under DeepSpeed ZeRO-3, this "
                                         r"one runs without DeepSpeed; launch it as the checkpoint's run was to "
                                         r"resume, or delete it to start fresh"):
        ppo.run(tiny_params, root)
    assert digests(root) == before


def test_a_finished_run_leaves_no_state_and_a_rerun_trains_again(tiny_run, tiny_params, tmp_path, capfd,
                                                                  monkeypatch):
    """A forced rerun (`dvc repro -f`) of a finished run trains from the start: no stage leaves resumable state
    behind, and the rerun runs every step (and, being deterministic, publishes the same bytes)."""
    for state in (SFT_CHECKPOINTS, REWARD_CHECKPOINTS, PPO_CHECKPOINTS):
        assert not (tiny_run / state).exists(), state
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root)
    remove_outputs_as_dvc_does(root, "ppo")
    steps = []
    step = PPOTrainer.step
    monkeypatch.setattr(PPOTrainer, "step", lambda self, *a, **k: steps.append(1) or step(self, *a, **k))
    capfd.readouterr()
    ppo.run(tiny_params, root)
    assert "resuming" not in capfd.readouterr().err
    assert len(steps) == -(-tiny_params.ppo["steps"] // tiny_params.ppo["batch_size"])
    assert digests(root, EXCLUDE) == digests(tiny_run, EXCLUDE)
    assert not (root / PPO_CHECKPOINTS).exists()


def test_a_discard_killed_midway_leaves_no_state_to_resume(tiny_params, tmp_path, monkeypatch):
    """A kill while a finished run's state is being deleted leaves no half-deleted checkpoint (one that would be
    resumed, or fail to load): the state is renamed aside first, and the leftover is removed by the next run."""
    directory = tmp_path / "checkpoints" / "ppo"
    (directory / "state" / "engine" / "shards").mkdir(parents=True)
    (directory / "state" / "trainer.pt").write_bytes(b"state")
    (directory / resume.FINGERPRINT).write_text("{}")
    rmtree = shutil.rmtree

    def killed_after_the_rename(path, ignore_errors=False):
        if not Path(path).exists():
            return
        raise SystemExit("killed")  # the first real deletion: of the state, moved aside

    monkeypatch.setattr(resume.shutil, "rmtree", killed_after_the_rename)
    with pytest.raises(SystemExit):
        resume.discard(directory)
    monkeypatch.setattr(resume.shutil, "rmtree", rmtree)
    assert not directory.exists() and resume.discarded(directory).is_dir()
    assert not resume.open_checkpoint_dir(directory, {"params": {}}, tiny_params, "ppo")  # starts fresh
    assert not resume.discarded(directory).exists()
    assert sorted(p.name for p in directory.iterdir()) == [resume.FINGERPRINT]


def test_a_code_change_starts_fresh_instead_of_resuming(tiny_run, tiny_params, tmp_path, monkeypatch, capfd):
    """dvc reruns a stage whose code changed; an interrupted run's checkpoint must then not be resumed (it would
    publish results of the old code): the fingerprint holds a digest of each code dependency dvc.yaml lists."""
    code = tmp_path / "code"  # a copy of the code the checkpoint was written with, to edit
    for package in ("stages", "ppo_core", "rewards"):
        shutil.copytree(ROOT / package, code / package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(resume, "CODE_ROOT", code)
    root = interrupted_after_publishing(tiny_run, tiny_params, tmp_path / "project", monkeypatch)
    with monkeypatch.context() as patch:
        patch.setattr(checkpoints, "discard", lambda directory: None)
        capfd.readouterr()
        ppo.run(tiny_params, root)
    assert "resuming from" in capfd.readouterr().err  # the same code: the checkpoint is reused

    remove_outputs_as_dvc_does(root, "ppo")
    with open(code / "ppo_core" / "algo" / "ppo_math.py", "a") as fh:
        fh.write("\n# an edit\n")
    (code / "ppo_core" / "__pycache__").mkdir(exist_ok=True)
    ppo.run(tiny_params, root)
    err = capfd.readouterr().err
    # the dep that covers it, as dvc.yaml lists it: the package, or the file itself
    assert re.search(r"data/checkpoints/ppo was written with other code \(ppo_core/algo/ppo_math\.py changed\); "
                     r"starting fresh", err), err
    assert "resuming" not in err
    (code / "ppo_core" / "__pycache__" / "x.cpython.pyc").write_bytes(b"compiled")  # not code: no change
    deps = stage("ppo").code
    before = resume.fingerprint(tiny_params, (), (), root, deps)["code"]
    (code / "ppo_core" / "__pycache__" / "y.cpython.pyc").write_bytes(b"compiled")
    assert resume.fingerprint(tiny_params, (), (), root, deps)["code"] == before


def test_a_non_finite_loss_stops_the_stage_and_the_checkpoint_resumes(tiny_run, tiny_params, tmp_path, capfd,
                                                                        monkeypatch):
    """A scorer that blows up at step 1 makes the value loss infinite: one-line error naming the step and the
    statistic, the step-1 checkpoint intact; with the scorer fixed (same params), the rerun resumes and ends."""
    scorer_module = tmp_path / "exploding.py"
    scorer_module.write_text("import os\nCALLS = [0]\n\ndef score(texts):\n    CALLS[0] += 1\n"
                             "    big = 1e30 if CALLS[0] == 2 and not os.environ.get('FIXED') else 1.0\n"
                             "    return [big * t.count('e') for t in texts]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    root = upstream_of_ppo(tiny_run, tmp_path / "project")
    scorer = dataclasses.replace(tiny_params.scorer, source="callable", name="exploding:score")
    params = dataclasses.replace(tiny_params, scorer=scorer)
    with pytest.raises(StageError) as err:
        ppo.run(params, root)
    message = str(err.value)
    assert "\n" not in message and message.startswith("PPO step 2, mini-batch 1: non-finite") and "ppo/" in message
    assert "data/checkpoints/ppo (if any) is intact" in message and ".;" not in message
    assert sorted(p.name for p in (root / checkpoints.WORK_ROLLOUTS).iterdir()) == [checkpoints.rollout_file(0)]
    assert not (root / "data" / "ppo").exists() and not (root / PPO_MODEL).exists()  # a failed run publishes nothing

    monkeypatch.setenv("FIXED", "1")
    capfd.readouterr()
    summary = ppo.run(params, root)
    assert "resumed at step 1" in summary
    assert sorted(p.name for p in (root / PPO_ROLLOUTS).iterdir()) == [checkpoints.rollout_file(i) for i in (0, 1)]
    assert (root / PPO_MODEL / "model.safetensors").exists()


def test_params_file_path_does_not_change_the_fingerprint(tiny_params, tmp_path):
    """The same values loaded from another file (dvc exp run, a copy) resume the same checkpoint."""
    other = load_params(params_file(tmp_path))
    keys, inputs = stage("ppo").params, ()
    assert resume.fingerprint(other, keys, inputs, tmp_path) == resume.fingerprint(tiny_params, keys, inputs, tmp_path)


def test_redundant_state_is_deleted_by_the_next_run_of_any_stage(tiny_run, tiny_params, tmp_path, monkeypatch):
    """An interrupted `dvc repro -f -s ppo` leaves ppo's state; the next `dvc repro` restores ppo's outputs from DVC's
    run-cache, so ppo never runs again to resume or delete it. The next run of any stage deletes such state (saying
    so): state written for the params, inputs and code the outputs in place are of. State for other params is kept,
    and so is the state of a run in progress (its stage's lock held)."""
    from typer.testing import CliRunner

    from stages.shared.artifacts import LOCKS
    from stages.shared.cli import app
    from tests.stages.test_by_hand import start_holder

    root = interrupted_after_publishing(tiny_run, tiny_params, tmp_path / "project", monkeypatch)
    for out in DVC_STAGES["ppo"]["outs"]:  # restored from the run-cache: the outputs of the same params and inputs
        (shutil.copytree if (tiny_run / out).is_dir() else shutil.copy)(tiny_run / out, root / out)
    monkeypatch.chdir(root)
    state = root / PPO_CHECKPOINTS

    write_params(root, {"ppo.learning_rate": 0.0001})
    result = CliRunner().invoke(app, ["report", "--params", "params.yaml"])
    assert result.exit_code == 0 and result.stderr == "", result.stderr
    assert (state / checkpoints.STATE).exists()  # written for other params than these: kept

    write_params(root, {})
    holder = start_holder(root / LOCKS / "ppo.lock", "ppo")  # a ppo run in progress
    try:
        result = CliRunner().invoke(app, ["report", "--params", "params.yaml"])
    finally:
        holder.kill()
        holder.wait()
    assert result.exit_code == 0 and result.stderr == "", result.stderr
    assert (state / checkpoints.STATE).exists()

    result = CliRunner().invoke(app, ["report", "--params", "params.yaml"])
    assert result.exit_code == 0, result.stderr
    assert result.stderr == ("note: report: deleted data/checkpoints/ppo, the state of an interrupted ppo run: the "
                             "outputs in place are of the same params, inputs and code, so nothing would resume "
                             "from it\n")
    assert not state.exists() and not state.parent.exists()

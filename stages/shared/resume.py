"""Resuming the training stages: a checkpoint exists only to finish an interrupted run, with the same inputs.

Each training stage keeps its resumable state in `data/checkpoints/<stage>`, which is not a DVC output: DVC
neither deletes it before rerunning the stage nor caches it, and the stage's declared outputs stay cacheable, so
DVC's run-cache can restore them (a queued experiment then skips unchanged stages). The state is deleted once the
stage has published its outputs: a finished run leaves none, so a forced or later rerun trains from the start.
Beside the state lies `fingerprint.json`: the params the stage tracks in dvc.yaml (but the `checkpoint` section,
which changes no output), a digest of each input file, of each code dependency dvc.yaml lists for it and of the
user's reward code, and the versions of the libraries that compute it. A rerun after an interruption whose
fingerprint matches resumes; one that does not either starts fresh (and says so) or stops, as
`checkpoint.on_mismatch` decides. State that nothing would resume from (`remove_redundant_state`: an interrupted
run's, whose outputs DVC restored from its run-cache) is deleted when any stage next runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from stages.shared.artifacts import LOCKS, STATE, fresh_dir, hash_file, remove_stale_temporaries, write_json
from stages.shared.params import Params
from stages.shared.pipeline import CODE_ROOT, StageSpec, stage
from stages.shared.runtime import StageError, lock_if_free, note, process_state

FINGERPRINT = "fingerprint.json"


LIBRARIES = ("torch", "transformers", "accelerate", "peft")


# Params sections a stage reads that change none of its outputs: not part of a fingerprint.
NO_OUTPUT_EFFECT = ("checkpoint",)


def fingerprint(params: Params, keys: Iterable[str], inputs: Iterable[Path], root: Path,
                code: Iterable[str] = ()) -> dict[str, Any]:
    """What a stage's state depends on: the values of its params `keys` (dotted, as dvc.yaml lists them; those
    of `NO_OUTPUT_EFFECT` sections left out), the SHA-256 of each input file or directory (paths relative to
    `root`; None for one that is not there: data/sources/*, when a stage runs alone before the sources stage ever
    did), of the Python sources of each `code` path (relative to the repository, as dvc.yaml lists them) and
    the versions of `LIBRARIES`. A stage adds what else its results depend on to "code" and "versions" (the ppo
    stage: the user's reward function, see `stages.shared.origins.scorer_origin`)."""
    keys = [key for key in keys if key.split(".")[0] not in NO_OUTPUT_EFFECT]
    return {"params": {key: _plain(_lookup(params, key)) for key in keys},
            "inputs": {str(path): digest(root / path) if (root / path).exists() else None for path in inputs},
            "code": {str(path): digest(CODE_ROOT / path, "*.py") for path in code},
            "versions": library_versions()}


def library_versions(names: Iterable[str] = LIBRARIES) -> dict[str, str | None]:
    """Installed versions of the libraries whose numerics a checkpoint depends on (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {}
    for name in names:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def digest(path: Path, pattern: str = "*") -> str:
    """SHA-256 of a file, or of a directory's files matching `pattern` (relative names and contents, sorted)."""
    path = Path(path)
    files = sorted(p for p in path.rglob(pattern) if p.is_file()) if path.is_dir() else [path]
    h = hashlib.sha256()
    for file in files:
        h.update(str(file.relative_to(path) if path.is_dir() else file.name).encode() + b"\0")
        hash_file(h, file)
    return h.hexdigest()


def open_checkpoint_dir(directory: Path, expected: dict[str, Any], params: Params, stage: str) -> bool:
    """Make `directory` ready for the stage: True when it holds state written for `expected` (resume from
    it), False when it is now empty but for the fingerprint (start fresh). State written for other params
    or inputs is discarded with a note, or refused with a StageError when `checkpoint.on_mismatch: stop`."""
    directory = Path(directory)
    shutil.rmtree(discarded(directory), ignore_errors=True)  # a finished run's state, killed while being deleted
    path = directory / FINGERPRINT
    found = json.loads(path.read_text()) if path.exists() else None
    if found == expected:
        return True
    if found is not None:
        what = first_difference(found, expected)
        if params.checkpoint.on_mismatch == "stop":
            raise StageError(f"{directory}: checkpoint written with other {what}; delete the directory to start "
                             f"fresh, or set checkpoint.on_mismatch: restart in {params.path}")
        note(f"{stage}: {directory} was written with other {what}; starting fresh (checkpoint.on_mismatch: restart)")
    fresh_dir(directory)
    write_json(expected, path)
    return False


def discard(directory: Path) -> None:
    """Delete a stage's resumable state once its outputs are published (main process): a finished run is never
    resumed. A kill before this leaves state whose rerun republishes the same outputs; the state is first renamed
    aside (one atomic step), so a kill while deleting it leaves no half-deleted state to resume from, only a
    `.tmp-` name that the next discard or `open_checkpoint_dir` removes."""
    directory = Path(directory)
    doomed = discarded(directory)
    shutil.rmtree(doomed, ignore_errors=True)  # left by a kill during an earlier discard
    if directory.exists():
        os.replace(directory, doomed)
    shutil.rmtree(doomed, ignore_errors=True)
    try:
        Path(directory).parent.rmdir()  # data/checkpoints, once no stage has state left there
    except OSError:
        pass


def discarded(directory: Path) -> Path:
    """Where :func:`discard` moves `directory` to delete it."""
    return directory.with_name(f".tmp-{directory.name}-discarded")


def remove_redundant_state(params: Params, root: Path, running: str) -> None:
    """Delete the other training stages' state that nothing would resume from (main process, at the start of a stage's
    run). An interrupted `dvc repro -f -s ppo` leaves ppo's state; the next `dvc repro` restores ppo's outputs from
    DVC's run-cache instead of rerunning it, so ppo never runs to resume or delete it. State is redundant when it was
    written for the params, inputs and code the stage has now and the stage's outputs are all in place: they are
    what it would finish into. A stage whose lock is held is running: its state is left alone, as is the running
    stage's own (it resumes from it)."""
    for name, (directory, *_) in STATE.items():
        if name == running or not (root / directory / FINGERPRINT).exists():
            continue
        with lock_if_free(root / LOCKS / f"{name}.lock") as free:
            if free and redundant(stage(name), params, root):
                note(f"{running}: deleted {directory}, the state of an interrupted {name} run: the outputs in place "
                     "are of the same params, inputs and code, so nothing would resume from it")
                discard(root / directory)


def redundant(spec: StageSpec, params: Params, root: Path) -> bool:
    """Whether the stage's outputs are all in place and its state's fingerprint is what it would write now."""
    if not all((root / out).exists() for out in spec.outs):
        return False
    try:
        found = json.loads((root / STATE[spec.name][0] / FINGERPRINT).read_text())
    except (OSError, ValueError):
        return False
    return found == current_fingerprint(found, spec, params, root)


def current_fingerprint(found: dict[str, Any], spec: StageSpec, params: Params, root: Path) -> dict[str, Any]:
    """The fingerprint the stage would write now for the state whose fingerprint is ``found``: :func:`fingerprint` of
    what dvc.yaml says it tracks (its inputs as ``found`` lists them: the ppo stage leaves the reward model out when
    it scores otherwise), and each entry the stage added to it (the user's reward code or its package, a local scorer
    model: see `stages.shared.scoring.scorer_origin`) computed again."""
    inputs = [path for path in spec.data if str(path) in found.get("inputs", {})]
    now = fingerprint(params, spec.params, inputs, root, spec.code)
    for path in found.get("inputs", {}).keys() - now["inputs"].keys():
        now["inputs"][path] = digest(root / path) if (root / path).exists() else None
    for path in found.get("code", {}).keys() - now["code"].keys():
        now["code"][path] = digest(CODE_ROOT / path, "*.py") if (CODE_ROOT / path).exists() else None
    now["versions"] |= library_versions(found.get("versions", {}).keys() - now["versions"].keys())
    return now


def first_difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    """The first differing leaf of two fingerprints, for a message: "params (ppo.learning_rate: 0.1 -> 0.2)"."""
    a, b = _flatten(old), _flatten(new)
    for key in sorted(a.keys() | b.keys()):
        if a.get(key) != b.get(key):
            kind, _, name = key.partition(":")
            if kind in ("inputs", "code"):
                return f"{kind} ({name} changed)"
            if kind == "versions":
                return f"library versions ({name} {a.get(key)} -> {b.get(key)})"
            return f"params ({name}: {a.get(key, '<absent>')} -> {b.get(key, '<absent>')})"
    return "contents"


def _flatten(fp: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for kind in ("params", "inputs", "code", "versions"):
        for key, value in (fp.get(kind) or {}).items():
            if isinstance(value, dict):
                out.update({f"{kind}:{key}.{k}": v for k, v in _flatten_dict(value).items()})
            else:
                out[f"{kind}:{key}"] = value
    return out


def _flatten_dict(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in _flatten_dict(value).items()})
        else:
            out[key] = value
    return out


def _lookup(params: Params, key: str) -> Any:
    value: Any = params
    for part in key.split("."):
        value = value[part] if isinstance(value, dict) else getattr(value, part)
    return value


def _plain(value: Any) -> Any:
    """A params value as JSON: dataclasses become dicts (tuples lists), as the fingerprint file stores them."""
    if dataclasses.is_dataclass(value):
        value = dataclasses.asdict(value)
    return json.loads(json.dumps(value))


# ---- transformers.Trainer checkpoints (sft, reward) ---------------------------------------------------------
COMPLETE = "COMPLETE"


def trainer_callback():
    """A Trainer callback that marks a checkpoint directory complete once transformers has written all of it.

    transformers writes `checkpoint-N/` file by file, in place: a kill during the save leaves a partial
    directory. Only marked ones are resumed from (a kill between the save and the mark loses one interval: the
    stages keep two checkpoints, `save_total_limit=2`, because transformers deletes the older ones before the
    mark is written).
    """
    from transformers import TrainerCallback

    class MarkComplete(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                (Path(args.output_dir) / f"checkpoint-{state.global_step}" / COMPLETE).touch()

    return MarkComplete()


def complete_checkpoints(directory: Path) -> list[Path]:
    """The `checkpoint-N` directories transformers finished writing, oldest first."""
    found = sorted(Path(directory).glob("checkpoint-*"), key=lambda p: int(p.name.rpartition("-")[2]))
    return [p for p in found if (p / COMPLETE).exists()]


def trainer_resume_point(name: str, params: Params, root: Path, checkpoints: Path,
                         outputs: Iterable[Path]) -> str | None:
    """Before a transformers training stage (sft, reward) trains: the leftovers of an interrupted publish in its
    ``outputs``' directories removed (by the main process), and the checkpoint in ``checkpoints`` to resume from, if
    one was written with the same params, inputs and code as dvc.yaml says the stage tracks (None: a fresh run)."""
    if process_state().is_main_process:
        remove_stale_temporaries(*outputs)
    spec = stage(name)
    expected = fingerprint(params, spec.params, spec.data, root, spec.code)
    return open_trainer_checkpoints(checkpoints, expected, params, name)


def open_trainer_checkpoints(directory: Path, expected: dict[str, Any], params: Params, stage: str) -> str | None:
    """For `trainer.train(resume_from_checkpoint=...)`: the checkpoint to resume from, or None (fresh run).

    Under several processes the main one checks the fingerprint and deletes partial checkpoints; all agree.
    """

    state = process_state()
    if state.is_main_process and open_checkpoint_dir(directory, expected, params, stage):
        complete = complete_checkpoints(directory)
        for partial in set(Path(directory).glob("checkpoint-*")) - set(complete):
            shutil.rmtree(partial)
        if complete:
            note(f"{stage}: resuming from {complete[-1]}")
    state.wait_for_everyone()
    complete = complete_checkpoints(directory)
    return str(complete[-1]) if complete else None

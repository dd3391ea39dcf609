"""The pipeline's artifacts: where they live, and how they are written and read.

Every artifact is written atomically: to a temporary name in the same directory, then `os.replace`d onto its
final name, so a killed stage never leaves a half-written file or model directory behind. A stage publishes its
outputs all or none (`publishing`): each is written to its temporary name first, and they are renamed into place
only once all are written. A write that fails because the place cannot be written (denied, read-only, full) is an
OSError naming the output, whatever the library said (`write_error`). Parquet files are written deterministically
(caller's row order, fixed writer options, no pandas metadata, no timestamps), so the same rows give the same bytes
and DVC sees no change.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from stages.shared.runtime import StageError, reason

# Artifacts, relative to the project root (dvc.yaml declares the same paths).
SOURCES_DATA = Path("data/sources/data.json")  # what the user's own material is now (stages/sources.py)
SOURCES_MODEL = Path("data/sources/model.json")
SOURCES_SCORER = Path("data/sources/scorer.json")
RAW_SFT = Path("data/raw/sft.parquet")
RAW_PAIRS = Path("data/raw/pairs.parquet")
RAW_PROMPTS_TRAIN = Path("data/raw/prompts_train.parquet")
RAW_PROMPTS_EVAL = Path("data/raw/prompts_eval.parquet")
SFT_MODEL = Path("data/models/sft")
SFT_METRICS = Path("data/sft/metrics.json")
SFT_CURVE = Path("data/sft/curve.csv")
REWARD_MODEL = Path("data/models/reward")
REWARD_ADAPTER = REWARD_MODEL / "adapter"  # with model.lora: the LoRA and its score head (the ppo stage scores with it)
REWARD_METRICS = Path("data/reward/metrics.json")
TOKENIZED_TRAIN = Path("data/tokenized/train.parquet")
TOKENIZED_EVAL = Path("data/tokenized/eval.parquet")
PPO_MODEL = Path("data/models/ppo")
PPO_ROLLOUTS = Path("data/ppo/rollouts")
PPO_STATS = Path("data/ppo/stats.parquet")
PPO_CURVES = Path("data/ppo/curves.csv")
PPO_METRICS = Path("data/ppo/metrics.json")
PPO_EVAL = Path("data/ppo/eval.csv")  # the held-out evaluations during the run (watch.eval_every)
EVAL_SAMPLES = Path("data/eval/samples.parquet")
EVAL_METRICS = Path("data/eval/metrics.json")
# Not DVC outputs: what is not a result of the run (dvc.yaml does not list them; test_stages_dvcyaml checks both).
# Resumable state of an interrupted run, deleted once its stage publishes (see stages/shared/resume.py):
SFT_CHECKPOINTS = Path("data/checkpoints/sft")
REWARD_CHECKPOINTS = Path("data/checkpoints/reward")
PPO_CHECKPOINTS = Path("data/checkpoints/ppo")
# Wall-clock timings of the last run that executed: different every run, so kept out of the hashed outputs.
PPO_TIMINGS = Path("data/logs/ppo/timings.csv")
PPO_TIMINGS_RUN = Path("data/logs/ppo/run.json")  # which results they are the timings of: {"curves_sha256": ...}
REPORT_TIMINGS = Path("data/logs/report")  # the report's chart of them, one SVG per run, linked from the page
# The page of a sweep (`rlhf report --experiments`, outside DVC: it reads the experiments DVC has).
REPORT_SWEEP = Path("data/report/experiments.html")
# The locks that make a stage's run the only one (see runtime.stage_lock): one file per stage, while it runs.
LOCKS = Path("data/.locks")
NOT_OUTPUTS = (Path("data/checkpoints"), Path("data/logs"), REPORT_SWEEP, LOCKS)
# The run's report page: a DVC output like any result (the same bytes for the same results).
REPORT = Path("data/report/index.html")
STATE = {"sft": (SFT_CHECKPOINTS,), "reward": (REWARD_CHECKPOINTS,), "ppo": (PPO_CHECKPOINTS, PPO_TIMINGS.parent)}



# A file or directory that cannot be written: denied, read-only, or a full disk (what the CLI prints as one line).
UNWRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT)
# What libraries say when a write runs out of space without an OSError carrying its errno (measured on a full tmpfs):
# safetensors "No space left on device (os error 28)", torch.save a short write ("unexpected pos N vs M", or "file
# write failed"), shutil.copytree a list of its files' errors.
OUT_OF_SPACE = ("no space left on device", "unexpected pos", "file write failed")


def write_error(err: BaseException, path: Path, tmp: Path | None = None) -> OSError | None:
    """``err``, raised while writing ``path`` (through its temporary name ``tmp``), as an OSError naming ``path`` (or
    the file in it) when it says the place cannot be written, else None. Libraries raise such errors without the
    file's name (pyarrow, json) or without an errno (safetensors, torch.save)."""
    code = getattr(err, "errno", None)
    if code is None:
        text = str(err).lower()
        code = errno.EDQUOT if "disk quota exceeded" in text else (
            errno.ENOSPC if any(words in text for words in OUT_OF_SPACE) else None)
    if code not in UNWRITABLE:
        return None
    name, where = getattr(err, "filename", None), Path(path)
    if tmp is not None and name is not None and Path(name).is_relative_to(tmp):
        where = Path(path) / Path(name).relative_to(tmp)  # the file inside a directory being written
    return OSError(code, os.strerror(code), str(where))


@contextmanager
def writing(path: Path, tmp: Path | None = None) -> Iterator[None]:
    """Run the block that writes ``path`` (through ``tmp``), raising what :func:`write_error` makes of its errors."""
    try:
        yield
    except Exception as err:
        named = write_error(err, path, tmp)
        if named is None:
            raise
        raise named from err


_staged: list[tuple[Path, Path]] | None = None  # the open publication's (temporary, final) paths; None: none open


@contextmanager
def publishing() -> Iterator[None]:
    """Publish the outputs the block writes all or none: each `atomic_path` in it stays under its temporary name, and
    only when the block has written all of them are they renamed into place. A failure (a full disk, an error, an
    interrupt) removes those not in place yet and leaves the previous outputs as they were. Inside another
    publication, the block joins it."""
    global _staged
    if _staged is not None:
        yield
        return
    _staged = staged = []
    try:
        yield
        _staged = None
        for tmp, path in staged:
            _move_into_place(tmp, path)
    except BaseException:
        for tmp, _ in staged:
            _remove(tmp)
        raise
    finally:
        _staged = None


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside `path`; when the block succeeds, move it onto `path` (file or directory), at
    once, or inside :func:`publishing` with the publication's other outputs. A failed block removes the temporary
    path; its error, when it says `path` cannot be written, becomes an OSError naming `path` (:func:`write_error`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    _remove(tmp)
    try:
        with writing(path, tmp):
            yield tmp
        if _staged is None:
            _move_into_place(tmp, path)
    except BaseException:
        _remove(tmp)
        raise
    if _staged is not None and (tmp, path) not in _staged:
        _staged.append((tmp, path))


def _move_into_place(tmp: Path, path: Path) -> None:
    """Rename ``tmp`` onto ``path``. A directory replaces an existing one by two renames (old aside, new in), then the
    old one is deleted."""
    with writing(path, tmp):
        if tmp.is_dir() and (path.is_dir() or path.is_symlink()):
            old = path.with_name(f".{path.name}.old-{os.getpid()}")
            os.replace(path, old)
            os.replace(tmp, path)
            _remove(old)
        else:
            os.replace(tmp, path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def remove_stale_temporaries(*directories: Path) -> None:
    """Delete what a killed writer left in `directories`: the temporary names of `atomic_path`
    (`.NAME.tmp-PID`, `.NAME.old-PID`) and of `ppo_core`'s checkpoint writer (`.tmp-*`)."""
    for directory in directories:
        for pattern in (".*.tmp-*", ".*.old-*", ".tmp-*"):
            for path in Path(directory).glob(pattern):
                _remove(path)


def fresh_dir(path: Path) -> Path:
    """An empty directory at `path` (what was there is removed), for outputs written file by file."""
    _remove(Path(path))
    Path(path).mkdir(parents=True)
    return Path(path)


PARQUET_OPTIONS = dict(
    compression="zstd", compression_level=3, version="2.6", data_page_version="1.0",
    use_dictionary=True, write_statistics=True, row_group_size=65536,
)


def write_parquet(columns: dict[str, Sequence[Any]], path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write equal-length columns to Parquet, atomically and deterministically; ``metadata``: the schema's key-value
    metadata (what the rows were made with, e.g. ``TOKENIZER_KEY``)."""
    table = pa.table({name: list(values) for name, values in columns.items()})
    if metadata:
        table = table.replace_schema_metadata(metadata)
    with atomic_path(path) as tmp:
        pq.write_table(table, tmp, **PARQUET_OPTIONS)


def sha256_file(path: Path) -> str:
    """The SHA-256 of a file's bytes, in hex."""
    return hash_file(hashlib.sha256(), path).hexdigest()


def hash_file(h, path: Path):
    """Feed a file's bytes to the hash object `h`, a block at a time; returns `h`."""
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h


def write_json(obj: Any, path: Path, sort_keys: bool = True) -> None:
    """Write JSON (indented, trailing newline; keys sorted unless the caller's order matters: it is the column order
    of `dvc metrics show` and `dvc exp show`), atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")


def write_csv(rows: list[dict[str, Any]], path: Path, columns: Sequence[str] | None = None) -> None:
    """Write rows with the same keys (``columns``, or the first row's) as CSV (for `dvc plots`), atomically; floats
    with 6 significant digits."""
    header = list(columns) if columns is not None else list(rows[0])
    lines = [",".join(header)]
    lines += [",".join(_cell(row[key]) for key in header) for row in rows]
    with atomic_path(path) as tmp:
        tmp.write_text("\n".join(lines) + "\n")


def _cell(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def save_pretrained(path: Path, *objects: Any) -> None:
    """`save_pretrained` each object (model, tokenizer) into one directory, atomically."""
    with atomic_path(path) as tmp:
        for obj in objects:
            obj.save_pretrained(tmp)


def read_table(path: Path, columns: Sequence[str]):
    """Read the named columns of a Parquet file written by an earlier stage, as a pandas DataFrame."""
    path = Path(path)
    if not path.exists():
        raise StageError(f"{path}: not found; run the stage that writes it first (`dvc repro` runs them in order)")
    try:
        present = pq.read_schema(path).names
        missing = [name for name in columns if name not in present]
        if missing:
            raise StageError(f"{path}: column '{missing[0]}' not found (columns: {present}); "
                             "rerun the stage that writes it")
        return pq.read_table(path, columns=list(columns)).to_pandas()
    except (pa.ArrowException, OSError) as err:  # empty, truncated or not Parquet at all
        raise StageError(f"{path}: not a readable Parquet file ({reason(err)}); {restore_hint(path)}") from None


def read_prompts(path: Path):
    """The tokenize stage's prompts (``query``, ``input_ids``), every row holding at least one token id."""
    prompts = read_table(path, ["query", "input_ids"])
    empty = [i for i, ids in enumerate(prompts["input_ids"]) if ids is None or len(ids) == 0]
    if empty:
        raise StageError(f"{path}: {len(empty)} rows have no input_ids (the first: row {empty[0]}); "
                         f"{restore_hint(path)}")
    return prompts


# The files of a saved tokenizer (whichever of them a tokenizer has): what its token ids mean.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "chat_template.jinja")
TOKENIZER_KEY = "tokenizer_sha256"  # data/tokenized/*.parquet's metadata: the tokenizer its ids come from
# data/tokenized/*.parquet's column of chats, where the prompts are chats: each the conversation the template formatted
# (JSON text), travelling with its prompt to the reward functions' `prompts` (TRL's conversational format)
CHATS = "messages"


def tokenizer_digest(model_dir: Path) -> str:
    """SHA-256 of the tokenizer saved in ``model_dir`` (its `TOKENIZER_FILES`, names and bytes)."""
    h = hashlib.sha256()
    for name in TOKENIZER_FILES:
        file = Path(model_dir) / name
        if file.is_file():
            h.update(name.encode() + b"\0")
            hash_file(h, file)
    return h.hexdigest()


def check_tokenized_with(path: Path, model_dir: Path) -> None:
    """Refuse token ids that another tokenizer than ``model_dir``'s made (the stage that tokenized them ran before the
    one that saved this tokenizer, e.g. `rlhf sft` with a new vocabulary and no `rlhf tokenize` after it)."""
    made_with = (pq.read_schema(path).metadata or {}).get(TOKENIZER_KEY.encode())
    if made_with is not None and made_with.decode() != tokenizer_digest(model_dir):
        raise StageError(f"{path}: tokenized with another tokenizer than {model_dir}'s (it was saved again after "
                         f"{writer_of(path)} ran); rerun {writer_of(path)} (`rlhf {writer_of(path)}`, or `dvc repro`)")


def evaluation_metrics(ppo: dict[str, float], sft: dict[str, float], win: float, heldout: dict[str, int]) -> dict:
    """data/eval/metrics.json: the win rate and the PPO policy's means at the top level, in the order a sweep
    compares them, the SFT baseline's in ``sft`` (its KL to itself, always 0, left out), and in ``heldout`` how many
    prompts were evaluated and how many of them are training prompts (``{"prompts", "in_train"}``: 0 by construction,
    measured here)."""
    return {"win_rate": win, **ppo, "sft": {k: v for k, v in sft.items() if k != "kl"}, "heldout": heldout}


def policy_means(metrics: dict, policy: str) -> dict[str, float]:
    """A policy's means from data/eval/metrics.json, keyed alike for both (``kl``: 0 for SFT)."""
    if policy == "sft":
        return {**metrics["sft"], "kl": 0.0}
    return {k: v for k, v in metrics.items() if k not in ("win_rate", "sft", "heldout", "accuracy")}


def check_writable(root: Path, paths: Sequence[Path | str]) -> None:
    """Create and delete a file where each of ``paths`` will be written (beside it: the atomic writers' temporary
    names), so that a stage that cannot write its outputs stops before its work, not after it. An OSError names the
    place (the CLI turns it into one line)."""
    for path in paths:
        folder = (Path(root) / path).parent
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write-check-{os.getpid()}"
        probe.touch()
        probe.unlink()


def writer_of(path: Path) -> str:
    """The stage whose outputs hold ``path`` (dvc.yaml's), for messages; "<stage>" if none does."""
    from stages.shared.pipeline import stages

    where = f"/{Path(path).as_posix()}/"
    for spec in stages().values():
        if any(f"/{out.rstrip('/')}/" in where for out in spec.outs):  # relative or under a project root
            return spec.name
    return "<stage>"


def restore_hint(path: Path) -> str:
    """How to get a damaged or missing artifact back: rerun the stage that writes it, or check out its last good one
    (DVC's cache); for a path no stage writes (a user's own model), to check it."""
    stage = writer_of(path)
    if stage == "<stage>":
        return "check the files there"
    return f"rerun the stage that writes it (`dvc repro -f {stage}`), or `dvc checkout {stage}` for the last good one"


@contextmanager
def loading(path: Path) -> Iterator[None]:
    """Around a ``from_pretrained`` of the saved model at ``path``: a library's error reading it (truncated weights, a
    damaged config) becomes one line naming the directory, what is wrong and how to restore it."""
    from safetensors import SafetensorError

    try:
        yield
    except StageError:
        raise
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as err:
        raise StageError(f"{path}: the saved model could not be read ({reason(err)}); {restore_hint(path)}") from None


def read_json(path: Path, required: Sequence[str] = ()) -> dict:
    """A JSON object an earlier stage wrote (metrics), holding the ``required`` keys; a StageError naming the file, what
    is wrong with it and how to restore it when it is missing, damaged (cut short, not JSON) or lacks a key."""
    path = Path(path)
    if not path.exists():
        raise StageError(f"{path}: not found; run the stage that writes it first (`dvc repro` runs them in order)")
    try:
        value = json.loads(path.read_text())
    except (ValueError, OSError) as err:  # cut short, not JSON, not UTF-8
        raise StageError(f"{path}: not valid JSON ({reason(err)}); {restore_hint(path)}") from None
    if not isinstance(value, dict):
        raise StageError(f"{path}: expected a JSON object, got {type(value).__name__}; {restore_hint(path)}")
    missing = [key for key in required if key not in value]
    if missing:
        raise StageError(f"{path}: no '{missing[0]}' in it; {restore_hint(path)}")
    return value


def require_dir(path: Path) -> Path:
    """Check that a model directory written by an earlier stage exists."""
    if not (Path(path) / "config.json").exists():
        raise StageError(f"{path}: no saved model here; run the stage that writes it first "
                         "(`dvc repro` runs them in order)")
    return Path(path)

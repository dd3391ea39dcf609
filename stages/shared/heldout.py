"""Held out means held out: the prompts split into training and held-out ones by distinct prompt (prepare), the
account of it that every held-out figure carries (how many held-out prompts are training prompts: none), and the
columns kept with each prompt (`data.prompts.keep`: checked at prepare, read back by tokenize, ppo and evaluate)."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from stages.shared.artifacts import CHATS, read_table
from stages.shared.params import DatasetSpec
from stages.shared.runtime import StageError, note, reason

# At most this share of the distinct prompts is held out, whatever data.n_eval_prompts asks (scikit-learn's default
# test share): a small prompts file still trains on most of its prompts (the count that fits the embedded 1,400
# would hold out all of a user's 200).
MAX_HELD_OUT_SHARE = 0.25


class Split(NamedTuple):
    """The prompts split by distinct prompt, as row indices: every copy of a prompt on one side."""

    train: list[int]  # the rows whose prompt is not held out, in their order (a repeated prompt stays repeated)
    held_out: list[int]  # the first row of each held-out prompt, in order


def held_out_split(prompts: list[str], n_held_out: int) -> Split:
    """Hold out the first ``n_held_out`` distinct prompts of ``prompts`` (shuffled already), each once (its first
    row), and train on every row of the others: no held-out prompt is a training prompt, however often the file
    repeats it. Without repeats, the first ``n_held_out`` rows and the rest, as a split by row gives."""
    first = {}
    for row, prompt in enumerate(prompts):
        first.setdefault(prompt, row)
    held_out = list(first.values())[:n_held_out]
    out = {prompts[row] for row in held_out}
    return Split([row for row, prompt in enumerate(prompts) if prompt not in out], held_out)


def rows_of(table: dict[str, list], rows: list[int]) -> dict[str, list]:
    """The ``rows`` of a table of equal-length columns, every column kept."""
    return {name: [values[i] for i in rows] for name, values in table.items()}


def held_out_count(prompts: list[str], asked: int, source: str, params_path: Path) -> int:
    """How many distinct prompts to hold out: ``data.n_eval_prompts``, capped at ``MAX_HELD_OUT_SHARE`` of the distinct
    prompts (at least 1) with a note; fewer than 2 distinct prompts is an error (nothing to hold out that training
    does not see)."""
    distinct = len(set(prompts))
    if distinct < 2:
        raise StageError(f"{source}: {len(prompts)} prompts but {distinct} distinct: a held-out prompt would also be "
                         f"a training prompt; give at least 2 distinct prompts (data.prompts.source in {params_path})")
    cap = max(1, int(MAX_HELD_OUT_SHARE * distinct))
    if asked > cap:
        note(f"prepare: data.n_eval_prompts is {asked}, but {source} has {distinct} distinct prompts: holding out "
             f"{cap} ({MAX_HELD_OUT_SHARE:.0%}) and training on the other {distinct - cap}")
    return min(asked, cap)


def storable(frame, column: str, spec: DatasetSpec) -> list:
    """The values of the source's ``column`` that ``data.prompts.keep`` names, as Parquet can store them (numbers,
    text, lists, nested mappings: one type down the column, missing values allowed); a StageError naming the
    column and the first row that cannot be stored beside the ones before it (rows counted from 1, as an editor
    shows them after a CSV's header)."""
    import pyarrow as pa

    if column not in frame.columns:
        raise StageError(f"{spec.source}: column '{column}' not found (data.prompts.keep names it); its columns are "
                         f"{list(frame.columns)}")
    values = [None if missing(v) else v for v in frame[column].tolist()]
    try:
        pa.array(values)
        return values
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError):
        pass
    for row in range(len(values)):  # the first row that breaks it (only where the column cannot be stored)
        try:
            pa.array(values[:row + 1])
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, OverflowError) as err:
            raise StageError(f"{spec.source}: column '{column}' (data.prompts.keep) cannot be stored: row {row + 1} "
                             f"holds {values[row]!r} ({type(values[row]).__name__}), which does not go with the rows "
                             f"before it ({reason(err, 120)}); give the column one type") from None
    return values


def missing(value) -> bool:
    """A missing value as pandas gives it (None, or NaN in a column of numbers)."""
    return value is None or (isinstance(value, float) and value != value)


def kept_columns(path: Path, names: list[str]) -> dict[str, list]:
    """The prompts columns that travel (`data.prompts.keep`) of a Parquet file an earlier stage wrote, as Python values
    (lists and dicts as the source had them, not numpy arrays); a StageError where one is missing."""
    if not names:
        return {}
    frame = read_table(path, names)  # checks the file and the columns
    del frame
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=list(names))
    return {name: table.column(name).to_pylist() for name in names}


def travelling_columns(path: Path, names: list[str]) -> dict[str, list]:
    """What travels with each prompt of the tokenize stage's table ``path``: where the prompts are chats, each chat
    (``artifacts.CHATS``, JSON text: the reward functions' ``prompts``), then the kept columns ``names``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        chats = [CHATS] if CHATS in pq.read_schema(path).names else []
    except (pa.ArrowException, OSError):  # reading the prompts names the problem
        chats = []
    return kept_columns(path, [*chats, *names])


def training_prompts_among(queries, training) -> int:
    """How many of the held-out ``queries`` are also training prompts (``training``): 0 where prepare and tokenize
    held them out, as they do; measured where a held-out figure is made, so that it says what it is."""
    training = set(training)
    return sum(query in training for query in queries)


def heldout_words(n: int, in_train: int) -> str:
    """``"200 held-out prompts, none of them a training prompt"`` (or how many are)."""
    return f"{n} held-out prompts, " + ("none of them a training prompt" if not in_train else
                                         f"{in_train} of them training prompts")

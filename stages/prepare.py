"""prepare: the raw datasets as Parquet: SFT texts, preference pairs, PPO prompts (train and held-out eval).

Each dataset is either generated (`source: synthetic`, see stages/shared/synthetic.py) or loaded from a local
.parquet/.jsonl/.json/.csv file or a Hugging Face dataset id, with its columns renamed by `columns`.
"""

from __future__ import annotations

import random
from pathlib import Path

from ppo_core import set_seed
from stages.shared import chat, synthetic
from stages.shared.artifacts import RAW_PAIRS, RAW_PROMPTS_EVAL, RAW_PROMPTS_TRAIN, RAW_SFT, publishing, write_parquet
from stages.shared.heldout import held_out_count, held_out_split, missing, rows_of, storable
from stages.shared.origins import LOCAL_READERS, local_data_file
from stages.shared.params import COLUMNS, SYNTHETIC, DatasetSpec, Params
from stages.shared.runtime import StageError, note, reason


def run(params: Params, root: Path = Path(".")) -> str:
    set_seed(params.seed)
    data = params.data
    tables = {name: load(getattr(data, name), name, params) for name in COLUMNS}
    column, prompts = next(iter(tables["prompts"].items()))  # query, or messages (chats as JSON text)
    split = held_out_split(prompts, held_out_count(prompts, data.n_eval_prompts, data.prompts.source, params.path))
    with publishing():  # all four or none
        write_parquet(tables["sft"], root / RAW_SFT)
        write_parquet(tables["pairs"], root / RAW_PAIRS)
        write_parquet(rows_of(tables["prompts"], split.train), root / RAW_PROMPTS_TRAIN)
        write_parquet(rows_of(tables["prompts"], split.held_out), root / RAW_PROMPTS_EVAL)
    repeats = f" ({len(set(prompts))} distinct, {len(prompts) - len(set(prompts))} repeats)" \
        if len(set(prompts)) < len(prompts) else ""
    kept = f", with {', '.join(data.prompts.keep)}" if data.prompts.keep else ""
    return (f"{len(next(iter(tables['sft'].values())))} SFT texts, {len(tables['pairs']['prompt'])} pairs, "
            f"{len(prompts)} prompts{repeats}{kept}: {len(split.train)} train + {len(split.held_out)} held out, none "
            f"of them a training prompt -> {RAW_SFT.parent}")


def load(spec: DatasetSpec, name: str, params: Params) -> dict[str, list[str]]:
    """One dataset as columns of strings, named as in its row shape (`chat.shape`: COLUMNS' by default)."""
    if spec.source == SYNTHETIC:
        if spec.n is None:
            raise StageError(f"{params.path}: data.{name}.n is null; synthetic data needs a row count")
        return generate(name, spec.n, params.seed)
    frame = read_source(spec, name)
    if len(frame) == 0:
        raise StageError(f"{spec.source}: no rows (data.{name}.source in {params.path}); "
                         "give a dataset with at least one row")
    where = f"data.{name}.columns in {params.path}"
    shape = chat.shape(name, spec.columns)
    for ours in shape:
        theirs = spec.columns.get(ours)
        if theirs is None:
            raise StageError(f"{params.path}: data.{name}.columns has no entry for '{ours}'; "
                             f"map it to a column of {spec.source}")
        if theirs not in frame.columns:
            raise StageError(f"{spec.source}: column '{theirs}' not found ({where} maps '{ours}' to it); "
                             f"its columns are {list(frame.columns)}")
        if ours == "messages":  # chats, as JSON text: compared, split and stored as the strings are
            frame[theirs] = chat.chats_as_json(frame[theirs], spec.source, theirs, ends_with_assistant=name == "sft")
        bad = frame[theirs].map(lambda v: not isinstance(v, str)).to_numpy()
        if bad.any():  # the first bad row, counted from 1 as an editor shows rows (after a CSV's header)
            count, first = int(bad.sum()), int(bad.argmax())
            values = "values that are" if count > 1 else "value that is"
            raise StageError(f"{spec.source}: column '{theirs}' has {count} {values} not text (missing or numbers), "
                             f"the first in row {first + 1} ({frame[theirs].iloc[first]!r}); clean the file")
    for column in spec.keep:  # prompts only (checked at load): checked where rows are the file's, named as it has them
        storable(frame, column, spec)
    frame = without_blank_texts(frame, spec, name, shape)
    order = list(range(len(frame)))
    random.Random(f"{params.seed}-{name}").shuffle(order)
    if spec.n is not None and spec.n > len(frame):
        note(f"prepare: data.{name}.n is {spec.n}, but {spec.source} has {len(frame)} rows: using all {len(frame)}")
    frame = frame.iloc[order[:spec.n]]
    kept = {column: [None if missing(v) else v for v in frame[column].tolist()] for column in spec.keep}
    return {ours: frame[spec.columns[ours]].tolist() for ours in shape} | kept


# The columns that must hold text: a blank one (empty, or only whitespace) would be trained on as if it were some.
NON_BLANK = {"sft": ("text", "completion"), "pairs": ("chosen", "rejected"), "prompts": ("query",)}


def without_blank_texts(frame, spec: DatasetSpec, name: str, shape: tuple[str, ...]):
    """``frame`` without the rows whose text columns (`NON_BLANK`, those of its row ``shape``) are blank, said in a
    note; none left is an error."""
    theirs = [spec.columns[ours] for ours in NON_BLANK[name] if ours in shape]
    if not theirs:  # chats: prepare checked their turns
        return frame
    blank = frame[theirs].apply(lambda column: column.str.strip() == "").any(axis=1)
    if not blank.any():
        return frame
    if blank.all():
        raise StageError(f"{spec.source}: every row's {'/'.join(theirs)} is blank (empty or only whitespace) "
                         f"(data.{name}.source); give a dataset with text")
    note(f"prepare: {int(blank.sum())} of {len(frame)} rows of {spec.source} have a blank {'/'.join(theirs)} (empty or "
         "only whitespace): dropped")
    return frame[~blank].reset_index(drop=True)


def generate(name: str, n: int, seed: int) -> dict[str, list[str]]:
    if name == "sft":
        return {"text": synthetic.reviews(n, seed)}
    if name == "prompts":
        return {"query": synthetic.prompts(n, seed)}
    prompt, chosen, rejected = zip(*synthetic.pairs(n, seed))
    return {"prompt": list(prompt), "chosen": list(chosen), "rejected": list(rejected)}


def read_source(spec: DatasetSpec, name: str):
    """A local file with pandas, or a Hugging Face dataset with `datasets.load_dataset` (hub, then pandas)."""
    import pandas as pd

    path = local_data_file(spec, name)
    if path is None:
        return read_hub(spec, name)
    reader = LOCAL_READERS[path.suffix.lower()]
    if path.suffix.lower() == ".jsonl":
        return read_jsonl(path)
    # utf-8-sig: a byte-order mark would otherwise begin the first column's name
    kwargs = {"read_json": {"dtype": False, "encoding": "utf-8-sig"},
              "read_csv": {"dtype": str, "encoding": "utf-8-sig"}}.get(reader, {})
    try:
        return getattr(pd, reader)(path, **kwargs)
    except (ValueError, OSError) as err:
        if reader == "read_csv" and isinstance(err, pd.errors.EmptyDataError):
            return pd.DataFrame()
        raise StageError(f"{path}: could not be read as {path.suffix} ({reason(err, 200)})") from None


def read_jsonl(path: Path):
    """A JSON Lines file (one object per line, blank lines skipped) as a DataFrame; a bad line is an error naming its
    number (strict JSON: pandas' own reader accepts trailing commas and names a byte offset)."""
    import json

    import pandas as pd

    rows = []
    try:
        with open(path, encoding="utf-8-sig") as fh:  # a byte-order mark (as some editors save) is not text
            for number, line in enumerate(fh, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as err:
                    raise StageError(f"{path}:{number}: not valid JSON ({err.msg}, column {err.colno}); fix that "
                                     "line") from None
                if not isinstance(row, dict):
                    raise StageError(f"{path}:{number}: expected a JSON object (one row), got "
                                     f"{type(row).__name__}; fix that line")
                rows.append(row)
    except UnicodeDecodeError as err:
        raise StageError(f"{path}: not UTF-8 text ({reason(err)}); save it as UTF-8") from None
    return pd.DataFrame(rows)


def read_hub(spec: DatasetSpec, name: str):
    import datasets

    try:
        return datasets.load_dataset(spec.source, split=spec.split).to_pandas()
    except Exception as err:  # noqa: BLE001 - the hub client raises many types; all mean "could not load"
        raise StageError(
            f"{spec.source}: could not load Hugging Face dataset split '{spec.split}' (data.{name}.source): "
            f"{reason(err, 200)}. Stage processes default to HF_HUB_OFFLINE=1; "
            "set HF_HUB_OFFLINE=0 to allow downloads, or use a local file"
        ) from None

"""sources: the user's own material that params.yaml names, hashed, so that DVC sees it change.

DVC reruns a stage when one of the deps dvc.yaml declares changes, but the pipeline's inputs from outside it are named
in params.yaml, at any path inside the project or outside it: a local data file (`data.<name>.source`), a local model
(`model.name_or_path`), the scorer's code or model (`scorer.name`). DVC runs this stage first at every `dvc repro`
(`always_changed` in dvc.yaml): it writes what each of them is now into data/sources/, one file per reader: data.json
(read by prepare), model.json (sft), scorer.json (ppo, evaluate). Unchanged material gives the same bytes, so nothing
downstream reruns; an edit changes the file of its readers, and DVC reruns exactly those stages (and what follows).

What is recorded: a local file or directory by the SHA-256 of its bytes (`resume.digest`), the synthetic data
and the stages' own reward model by name, a Hugging Face hub id by name only (what the hub serves under it is not
tracked), a scorer from an installed package by the package's version (`stages.shared.origins`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from stages.shared.artifacts import SOURCES_DATA, SOURCES_MODEL, SOURCES_SCORER, publishing, write_json
from stages.shared.origins import callable_origin, check_model_source, local_data_file, scorer_origin
from stages.shared.params import SYNTHETIC, Params
from stages.shared.resume import digest


def run(params: Params, root: Path = Path(".")) -> str:
    records = records_now(params)
    with publishing():  # all three or none
        for path, record in records.items():
            write_json(record, root / path)
    local = [where for record in records.values() for where in local_paths(record)]
    if not local:
        return f"no local data, model or scorer files in the params -> {SOURCES_DATA.parent}"
    return f"hashed {len(local)} local source{'s' * (len(local) > 1)} ({', '.join(local)}) -> {SOURCES_DATA.parent}"


# What reads each record (and so reruns, with what follows it, when the record changes), and the params it records.
READERS = {SOURCES_DATA: "prepare", SOURCES_MODEL: "sft", SOURCES_SCORER: "ppo and evaluate"}


def records_now(params: Params) -> dict[Path, dict[str, Any]]:
    """What each of data/sources/*.json would hold if the sources stage ran now. A local data file, model or scorer
    model the params name that is not there fails here (a StageError): first in every `dvc repro`, where DVC deleted
    nothing, not at its reader after DVC deleted that stage's last outputs."""
    return {SOURCES_DATA: data_sources(params), SOURCES_MODEL: model_source(params),
            SOURCES_SCORER: scorer_source(params)}


def changes(params: Params, root: Path = Path(".")) -> list[str]:
    """What differs between the material params.yaml names now and what the last run of the sources stage recorded
    (what `dvc status` cannot see: DVC hashes these at `dvc repro`, in this stage), one line each, saying which stages
    the next `dvc repro` reruns for it, each line once (a new scorer changes its source, name and code: one line).
    Nothing: all as recorded."""
    out = []
    for path, record in records_now(params).items():
        recorded = read_recorded(root / path)
        now = json.loads(json.dumps(record))  # as written: tuples as lists
        if recorded is None:
            out.append(f"{path}: not recorded yet; the next `dvc repro` records it and runs {READERS[path]}")
            continue
        for key in sorted(now.keys() | recorded.keys()):
            if now.get(key) != recorded.get(key):
                out.append(f"{described(path, key, now, recorded)} changed since the last run: the next `dvc repro` "
                           f"reruns {READERS[path]} and what follows")
    return list(dict.fromkeys(out))  # in order, without repeats


def read_recorded(path: Path) -> dict[str, Any] | None:
    """A record the sources stage wrote, or None where there is none (or it is damaged: the next run rewrites it)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def described(path: Path, key: str, now: dict[str, Any], recorded: dict[str, Any]) -> str:
    """The param behind one entry of a record, with its value: "data.prompts.source (prompts.jsonl)"."""
    if path == SOURCES_DATA:
        return f"data.{key}.source ({(now.get(key) or recorded.get(key) or {}).get('source')})"
    if path == SOURCES_MODEL:
        return f"model.name_or_path ({now.get('source')})"
    if key == "judges":
        return "evaluate.judges"
    return f"scorer ({now.get('source')} {now.get('name') or ''})".replace(" )", ")")


def local_source(name: str | None) -> dict[str, Any]:
    """``{"source": name}``, with ``"sha256"`` when ``name`` is a local file or directory."""
    if name is None or not Path(name).expanduser().exists():
        return {"source": name}
    return {"source": name, "sha256": digest(Path(name).expanduser())}


def data_sources(params: Params) -> dict[str, Any]:
    """The three datasets: the synthetic generator, a local file (hashed), or a hub dataset (its id and split)."""
    out = {}
    for name in ("sft", "pairs", "prompts"):
        spec = getattr(params.data, name)
        if spec.source == SYNTHETIC:
            out[name] = {"source": SYNTHETIC}
        elif local_data_file(spec, name) is not None:  # checked to be a data file, as prepare reads it
            out[name] = local_source(spec.source)
        else:
            out[name] = {"source": spec.source, "split": spec.split}
    return out


def model_source(params: Params) -> dict[str, Any]:
    """The pretrained model SFT starts from: none (trained from scratch), a local directory (hashed) or a hub id."""
    if params.model.name_or_path is not None:
        check_model_source(params.model.name_or_path)
    return local_source(params.model.name_or_path)


def scorer_source(params: Params) -> dict[str, Any]:
    """The reward function of ppo and evaluate: the reward model (an artifact of the pipeline already), a pipeline
    model or a callable, with what its scores depend on (its code or model, hashed; or its package's version); and
    evaluate's judges likewise."""
    spec, judges = params.scorer, params.evaluate.judges
    return {"source": spec.source, "name": spec.name} | scorer_origin(params) | ({"judges": {
        name: {"source": value} | callable_origin(value, f"evaluate.judges.{name}", params)
        for name, value in judges.items()}} if judges else {})


def local_paths(record: dict[str, Any]) -> list[str]:
    """The local files and directories a record hashed (for the summary line)."""
    found = [record["source"]] if "sha256" in record else []
    found += list(record.get("code", {})) + list(record.get("inputs", {}))
    for value in [*record.values(), *record.get("judges", {}).values()]:
        if isinstance(value, dict) and "source" in value:
            found += local_paths(value)
    return found

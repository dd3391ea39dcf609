"""prepare: synthetic data by default; real data from local JSONL/CSV with a column mapping; clear errors."""

from __future__ import annotations

import dataclasses
import json

import pandas as pd
import pytest

from stages import prepare
from stages.shared.artifacts import RAW_PAIRS, RAW_PROMPTS_EVAL, RAW_PROMPTS_TRAIN, RAW_SFT
from stages.shared.params import DatasetSpec
from stages.shared.runtime import StageError
from stages.shared.synthetic import gold_score


def with_data(params, **specs):
    return dataclasses.replace(params, data=dataclasses.replace(params.data, **specs))


def test_synthetic_sizes_and_labels(tiny_params, tmp_path):
    prepare.run(tiny_params, tmp_path)
    data = tiny_params.data
    assert len(pd.read_parquet(tmp_path / RAW_SFT)) == data.sft.n
    pairs = pd.read_parquet(tmp_path / RAW_PAIRS)
    assert list(pairs.columns) == ["prompt", "chosen", "rejected"] and len(pairs) == data.pairs.n
    assert all(gold_score(p + c) > gold_score(p + r) for p, c, r in pairs.itertuples(index=False))
    held_out, train = (pd.read_parquet(tmp_path / path)["query"] for path in (RAW_PROMPTS_EVAL, RAW_PROMPTS_TRAIN))
    assert len(held_out) == data.n_eval_prompts and not set(held_out) & set(train)
    assert len(train) + sum((train == q).sum() for q in held_out) <= data.prompts.n


def test_same_seed_same_bytes(tiny_params, tmp_path):
    prepare.run(tiny_params, tmp_path / "a")
    prepare.run(tiny_params, tmp_path / "b")
    for path in (RAW_SFT, RAW_PAIRS, RAW_PROMPTS_TRAIN, RAW_PROMPTS_EVAL):
        assert (tmp_path / "a" / path).read_bytes() == (tmp_path / "b" / path).read_bytes()


@pytest.fixture
def real_files(tmp_path):
    """SFT texts as JSONL (`review`), pairs as CSV (`good`/`bad`), prompts as JSONL (`prompt`, as in the seed)."""
    reviews = [f"review number {i} was fine." for i in range(12)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps({"review": r, "stars": 3}) + "\n" for r in reviews))
    pd.DataFrame({"prompt": ["the film", "the plot"], "good": [" was great", " worked"], "bad": [" was bad", " failed"]}
                 ).to_csv(tmp_path / "pairs.csv", index=False)
    prompts = [{"prompt": f"prompt {i}", "meta": i} for i in range(10)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return tmp_path


def real_specs(files):
    return dict(
        sft=DatasetSpec(source=str(files / "sft.jsonl"), split="train", columns={"text": "review"}, n=None),
        pairs=DatasetSpec(source=str(files / "pairs.csv"), split="train",
                          columns={"prompt": "prompt", "chosen": "good", "rejected": "bad"}, n=None),
        prompts=DatasetSpec(source=str(files / "prompts.jsonl"), split="train", columns={"query": "prompt"}, n=None),
    )


def test_real_data_jsonl_and_csv_with_column_mapping(tiny_params, real_files):
    params = with_data(tiny_params, n_eval_prompts=2, **real_specs(real_files))
    assert not params.data.is_synthetic
    out = real_files / "project"
    prepare.run(params, out)
    sft = pd.read_parquet(out / RAW_SFT)
    assert list(sft.columns) == ["text"]
    assert sorted(sft["text"]) == sorted(f"review number {i} was fine." for i in range(12))
    pairs = pd.read_parquet(out / RAW_PAIRS)
    assert sorted(pairs["chosen"]) == [" was great", " worked"]
    train, held_out = pd.read_parquet(out / RAW_PROMPTS_TRAIN), pd.read_parquet(out / RAW_PROMPTS_EVAL)
    assert len(train) == 8 and len(held_out) == 2
    assert sorted(train["query"].tolist() + held_out["query"].tolist()) == sorted(f"prompt {i}" for i in range(10))


def test_n_keeps_a_seeded_subset(tiny_params, real_files):
    specs = real_specs(real_files)
    specs["sft"] = dataclasses.replace(specs["sft"], n=5)
    prepare.run(with_data(tiny_params, n_eval_prompts=3, **specs), real_files / "project")
    assert len(pd.read_parquet(real_files / "project" / RAW_SFT)) == 5


def test_missing_column_names_file_and_column(tiny_params, real_files):
    specs = real_specs(real_files)
    columns = {"prompt": "prompt", "chosen": "best", "rejected": "bad"}
    specs["pairs"] = dataclasses.replace(specs["pairs"], columns=columns)
    with pytest.raises(StageError, match=r"pairs.csv: column 'best' not found \(data.pairs.columns .* maps 'chosen'"):
        prepare.run(with_data(tiny_params, n_eval_prompts=3, **specs), real_files / "project")


@pytest.mark.parametrize("content", ["", "prompt,good,bad\n"])
def test_empty_dataset_names_file(tiny_params, real_files, content):
    (real_files / "pairs.csv").write_text(content)
    with pytest.raises(StageError, match=r"pairs.csv: no rows \(data.pairs.source"):
        prepare.run(with_data(tiny_params, n_eval_prompts=3, **real_specs(real_files)), real_files / "project")


def test_empty_jsonl_names_file(tiny_params, real_files):
    (real_files / "sft.jsonl").write_text("")
    with pytest.raises(StageError, match=r"sft.jsonl: no rows"):
        prepare.run(with_data(tiny_params, n_eval_prompts=3, **real_specs(real_files)), real_files / "project")


def test_a_held_out_count_beyond_a_quarter_of_the_prompts_is_capped_and_said(tiny_params, real_files, capsys):
    """data.n_eval_prompts 200 (the shipped params) on a user's 10 prompts: 2 held out (25%), 8 trained on, a note."""
    prepare.run(with_data(tiny_params, n_eval_prompts=200, **real_specs(real_files)), real_files / "project")
    assert len(pd.read_parquet(real_files / "project" / RAW_PROMPTS_EVAL)) == 2
    assert len(pd.read_parquet(real_files / "project" / RAW_PROMPTS_TRAIN)) == 8
    assert "data.n_eval_prompts is 200, but" in capsys.readouterr().err


def test_one_distinct_prompt_cannot_be_held_out(tiny_params, real_files):
    """300 copies of one prompt: whatever is held out is a training prompt too, so prepare refuses, saying why."""
    (real_files / "prompts.jsonl").write_text("".join(json.dumps({"prompt": "the same"}) + "\n" for _ in range(300)))
    with pytest.raises(StageError, match=r"prompts.jsonl: 300 prompts but 1 distinct: a held-out prompt would also be "
                                         r"a training prompt; give at least 2 distinct prompts"):
        prepare.run(with_data(tiny_params, n_eval_prompts=3, **real_specs(real_files)), real_files / "project")


def test_repeated_prompts_are_held_out_whole_none_of_them_a_training_prompt(tiny_params, real_files, capsys):
    """A prompts file whose rows repeat prompts (each of 40 prompts 1 to 5 times): the split is by distinct prompt,
    every copy on one side; the held-out prompts are each there once, none of them among the training prompts; the
    summary counts the repeats."""
    rows = [f"prompt {i}" for i in range(40) for _ in range(1 + i % 5)]
    (real_files / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in rows))
    summary = prepare.run(with_data(tiny_params, n_eval_prompts=8, **real_specs(real_files)), real_files / "project")
    train = pd.read_parquet(real_files / "project" / RAW_PROMPTS_TRAIN)["query"].tolist()
    held_out = pd.read_parquet(real_files / "project" / RAW_PROMPTS_EVAL)["query"].tolist()
    assert len(held_out) == len(set(held_out)) == 8 and not set(held_out) & set(train)
    assert sorted(set(train) | set(held_out)) == sorted(set(rows))
    assert len(train) == len(rows) - sum(rows.count(p) for p in held_out)  # every copy of a trained prompt kept
    assert f"{len(rows)} prompts (40 distinct, {len(rows) - 40} repeats)" in summary
    assert "none of them a training prompt" in summary


def test_the_split_by_prompt_is_the_split_by_row_without_repeats():
    prompts = [f"p{i}" for i in range(10)]
    assert prepare.held_out_split(prompts, 3) == (list(range(3, 10)), [0, 1, 2])  # rows
    repeated = ["a", "b", "a", "c", "b", "d"]
    assert prepare.held_out_split(repeated, 2) == ([3, 5], [0, 1])  # c and d trained on; a and b held out once


def test_the_synthetic_default_holds_out_prompts_it_never_trains_on(tiny_params, tmp_path):
    """The embedded default: 1,400 synthetic prompts, 200 held out, none of them a training prompt (independent
    draws made 633 distinct prompts of 1,400; most held-out ones were training prompts too)."""
    params = with_data(tiny_params, n_eval_prompts=200,
                       prompts=dataclasses.replace(tiny_params.data.prompts, n=1400))
    prepare.run(params, tmp_path)
    train = pd.read_parquet(tmp_path / RAW_PROMPTS_TRAIN)["query"]
    held_out = pd.read_parquet(tmp_path / RAW_PROMPTS_EVAL)["query"]
    assert len(held_out) == held_out.nunique() == 200 and not set(held_out) & set(train)
    assert train.nunique() == 640  # the other distinct openers, each trained on


def test_unsupported_local_file(tiny_params, real_files):
    (real_files / "sft.txt").write_text("hello\n")
    specs = real_specs(real_files)
    specs["sft"] = dataclasses.replace(specs["sft"], source=str(real_files / "sft.txt"))
    with pytest.raises(StageError, match=r"sft.txt: not a readable .parquet/.jsonl/.json/.csv file"):
        prepare.run(with_data(tiny_params, **specs), real_files / "project")


def test_hub_dataset_offline_is_a_clear_error(tiny_params):
    """A dataset id goes through datasets.load_dataset; offline (the default) it fails in one actionable line."""
    spec = DatasetSpec(source="someone/movie-reviews", split="train", columns={"text": "text"}, n=None)
    with pytest.raises(StageError, match=r"someone/movie-reviews: could not load .* HF_HUB_OFFLINE=0"):
        prepare.load(spec, "sft", tiny_params)


def test_blank_rows_are_dropped_and_said(tiny_params, real_files, capfd):
    """Prompts that are empty or only whitespace would be tokenized to a few space tokens and trained on as if they
    were prompts: dropped, with a note that counts them."""
    prompts = [f"prompt {i}" for i in range(10)] + ["", "   ", "\t \n"] * 4
    (real_files / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    prepare.run(with_data(tiny_params, n_eval_prompts=3, **real_specs(real_files)), real_files / "project")
    kept = pd.concat([pd.read_parquet(real_files / "project" / p) for p in (RAW_PROMPTS_TRAIN, RAW_PROMPTS_EVAL)])
    assert sorted(kept["query"]) == sorted(f"prompt {i}" for i in range(10))
    assert f"note: prepare: 12 of 22 rows of {real_files / 'prompts.jsonl'} have a blank prompt (empty or only " \
           "whitespace): dropped\n" in capfd.readouterr().err


def test_a_malformed_jsonl_line_is_named_by_its_number(tiny_params, real_files):
    """Strict JSON, line by line (pandas' reader accepts a trailing comma and names a byte offset for other errors)."""
    lines = (real_files / "sft.jsonl").read_text().splitlines()
    lines[4] = lines[4].rstrip("}") + ",}"
    (real_files / "sft.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(StageError, match=r"sft.jsonl:5: not valid JSON \(Expecting property name enclosed in double "
                                         r"quotes, column \d+\); fix that line$"):
        prepare.run(with_data(tiny_params, n_eval_prompts=3, **real_specs(real_files)), real_files / "project")
    (real_files / "sft.jsonl").write_text('{"review": "fine"}\n["not", "a", "row"]\n')
    with pytest.raises(StageError, match=r"sft.jsonl:2: expected a JSON object \(one row\), got list; fix that line"):
        prepare.run(with_data(tiny_params, n_eval_prompts=3, **real_specs(real_files)), real_files / "project")


@pytest.mark.parametrize("suffix", [".jsonl", ".csv", ".json"])
def test_a_file_with_a_byte_order_mark_is_read_as_its_text(tiny_params, tmp_path, suffix):
    """Editors on Windows save UTF-8 with a byte-order mark: the file reads as the same file without one."""
    texts = [f"review number {i} was fine" for i in range(6)]
    body = {".jsonl": "".join(json.dumps({"text": t}) + "\n" for t in texts),
            ".csv": "text\n" + "".join(f"{t}\n" for t in texts),
            ".json": json.dumps([{"text": t} for t in texts])}[suffix]
    path = tmp_path / f"texts{suffix}"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    spec = DatasetSpec(source=str(path), split="train", columns={"text": "text"}, n=None)
    assert sorted(prepare.load(spec, "sft", tiny_params)["text"]) == sorted(texts)

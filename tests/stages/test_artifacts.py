"""stages/shared/artifacts.py: atomic writes, deterministic Parquet, clear errors for missing inputs."""

from __future__ import annotations

import pytest

from stages.shared.artifacts import atomic_path, read_table, save_pretrained, write_json, write_parquet
from stages.shared.runtime import StageError


def test_atomic_file_replaces_and_leaves_no_temp(tmp_path):
    target = tmp_path / "out" / "metrics.json"
    write_json({"a": 1}, target)
    write_json({"a": 2}, target)
    assert target.read_text() == '{\n  "a": 2\n}\n'
    assert [p.name for p in target.parent.iterdir()] == ["metrics.json"]


def test_failed_write_keeps_the_old_artifact(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "weights").write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.mkdir()
        (tmp / "weights").write_text("half")
        raise RuntimeError("killed mid-write")
    assert (target / "weights").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_directory_is_replaced_whole(tmp_path):
    class Saver:
        def __init__(self, name):
            self.name = name

        def save_pretrained(self, directory):  # creates the directory, as transformers does
            directory.mkdir(exist_ok=True)
            (directory / self.name).write_text(self.name)

    target = tmp_path / "model"
    save_pretrained(target, Saver("a"), Saver("b"))
    save_pretrained(target, Saver("c"))
    assert sorted(p.name for p in target.iterdir()) == ["c"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_parquet_is_byte_for_byte_deterministic(tmp_path):
    columns = {"query": ["a", "b"], "input_ids": [[1, 2], [3]], "score": [0.5, -1.0]}
    write_parquet(columns, tmp_path / "one.parquet")
    write_parquet(columns, tmp_path / "two.parquet")
    assert (tmp_path / "one.parquet").read_bytes() == (tmp_path / "two.parquet").read_bytes()
    frame = read_table(tmp_path / "one.parquet", ["query", "input_ids"])
    assert frame["query"].tolist() == ["a", "b"] and frame["input_ids"][0].tolist() == [1, 2]


def test_read_table_errors_name_file_and_column(tmp_path):
    with pytest.raises(StageError, match=r"missing.parquet: not found; run the stage that writes it"):
        read_table(tmp_path / "missing.parquet", ["query"])
    write_parquet({"text": ["x"]}, tmp_path / "t.parquet")
    with pytest.raises(StageError, match=r"t.parquet: column 'query' not found"):
        read_table(tmp_path / "t.parquet", ["query"])

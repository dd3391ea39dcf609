"""ppo_core/step/data.py: the dataloader a loop draws its queries from, and its collation, without a trainer."""

from __future__ import annotations

import pytest
import torch

from ppo_core import PPOConfig
from ppo_core.step.data import dataloader, default_collator, repeated, signature_columns, warn_no_dataset


def test_repeated_gives_each_row_times_in_a_row():
    assert repeated(list, 3)(["a", "b"]) == ["a", "a", "a", "b", "b", "b"]
    assert repeated(list, 1) is list


def test_dict_rows_collate_to_lists_and_token_id_lists_to_tensors():
    batch = default_collator([{"q": [3, 4], "label": "x"}, {"q": [5], "label": "y"}])
    assert [t.tolist() for t in batch["q"]] == [[3, 4], [5]] and batch["label"] == ["x", "y"]
    assert all(t.dtype == torch.long for t in batch["q"])
    assert default_collator([{"flag": [True, False]}])["flag"] == [[True, False]]  # booleans are not token ids


def test_tensor_rows_collate_as_torch_does():
    queries, scores = default_collator([(torch.tensor([1, 2]), 0.5), (torch.tensor([3, 4]), 1.5)])
    assert queries.tolist() == [[1, 2], [3, 4]] and scores.tolist() == [0.5, 1.5]


def test_a_batch_holds_batch_size_rows_as_prompts_repeated_num_generations_times():
    config = PPOConfig(batch_size=6, mini_batch_size=3, num_generations=3, advantage_estimator="grpo", seed=1)
    rows = [{"query": f"q{i}"} for i in range(7)]
    batches = list(dataloader(rows, config))
    assert len(batches) == 3  # 7 prompts, 2 a batch, the ragged last one dropped
    for batch in batches:
        assert len(batch["query"]) == 6 and batch["query"][:3] == [batch["query"][0]] * 3
    again = [b["query"] for b in dataloader(rows, config)]
    assert again == [b["query"] for b in batches]  # the shuffle is the config's seed's


def test_a_datasets_dataset_keeps_only_the_columns_the_model_or_the_logs_use():
    datasets = pytest.importorskip("datasets")
    data = datasets.Dataset.from_dict({"query": ["a", "b"], "input_ids": [[3], [4]], "extra": [0, 1]})
    config = PPOConfig(batch_size=2, mini_batch_size=2)
    batch = next(iter(dataloader(data, config)))
    assert sorted(batch) == ["input_ids", "query"]
    assert {"input_ids", "attention_mask", "query", "response", "label"} <= set(signature_columns())


def test_without_a_dataset_the_warning_says_what_step_takes():
    with pytest.warns(UserWarning, match=r"step\(\) takes config.batch_size \(now 8\).*on each of the 2 processes"):
        warn_no_dataset(8, 2)

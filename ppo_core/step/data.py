"""The data a ``PPOTrainer`` loop draws its queries from: the dataloader over a dataset (``num_generations`` rows of
each prompt in a row) and its collation, as legacy ``prepare_dataloader`` built them."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate

from ..config import PPOConfig
from ..models.modeling import AutoModelForCausalLMWithValueHead


def repeated(collate: Callable, times: int) -> Callable:
    """``collate`` of each row ``times`` times in a row (``num_generations`` samples of every prompt)."""
    if times == 1:
        return collate
    return lambda rows: collate([row for row in rows for _ in range(times)])


def default_collator(rows: list[Any]) -> Any:
    """The collation without a ``data_collator`` (legacy: ``collate_fn=None``, torch's default collation).

    Rows of tuples of tensors, tensors, numbers...: as torch's default collation batches them, e.g. a dataset of
    ``(query, response)`` tensor pairs gives ``(queries (B, Lq), responses (B, Lr))``. Dict rows (a ``datasets``
    dataset): ``{k: v} -> {k: [v, ...]}``, each column a list of the rows' values, so that variable-length queries stay
    a list of 1-D tensors (torch's collation raises on them), in every batch whatever lengths it happens to hold; a
    column of token-id lists (``datasets`` without ``set_format("torch")``) gives 1-D LongTensors.
    """
    if isinstance(rows[0], Mapping):
        return {key: [_token_ids(row[key]) for row in rows] for key in rows[0]}
    return default_collate(rows)


def _token_ids(value: Any) -> Any:
    """A list of ints as a 1-D LongTensor; anything else as it is."""
    if isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return torch.tensor(value, dtype=torch.long)
    return value


def signature_columns() -> list[str]:
    """The dataset columns a dataloader keeps: the value-head model's forward arguments, plus ``label``, ``query`` and
    ``response`` for logging."""
    keep = list(inspect.signature(AutoModelForCausalLMWithValueHead.forward).parameters)
    return keep + ["label", "query", "response", "input_ids", "attention_mask"]


def dataloader(dataset, config: PPOConfig, data_collator: Callable | None = None,
               columns: list[str] | None = None) -> DataLoader:
    """Shuffled ``DataLoader`` of ``batch_size`` rows per process (last ragged batch dropped): ``batch_size / G``
    prompts, each ``G = num_generations`` times in a row (``step``'s groups). A ``datasets`` dataset loses the columns
    not in ``columns`` (default :func:`signature_columns`) with ``remove_unused_columns``."""
    if hasattr(dataset, "remove_columns") and config.remove_unused_columns:
        keep = signature_columns() if columns is None else columns
        drop = [c for c in dataset.column_names if c not in keep]
        dataset = dataset.remove_columns(drop) if drop else dataset
    generator = torch.Generator().manual_seed(config.seed)
    size = config.num_generations
    return DataLoader(dataset, batch_size=config.batch_size // size,
                      collate_fn=repeated(data_collator or default_collator, size), shuffle=True, drop_last=True,
                      generator=generator)


def warn_no_dataset(batch_size: int, num_processes: int) -> None:
    """Legacy's warning without a dataset: ``trainer.dataloader`` is None, and ``step`` takes ``batch_size`` samples a
    call (on each process)."""
    message = ("PPOTrainer: no dataset is provided, so trainer.dataloader is None; step() takes config.batch_size "
               f"(now {batch_size}) queries, responses and scores per call, so build the trainer with the batch size "
               "the loop passes")
    if num_processes > 1:
        message += (f", on each of the {num_processes} processes (give each its own share of the data, e.g. with "
                    "trainer.accelerator.prepare(your_dataloader))")
    warnings.warn(message + ".", UserWarning, stacklevel=3)

"""stages/tokenize.py on tiny params (the shared run, see conftest.tiny_run): the prompts truncated, filtered and
round-tripped, and a missing upstream model as one clear error."""

from __future__ import annotations

import pandas as pd
import pytest
from transformers import AutoTokenizer

from stages import tokenize
from stages.artifacts import SFT_MODEL, TOKENIZED_EVAL, TOKENIZED_TRAIN
from stages.runtime import StageError


def test_tokenize_truncates_filters_and_round_trips(tiny_run, tiny_params):
    tokenizer = AutoTokenizer.from_pretrained(tiny_run / SFT_MODEL)
    for path in (TOKENIZED_TRAIN, TOKENIZED_EVAL):
        frame = pd.read_parquet(tiny_run / path)
        assert list(frame.columns) == ["query", "input_ids"] and len(frame)
        lengths = frame["input_ids"].map(len)
        assert lengths.between(tiny_params.tokenize.min_query_tokens, tiny_params.tokenize.max_query_tokens).all()
        assert all(tokenizer.decode(ids) == q for q, ids in zip(frame["query"], frame["input_ids"]))


def test_missing_upstream_model_is_a_clear_error(tiny_params, tmp_path):
    with pytest.raises(StageError, match=r"data/models/sft: no saved model here; run the stage that writes it"):
        tokenize.run(tiny_params, tmp_path)

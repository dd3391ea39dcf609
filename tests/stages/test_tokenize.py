"""stages/tokenize.py on tiny params (the shared run, see conftest.tiny_run): the prompts truncated, filtered and
round-tripped, and a missing upstream model as one clear error."""

from __future__ import annotations

import pandas as pd
import pytest
from transformers import AutoTokenizer

from stages import tokenize
from stages.shared.artifacts import SFT_MODEL, TOKENIZED_EVAL, TOKENIZED_TRAIN
from stages.shared.runtime import StageError


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


def tokenize_params(how: str, limit: int = 4):
    from stages.shared.params import TokenizeParams

    return TokenizeParams(max_query_tokens=limit, truncation=how, min_query_tokens=1)


def test_a_query_over_the_limit_is_refused_by_default_saying_how_many_and_what_to_set(tiny_run):
    tokenizer = AutoTokenizer.from_pretrained(tiny_run / SFT_MODEL)
    ids = tokenizer(["a short one", "my grandmother baked bread every single morning of the week"])["input_ids"]
    limit = len(ids[0])
    with pytest.raises(StageError, match=rf"^prompts.jsonl: 1 of 2 queries have more than tokenize.max_query_tokens="
                                         rf"{limit} tokens \(the longest {len(ids[1])}\); raise it in params.yaml, or "
                                         r"set tokenize.truncation to keep_start, keep_end or drop$"):
        tokenize.fitted(ids, tokenize_params("refuse", limit), tokenizer, "prompts.jsonl", "params.yaml")


def test_truncation_keeps_the_start_or_the_end_or_drops_and_counts_the_cuts(tiny_run):
    tokenizer = AutoTokenizer.from_pretrained(tiny_run / SFT_MODEL)
    text = "my grandmother baked bread every single morning of the week"
    ids = tokenizer(["a short one", text])["input_ids"]
    n = len(ids[0])
    fitted, cut = tokenize.fitted(ids, tokenize_params("keep_start", n), tokenizer, "p", "params.yaml")
    assert fitted == [ids[0], ids[1][:n]] and cut.count == 1 and cut.most == len(ids[1]) - n
    fitted, _ = tokenize.fitted(ids, tokenize_params("keep_end", n), tokenizer, "p", "params.yaml")
    assert fitted == [ids[0], ids[1][-n:]] and tokenizer.decode(fitted[1]).endswith("week")
    fitted, cut = tokenize.fitted(ids, tokenize_params("drop", n), tokenizer, "p", "params.yaml")
    assert fitted == [ids[0]] and cut.count == 0
    assert "1 cut to their first 4 tokens (tokenize.truncation: keep_start; by up to" in \
        tokenize.Cut(1, 3, 0).describe(tokenize_params("keep_start"), 4)


def test_a_cut_through_a_word_is_counted():
    class Chars:  # one token per character: "ab cd" cut at 4 keeps "ab c", through the word "cd"
        all_special_ids = []

        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))

    ids = [list(map(ord, "ab cd")), list(map(ord, "abc de"))]
    _, cut = tokenize.fitted(ids, tokenize_params("keep_start"), Chars(), "p", "params.yaml")
    assert cut == tokenize.Cut(2, 2, 1)  # "abc " ends at a space: not mid-word
    _, cut = tokenize.fitted(ids, tokenize_params("keep_end"), Chars(), "p", "params.yaml")
    assert cut == tokenize.Cut(2, 2, 2)  # "b cd" and "c de" both start inside a word
    Chars.all_special_ids = [ord("^")]  # a BOS stays first when the end is kept
    fitted, _ = tokenize.fitted([list(map(ord, "^ab cd"))], tokenize_params("keep_end"), Chars(), "p", "params.yaml")
    assert "".join(map(chr, fitted[0])) == "^ cd"


def test_the_stage_says_how_many_queries_it_cut_and_by_how_much(tiny_run, tiny_params, tmp_path, capfd):
    """The tiny params keep the start of the synthetic prompts, which their small tokenizer makes longer than 8
    tokens: the summary and a warning say how many were cut, by how much, and which param decides."""
    import shutil

    for part in ("raw", "models/sft"):
        shutil.copytree(tiny_run / "data" / part, tmp_path / "data" / part)
    summary = tokenize.run(tiny_params, tmp_path)
    assert "cut to their first 8 tokens (tokenize.truncation: keep_start; by up to " in summary
    err = capfd.readouterr().err
    assert "warning: data/raw/prompts_train.parquet (data.prompts.source's train prompts): " in err
    assert "tokenize.truncation: refuse stops instead, a larger tokenize.max_query_tokens keeps them whole" in err


def test_held_out_prompts_that_a_cut_makes_training_prompts_are_left_out(tiny_run, tiny_params, tmp_path, capfd):
    """prepare holds out distinct prompts; keep_start can cut two of them to the same first tokens. A held-out prompt
    that becomes a training prompt so is left out of the held-out set, with a warning: none of it is trained on."""
    import dataclasses
    import shutil

    from stages.shared.artifacts import RAW_PROMPTS_EVAL, RAW_PROMPTS_TRAIN, write_parquet

    shutil.copytree(tiny_run / SFT_MODEL, tmp_path / SFT_MODEL)
    write_parquet({"query": ["the film was good", "the plot was slow"]}, tmp_path / RAW_PROMPTS_TRAIN)
    write_parquet({"query": ["the film was dull", "my sister liked the music"]}, tmp_path / RAW_PROMPTS_EVAL)
    tokenizer = AutoTokenizer.from_pretrained(tiny_run / SFT_MODEL)
    limit = len(tokenizer("the film was")["input_ids"])  # "the film was ..." cut to these: one prompt
    cut = dataclasses.replace(tiny_params.tokenize, truncation="keep_start", max_query_tokens=limit, min_query_tokens=1)
    params = dataclasses.replace(tiny_params, tokenize=cut)
    summary = tokenize.run(params, tmp_path)
    train, held_out = (pd.read_parquet(tmp_path / path)["query"].tolist() for path in (TOKENIZED_TRAIN, TOKENIZED_EVAL))
    assert not set(held_out) & set(train) and len(held_out) == 1
    assert "1 left out (training prompts once cut)" in summary
    err = capfd.readouterr().err
    assert "warning: tokenize: 1 held-out prompts are training prompts once tokenized and cut to" in err


def test_a_null_limit_is_what_the_context_leaves_beside_the_response(tiny_run, tiny_params, tmp_path):
    """tokenize.max_query_tokens null (the shipped default): a prompt may take the SFT model's context less
    generation.max_new_tokens, so a user's longer prompts fit without a first failed run."""
    import dataclasses
    import shutil

    from stages.shared.artifacts import RAW_PROMPTS_EVAL, RAW_PROMPTS_TRAIN, write_parquet
    from stages.shared.models import model_context

    shutil.copytree(tiny_run / SFT_MODEL, tmp_path / SFT_MODEL)
    long = "i saw it last week and the acting was good but the plot was slow"
    write_parquet({"query": [long, "the film was"]}, tmp_path / RAW_PROMPTS_TRAIN)
    write_parquet({"query": ["the plot was"]}, tmp_path / RAW_PROMPTS_EVAL)
    params = dataclasses.replace(tiny_params, tokenize=dataclasses.replace(tiny_params.tokenize, truncation="refuse",
                                                                           max_query_tokens=None))
    tokenize.run(params, tmp_path)
    kept = pd.read_parquet(tmp_path / TOKENIZED_TRAIN)
    assert long in kept["query"].tolist()  # over the tiny params' 8 tokens, within the context's room
    room = model_context(tmp_path / SFT_MODEL) - params.generation.max_new_tokens
    assert kept["input_ids"].map(len).max() <= room

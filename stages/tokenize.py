"""tokenize: the PPO prompts tokenized with the policy's tokenizer, as Parquet (`query`, `input_ids`).

Queries longer than tokenize.max_query_tokens keep their first tokens; those shorter than min_query_tokens
are dropped. `query` is the decoded kept tokens, so `query + response` is exactly the text the policy saw.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from ppo_core.utils import set_seed
from stages.artifacts import (
    RAW_PROMPTS_EVAL,
    RAW_PROMPTS_TRAIN,
    SFT_MODEL,
    TOKENIZED_EVAL,
    TOKENIZED_TRAIN,
    publishing,
    read_table,
    require_dir,
    write_parquet,
)
from stages.models import model_context
from stages.params import Params
from stages.runtime import StageError


def run(params: Params, root: Path = Path(".")) -> str:
    set_seed(params.seed)
    tokenizer = AutoTokenizer.from_pretrained(require_dir(root / SFT_MODEL))
    context = model_context(root / SFT_MODEL)
    kept, tables = {}, {}
    for source, target in ((RAW_PROMPTS_TRAIN, TOKENIZED_TRAIN), (RAW_PROMPTS_EVAL, TOKENIZED_EVAL)):
        queries = read_table(root / source, ["query"])["query"].tolist()
        ids = [x[:params.tokenize.max_query_tokens] for x in tokenizer(queries)["input_ids"]]
        ids = [x for x in ids if len(x) >= params.tokenize.min_query_tokens]
        if not ids:
            raise StageError(f"{source}: no query has tokenize.min_query_tokens={params.tokenize.min_query_tokens} "
                             f"tokens; lower it in {params.path}")
        fitting = [x for x in ids if len(x) < context]  # room for at least one response token
        if not fitting:
            raise StageError(f"{source}: all {len(ids)} queries are {context} tokens or longer after truncation, the "
                             f"whole context of {SFT_MODEL}; lower tokenize.max_query_tokens in {params.path}")
        ids = fitting
        tables[target] = {"query": tokenizer.batch_decode(ids, skip_special_tokens=True), "input_ids": ids}
        kept[target.stem] = (len(ids), len(queries))
    with publishing():  # both or neither
        for target, columns in tables.items():
            write_parquet(columns, root / target)
    counts = ", ".join(f"{name}: {n} of {total} queries kept" for name, (n, total) in kept.items())
    return f"{counts} -> {TOKENIZED_TRAIN.parent}"


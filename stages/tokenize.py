"""tokenize: the PPO prompts tokenized with the policy's tokenizer, as Parquet (`query`, `input_ids`).

Queries longer than tokenize.max_query_tokens keep their first tokens; those shorter than min_query_tokens
are dropped. `query` is the decoded kept tokens, so `query + response` is exactly the text the policy saw.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from ppo_core.runtime.utils import set_seed
from stages.artifacts import (
    RAW_PROMPTS_EVAL,
    RAW_PROMPTS_TRAIN,
    SFT_MODEL,
    TOKENIZED_EVAL,
    TOKENIZED_TRAIN,
    TOKENIZER_KEY,
    publishing,
    read_table,
    require_dir,
    tokenizer_digest,
    write_parquet,
)
from stages.models import model_context
from stages.params import Params
from stages.runtime import StageError


def run(params: Params, root: Path = Path(".")) -> str:
    set_seed(params.seed)
    tokenizer = AutoTokenizer.from_pretrained(require_dir(root / SFT_MODEL))
    context = model_context(root / SFT_MODEL)
    made_with = tokenizer_digest(root / SFT_MODEL)  # recorded with the ids: ppo and evaluate check they match
    kept, tables = {}, {}
    for source, target in ((RAW_PROMPTS_TRAIN, TOKENIZED_TRAIN), (RAW_PROMPTS_EVAL, TOKENIZED_EVAL)):
        queries = read_table(root / source, ["query"])["query"].tolist()
        ids = [x[:params.tokenize.max_query_tokens] for x in tokenizer(queries)["input_ids"]]
        ids = [x for x in ids if len(x) >= params.tokenize.min_query_tokens]
        short = len(queries) - len(ids)
        if not ids:
            raise StageError(f"{source}: no query has tokenize.min_query_tokens={params.tokenize.min_query_tokens} "
                             f"tokens; lower it in {params.path}")
        fitting = [x for x in ids if len(x) < context]  # room for at least one response token
        if not fitting:
            raise StageError(f"{source}: all {len(ids)} queries are {context} tokens or longer after truncation, the "
                             f"whole context of {SFT_MODEL}; lower tokenize.max_query_tokens in {params.path}")
        too_long = len(ids) - len(fitting)
        ids = fitting
        tables[target] = {"query": tokenizer.batch_decode(ids, skip_special_tokens=True), "input_ids": ids}
        dropped = {f"shorter than tokenize.min_query_tokens={params.tokenize.min_query_tokens}": short,
                   "filling the whole context": too_long}
        why = ", ".join(f"{n} {reason}" for reason, n in dropped.items() if n)
        kept[target.stem] = f"{len(ids)} of {len(queries)} queries kept" + (f" ({why})" if why else "")
    with publishing():  # both or neither
        for target, columns in tables.items():
            write_parquet(columns, root / target, metadata={TOKENIZER_KEY: made_with})
    return f"{', '.join(f'{name}: {what}' for name, what in kept.items())} -> {TOKENIZED_TRAIN.parent}"


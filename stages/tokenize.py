"""tokenize: the PPO prompts tokenized with the policy's tokenizer, as Parquet (`query`, `input_ids`; where the prompts
are chats, `messages`: each chat as the template formatted it, for the reward functions; then the kept columns).

A query longer than tokenize.max_query_tokens is refused (the default), cut to its first or its last tokens, or
dropped, as tokenize.truncation says; the stage says how many were cut, by how much and how many mid-word. Those
shorter than min_query_tokens are dropped. `query` is the decoded kept tokens, so `query + response` is exactly the
text the policy saw.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from transformers import AutoTokenizer

from ppo_core import set_seed
from stages.shared import chat
from stages.shared.artifacts import (
    CHATS,
    RAW_PROMPTS_EVAL,
    RAW_PROMPTS_TRAIN,
    SFT_MODEL,
    TOKENIZED_EVAL,
    TOKENIZED_TRAIN,
    TOKENIZER_KEY,
    publishing,
    require_dir,
    tokenizer_digest,
    write_parquet,
)
from stages.shared.heldout import kept_columns
from stages.shared.models import model_context
from stages.shared.params import Params, TokenizeParams
from stages.shared.runtime import StageError, warning


class Cut(NamedTuple):
    """The queries a truncation cut: how many, by how many tokens at most, how many of them mid-word."""

    count: int
    most: int
    mid_word: int

    def describe(self, tokenize: TokenizeParams, limit: int) -> str:
        kept = {"keep_start": "first", "keep_end": "last"}[tokenize.truncation]
        return (f"{self.count} cut to their {kept} {limit} tokens (tokenize.truncation: "
                f"{tokenize.truncation}; by up to {self.most} tokens, {self.mid_word} mid-word)")


def fitted(ids: list[list[int]], tokenize: TokenizeParams, tokenizer, source: str, params_path: Path,
           limit: int | None = None) -> tuple[list[list[int]], Cut]:
    """The queries' token ids within ``limit`` tokens (by default ``tokenize.max_query_tokens``) as
    ``tokenize.truncation`` says: ``refuse`` raises a StageError naming how many are longer, ``keep_start`` /
    ``keep_end`` keep their first / last tokens (a leading special token, such as a BOS, stays first), ``drop`` leaves
    them out. Returns the ids and what was cut."""
    limit, how = tokenize.max_query_tokens if limit is None else limit, tokenize.truncation
    over = [x for x in ids if len(x) > limit]
    if not over:
        return ids, Cut(0, 0, 0)
    if how == "refuse":
        setting, fix = (("tokenize.max_query_tokens=", "raise it") if tokenize.max_query_tokens is not None else
                        ("the tokens the model's context leaves beside generation.max_new_tokens, ",
                         "lower generation.max_new_tokens"))
        raise StageError(f"{source}: {len(over)} of {len(ids)} queries have more than {setting}{limit} tokens (the "
                         f"longest {max(map(len, over))}); {fix} in {params_path}, or set tokenize.truncation to "
                         "keep_start, keep_end or drop")
    if how == "drop":
        return [x for x in ids if len(x) <= limit], Cut(0, 0, 0)
    special = set(tokenizer.all_special_ids)
    out, mid_word = [], 0
    for x in ids:
        if len(x) <= limit:
            out.append(x)
            continue
        lead = 1 if x[0] in special and limit > 1 else 0  # a BOS stays where the model expects it
        kept = x[:limit] if how == "keep_start" else x[:lead] + x[len(x) - (limit - lead):]
        mid_word += splits_a_word(tokenizer, x, kept, how)
        out.append(kept)
    return out, Cut(len(over), max(len(x) for x in over) - limit, mid_word)


def query_token_limit(tokenize: TokenizeParams, context: int, max_new_tokens: int) -> int:
    """The most tokens a query may have: tokenize.max_query_tokens, or where it is null the ``context`` (the SFT
    model's, in tokens) less ``max_new_tokens`` (the response's room)."""
    return tokenize.max_query_tokens if tokenize.max_query_tokens is not None else context - max_new_tokens


def without_training_prompts(table: dict[str, list], training: set[str]) -> dict[str, list]:
    """The held-out ``table`` (``query``, ``input_ids``) without the rows whose decoded query is a training prompt:
    prepare splits by distinct prompt, but two prompts cut to the same first (or last) tokens become one."""
    keep = [i for i, query in enumerate(table["query"]) if query not in training]
    return {key: [values[i] for i in keep] for key, values in table.items()}


def splits_a_word(tokenizer, ids: list[int], kept: list[int], how: str) -> bool:
    """Whether cutting ``ids`` to ``kept`` cut through a word: no whitespace on either side of the cut."""
    whole, part = (tokenizer.decode(x, skip_special_tokens=True) for x in (ids, kept))
    if how == "keep_start":
        if not whole.startswith(part) or not part or len(part) == len(whole):
            return False
        return not (part[-1].isspace() or whole[len(part)].isspace())
    if not whole.endswith(part) or not part or len(part) == len(whole):
        return False
    return not (part[0].isspace() or whole[-len(part) - 1].isspace())


def run(params: Params, root: Path = Path(".")) -> str:
    set_seed(params.seed)
    tokenizer = AutoTokenizer.from_pretrained(require_dir(root / SFT_MODEL))
    context = model_context(root / SFT_MODEL)
    limit = query_token_limit(params.tokenize, context, params.generation.max_new_tokens)
    if limit < params.tokenize.min_query_tokens:
        raise StageError(f"{SFT_MODEL}: its {context}-token context leaves {limit} tokens beside "
                         f"generation.max_new_tokens={params.generation.max_new_tokens} for a query, fewer than "
                         f"tokenize.min_query_tokens={params.tokenize.min_query_tokens}; lower max_new_tokens in "
                         f"{params.path}")
    made_with = tokenizer_digest(root / SFT_MODEL)  # recorded with the ids: ppo and evaluate check they match
    kept, tables = {}, {}
    for source, target in ((RAW_PROMPTS_TRAIN, TOKENIZED_TRAIN), (RAW_PROMPTS_EVAL, TOKENIZED_EVAL)):
        queries = chat.read_prompts(root / source)  # query strings, or chats
        chats = chat.templated_chats(queries, params.chat)  # chats: for the reward functions (TRL's format)
        travelling = ({CHATS: chats} if chats is not None else {}) | kept_columns(root / source,
                                                                                  params.data.prompts.keep)
        where = f"{source} (data.prompts.source's {target.stem} prompts)"
        every = chat.prompt_ids(queries, tokenizer, params.chat, str(SFT_MODEL))  # the chat template's where it is on
        ids, cut = fitted(every, params.tokenize, tokenizer, where, params.path, limit)
        rows = [i for i, x in enumerate(every) if len(x) <= limit] if len(ids) < len(every) else range(len(every))
        long = len(queries) - len(ids)
        kept_rows = [(row, x) for row, x in zip(rows, ids) if len(x) >= params.tokenize.min_query_tokens]
        short = len(queries) - long - len(kept_rows)
        if not kept_rows:
            raise StageError(f"{source}: no query has tokenize.min_query_tokens={params.tokenize.min_query_tokens} "
                             f"tokens; lower it in {params.path}")
        fitting = [(row, x) for row, x in kept_rows if len(x) < context]  # room for at least one response token
        if not fitting:
            raise StageError(f"{source}: all {len(kept_rows)} queries are {context} tokens or longer after "
                             f"truncation, the whole context of {SFT_MODEL}; lower tokenize.max_query_tokens in "
                             f"{params.path}")
        too_long = len(kept_rows) - len(fitting)
        ids = [x for _, x in fitting]
        tables[target] = {"query": chat.decoded(tokenizer, ids, chat.templated(queries, params.chat)), "input_ids": ids,
                          **{name: [values[row] for row, _ in fitting] for name, values in travelling.items()}}
        dropped = {f"over {limit} tokens (tokenize.truncation: drop)": long,
                   f"shorter than tokenize.min_query_tokens={params.tokenize.min_query_tokens}": short,
                   "filling the whole context": too_long}
        why = ", ".join(f"{n} {reason}" for reason, n in dropped.items() if n)
        kept[target.stem] = f"{len(ids)} of {len(queries)} queries kept" + (f" ({why})" if why else "")
        if cut.count:
            kept[target.stem] += f", {cut.describe(params.tokenize, limit)}"
            warning(f"{where}: {cut.describe(params.tokenize, limit)}; the policy sees them cut (tokenize.truncation: "
                    f"refuse stops instead, a larger tokenize.max_query_tokens keeps them whole)")
    held_out = without_training_prompts(tables[TOKENIZED_EVAL], set(tables[TOKENIZED_TRAIN]["query"]))
    if len(held_out["query"]) < len(tables[TOKENIZED_EVAL]["query"]):
        gone = len(tables[TOKENIZED_EVAL]["query"]) - len(held_out["query"])
        if not held_out["query"]:
            raise StageError(f"{RAW_PROMPTS_EVAL}: every held-out prompt is a training prompt once tokenized and cut "
                             f"to {limit} tokens; keep prompts whole (tokenize.truncation: refuse, or a larger "
                             f"tokenize.max_query_tokens in {params.path})")
        warning(f"tokenize: {gone} held-out prompts are training prompts once tokenized and cut to {limit} tokens: "
                "left out of the held-out set, which holds no training prompt")
        kept[TOKENIZED_EVAL.stem] += f", {gone} left out (training prompts once cut)"
        tables[TOKENIZED_EVAL] = held_out
    with publishing():  # both or neither
        for target, columns in tables.items():
            write_parquet(columns, root / target, metadata={TOKENIZER_KEY: made_with})
    return f"{', '.join(f'{name}: {what}' for name, what in kept.items())} -> {TOKENIZED_TRAIN.parent}"


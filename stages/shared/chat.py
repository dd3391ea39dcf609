"""Chat prompts and SFT on completions: the row shapes a dataset may take, prompts put in the tokenizer's own chat
template, and SFT examples whose loss is on the completion tokens only.

A chat (a `messages` column) is a list of {role, content} turns; prepare stores it as JSON text (canonical, so the
held-out split compares chats as it compares strings). A prompt goes through the template as the tokenize stage and
sft alike put it, `apply_chat_template(chat, add_generation_prompt=True)` (a chat ending with an assistant turn, a
prefill, is left open for the response to continue: `continue_final_message`, as TRL formats it), so the prompt SFT
trained after is, token for token, the query PPO samples after. SFT on prompt/completion rows (or chats, whose last
turn is the assistant's completion) labels the prompt's tokens -100, as TRL's SFTTrainer does for prompt-completion
data: the loss is the completion's (and its EOS) alone. Plain `text` rows take the path they always took.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from stages.shared.artifacts import read_table
from stages.shared.params import COLUMNS, ChatParams
from stages.shared.runtime import StageError, note

IGNORE = -100  # the label transformers' causal LM loss (CrossEntropyLoss's ignore_index) leaves out
# Each dataset's row shapes, the first the default (COLUMNS'): data.<name>.columns maps the columns of one of them.
SHAPES = {"sft": (COLUMNS["sft"], ("prompt", "completion"), ("messages",)), "pairs": (COLUMNS["pairs"],),
          "prompts": (COLUMNS["prompts"], ("messages",))}


def shape(name: str, columns) -> tuple[str, ...]:
    """The row shape of dataset ``name`` whose columns ``columns`` (ours, e.g. data.sft.columns' keys) all name: the
    first such of ``SHAPES[name]``, else the default (whose missing column the caller names)."""
    return next((s for s in SHAPES[name] if set(s) <= set(columns)), SHAPES[name][0])


def stored_shape(path: Path, name: str) -> tuple[str, ...]:
    """The row shape of the Parquet file ``path`` (an earlier stage's): the default where the file cannot say, so
    that reading it (`read_table`) names the problem."""
    try:
        return shape(name, pq.read_schema(path).names)
    except (pa.ArrowException, OSError):
        return SHAPES[name][0]


def chats_as_json(values, source: str, column: str, ends_with_assistant: bool) -> list[str]:
    """A `messages` column's values (lists of {role, content} objects; a Parquet or hub list arrives as an array) as
    canonical JSON text; a value that is no chat (or, with ``ends_with_assistant``, does not end with the assistant's
    turn, the completion SFT trains on) is an error naming the first such row, counted from 1."""
    out = []
    for row, value in enumerate(values, start=1):
        turns = value.tolist() if hasattr(value, "tolist") else value
        ok = isinstance(turns, list) and turns and all(
            isinstance(t, dict) and isinstance(t.get("role"), str) and isinstance(t.get("content"), str)
            for t in turns)
        if not ok or (ends_with_assistant and turns[-1]["role"] != "assistant"):
            what = "a chat ending with an assistant turn" if ends_with_assistant else "a chat"
            raise StageError(f"{source}: column '{column}' row {row} is not {what} (a list of {{role, content}} "
                             f"objects), got {str(value)[:80]!r}; clean the file")
        out.append(json.dumps([{"role": t["role"], "content": t["content"]} for t in turns], ensure_ascii=False))
    return out


def conversation(prompt: str | list[dict], system_prompt: str | None) -> list[dict]:
    """``prompt`` as a chat (a string: one user turn), with a system turn of ``system_prompt`` first where it has
    none."""
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt is not None and turns[0]["role"] != "system":
        turns = [{"role": "system", "content": system_prompt}, *turns]
    return turns


def check_template(tokenizer, model: str, why: str) -> None:
    """A StageError, one line, where ``tokenizer`` (``model``'s) has no chat template to format prompts with."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise StageError(f"{model}: its tokenizer has no chat template, but {why}; give a model whose tokenizer has "
                         "one (model.name_or_path), or set chat.template: false with plain text rows")


def templated(prompts: list, chat: ChatParams) -> bool:
    """Whether ``prompts`` go through the chat template: chats always, strings where chat.template is on."""
    return chat.template or any(not isinstance(p, str) for p in prompts)


def prompt_ids(prompts: list, tokenizer, chat: ChatParams, model: str) -> list[list[int]]:
    """Token ids of ``prompts`` (strings, or chats: lists of turns): the plain tokenizer's (special tokens as it adds
    them) or, where ``templated``, the chat template's (``template_ids``)."""
    if not templated(prompts, chat):
        return tokenizer(prompts)["input_ids"]
    check_template(tokenizer, model, "chat.template is true" if chat.template else "the rows are chats (messages)")
    return [template_ids(tokenizer, conversation(p, chat.system_prompt)) for p in prompts]


def template_ids(tokenizer, turns: list[dict]) -> list[int]:
    """A chat's token ids by the tokenizer's template, as TRL formats a prompt: the assistant's turn opened after it
    (add_generation_prompt) or, where the chat ends with an assistant turn (a prefill, "Let me think."), that turn
    left open for the response to continue (continue_final_message)."""
    ends_open = turns[-1]["role"] == "assistant"
    return tokenizer.apply_chat_template(turns, add_generation_prompt=not ends_open, continue_final_message=ends_open,
                                         tokenize=True, return_dict=True)["input_ids"]


def decoded(tokenizer, ids: list[list[int]], with_template: bool) -> list[str]:
    """The queries' text: the kept tokens decoded, a template's special tokens kept (`query + response` is then
    what the policy saw); plain prompts without them, as always."""
    return tokenizer.batch_decode(ids, skip_special_tokens=not with_template)


def read_prompts(path: Path) -> list:
    """The prompts of prepare's table ``path``: query strings, or chats (lists of turns)."""
    column = stored_shape(path, "prompts")[0]
    values = read_table(path, [column])[column].tolist()
    return [json.loads(v) for v in values] if column == "messages" else values


def templated_chats(prompts: list, chat: ChatParams) -> list[str] | None:
    """Where ``prompts`` are chats, each as the template formats it (``conversation``: chat.system_prompt's turn
    first where it has no system turn), as canonical JSON text; None for query strings (templated or not)."""
    if all(isinstance(p, str) for p in prompts):
        return None
    return [json.dumps(conversation(p, chat.system_prompt), ensure_ascii=False) for p in prompts]


def read_sft(path: Path) -> dict[str, list]:
    """prepare's SFT table: {text}, {prompt, completion}, or {prompt, completion} made of chats (the turns before the
    last, and the last's content)."""
    columns = stored_shape(path, "sft")
    table = {c: values.tolist() for c, values in read_table(path, list(columns)).items()}
    if columns != ("messages",):
        return table
    chats = [json.loads(v) for v in table["messages"]]
    return {"prompt": [c[:-1] for c in chats], "completion": [c[-1]["content"] for c in chats]}


def tokenizer_texts(table: dict[str, list]) -> list[str]:
    """The texts a tokenizer trained from scratch learns from: the SFT texts, or each row's prompt and completion."""
    if "text" in table:
        return table["text"]
    prompts = [p if isinstance(p, str) else " ".join(t["content"] for t in p) for p in table["prompt"]]
    return [p + c for p, c in zip(prompts, table["completion"])]


def completion_example(prompt: list[int], completion: list[int], eos: int, max_length: int) -> dict | None:
    """One SFT example of at most ``max_length`` tokens: ``prompt + completion`` (cut at its end) + EOS as input,
    labels IGNORE on the prompt's positions (the loss is the completion's and EOS's); None where the prompt leaves
    no room for a completion token."""
    ids = (prompt + completion)[:max_length - 1]
    if len(ids) <= len(prompt):
        return None
    return {"input_ids": ids + [eos], "labels": [IGNORE] * len(prompt) + ids[len(prompt):] + [eos]}


def sft_examples(table: dict[str, list], tokenizer, max_length: int, chat: ChatParams, model: str):
    """The causal LM's SFT examples and their collator: plain texts each whole (+ EOS) under the LM collator, as
    always; prompt/completion rows with the loss on the completion only (``completion_example``), padded with labels
    IGNORE."""
    from transformers import DataCollatorForLanguageModeling, DataCollatorForSeq2Seq

    if "text" in table:
        ids = tokenizer(table["text"], truncation=True, max_length=max_length - 1)["input_ids"]
        return ([{"input_ids": x + [tokenizer.eos_token_id]} for x in ids],
                DataCollatorForLanguageModeling(tokenizer, mlm=False))
    prompts = prompt_ids(table["prompt"], tokenizer, chat, model)
    completions = tokenizer(table["completion"], add_special_tokens=False)["input_ids"]
    examples = [completion_example(p, c, tokenizer.eos_token_id, max_length) for p, c in zip(prompts, completions)]
    if None in examples:
        note(f"sft: {examples.count(None)} of {len(examples)} prompts fill sft.max_length={max_length} tokens, leaving "
             "no room for their completion: left out")
    kept = [x for x in examples if x is not None]
    if not kept:
        raise StageError(f"every prompt fills sft.max_length={max_length} tokens; raise sft.max_length")
    return kept, DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE)

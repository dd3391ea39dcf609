"""stages/shared/chat.py through the stages that use it: prompts in the tokenizer's own chat template (tokenize), chats
through prepare, and SFT on prompt/completion rows with the loss on the completion tokens only."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pandas as pd
import pytest
import torch
from transformers import AutoTokenizer

from stages import prepare, sft, tokenize
from stages.shared import chat
from stages.shared.artifacts import (
    CHATS,
    RAW_PROMPTS_EVAL,
    RAW_PROMPTS_TRAIN,
    RAW_SFT,
    SFT_METRICS,
    SFT_MODEL,
    TOKENIZED_EVAL,
    TOKENIZED_TRAIN,
)
from stages.shared.params import ChatParams, DatasetSpec
from stages.shared.runtime import StageError
from tests.tiny import EOS, tiny_causal_lm, tiny_tokenizer

# A small template of our own (the tiny tokenizers have none): a special token opens each turn, as real ones do.
TEMPLATE = ("{% for m in messages %}<|endoftext|>{{ m.role }}: {{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|endoftext|>assistant:{% endif %}")
TRAIN, HELD_OUT = ["the movie was", "a slow film", "the cast", "i liked it"], ["the plot was", "music"]
OFF, ON = ChatParams(template=False, system_prompt=None), ChatParams(template=True, system_prompt="be brief")


def with_chat_model(tiny_run, root):
    """``root`` holding the tiny SFT model whose tokenizer has ``TEMPLATE``; returns that tokenizer."""
    shutil.copytree(tiny_run / SFT_MODEL, root / SFT_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(root / SFT_MODEL)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(root / SFT_MODEL)
    return AutoTokenizer.from_pretrained(root / SFT_MODEL)


def templated_ids(tokenizer, turns: list[dict]) -> list[int]:
    encoded = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=True)
    return encoded["input_ids"]


def tokenize_params(tiny_params, template: ChatParams):
    room = dataclasses.replace(tiny_params.tokenize, max_query_tokens=None, truncation="refuse")
    return dataclasses.replace(tiny_params, chat=template, tokenize=room)


def test_a_query_with_the_template_on_is_what_apply_chat_template_makes(tiny_run, tiny_params, tmp_path):
    tokenizer = with_chat_model(tiny_run, tmp_path)
    for path, queries in ((RAW_PROMPTS_TRAIN, TRAIN), (RAW_PROMPTS_EVAL, HELD_OUT)):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        pd.DataFrame({"query": queries}).to_parquet(tmp_path / path)
    tokenize.run(tokenize_params(tiny_params, ON), tmp_path)
    for path, queries in ((TOKENIZED_TRAIN, TRAIN), (TOKENIZED_EVAL, HELD_OUT)):
        table = pd.read_parquet(tmp_path / path)
        expected = [templated_ids(tokenizer, [{"role": "system", "content": "be brief"},
                                              {"role": "user", "content": q}]) for q in queries]
        assert [list(x) for x in table["input_ids"]] == expected
        # query is the decoded prompt, the template's special tokens kept: query + response is what the policy saw
        assert table["query"].tolist() == [tokenizer.decode(x) for x in expected]
        assert table["query"][0] == f"<|endoftext|>system: be brief\n<|endoftext|>user: {queries[0]}\n" \
                                    "<|endoftext|>assistant:"


def test_the_template_off_tokenizes_the_query_as_it_is(tiny_run, tiny_params, tmp_path):
    tokenizer = with_chat_model(tiny_run, tmp_path)
    assert chat.prompt_ids(TRAIN, tokenizer, OFF, "m") == tokenizer(TRAIN)["input_ids"]


def test_chats_go_through_prepare_and_the_template(tiny_run, tiny_params, tmp_path):
    """A prompts file of chats (`messages`): prepare keeps them, tokenize formats each with the template, chat.template
    off as on (its own system turn kept; the system prompt goes to the chats that have none)."""
    chats = [[{"role": "user", "content": f"film {i}"}] for i in range(12)]
    chats[0] = [{"role": "system", "content": "rate"}, *chats[0]]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"turns": c}) + "\n" for c in chats))
    prompts = DatasetSpec(source=str(tmp_path / "chats.jsonl"), split="train", columns={"messages": "turns"}, n=None)
    prepare.run(dataclasses.replace(tiny_params, data=dataclasses.replace(tiny_params.data, prompts=prompts)), tmp_path)
    raw = pd.concat([pd.read_parquet(tmp_path / p) for p in (RAW_PROMPTS_TRAIN, RAW_PROMPTS_EVAL)])
    assert list(raw.columns) == ["messages"] and sorted(map(json.loads, raw["messages"]), key=str) == \
        sorted(chats, key=str)

    tokenizer = with_chat_model(tiny_run, tmp_path)
    tokenize.run(tokenize_params(tiny_params, ChatParams(template=False, system_prompt="hi")), tmp_path)
    for raw, tokenized in ((RAW_PROMPTS_TRAIN, TOKENIZED_TRAIN), (RAW_PROMPTS_EVAL, TOKENIZED_EVAL)):
        chats = [json.loads(m) for m in pd.read_parquet(tmp_path / raw)["messages"]]
        system = {"role": "system", "content": "hi"}
        expected = [templated_ids(tokenizer, c if c[0]["role"] == "system" else [system, *c]) for c in chats]
        assert [list(x) for x in pd.read_parquet(tmp_path / tokenized)["input_ids"]] == expected


def test_a_messages_column_that_is_not_chats_is_one_line(tiny_params, tmp_path):
    (tmp_path / "chats.jsonl").write_text(json.dumps({"m": [{"role": "user", "content": "hi"}]}) + "\n"
                                          + json.dumps({"m": "hello"}) + "\n")
    spec = DatasetSpec(source="chats.jsonl", split="train", columns={"messages": "m"}, n=None)
    with pytest.raises(StageError, match=r"^chats.jsonl: column 'm' row 2 is not a chat \(a list of \{role, content\} "
                                         r"objects\), got 'hello'; clean the file$"):
        chat.chats_as_json(pd.read_json(tmp_path / "chats.jsonl", lines=True)["m"], spec.source, "m", False)


def completion_only_loss(model, ids: list[int], n_prompt: int) -> torch.Tensor:
    """The mean cross-entropy of the tokens after the first ``n_prompt`` (the completion and EOS) given all before
    them, computed from the logits by hand."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.nn.functional.cross_entropy(logits[n_prompt - 1:-1], torch.tensor(ids[n_prompt:]))


def test_the_sft_loss_is_the_completion_s_alone():
    """Prompt/completion rows: labels -100 on the prompt's tokens, so the model's loss on a batch (padded by the
    collator) is the completions' cross-entropy; were the prompt's tokens counted, it would be the whole text's."""
    tokenizer, model = tiny_tokenizer(), tiny_causal_lm().eval()
    table = {"prompt": ["w5 w6 w7 w8 w9", "w10 w11"], "completion": ["w20 w21", "w30 w31 w32"]}
    examples, collator = chat.sft_examples(table, tokenizer, 40, OFF, "tiny")
    assert examples[0] == {"input_ids": [5, 6, 7, 8, 9, 20, 21, EOS], "labels": [-100] * 5 + [20, 21, EOS]}
    with torch.no_grad():
        losses = [model(**collator([x])).loss for x in examples]
        batch = collator(examples)  # padded: the shorter row's padding is -100 too
        per_token = model(**batch).loss
    for x, n_prompt, loss in zip(examples, (5, 2), losses):
        assert loss == pytest.approx(float(completion_only_loss(model, x["input_ids"], n_prompt)), abs=1e-6)
        assert loss != pytest.approx(float(completion_only_loss(model, x["input_ids"], 1)), abs=1e-3)  # whole text
    # the batch's loss: the mean over the 3 + 4 completion tokens, none of the prompts' or the padding's
    assert float(per_token) == pytest.approx((3 * float(losses[0]) + 4 * float(losses[1])) / 7, abs=1e-6)


def test_a_templated_sft_prompt_is_the_query_ppo_gets(tiny_run, tmp_path):
    """With chat.template on, an SFT prompt's tokens are the tokenize stage's for that query, all of them labelled
    -100; a chat's last (assistant) turn is the completion."""
    tokenizer = with_chat_model(tiny_run, tmp_path)
    table = {"prompt": ["the movie was"], "completion": [" good"]}
    (example,), _ = chat.sft_examples(table, tokenizer, 40, ON, "m")
    query = chat.prompt_ids(["the movie was"], tokenizer, ON, "m")[0]
    completion = tokenizer(" good", add_special_tokens=False)["input_ids"]
    assert example["input_ids"] == query + completion + [tokenizer.eos_token_id]
    assert example["labels"] == [-100] * len(query) + completion + [tokenizer.eos_token_id]
    messages = [{"role": "user", "content": "the movie was"}, {"role": "assistant", "content": " good"}]
    (tmp_path / "raw").mkdir()
    pd.DataFrame({"messages": [json.dumps(messages)]}).to_parquet(tmp_path / "raw" / "sft.parquet")
    as_chat = chat.read_sft(tmp_path / "raw" / "sft.parquet")
    assert chat.sft_examples(as_chat, tokenizer, 40, ON, "m")[0] == [example]


def test_a_prompt_that_fills_max_length_is_left_out_and_said(capfd):
    tokenizer = tiny_tokenizer()
    table = {"prompt": ["w5 w6 w7 w8", "w5"], "completion": ["w9", "w9 w10 w11 w12"]}
    examples, _ = chat.sft_examples(table, tokenizer, 5, OFF, "tiny")
    assert examples == [{"input_ids": [5, 9, 10, 11, EOS], "labels": [-100, 9, 10, 11, EOS]}]  # cut at its end
    assert "note: sft: 1 of 2 prompts fill sft.max_length=5 tokens" in capfd.readouterr().err


def test_sft_trains_on_prompt_completion_rows(tiny_params, tmp_path):
    """The stage end to end on a prompts file of prompt/completion rows (a tokenizer trained from scratch on them)."""
    rows = [{"q": f"question {i} is", "a": f" answer {i % 7}."} for i in range(40)]
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = DatasetSpec(source=str(tmp_path / "pc.jsonl"), split="train", columns={"prompt": "q", "completion": "a"},
                       n=None)
    params = dataclasses.replace(tiny_params, data=dataclasses.replace(tiny_params.data, sft=spec))
    prepare.run(params, tmp_path)
    assert list(pd.read_parquet(tmp_path / RAW_SFT).columns) == ["prompt", "completion"]
    sft.run(params, tmp_path)
    assert json.loads((tmp_path / SFT_METRICS).read_text())["n_train"] == 38


def test_a_reward_function_gets_chats_in_trl_s_conversational_format():
    """Prompts that are chats: ``prompts`` each its chat and ``completions`` each ``[{"role": "assistant", "content":
    response}]``, as TRL's GRPOTrainer calls reward functions on conversational data; the chat column itself is no
    keyword argument. Plain queries (templated or not) stay strings."""
    from stages.shared.scoring import Row, row_arguments

    turns = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"q{i}"}] for i in range(3)]
    row = Row(["<t>q0", "<t>q1", "<t>q2"], ["a0", "a1", "a2"], {CHATS: [json.dumps(t) for t in turns],
                                                                 "answer": [0, 1, 2]})

    def reward(prompts, completions, **kwargs):
        return [0.0] * len(completions)

    arguments = row_arguments(reward, row)
    assert arguments["prompts"] == turns
    assert arguments["completions"] == [[{"role": "assistant", "content": f"a{i}"}] for i in range(3)]
    assert arguments["answer"] == [0, 1, 2] and CHATS not in arguments
    assert row_arguments(reward, row.sliced(1, 2))["prompts"] == turns[1:2]
    plain = Row(["q0"], ["a0"], {"answer": [0]})
    assert row_arguments(reward, plain)["prompts"] == ["q0"] and row_arguments(reward, plain)["completions"] == ["a0"]
    # a prefill (the chat ends with the assistant's turn, which the response continued): TRL moves it to the completion
    prefilled = Row(["<t>q0 Let me"], [" think."], {CHATS: [json.dumps([*turns[0], {"role": "assistant",
                                                                                     "content": "Let me"}])]})
    arguments = row_arguments(reward, prefilled)
    assert arguments["prompts"] == [turns[0]]
    assert arguments["completions"] == [[{"role": "assistant", "content": "Let me think."}]]


def test_a_chat_that_ends_with_an_assistant_turn_is_left_open_for_the_response(tiny_run, tmp_path):
    """A prefill: the template's text up to the end of the assistant's turn, as apply_chat_template's
    continue_final_message (TRL's formatting of such a prompt) gives it; any other chat opens the assistant's turn."""
    tokenizer = with_chat_model(tiny_run, tmp_path)
    asked = [{"role": "user", "content": "the movie was"}]
    prefilled = [*asked, {"role": "assistant", "content": "I think it"}]
    ids = chat.prompt_ids([asked, prefilled], tokenizer, OFF, "m")
    assert ids[0] == templated_ids(tokenizer, asked)
    assert ids[1] == tokenizer.apply_chat_template(prefilled, continue_final_message=True, tokenize=True,
                                                   return_dict=True)["input_ids"]
    assert tokenizer.decode(ids[1]).endswith("<|endoftext|>assistant: I think it")


CONVERSATIONAL = '''
SEEN = []

def longer(completions, prompts, **kwargs):
    """TRL's test of a reward function on conversational data: the completion's content read as TRL gives it."""
    contents = [completion[0]["content"] for completion in completions]
    SEEN.append((prompts, completions, kwargs))
    return [float(len(content)) for content in contents]
'''


def test_chat_prompts_reach_the_reward_functions_as_chats_through_ppo_and_evaluate(tiny_run, tiny_params, tmp_path,
                                                                                   monkeypatch):
    """A prompts file of chats: tokenize keeps each chat as the template formatted it, and the ppo steps, the held-out
    watch and evaluate (its pass@k samples too) call a reward function written for TRL's conversational format with
    each response's own prompt chat and its text as the assistant's turn; the rollouts and the samples hold the chat."""
    from stages import evaluate, ppo
    from stages.shared.artifacts import EVAL_SAMPLES
    from tests.stages.test_columns import written_module

    rewards = written_module("chat_rewards", CONVERSATIONAL, tmp_path, monkeypatch)
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints", "ppo", "eval", "report", "logs"))
    shutil.rmtree(root / SFT_MODEL)
    with_chat_model(tiny_run, root)
    chats = [[{"role": "user", "content": f"the film {i} was"}] for i in range(40)]
    chats[0] = [{"role": "system", "content": "rate"}, *chats[0]]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"turns": c}) + "\n" for c in chats))
    prompts = DatasetSpec(source=str(tmp_path / "chats.jsonl"), split="train", columns={"messages": "turns"}, n=None)
    params = tokenize_params(tiny_params, ChatParams(template=False, system_prompt="be brief"))
    params = dataclasses.replace(
        params, data=dataclasses.replace(params.data, prompts=prompts),
        scorer=dataclasses.replace(params.scorer, source="callable", name="chat_rewards:longer", input="response"),
        ppo={**params.ppo, "advantage_estimator": "grpo", "num_generations": 2},
        evaluate=dataclasses.replace(params.evaluate, samples_per_prompt=2, pass_at_k=[1, 2], success_threshold=1.0))
    prepare.run(params, root)
    tokenize.run(params, root)
    system = {"role": "system", "content": "be brief"}
    tokenizer = AutoTokenizer.from_pretrained(root / SFT_MODEL)
    for raw, path in ((RAW_PROMPTS_TRAIN, TOKENIZED_TRAIN), (RAW_PROMPTS_EVAL, TOKENIZED_EVAL)):
        table = pd.read_parquet(root / path)
        formatted = [json.loads(m) for m in table[CHATS]]  # the chat the template formatted, row by row
        given = [json.loads(m) for m in pd.read_parquet(root / raw)["messages"]]
        assert formatted == [c if c[0]["role"] == "system" else [system, *c] for c in given]
        assert [list(x) for x in table["input_ids"]] == [templated_ids(tokenizer, c) for c in formatted]

    def paired(table: pd.DataFrame, seen: set[tuple[str, str]]):
        """Each row's query is the template's text of its own chat, and the reward saw that chat with its response."""
        expected = [tokenizer.decode(templated_ids(tokenizer, json.loads(t))) for t in table[CHATS]]
        assert table["query"].tolist() == expected
        assert {(json.dumps(json.loads(t)), r) for t, r in zip(table[CHATS], table["response"])} <= seen
        assert table["score"].tolist() == [float(len(r)) for r in table["response"]]  # the content is the response

    ppo.run(params, root)
    evaluate.run(params, root)
    assert len(rewards.SEEN) > params.ppo_config.total_ppo_epochs + 1  # the steps, the watch, evaluate's calls
    seen = set()
    for prompts_seen, completions, kwargs in rewards.SEEN:
        assert CHATS not in kwargs and len(prompts_seen) == len(completions)
        assert all(len(c) == 1 and c[0]["role"] == "assistant" and isinstance(c[0]["content"], str)
                   for c in completions)
        assert all(p[0]["role"] == "system" and p[-1]["role"] == "user" for p in prompts_seen)
        seen |= {(json.dumps(p), c[0]["content"]) for p, c in zip(prompts_seen, completions)}
    paired(pd.concat(pd.read_parquet(p) for p in sorted((root / "data" / "ppo" / "rollouts").glob("*.parquet"))), seen)
    paired(pd.read_parquet(root / EVAL_SAMPLES), seen)


def test_only_chat_prompts_reserve_the_name_messages(tiny_params):
    """Chats travel under `messages`: chat prompts cannot keep a column of that name, plain queries can."""
    from ppo_core.fields import ConfigError
    from stages.shared.checks import check_values

    def keeping(columns: dict):
        spec = DatasetSpec(source="p.jsonl", split="train", columns=columns, n=None, keep=["messages"])
        return dataclasses.replace(tiny_params, data=dataclasses.replace(tiny_params.data, prompts=spec))

    check_values(keeping({"query": "q"}))
    with pytest.raises(ConfigError, match=r"data.prompts.keep must be names other than 'messages' with chat prompts"):
        check_values(keeping({"messages": "turns"}))

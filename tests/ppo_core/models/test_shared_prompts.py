"""A batch's copies of a query prefilled once (``generate_batched(share_prompts=True)``: a group estimator's
``num_generations`` samples of a prompt, evaluate's pass@k samples): the same tokens as one prefill per row, the prompt
run once per distinct query, and only where transformers' dynamic cache is the cache."""

from __future__ import annotations

import pytest
import torch

from ppo_core.models.generation import can_share_prompts, distinct_rows, generate_batched
from tests.ppo_core.test_trainer import make_trainer
from tests.tiny import random_queries, randomize_lora, tiny_causal_lm, tiny_lora_config, tiny_tokenizer

torch.set_num_threads(1)  # tiny models: extra threads only add spin-up cost

SAMPLED = dict(max_new_tokens=8, do_sample=True, top_k=0)


def grouped_queries() -> list[torch.Tensor]:
    """Nine queries of mixed lengths (left padding differs between them), five distinct: groups of 3, 1, 2, 2 and 1."""
    q = random_queries(5, seed=1, min_len=2, max_len=7)
    return [q[0]] * 3 + [q[1]] + [q[2]] * 2 + [q[3], q[3], q[4]]


def sampled(lm, queries, share: bool, seed: int = 0, **kwargs) -> list[list[int]]:
    torch.manual_seed(seed)
    out = generate_batched(lm, tiny_tokenizer(), queries, "cpu", None, len(queries), kwargs.pop("return_prompt", False),
                           {**SAMPLED, **kwargs}, share_prompts=share)
    return [r.tolist() for r in out]


def prefill_rows(lm, run) -> int:
    """The rows of ``lm``'s first forward pass within ``run()``: the prefill's batch."""
    rows = []
    handle = lm.get_input_embeddings().register_forward_hook(lambda module, args, out: rows.append(args[0].shape[0]))
    try:
        run()
    finally:
        handle.remove()
    return rows[0]


def test_distinct_rows_gives_each_query_s_first_row_and_tells_padding_apart():
    ids = torch.tensor([[0, 5, 6], [7, 8, 9], [0, 5, 6], [0, 5, 6], [7, 8, 9]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])  # row 3: a real token 0, not padding
    firsts, inverse = distinct_rows(ids, mask)
    assert sorted(firsts.tolist()) == [0, 1, 3]
    assert firsts[inverse].tolist() == [0, 1, 0, 3, 1]  # each row's own distinct query
    assert distinct_rows(ids[:2], mask[:2]) is None  # nothing to share


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gpt_neox"])
def test_a_shared_prefill_samples_the_tokens_one_prefill_per_row_samples(arch):
    """Float64, so that rounding (other shapes of the same sums) cannot move a draw: the same random numbers pick the
    same tokens, sampled and greedy, responses alone and with their prompts."""
    lm = tiny_causal_lm(arch).double().eval()
    queries = grouped_queries()
    for seed in range(3):
        assert sampled(lm, queries, True, seed) == sampled(lm, queries, False, seed)
    assert sampled(lm, queries, True, do_sample=False) == sampled(lm, queries, False, do_sample=False)
    with_prompt = sampled(lm, queries, True, return_prompt=True)
    assert with_prompt == sampled(lm, queries, False, return_prompt=True)
    assert all(row[:len(q)] == q.tolist() for row, q in zip(with_prompt, queries))


def test_a_lora_policy_shares_its_prompts_with_the_same_tokens():
    from peft import get_peft_model

    lm = get_peft_model(tiny_causal_lm("gpt2"), tiny_lora_config()).double().eval()
    randomize_lora(lm)
    queries = grouped_queries()
    assert sampled(lm, queries, True) == sampled(lm, queries, False)
    assert prefill_rows(lm, lambda: sampled(lm, queries, True)) == 5


def test_the_prompt_runs_once_per_distinct_query():
    lm = tiny_causal_lm("llama").eval()
    queries = grouped_queries()
    assert prefill_rows(lm, lambda: sampled(lm, queries, True)) == 5
    assert prefill_rows(lm, lambda: sampled(lm, queries, False)) == 9
    distinct = random_queries(4, seed=2)
    assert prefill_rows(lm, lambda: sampled(lm, distinct, True)) == 4  # nothing shared: generate's own prefill


def test_only_transformers_dynamic_cache_of_a_decoder_only_model_is_shared():
    lm = tiny_causal_lm("gpt2")
    assert can_share_prompts(lm, {}, False) and can_share_prompts(lm, {"cache_implementation": "dynamic"}, False)
    assert not can_share_prompts(lm, {"cache_implementation": "static"}, False)  # generate allocates and compiles it
    assert not can_share_prompts(lm, {"past_key_values": object()}, False)  # the caller's own cache
    assert not can_share_prompts(lm, {"cache": object()}, False)
    assert not can_share_prompts(lm, {}, True)  # an encoder-decoder's prompt is the encoder's, run once anyway
    lm.generation_config.cache_implementation = "static"
    assert not can_share_prompts(lm, {}, False)  # the model's own setting, which generate would clash with


def test_a_dynamic_cache_named_in_the_call_is_the_shared_one():
    """The ppo stage names ``cache_implementation: dynamic`` on a CPU; transformers refuses it beside a cache given."""
    lm = tiny_causal_lm("gpt2").double().eval()
    queries = grouped_queries()
    dynamic = dict(cache_implementation="dynamic")
    assert sampled(lm, queries, True, **dynamic) == sampled(lm, queries, False, **dynamic)
    assert prefill_rows(lm, lambda: sampled(lm, queries, True, **dynamic)) == 5


@pytest.mark.parametrize("num_generations, rows", [(3, 5), (1, 9)])
def test_the_trainer_prefills_a_group_s_prompt_once_only_with_num_generations(num_generations, rows):
    """``num_generations`` > 1 shares (a group estimator's samples of a prompt); 1 samples as legacy TRL did, one
    prefill per query."""
    estimator = "grpo" if num_generations > 1 else "gae"
    trainer = make_trainer(advantage_estimator=estimator, num_generations=num_generations, batch_size=9,
                           mini_batch_size=3)
    lm = trainer.model.pretrained_model
    run = lambda: trainer.generate(grouped_queries(), batch_size=9, return_prompt=False, **SAMPLED)  # noqa: E731
    assert prefill_rows(lm, run) == rows

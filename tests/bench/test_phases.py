"""bench/phases.py's FLOP counts and bench/grpo_trl.py's prompts, checked by hand on small cases (the benchmarks
themselves need the real model and the TRL venvs: not part of the suite)."""

from __future__ import annotations

import math
import sys

from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import common
import grpo_trl
import phases

# a one-layer toy: H 4, MLP 8, V 10, KV width 2
DIMS = {"H": 4, "I": 8, "L": 1, "V": 10, "K": 2}


def test_block_flops_counts_each_projection_and_attention():
    # per token: q and o 2 * 4 * 4 each, k and v 2 * 4 * 2 each, gate/up/down 2 * 4 * 8 each = 64 + 32 + 192 = 288;
    # attention over 3 positions: scores and weighted values, 2 * 4 * 3 each = 48
    assert phases.block_flops(DIMS, tokens=1, context=3) == 288 + 48
    assert phases.block_flops(DIMS, tokens=5, context=0) == 5 * 288


def test_step_flops_of_one_query_by_hand():
    setting = common.Setting(batch_size=1, mini_batch_size=1, ppo_epochs=2, max_new_tokens=2)
    flops = phases.step_flops(DIMS, setting, query_lengths=[3])
    head = 2 * 4 * 10  # one logit row
    prefill = 3 * (288 + 4 * 4 * 1.5)  # 3 positions over 1.5 on average
    decode = 288 + 4 * 4 * 3  # the second new token, over the 3 query positions (the first came from the prefill)
    assert flops["generate"] == prefill + decode + 2 * head
    forward = 5 * (288 + 4 * 4 * 2.5) + 2 * head  # query + response, logits for the 2 response tokens
    assert flops["log-probs"] == 2 * forward  # policy and reference
    assert flops["update"] == 2 * 3 * forward  # 2 epochs of forward + backward


def test_group_flops_repeat_the_first_prompts():
    setting = common.Setting(batch_size=4, mini_batch_size=2, max_new_tokens=2)
    grouped = phases.step_flops(DIMS, setting, query_lengths=[3, 5, 7, 9], group=2)
    assert grouped == phases.step_flops(DIMS, setting, query_lengths=[3, 3, 5, 5])


def test_trl_grpo_prompts_tokenize_back_to_the_rounds_queries():
    """TRL's GRPOTrainer takes text: each round's prompts, through the benchmark tokenizer, are the token ids that
    ppo_step.py's grpo round samples from (its first batch / G queries)."""
    setting = common.setting_for("smollm2")
    tokenizer = common.build_tokenizer(1000)
    queries = common.make_queries(3, 1000, setting)
    prompts = grpo_trl.prompts_of_round(3, 1000, setting)
    assert len(prompts) == setting.batch_size // grpo_trl.GROUP_SIZE
    assert [tokenizer(p)["input_ids"] for p in prompts] == [q.tolist() for q in queries[: len(prompts)]]


def test_parameter_shapes_are_the_value_head_model_s_weights_by_hand():
    # embedding (tied LM head) 10 x 4 = 40; a layer: q 16, k 8, v 8, o 16, gate 32, up 32, down 32, two norms 4 + 4 =
    # 152; the final norm 4; the value head 4 + 1
    shapes = phases.parameter_shapes(DIMS)
    assert sum(math.prod(s) for s in shapes) == 40 + 152 + 4 + 5
    assert shapes[0] == (10, 4) and len(shapes) == 1 + 9 + 3

"""ppo_core.algo.advantages: a step's advantages by the estimator's function (``step_advantages``), the loss mask, the
policy loss's reduction and the KL loss term, from a PPOConfig, on small hand-computed tensors. The registry's side
(which estimator takes which settings, a user's own estimator) is ``test_registry.py``."""

from __future__ import annotations

import math
import types

import pytest
import torch

from ppo_core import PPOConfig
from ppo_core.algo.advantages import (
    kl_loss,
    loss_mask,
    loss_reduction,
    overlong_penalties,
    sequence_advantages,
    step_advantages,
)
from ppo_core.algo.ppo_math import Divisors
from ppo_core.runtime.distributed import SingleProcess

F64 = torch.float64


def batch_of(scores, lengths=None, kls=None):
    """A StepBatch's tensors: ``scores`` (B,), responses of ``lengths`` tokens (default 1 each)."""
    scores = torch.tensor(scores, dtype=F64)
    lengths = lengths or [1] * len(scores)
    width = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths], dtype=F64)
    kls = torch.zeros_like(mask) if kls is None else torch.tensor(kls, dtype=F64)
    return scores, kls, torch.zeros_like(mask), mask


def advantages_of(estimator, scores, size, lengths=None, kls=None, kl_coef=0.0, **options):
    config = PPOConfig(advantage_estimator=estimator, num_generations=size, batch_size=len(scores),
                       mini_batch_size=len(scores), **options)
    scores, kls, values, mask = batch_of(scores, lengths, kls)
    shaped, adv = step_advantages(config, scores, kls, values, mask, kl_coef, SingleProcess(torch.device("cpu")))
    return shaped, adv.advantages


@pytest.mark.parametrize("estimator", ["grpo", "dapo", "gspo", "cispo"])
def test_grpo_s_advantages_by_hand(estimator):
    # group 1: scores 1, 3: mean 2, unbiased std sqrt(2); group 2: equal scores, no signal
    _, got = advantages_of(estimator, [1.0, 3.0, 0.5, 0.5], 2)
    s = 1 / (math.sqrt(2) + 1e-4)
    torch.testing.assert_close(got[:, 0], torch.tensor([-s, s, 0.0, 0.0], dtype=F64))


def test_dr_grpo_rloo_by_hand():
    torch.testing.assert_close(advantages_of("dr_grpo", [1.0, 3.0, 0.5, 0.5], 2)[1][:, 0],
                               torch.tensor([-1.0, 1.0, 0.0, 0.0], dtype=F64))
    # A_i = r_i - mean of the other two: 1 - 4 = -3 ; 2 - 3.5 = -1.5 ; 6 - 1.5 = 4.5
    torch.testing.assert_close(advantages_of("rloo", [1.0, 2.0, 6.0], 3)[1][:, 0],
                               torch.tensor([-3.0, -1.5, 4.5], dtype=F64))


def test_reinforce_plus_plus_baseline_centres_on_the_group_before_whitening():
    """Without the centring (a mutation that survived the suite before), the whitened returns of these scores differ:
    3, 1, 10, 12 whiten to other values than their centred 1, -1, -1, 1."""
    _, got = advantages_of("reinforce_plus_plus_baseline", [3.0, 1.0, 10.0, 12.0], 2)
    w = 1 / math.sqrt(4 / 3 + 1e-8)  # centred 1, -1, -1, 1: mean 0, unbiased variance 4/3
    torch.testing.assert_close(got[:, 0], torch.tensor([w, -w, -w, w], dtype=F64))


def test_reinforce_plus_plus_shapes_the_kl_into_every_token():
    # one 2-token response and one of 1, kl coefficient 0.5: rewards [-0.5*1, -0.5*2 + 4] ; [-0.5*4 + 0]
    shaped, got = advantages_of("reinforce_plus_plus", [4.0, 0.0], 1, lengths=[2, 1], kls=[[1.0, 2.0], [4.0, 0.0]],
                                kl_coef=0.5)
    torch.testing.assert_close(shaped.rewards, torch.tensor([[-0.5, 3.0], [-2.0, 0.0]], dtype=F64))
    returns = [2.5, 3.0, -2.0]  # gamma 1: reverse sums
    mean = sum(returns) / 3
    std = math.sqrt(sum((r - mean) ** 2 for r in returns) / 2)
    w = [(r - mean) / math.sqrt(std ** 2 + 1e-8) for r in returns]
    torch.testing.assert_close(got, torch.tensor([[w[0], w[1]], [w[2], 0.0]], dtype=F64))


def test_a_group_estimator_with_the_kl_in_the_reward_ranks_by_the_shaped_score():
    # rloo, kl coefficient 1: sequence rewards 1 - 0.5 = 0.5 and 1 - 0 = 1: same score, the lower KL wins
    _, got = advantages_of("rloo", [1.0, 1.0], 2, kls=[[0.5], [0.0]], kl_coef=1.0)
    torch.testing.assert_close(got[:, 0], torch.tensor([-0.5, 0.5], dtype=F64))


def test_the_loss_mask_leaves_out_truncated_responses_and_groups_of_one_score():
    mask = torch.ones(6, 3)
    scores = torch.tensor([1.0, 1.0, 0.0, 2.0, 5.0, 5.0])
    truncated = torch.tensor([False, False, True, False, False, False])
    config = types.SimpleNamespace(mask_truncated_completions=True, dynamic_sampling=True, num_generations=2)
    got = loss_mask(config, mask, scores, truncated)
    assert got.sum(dim=1).tolist() == [0.0, 0.0, 0.0, 3.0, 0.0, 0.0]  # groups 0 and 2: one score; sample 2: cut
    config.dynamic_sampling = False
    assert loss_mask(config, mask, scores, truncated).sum(dim=1).tolist() == [3.0, 3.0, 0.0, 3.0, 3.0, 3.0]


# ---- the glue functions the trainer calls, each on a few hand-computed tensors -------------------------------------


def test_ppo_s_advantages_are_the_whitened_gae_of_the_kl_shaped_rewards_by_hand():
    """The default estimator (``gae``): the score on the last valid token less beta * KL on every token, then GAE with
    the values (zeroed where masked), the advantages whitened over the valid tokens and the returns raw."""
    config = PPOConfig(batch_size=2, mini_batch_size=2, gamma=1.0, lam=0.5)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)  # responses of 2 and 1 tokens
    kls = torch.tensor([[0.2, 0.4], [1.0, 7.0]], dtype=F64)  # 7 and 9 below sit on the masked token
    values = torch.tensor([[0.5, 0.25], [1.0, 9.0]], dtype=F64)
    scores = torch.tensor([1.0, -2.0], dtype=F64)
    shaped, adv = step_advantages(config, scores, kls, values, mask, 0.5, SingleProcess(torch.device("cpu")))
    # rewards: -0.5 * kl, plus the score on the last valid token: [-0.1, -0.2 + 1] ; [-0.5 - 2, 0]
    torch.testing.assert_close(shaped.rewards, torch.tensor([[-0.1, 0.8], [-2.5, 0.0]], dtype=F64))
    # deltas r_t + V_{t+1} - V_t: row 0: -0.1 + 0.25 - 0.5 = -0.35, 0.8 - 0.25 = 0.55; row 1: -2.5 - 1 = -3.5, 0
    # A_t = delta_t + 0.5 * A_{t+1}: row 0: -0.35 + 0.275 = -0.075, 0.55; row 1: -3.5, 0; returns = A + V
    torch.testing.assert_close(adv.returns, torch.tensor([[0.425, 0.8], [-2.5, 0.0]], dtype=F64))
    raw = [-0.075, 0.55, -3.5]
    mean = sum(raw) / 3
    var = sum((a - mean) ** 2 for a in raw) / 2  # unbiased, over the 3 valid tokens
    w = [(a - mean) / math.sqrt(var + 1e-8) for a in raw]
    torch.testing.assert_close(adv.advantages, torch.tensor([[w[0], w[1]], [w[2], 0.0]], dtype=F64))


def test_grpo_with_batch_scaling_divides_by_the_std_of_the_gathered_global_batch():
    """``scale_rewards="batch"``: the std is the global batch's (here this process's 4 scores and another's 2, as the
    group gathers them), not this process's alone."""
    config = PPOConfig(advantage_estimator="grpo", num_generations=2, batch_size=4, mini_batch_size=4,
                       scale_rewards="batch")
    other_process = torch.tensor([4.0, 6.0], dtype=F64)
    group = types.SimpleNamespace(gather=lambda x: torch.cat([x, other_process]), sum_across=lambda x: x)
    scores, kls, values, mask = batch_of([1.0, 3.0, 0.5, 0.5])
    _, adv = step_advantages(config, scores, kls, values, mask, 0.0, group)
    # centred on their groups (means 2 and 0.5): -1, 1, 0, 0; the 6 gathered scores 1 3 .5 .5 4 6: mean 2.5,
    # squared deviations 2.25 .25 4 4 2.25 12.25 = 25, unbiased variance 25 / 5 = 5
    s = 1 / (math.sqrt(5.0) + 1e-4)
    torch.testing.assert_close(adv.advantages[:, 0], torch.tensor([-s, s, 0.0, 0.0], dtype=F64))
    torch.testing.assert_close(adv.returns, adv.advantages)  # no critic: the returns are the advantages


def test_overlong_penalties_by_hand():
    """DAPO's soft overlong shaping from the responses' lengths: L_max 8, L_cache 4, factor 0.5: nothing up to 4
    tokens, then linearly down to -0.5 at 8 tokens, and -0.5 beyond."""
    config = PPOConfig(batch_size=4, mini_batch_size=4, max_completion_length=8, overlong_buffer_len=4,
                       overlong_penalty_factor=0.5)
    lengths = torch.tensor([4.0, 6.0, 8.0, 10.0])
    got = overlong_penalties(config, lengths)
    # 6 tokens: (4 - 6) / 4 * 0.5 = -0.25; 8 tokens: (4 - 8) / 4 * 0.5 = -0.5; 10 tokens: capped at -0.5
    assert got.tolist() == pytest.approx([0.0, -0.25, -0.5, -0.5])
    assert overlong_penalties(PPOConfig(batch_size=4, mini_batch_size=4), lengths) is None  # shaping off by default


def test_loss_reduction_follows_the_config_s_aggregation_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])  # the 100s are masked
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    own = Divisors(None, None)  # the mini-batch is its window: its own counts
    token_mean = PPOConfig(batch_size=2, mini_batch_size=2)
    assert loss_reduction(token_mean, mask, own, norm_length=5) is None  # policy_loss's own token mean, untouched
    sequences = PPOConfig(batch_size=2, mini_batch_size=2, loss_aggregation="seq-mean-token-mean")
    # each response's mean, then their mean: (6 / 3 + 4 / 1) / 2 = 3
    assert loss_reduction(sequences, mask, own, norm_length=5)(loss).item() == pytest.approx(3.0)
    # in a window of 4 sequences (its other mini-batch holds 2 more): this mini-batch's share, (2 + 4) / 4
    window = Divisors(torch.tensor(8.0), torch.tensor(4.0))
    assert loss_reduction(sequences, mask, window, norm_length=5)(loss).item() == pytest.approx(1.5)
    constant = PPOConfig(batch_size=2, mini_batch_size=2, loss_aggregation="seq-mean-token-sum-norm")
    # every valid token summed, over 2 sequences times the given norm_length 5 (not the width, 3): 10 / 10
    assert loss_reduction(constant, mask, own, norm_length=5)(loss).item() == pytest.approx(1.0)
    # Dr. GRPO's B is the mini-batch's rows, whatever the window's counts (a window's rows over N * GA are its
    # mini-batches' rows): the same constant in every step
    assert loss_reduction(constant, mask, window, norm_length=5)(loss).item() == pytest.approx(1.0)  # 10 / (2 * 5)


def test_kl_loss_is_k3_reduced_as_the_policy_loss_and_only_where_the_kl_is_in_the_loss():
    logprobs = torch.tensor([[0.0, math.log(2.0)], [-math.log(2.0), 5.0]], dtype=F64)  # the 5 is masked
    ref = torch.zeros(2, 2, dtype=F64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
    # k3 = exp(-d) - 1 + d, d = log p - log p_ref: 0 at d = 0; 1/2 - 1 + ln 2 at d = ln 2; 2 - 1 - ln 2 at d = -ln 2
    k3 = [0.0, math.log(2.0) - 0.5, 1 - math.log(2.0)]
    grpo = PPOConfig(advantage_estimator="grpo", num_generations=2, batch_size=2, mini_batch_size=2)
    assert (grpo.resolved.kl_in, grpo.resolved.loss_aggregation) == ("loss", "seq-mean-token-mean")  # GRPO's
    got = kl_loss(grpo, logprobs, ref, mask, Divisors(torch.tensor(4.0), None), norm_length=2)
    assert got.item() == pytest.approx(((k3[0] + k3[1]) / 2 + k3[2]) / 2)  # the mean of the two responses' means
    by_token = PPOConfig(advantage_estimator="grpo", num_generations=2, batch_size=2, mini_batch_size=2,
                         loss_aggregation="token-mean")
    # the token mean divides by the n_tokens it is given (the global count under N processes), 4, not by the 3 here
    got = kl_loss(by_token, logprobs, ref, mask, Divisors(torch.tensor(4.0, dtype=F64), None), norm_length=2)
    assert got.item() == pytest.approx(sum(k3) / 4)
    no_coef = PPOConfig(advantage_estimator="grpo", num_generations=2, batch_size=2, mini_batch_size=2,
                        kl_loss_coef=0.0)
    own = Divisors(None, None)
    assert kl_loss(no_coef, logprobs, ref, mask, own, 2) is None
    assert kl_loss(grpo, logprobs, None, mask, own, 2) is None  # no reference pass ran
    assert kl_loss(PPOConfig(batch_size=2, mini_batch_size=2), logprobs, ref, mask, own, 2) is None  # PPO: reward


def test_sequence_advantages_fill_each_response_s_tokens_only():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=F64)
    adv = sequence_advantages(torch.tensor([2.0, -1.0]), mask)
    assert adv.advantages.dtype == F64  # the mask's dtype
    assert adv.advantages.tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]
    assert adv.returns.tolist() == adv.advantages.tolist()

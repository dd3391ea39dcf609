"""The critic-free estimators' math: hand-computed cases, equivalence with naive per-group loops, properties."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_core.algo.estimators import (
    check_groups,
    group_centred,
    group_normalized,
    grouped,
    leave_one_out,
    reinforce_plus_plus_advantages,
    soft_overlong_penalty,
)
from ppo_core.algo.ppo_math import aggregate, kl_penalty, shape_rewards

F64 = torch.float64


def test_grpo_by_hand():
    # group 1: scores 1, 3: mean 2, unbiased std sqrt(((1-2)^2 + (3-2)^2) / 1) = sqrt(2); group 2: equal scores
    got = group_normalized(torch.tensor([1.0, 3.0, 0.5, 0.5], dtype=F64), 2, eps=1e-4)
    s = 1 / (math.sqrt(2) + 1e-4)
    torch.testing.assert_close(got, torch.tensor([-s, s, 0.0, 0.0], dtype=F64))


def test_dr_grpo_by_hand():
    got = group_centred(torch.tensor([1.0, 3.0, 0.5, 0.5], dtype=F64), 2)
    torch.testing.assert_close(got, torch.tensor([-1.0, 1.0, 0.0, 0.0], dtype=F64))


def test_rloo_by_hand():
    # A_i = r_i - mean of the other two: 1 - (2+6)/2 = -3 ; 2 - (1+6)/2 = -1.5 ; 6 - (1+2)/2 = 4.5
    got = leave_one_out(torch.tensor([1.0, 2.0, 6.0], dtype=F64), 3)
    torch.testing.assert_close(got, torch.tensor([-3.0, -1.5, 4.5], dtype=F64))


def naive_group_advantages(scores: list[float], group_size: int, estimator: str, scale: str, eps: float):
    out = []
    batch_std = torch.tensor(scores, dtype=F64).std().item()
    for start in range(0, len(scores), group_size):
        group = scores[start:start + group_size]
        mean = sum(group) / len(group)
        std = math.sqrt(sum((x - mean) ** 2 for x in group) / (len(group) - 1))
        for x in group:
            if estimator == "rloo":
                out.append(x - (sum(group) - x) / (len(group) - 1))
            elif estimator == "dr_grpo" or scale == "none":
                out.append(x - mean)
            else:
                out.append((x - mean) / ((std if scale == "group" else batch_std) + eps))
    return torch.tensor(out, dtype=F64)


@pytest.mark.parametrize("estimator,scale", [("grpo", "group"), ("grpo", "batch"), ("grpo", "none"),
                                             ("dr_grpo", "group"), ("rloo", "group")])
@pytest.mark.parametrize("group_size", [2, 4])
def test_group_estimators_equal_a_naive_loop(estimator, scale, group_size):
    scores = torch.randn(8 * group_size, generator=torch.Generator().manual_seed(group_size), dtype=F64)
    got = group_advantages(scores, group_size, estimator, scale, eps=1e-4)
    expected = naive_group_advantages(scores.tolist(), group_size, estimator, scale, 1e-4)
    torch.testing.assert_close(got, expected, atol=1e-12, rtol=1e-12)


def group_advantages(scores, group_size, estimator, scale="group", eps=1e-4):
    """The group function each built-in group estimator uses (ppo_core.algo.registry)."""
    if estimator == "rloo":
        return leave_one_out(scores, group_size)
    if estimator == "dr_grpo":
        return group_centred(scores, group_size)
    return group_normalized(scores, group_size, scale, eps=eps)


def test_group_advantages_properties():
    scores = torch.randn(24, generator=torch.Generator().manual_seed(0), dtype=F64)
    for estimator in ("grpo", "dr_grpo", "rloo"):
        advantages = grouped(group_advantages(scores, 4, estimator), 4)
        torch.testing.assert_close(advantages.sum(dim=1), torch.zeros(6, dtype=F64), atol=1e-12, rtol=0)  # centred
    # a better-scoring sample of a group never gets the smaller advantage
    a = group_advantages(torch.tensor([0.0, 1.0, 5.0, 2.0], dtype=F64), 4, "grpo")
    assert a.argsort().tolist() == [0, 1, 3, 2]
    with pytest.raises(ValueError, match="num_generations >= 2"):
        group_advantages(scores, 1, "grpo")
    with pytest.raises(ValueError, match="do not split into groups of 5"):
        group_advantages(scores, 5, "rloo")


def test_an_unknown_scaling_is_refused():
    scores = torch.tensor([1.0, 3.0, 0.5, 0.5], dtype=F64)
    with pytest.raises(ValueError, match=r"^group_normalized: scale_rewards must be 'group', 'batch' or 'none' "
                                         r"\(got 'std'\)"):
        group_normalized(scores, 2, "std")


def test_reinforce_plus_plus_by_hand():
    kls = torch.tensor([[0.5, 1.0], [2.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=F64)
    shaped = shape_rewards(torch.tensor([1.0, -1.0], dtype=F64), kls, mask, 0.1)
    advantages, returns = reinforce_plus_plus_advantages(shaped.rewards, mask)
    # rewards: row 0 [-0.05, -0.1 + 1] ; row 1 [-0.2 - 1, masked]   returns (gamma 1): [0.85, 0.9] ; [-1.2, 0]
    torch.testing.assert_close(returns, torch.tensor([[0.85, 0.9], [-1.2, 0.0]], dtype=F64))
    valid = [0.85, 0.9, -1.2]  # whitened over the three valid tokens (unbiased variance)
    mean = sum(valid) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in valid) / 2)
    w = [(x - mean) / math.sqrt(std ** 2 + 1e-8) for x in valid]
    torch.testing.assert_close(advantages, torch.tensor([[w[0], w[1]], [w[2], 0.0]], dtype=F64))


def test_reinforce_plus_plus_baseline_centres_scores_on_their_group():
    # scores minus their group's mean: 3, 1 -> 1, -1 ; 10, 12 -> -1, 1
    got = group_centred(torch.tensor([3.0, 1.0, 10.0, 12.0], dtype=F64), 2)
    torch.testing.assert_close(got, torch.tensor([1.0, -1.0, -1.0, 1.0], dtype=F64))


def test_reinforce_plus_plus_returns_equal_a_naive_loop():
    g = torch.Generator().manual_seed(3)
    rewards = torch.randn(5, 7, generator=g, dtype=F64)
    lengths = [7, 3, 1, 5, 6]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(7)] for n in lengths], dtype=F64)
    _, returns = reinforce_plus_plus_advantages(rewards, mask, gamma=0.9)
    for i, n in enumerate(lengths):
        running = 0.0
        for t in reversed(range(n)):
            running = rewards[i, t].item() + 0.9 * running
            assert returns[i, t].item() == pytest.approx(running, abs=1e-12)
        assert (returns[i, n:] == 0).all()


def test_kl_estimates_by_hand():
    logp, ref = torch.tensor([-1.0, -2.0], dtype=F64), torch.tensor([-1.5, -1.0], dtype=F64)
    d = [0.5, -1.0]  # log p - log q
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), torch.tensor(d, dtype=F64))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), torch.tensor([0.125, 0.5], dtype=F64))
    k3 = [math.exp(-x) - 1 + x for x in d]  # exp(q/p) - log(q/p) - 1 with log(q/p) = -d
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), torch.tensor(k3, dtype=F64))
    assert (kl_penalty(torch.randn(100, dtype=F64), torch.randn(100, dtype=F64), "k3") >= 0).all()
    with pytest.raises(ValueError, match="k1"):
        kl_penalty(logp, ref, "k4")
    # the legacy names are the same estimates: kl = k1, mse = k2
    torch.testing.assert_close(kl_penalty(logp, ref, "kl"), kl_penalty(logp, ref, "k1"))
    torch.testing.assert_close(kl_penalty(logp, ref, "mse"), kl_penalty(logp, ref, "k2"))


def test_k3_is_capped_where_the_policy_moved_far_below_the_reference():
    # a token 100 nats less likely under the policy: exp(100) overflows float32; the estimate is capped at 10
    # (veRL's low_var_kl) and that token gives no gradient
    logp = torch.tensor([-101.0, -3.0, -1.0], requires_grad=True)
    ref = torch.tensor([-1.0, -1.0, -30.0])
    kl = kl_penalty(logp, ref, "k3")
    assert torch.isfinite(kl).all()
    assert kl[0].item() == 10.0 and kl[2].item() == 10.0  # d = -100 and d = +29 (k3 = d - 1 + e^-d = 28)
    assert kl[1].item() == pytest.approx(math.exp(2) - 1 - 2)  # d = -2: under the cap, exact
    kl.sum().backward()
    assert logp.grad[0].item() == 0.0 and logp.grad[2].item() == 0.0
    assert logp.grad[1].item() == pytest.approx(1 - math.exp(2))  # d/dd (e^-d - 1 + d) = 1 - e^-d


def test_loss_aggregation_by_hand():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], dtype=F64)
    assert aggregate(loss, mask, "token-mean").item() == pytest.approx(10 / 4)  # 1 + 2 + 3 + 4 over 4 tokens
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", norm_length=5).item() == pytest.approx(10 / (2 * 5))
    # with the global counts of two processes, each process's share averages to the global value
    assert aggregate(loss, mask, "token-mean", n_tokens=2.0).item() == pytest.approx(10 / 2)


def test_check_groups_names_the_first_group_that_is_not_one_prompt():
    a, b = torch.tensor([1, 2]), torch.tensor([1, 3])
    assert check_groups([a, a, b, b], 2) is None
    assert check_groups([a, a, b, a], 2) == 1
    assert check_groups([a, torch.tensor([1, 2, 3])], 2) == 0


def test_a_row_masked_whole_is_not_a_sequence_of_the_sequence_means():
    """Dynamic sampling and mask_truncated_completions mask whole rows: the sequence mean leaves them out, not
    averaged in as 0; Dr. GRPO's constant normaliser counts every row (TRL's B * L), so that it stays constant."""
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 7.0, 7.0], [5.0, 5.0, 5.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    assert aggregate(loss, mask, "seq-mean-token-mean").item() == pytest.approx((6 / 3 + 4 / 1) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", norm_length=5).item() == pytest.approx(10 / (3 * 5))


def test_soft_overlong_penalty_by_hand():
    # L_max 10, L_cache 4: no penalty up to 6 tokens, then -(L - 6) / 4, -1 from 10 on
    lengths = torch.tensor([3, 6, 7, 8, 10, 12])
    got = soft_overlong_penalty(lengths, max_length=10, buffer_len=4)
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    torch.testing.assert_close(soft_overlong_penalty(lengths, 10, 4, penalty_factor=2.0), 2 * got)
    with pytest.raises(ValueError, match="buffer_len must be in"):
        soft_overlong_penalty(lengths, 10, 11)


def test_the_config_s_choices_are_the_math_layer_s():
    import typing

    from ppo_core import PPOConfig
    from ppo_core.algo.ppo_math import IMPORTANCE_SAMPLING_LEVELS, KL_PENALTIES, LOSS_AGGREGATIONS

    hints = typing.get_type_hints(PPOConfig)
    assert typing.get_args(hints["kl_penalty"]) == KL_PENALTIES
    assert typing.get_args(hints["kl_estimator"]) == tuple(k for k in KL_PENALTIES if k != "full")
    assert typing.get_args(typing.get_args(hints["loss_aggregation"])[0]) == LOSS_AGGREGATIONS
    assert typing.get_args(typing.get_args(hints["importance_sampling_level"])[0]) == IMPORTANCE_SAMPLING_LEVELS

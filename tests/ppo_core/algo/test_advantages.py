"""ppo_core.algo.advantages: a step's advantages by the estimator's function (``step_advantages``), the loss mask, the
policy loss's reduction and the KL loss term, from a PPOConfig, on small hand-computed tensors. The registry's side
(which estimator takes which settings, a user's own estimator) is ``test_registry.py``."""

from __future__ import annotations

import math
import types

import pytest
import torch

from ppo_core import PPOConfig
from ppo_core.algo.advantages import loss_mask, step_advantages
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

"""ppo_core.step.update: a mini-batch's skip decision (one collective, one host read) and the optimizer updates of
a gradient-accumulation window, with fake process groups and a fake accelerator standing in for a run's."""

from __future__ import annotations

import math
import types

import pytest
import torch

from ppo_core.runtime.distributed import SingleProcess
from ppo_core.step.update import Updates, minibatch_decision

ALONE = SingleProcess(torch.device("cpu"))


def stats(ratio: float, tokens: float = 4.0, **others: list[float]) -> dict[str, torch.Tensor]:
    """A mini-batch's stats as `ppo_loss` gives them: the sum of its ratios over ``tokens`` tokens, and others."""
    return {"policy/ratio_sum": torch.tensor(ratio * tokens), "policy/tokens": torch.tensor(tokens),
            **{k: torch.tensor(v) for k, v in others.items()}}


def test_a_ratio_above_the_threshold_skips_the_minibatch():
    decision = minibatch_decision(stats(1.25, loss=[0.5, 1.0]), ratio_threshold=1.125, group=ALONE)
    assert decision.ratio_mean == 1.25 and decision.skipped and not decision.non_finite and not decision.empty
    assert decision.skipped_flag.item() == 1.0 and decision.skipped_flag.dtype == torch.float32


@pytest.mark.parametrize("ratio", [1.0, 1.125])  # below, and equal: only a ratio above the threshold skips
def test_a_ratio_up_to_the_threshold_keeps_the_minibatch(ratio):
    decision = minibatch_decision(stats(ratio, loss=[0.5, 1.0]), ratio_threshold=1.125, group=ALONE)
    assert decision.ratio_mean == ratio and not decision.skipped and not decision.non_finite
    assert decision.skipped_flag.item() == 0.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_statistic_is_flagged_whichever_it_is(bad):
    assert minibatch_decision(stats(1.0, loss=[0.5, bad]), 2.0, ALONE).non_finite
    flagged = minibatch_decision(stats(bad), 2.0, ALONE)  # the ratio itself
    assert flagged.non_finite and flagged.skipped == (bad == math.inf)  # a NaN is above no threshold


def test_a_minibatch_without_a_token_is_empty_not_skipped():
    decision = minibatch_decision(stats(0.0, tokens=0.0), ratio_threshold=1.125, group=ALONE)
    assert decision.empty and decision.empty_flag.item() == 1.0 and not decision.skipped and decision.ratio_mean == 0


class TwoProcesses:
    """This process and another, whose share of the sums is ``other`` ((ratio sum, non-finite count, tokens))."""

    num_processes = 2

    def __init__(self, other: list[float]):
        self.other = torch.tensor(other)

    def sum_across(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.other


def test_the_decision_is_the_global_minibatch_s():
    """The skip compares the global mini-batch's mean ratio, each process's ratios weighed by its tokens; a
    non-finite statistic on another process stops this one too; a mini-batch empty here but not there is not empty."""
    group = TwoProcesses([6.0, 0.0, 4.0])  # 4 tokens of mean ratio 1.5 there
    decision = minibatch_decision(stats(1.0), ratio_threshold=1.125, group=group)  # (4 * 1 + 6) / 8 = 1.25
    assert decision.ratio_mean == 1.25 and decision.skipped and not decision.non_finite
    kept = minibatch_decision(stats(0.5), ratio_threshold=1.125, group=group)  # (4 * 0.5 + 6) / 8 = 1: kept
    assert kept.ratio_mean == 1.0 and not kept.skipped
    uneven = minibatch_decision(stats(1.0, tokens=12.0), 1.125, group)  # (12 + 6) / 16: tokens weigh, not processes
    assert uneven.ratio_mean == 1.125 and not uneven.skipped
    assert minibatch_decision(stats(1.0), 1.125, TwoProcesses([4.0, 1.0, 4.0])).non_finite  # the other's NaN
    assert not minibatch_decision(stats(0.0, tokens=0.0), 1.125, group).empty


class FakeAccelerator:
    """What :class:`Updates` uses of accelerate's ``Accelerator``, recording the calls."""

    def __init__(self, norm: float = 1.0, scaler=None):
        self.norm, self.scaler, self.sync_gradients = norm, scaler, True
        self.backwards: list[float] = []
        self.clipped_at: list[float] = []

    def backward(self, loss: torch.Tensor) -> None:
        self.backwards.append(loss.item())

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        self.clipped_at.append(max_norm)
        return torch.tensor(self.norm)


class FakeOptimizer:
    def __init__(self):
        self.steps = self.zero_grads = 0

    def step(self) -> None:
        self.steps += 1

    def zero_grad(self) -> None:
        self.zero_grads += 1


def updates(norm: float = 1.0, scaler=None, max_grad_norm: float | None = 0.5, overflows: int = 3,
            sync_in_backward: bool = False) -> Updates:
    return Updates(FakeAccelerator(norm, scaler), torch.nn.Linear(1, 1), FakeOptimizer(), max_grad_norm, overflows,
                   sync_in_backward)


def failed(what: str, advice: str) -> Exception:
    return RuntimeError(what + advice)


def test_a_window_clips_steps_and_frees_the_gradients_once():
    u = updates()
    u.backward(torch.tensor(2.0), skipped=False)
    u.backward(torch.tensor(3.0), skipped=True)  # without DDP or DeepSpeed a skipped one runs no backward
    assert u.accelerator.backwards == [2.0]
    assert u.step(failed) is False
    assert u.accelerator.clipped_at == [0.5] and (u.optimizer.steps, u.optimizer.zero_grads) == (1, 1)
    assert u.step(failed) is False  # the next window has no gradient yet: nothing is clipped or stepped
    assert u.accelerator.clipped_at == [0.5] and u.optimizer.steps == 1
    unclipped = updates(max_grad_norm=None)
    unclipped.backward(torch.tensor(1.0), skipped=False)
    unclipped.step(failed)
    assert unclipped.accelerator.clipped_at == [math.inf]  # the norm measured, not clipped


def test_a_window_whose_minibatches_are_all_skipped_steps_nothing():
    u = updates(sync_in_backward=True)
    u.backward(torch.tensor(2.0), skipped=True)
    assert u.accelerator.backwards == []  # no gradient in the window: no zero-loss backward either
    assert u.step(failed) is False
    assert u.accelerator.clipped_at == [] and (u.optimizer.steps, u.optimizer.zero_grads) == (0, 0)


def test_a_skipped_last_minibatch_under_ddp_still_runs_a_zero_loss_backward():
    u = updates(sync_in_backward=True)
    u.accelerator.sync_gradients = False  # inside the window: a skipped mini-batch runs nothing
    u.backward(torch.tensor(2.0), skipped=False)
    u.backward(torch.tensor(3.0), skipped=True)
    u.accelerator.sync_gradients = True  # the window's last mini-batch: its backward all-reduces the window's
    u.backward(torch.tensor(4.0), skipped=True)
    assert u.accelerator.backwards == [2.0, 0.0]
    assert u.step(failed) is False and u.optimizer.steps == 1


@pytest.mark.parametrize("norm", [math.nan, math.inf])
def test_a_non_finite_gradient_norm_without_loss_scaling_raises_before_the_optimizer_steps(norm):
    u = updates(norm=norm)
    u.backward(torch.tensor(1.0), skipped=False)
    with pytest.raises(RuntimeError, match=r"non-finite gradient norm \((nan|inf)\) Lower learning_rate"):
        u.step(failed)
    assert (u.optimizer.steps, u.optimizer.zero_grads) == (0, 1)  # the gradients dropped, nothing written


def test_under_loss_scaling_an_overflow_is_a_skipped_update_until_too_many_in_a_row():
    u = updates(norm=math.inf, scaler=types.SimpleNamespace(), overflows=2)
    u.backward(torch.tensor(1.0), skipped=False)
    assert u.step(failed) is True  # an overflow: the scaler skips the update inside optimizer.step
    assert u.optimizer.steps == 1
    u.accelerator.norm = 1.0
    u.backward(torch.tensor(1.0), skipped=False)
    assert u.step(failed) is False  # a finite norm ends the run of overflows
    u.accelerator.norm = math.inf
    u.backward(torch.tensor(1.0), skipped=False)
    assert u.step(failed) is True
    u.backward(torch.tensor(1.0), skipped=False)
    with pytest.raises(RuntimeError, match="2 loss-scale overflows in a row"):
        u.step(failed)
    assert u.optimizer.steps == 3  # the second overflow in a row is not stepped


def test_the_stats_of_a_user_s_own_loss_decide_as_legacy_s_did():
    """A legacy subclass's `loss` returns its own stats, with the ratio's mean share and no token count: the skip
    compares the mean of the shares over the processes, and such a mini-batch is never taken for empty."""
    own = {"policy/ratio_mean": torch.tensor(1.0)}
    decision = minibatch_decision(own, ratio_threshold=1.125, group=TwoProcesses([1.5, 0.0, 1.0]))
    assert decision.ratio_mean == 1.25 and decision.skipped and not decision.empty


# ---- every config field that reaches the loss, pinned: dropped or swapped on its way, a test here fails ------------
def one_token_loss(config, log_ratio: list[list[float]], advantages: list[list[float]], mask=None, **tensors):
    """`ppo_loss` of a (b, R) mini-batch whose log-probabilities are ``log_ratio`` above the rollout's: (policy loss,
    value loss, stats), in float64, alone (the mini-batch is its window)."""
    from ppo_core.step.rollout import PolicyOutputs, Rollout
    from ppo_core.step.update import ppo_loss

    log_ratio = torch.tensor(log_ratio, dtype=torch.float64)
    zeros = torch.zeros_like(log_ratio)
    mask = torch.ones_like(log_ratio) if mask is None else torch.tensor(mask, dtype=torch.float64)
    values, vpreds, returns = (torch.tensor(tensors.get(k, zeros.tolist()), dtype=torch.float64)
                               for k in ("values", "vpreds", "returns"))
    ref = torch.tensor(tensors["ref"], dtype=torch.float64) if "ref" in tensors else None
    mb = Rollout(None, mask, zeros, values, ref, torch.tensor(advantages, dtype=torch.float64), returns)
    return ppo_loss(config, ALONE, mb, PolicyOutputs(log_ratio, vpreds, None, None))


def test_the_clip_s_low_side_is_cliprange_and_its_high_side_epsilon_high():
    from ppo_core import PPOConfig

    config = PPOConfig(batch_size=2, mini_batch_size=2, cliprange=0.1, epsilon_high=0.3)
    up = one_token_loss(config, [[math.log(1.5)]], [[1.0]])[0]  # ratio 1.5, A = 1: clipped at 1 + 0.3
    assert up.item() == pytest.approx(-1.3)
    down = one_token_loss(config, [[math.log(0.5)]], [[-1.0]])[0]  # ratio 0.5, A = -1: clipped at 1 - 0.1
    assert down.item() == pytest.approx(0.9)


def test_the_ratio_s_level_is_importance_sampling_level():
    """A response whose two tokens moved by +0.2 and -0.2 nats: per token, the first one's ratio is clipped; per
    sequence (GSPO) the ratio is exp(0) = 1 at both, and nothing is clipped."""
    from ppo_core import PPOConfig

    token = PPOConfig(batch_size=2, mini_batch_size=2, cliprange=0.1)
    sequence = PPOConfig(batch_size=2, mini_batch_size=2, cliprange=0.1, importance_sampling_level="sequence")
    ratios = [[0.2, -0.2]]
    assert one_token_loss(sequence, ratios, [[1.0, 1.0]])[0].item() == pytest.approx(-1.0)
    per_token = (-min(math.exp(0.2), 1.1) - math.exp(-0.2)) / 2  # the first clipped at 1.1, the second not
    assert one_token_loss(token, ratios, [[1.0, 1.0]])[0].item() == pytest.approx(per_token)


def test_the_value_loss_clips_at_cliprange_value_not_at_the_policy_s_cliprange():
    from ppo_core import PPOConfig

    config = PPOConfig(batch_size=2, mini_batch_size=2, cliprange=0.2, cliprange_value=0.05, vf_coef=1.0)
    # old value 0, new prediction 1, return 2: clipped prediction 0.05; loss 0.5 * max(1, 1.95^2)
    _, value_loss, stats = one_token_loss(config, [[0.0]], [[0.0]], values=[[0.0]], vpreds=[[1.0]], returns=[[2.0]])
    assert value_loss.item() == pytest.approx(0.5 * 1.95 ** 2) and stats["val/clipfrac"].item() == 1.0


@pytest.mark.parametrize("estimator,expected", [("k1", 0.5), ("k2", 0.125), ("abs", 0.5),
                                                ("k3", math.exp(-0.5) - 1 + 0.5)])
def test_the_kl_loss_term_is_kl_estimator_s(estimator, expected):
    from ppo_core import PPOConfig

    config = PPOConfig(batch_size=2, mini_batch_size=2, advantage_estimator="grpo", num_generations=2,
                       kl_estimator=estimator, kl_loss_coef=1.0)
    # log p - log p_ref = 0.5 at the one token, no advantage: the loss is the KL term alone
    policy, _, stats = one_token_loss(config, [[0.0]], [[0.0]], ref=[[-0.5]])
    assert stats["policy/kl_loss"].item() == pytest.approx(expected) and policy.item() == pytest.approx(expected)

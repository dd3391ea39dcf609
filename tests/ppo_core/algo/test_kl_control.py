"""ppo_core.algo.kl_control: the adaptive and fixed KL controllers and RunningMoments, against hand-computed arithmetic
and numpy (expected values never come from the code under test)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ppo_core.algo.kl_control import AdaptiveKLController, FixedKLController, RunningMoments

torch.set_num_threads(1)  # tiny tensors: extra threads only add spin-up cost


def test_adaptive_kl_controller_arithmetic():
    ctl = AdaptiveKLController(init_kl_coef=0.2, target=6.0, horizon=10000)
    ctl.update(current=9.0, n_steps=128)
    # err = clip(9/6 - 1, -0.2, 0.2) = 0.2 ; value = 0.2 * (1 + 0.2 * 128 / 10000) = 0.2 * 1.00256
    assert ctl.value == pytest.approx(0.2 * 1.00256, abs=1e-15)
    ctl.update(current=6.0, n_steps=128)  # err = 0: unchanged
    assert ctl.value == pytest.approx(0.2 * 1.00256, abs=1e-15)
    ctl.update(current=3.0, n_steps=100)
    # err = clip(3/6 - 1) = clip(-0.5) = -0.2 ; factor = 1 - 0.2 * 100 / 10000 = 0.998
    assert ctl.value == pytest.approx(0.2 * 1.00256 * 0.998, abs=1e-15)
    ctl.update(current=6.6, n_steps=1000)
    # err = 6.6/6 - 1 = 0.1 (inside the clip) ; factor = 1 + 0.1 * 0.1 = 1.01
    assert ctl.value == pytest.approx(0.2 * 1.00256 * 0.998 * 1.01, abs=1e-15)

    restored = AdaptiveKLController(1.0, 1.0, 1.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.state_dict() == ctl.state_dict()


def test_fixed_kl_controller_is_constant():
    ctl = FixedKLController(0.05)
    for current in (0.0, 100.0, -5.0):
        ctl.update(current, n_steps=64)
    assert ctl.value == 0.05
    restored = FixedKLController(1.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == 0.05


def test_running_moments_match_numpy_over_several_batches():
    rng = np.random.default_rng(0)
    running, seen = RunningMoments(), []
    for size, loc, scale in [(5, 1.0, 2.0), (17, -3.0, 0.5), (2, 10.0, 1.0), (40, 0.0, 3.0)]:
        batch = rng.normal(loc, scale, size)
        seen.extend(batch)
        batch_mean, batch_std = running.update(torch.tensor(batch))
        assert batch_mean == pytest.approx(np.mean(batch), abs=1e-10)
        assert batch_std == pytest.approx(np.std(batch, ddof=1), abs=1e-10)
        assert running.mean == pytest.approx(np.mean(seen), abs=1e-10)
        assert running.var == pytest.approx(np.var(seen), abs=1e-10)
        assert running.std == pytest.approx(np.std(seen, ddof=1), abs=1e-10)
    restored = RunningMoments()
    restored.load_state_dict(running.state_dict())
    assert restored.state_dict() == running.state_dict()


@pytest.mark.parametrize("options,in_loss,estimator,loss_coef", [
    ({}, False, "kl", 0.0),  # PPO: the reward, legacy's kl_penalty
    ({"kl_penalty": "k3"}, False, "k3", 0.0),
    ({"advantage_estimator": "grpo", "num_generations": 2}, True, "k3", 0.04),  # the loss: kl_estimator's
    ({"advantage_estimator": "grpo", "num_generations": 2, "kl_estimator": "k2", "kl_penalty": "abs"}, True, "k2",
     0.04),
    ({"advantage_estimator": "dr_grpo", "num_generations": 2}, True, "k3", 0.0),
    ({"advantage_estimator": "rloo", "num_generations": 2}, False, "kl", 0.0),
])
def test_the_kl_s_placement_is_decided_once_from_the_config(options, in_loss, estimator, loss_coef):
    """`KLPlacement.of`: where the KL goes, which estimate it is shaped or penalised (and measured) with, the loss
    term's coefficient; and from it, with the controller, the rewards' coefficient and whether the reference counts."""
    from ppo_core import PPOConfig
    from ppo_core.algo.kl_control import KLPlacement

    config = PPOConfig(batch_size=2, mini_batch_size=2, **options)
    placement = KLPlacement.of(config)
    assert (placement.in_loss, placement.estimator, placement.loss_coef) == (in_loss, estimator, loss_coef)
    controller = FixedKLController(0.3)
    assert placement.reward_coef(controller) == (0.0 if in_loss else 0.3)
    assert placement.uses_reference(controller) == (loss_coef != 0 if in_loss else True)
    assert placement.uses_reference(FixedKLController(0.0)) == (loss_coef != 0)
    assert placement.in_loss_term() == (in_loss and loss_coef != 0)

"""Mixed precision on the CPU: fp16 loss scaling, with torch's CPU GradScaler standing in for the CUDA one."""

from __future__ import annotations

import pytest
import torch

from ppo_core import trainer as trainer_module
from tests.test_core_trainer import make_batch, make_trainer, params_snapshot

torch.set_num_threads(1)

INITIAL_SCALE = 2.0**16  # torch's GradScaler and DeepSpeed start there


@pytest.fixture
def fp16(monkeypatch):
    """``accelerator_kwargs`` for an fp16 trainer on the CPU. accelerate gives a GPU run a CUDA GradScaler and fp16
    autocast, and a CPU run neither; here the trainer's Accelerator gets torch's CPU GradScaler and autocast to float16,
    so that accelerate's fp16 path (scaled backward, unscaling clip, scaler step and update) runs as on a GPU."""
    build = trainer_module.accelerator_for

    def with_cpu_scaler(config):
        accelerator = build(config)
        accelerator.scaler, accelerator.native_amp = torch.amp.GradScaler("cpu", init_scale=INITIAL_SCALE), True
        return accelerator

    monkeypatch.setattr(trainer_module, "accelerator_for", with_cpu_scaler)
    return {"mixed_precision": "fp16"}


def overflow_at(trainer, backwards: set[int] | None):
    """Make the gradient of the given backwards (1-based; None: every one) infinite, as a scaled fp16 backward
    that overflows makes it; returns the list of backwards seen."""
    calls = []

    def hook(grad):
        calls.append(1)
        return grad * float("inf") if backwards is None or len(calls) in backwards else grad

    trainer.model.v_head.summary.weight.register_hook(hook)
    return calls


def test_an_fp16_overflow_skips_that_update_and_the_run_goes_on(fp16):
    """The loss scaler overflows on purpose: the update is skipped (counted), the scale halves, the next update is
    applied. (It used to end the run: the unscaled norm is infinite, and the trainer raised FloatingPointError.)"""
    trainer = make_trainer(ppo_epochs=1, accelerator_kwargs=fp16)  # two mini-batches, two updates
    assert trainer.accelerator.scaler is not None
    overflow_at(trainer, {1})
    before = params_snapshot(trainer.model)
    stats = trainer.step(*make_batch(4))
    assert stats["ppo/policy/overflowed_updates"] == 1 and stats["ppo/policy/skipped_minibatches"] == 0
    assert stats["ppo/loss_scale"] == INITIAL_SCALE / 2 == trainer.accelerator.scaler.get_scale()
    after = params_snapshot(trainer.model)
    assert all(torch.isfinite(p).all() for p in after.values())
    assert any(not torch.equal(after[n], before[n]) for n in before)  # the second update was applied
    assert trainer._updates.overflows.in_a_row == 0  # a finite update after it ends the run of overflows


def test_an_fp16_run_resumes_with_its_loss_scale_and_overflow_count(fp16, tmp_path):
    """The scaler's state (its scale and growth tracker) and the overflows in a row are checkpointed: a resumed run
    does not start again from the initial scale and meet the same overflows."""
    trainer = make_trainer(ppo_epochs=1, accelerator_kwargs=fp16)
    overflow_at(trainer, {2})  # the step's last update overflows: one in a row when the checkpoint is written
    trainer.step(*make_batch(4))
    trainer.save_checkpoint(str(tmp_path / "ckpt"))
    state = torch.load(tmp_path / "ckpt" / "engine" / "state.pt", weights_only=True)
    assert state["scaler"]["scale"] == INITIAL_SCALE / 2
    resumed = make_trainer(ppo_epochs=1, accelerator_kwargs=fp16)
    assert resumed.accelerator.scaler.get_scale() == INITIAL_SCALE
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert resumed.accelerator.scaler.state_dict() == trainer.accelerator.scaler.state_dict()
    assert resumed._updates.overflows.in_a_row == 1


def test_fp16_overflows_in_a_row_stop_the_run_as_diverged(fp16):
    """Real divergence still stops the run: ``max_consecutive_overflows`` overflows in a row raise, naming them."""
    trainer = make_trainer(ppo_epochs=2, max_consecutive_overflows=3, accelerator_kwargs=fp16)  # four updates
    overflow_at(trainer, None)
    with pytest.raises(FloatingPointError, match=r"PPO step 1, mini-batch 3: 3 loss-scale overflows in a row "
                                                 r"\(max_consecutive_overflows; the loss scaler skipped those "
                                                 r"updates\) before the update.*train in bf16"):
        trainer.step(*make_batch(4))
    assert trainer.accelerator.scaler.get_scale() == INITIAL_SCALE / 4  # two halvings, then the third stopped it


def test_an_fp16_step_whose_minibatches_are_all_skipped_steps_nothing(fp16):
    """A window without a backward (every mini-batch over ratio_threshold) has no gradient for the scaler to check:
    no optimizer step, no scale update. (The scaler's step asserted "No inf checks were recorded for this optimizer".)
    """
    trainer = make_trainer(gradient_accumulation_steps=2, batch_size=8, mini_batch_size=2, accelerator_kwargs=fp16)
    trainer.step(*make_batch(8))  # an ordinary step first: the scaler has scaled and stepped
    trainer.config.ratio_threshold = 1e-3  # every mini-batch of the next step is skipped
    before, scaler_state = params_snapshot(trainer.model), trainer.accelerator.scaler.state_dict()
    with pytest.warns(UserWarning, match="ratio_threshold"):
        stats = trainer.step(*make_batch(8, seed=1))
    assert stats["ppo/policy/skipped_minibatches"] == 2 * 4 and stats["ppo/policy/overflowed_updates"] == 0
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param, before[name]), name
    assert trainer.accelerator.scaler.state_dict() == scaler_state


def test_a_float32_run_reports_no_loss_scale_statistics():
    """The fp16 statistics exist only where a loss is scaled: a float32 run's stats (and the ppo stage's
    stats.parquet) keep their keys."""
    stats = make_trainer(ppo_epochs=1).step(*make_batch(4))
    assert not [k for k in stats if "overflow" in k or "loss_scale" in k]

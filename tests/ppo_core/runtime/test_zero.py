"""ppo_core.runtime.zero without DeepSpeed: the DeepSpeed config filled from PPOConfig, and the reference copy ZeRO-3
can make. The trainer under DeepSpeed itself is ``test_deepspeed.py``."""

from __future__ import annotations

import pytest

from tests.tiny import tiny_value_model


def test_deepspeed_config_takes_accumulation_and_clipping_from_ppo_config():
    """DeepSpeed accumulates and clips itself: its "auto" (or absent) settings are filled from PPOConfig, and a
    different number raises naming both (no deepspeed needed: the config is a dict)."""
    from ppo_core.runtime.zero import fill_config

    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "zero_optimization": {"stage": 3}}
    fill_config(ds, mini_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=None, num_processes=3)
    assert ds == {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                  "gradient_clipping": 0.0, "zero_optimization": {"stage": 3}}  # 0: DeepSpeed does not clip
    fill_config(ds, mini_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=None, num_processes=3)  # idempotent
    absent = {}
    fill_config(absent, mini_batch_size=2, gradient_accumulation_steps=1, max_grad_norm=0.5, num_processes=2)
    assert absent["gradient_clipping"] == 0.5 and absent["train_batch_size"] == 4
    with pytest.raises(ValueError, match=r"gradient_clipping=1.0, but PPOConfig gives 0.0 \(ppo.max_grad_norm"):
        fill_config({"gradient_clipping": 1.0}, 4, 1, None, 2)
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=1, but PPOConfig gives 2"):
        fill_config({"gradient_accumulation_steps": 1}, 4, 2, None, 2)


def test_zero3_refuses_a_reference_copy_it_cannot_make():
    """Under ZeRO-3 the reference is copied from the whole policy and sharded in its own engine."""
    from ppo_core.runtime.zero import check_reference_copy

    model = tiny_value_model()
    check_reference_copy(model, None)  # whole weights, no shared layers: fine
    with pytest.raises(ValueError, match="num_shared_layers is not supported under ZeRO-3"):
        check_reference_copy(model, 1)
    next(model.parameters()).ds_id = 0  # what deepspeed.zero.Init tags its shards with
    with pytest.raises(ValueError, match="already ZeRO-3 shards.*build the policy before the first PPOTrainer"):
        check_reference_copy(model, None)

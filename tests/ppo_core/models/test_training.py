"""ppo_core/models/training.py: the policy made ready for PPO, in place."""

from __future__ import annotations

import pytest
import torch

from ppo_core.models.training import disable_dropout, prepare_for_training
from tests.tiny import tiny_tokenizer, tiny_value_model


def test_dropout_modules_and_float_rates_go_to_zero():
    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_dropout, self.drop = 0.1, torch.nn.Dropout(0.3)

    model = torch.nn.Sequential(Attention(), torch.nn.Dropout(0.5))
    disable_dropout(model)
    assert model[0].attention_dropout == 0.0 and model[0].drop.p == 0.0 and model[1].p == 0.0


def test_a_critic_free_policy_gets_a_frozen_value_head_and_a_pad_token():
    model, tokenizer = tiny_value_model(), tiny_tokenizer()
    tokenizer.pad_token = None
    with pytest.warns(UserWarning, match="no pad token; using its EOS token"):
        prepare_for_training(model, tokenizer, no_dropout=True, gradient_checkpointing=False, uses_critic=False)
    assert tokenizer.pad_token == tokenizer.eos_token
    assert not any(p.requires_grad for p in model.v_head.parameters())
    assert all(p.requires_grad for p in model.pretrained_model.parameters())
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


def test_with_a_critic_the_value_head_trains():
    model = tiny_value_model()
    prepare_for_training(model, tiny_tokenizer(), no_dropout=False, gradient_checkpointing=False, uses_critic=True)
    assert all(p.requires_grad for p in model.v_head.parameters())

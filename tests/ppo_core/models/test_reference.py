"""ppo_core.models.reference: ``create_reference_model``'s frozen copy of a policy, sharing its first layers (the
parameters themselves) or none, found by the architecture's layer pattern or an explicit one. The reference a
PPOTrainer builds (``num_shared_layers``, a plain ``ref_model``, a PEFT policy's) is tested with the trainer
(``tests/ppo_core/test_trainer.py``) and with LoRA (``test_adapters.py``)."""

from __future__ import annotations

import pytest
import torch

from ppo_core import create_reference_model
from tests.tiny import ARCHS, tiny_value_model

torch.set_num_threads(1)  # tiny models: extra threads only add spin-up cost

# The parameters before block 1: embeddings and block 0, per architecture (names inside the wrapper).
SHARED_PREFIXES = {
    "gpt2": ("pretrained_model.transformer.wte.", "pretrained_model.transformer.wpe.",
             "pretrained_model.transformer.h.0."),
    "llama": ("pretrained_model.model.embed_tokens.", "pretrained_model.model.layers.0."),
    "gpt_neox": ("pretrained_model.gpt_neox.embed_in.", "pretrained_model.gpt_neox.layers.0."),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_reference_model_shares_its_first_layers(arch):
    model = tiny_value_model(arch)
    ref = create_reference_model(model, num_shared_layers=1)
    policy = dict(model.named_parameters())
    ref_params = dict(ref.named_parameters())
    assert policy.keys() == ref_params.keys()
    shared = [n for n in policy if n.startswith(SHARED_PREFIXES[arch])]
    assert shared and len(shared) < len(policy)
    for name, param in policy.items():
        ref_param = ref_params[name]
        assert not ref_param.requires_grad, name
        if name in shared:
            assert ref_param is param and ref_param.data_ptr() == param.data_ptr(), name
            assert not param.requires_grad, name  # frozen in the trained model too
        else:
            assert ref_param.data_ptr() != param.data_ptr(), name
            torch.testing.assert_close(ref_param, param, atol=0, rtol=0)
            assert param.requires_grad, name
    assert not ref.training

    # the copy is independent: changing an unshared policy weight leaves the reference alone
    name = next(n for n in policy if n not in shared)
    before = ref_params[name].clone()
    with torch.no_grad():
        policy[name].add_(1.0)
    torch.testing.assert_close(ref_params[name], before, atol=0, rtol=0)


def test_reference_model_without_sharing_is_a_frozen_deep_copy():
    model = tiny_value_model("gpt2")
    ref = create_reference_model(model)
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
        assert param.requires_grad and not ref_param.requires_grad, name
        assert ref_param.data_ptr() != param.data_ptr(), name


def test_reference_model_with_an_explicit_pattern():
    model = tiny_value_model("gpt2")
    ref = create_reference_model(model, num_shared_layers=1, pattern="transformer.h.{layer}")
    shared = model.pretrained_model.transformer.h[0].attn.c_attn.weight
    assert ref.pretrained_model.transformer.h[0].attn.c_attn.weight is shared


@pytest.mark.parametrize("kwargs", [dict(num_shared_layers=1, pattern="decoder.blocks.{layer}"),
                                    dict(num_shared_layers=5)])  # the tiny models have 2 layers
def test_reference_model_bad_pattern_or_layer_is_rejected(kwargs):
    with pytest.raises(ValueError, match="pattern"):
        create_reference_model(tiny_value_model("gpt2"), **kwargs)

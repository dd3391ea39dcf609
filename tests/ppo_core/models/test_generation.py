"""ppo_core.models.generation: sampling (one categorical draw per row, the CPU fast path of torch.multinomial) and
the cut of a response after its first EOS. What PPOTrainer.generate does with them is in
``tests/ppo_core/test_trainer.py``."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from ppo_core.models.generation import cut_after_eos, fast_cpu_sampling, generation_setting, sample_categorical
from tests.tiny import EOS


def test_cut_after_eos():
    x = torch.tensor([5, 6, EOS, 7, EOS])
    assert cut_after_eos(x, {EOS}).tolist() == [5, 6, EOS]
    assert cut_after_eos(torch.tensor([EOS, 4]), {EOS}).tolist() == [EOS]
    assert cut_after_eos(torch.tensor([4, 5, 6]), {EOS}).tolist() == [4, 5, 6]
    assert cut_after_eos(torch.tensor([4, 9, EOS]), {EOS, 9}).tolist() == [4, 9]
    assert cut_after_eos(x, set()).tolist() == x.tolist()


def test_generation_setting_reads_the_call_then_the_model_s_config_then_the_default():
    config = GenerationConfig(do_sample=True, temperature=0.7)
    assert generation_setting("temperature", {"temperature": 1.3}, config, 1.0) == 1.3
    assert generation_setting("temperature", {}, config, 1.0) == 0.7
    assert generation_setting("temperature", {"temperature": None}, config, 1.0) == 1.0  # None: unset
    assert generation_setting("do_sample", {}, config, False) is True
    assert generation_setting("do_sample", {"do_sample": False}, config, False) is False
    assert generation_setting("do_sample", {}, None, False) is False  # a model without a generation config


def test_sample_categorical_draws_from_the_given_distribution():
    """200k draws from one unnormalised row: every frequency within 5 standard errors of its probability,
    and the zero-probability entries (first, middle, last) never drawn."""
    torch.manual_seed(0)
    weights = torch.tensor([0.0, 1.0, 0.0, 5.0, 0.5, 0.0, 2.5, 1e-3, 0.0])
    p = weights / weights.sum()
    n = 200_000
    draws = sample_categorical(weights.expand(n, -1))
    assert draws.shape == (n, 1) and draws.dtype == torch.long
    freq = torch.bincount(draws[:, 0], minlength=len(p)).double() / n
    stderr = (p.double() * (1 - p.double()) / n).sqrt()
    assert ((freq - p.double()).abs() <= 5 * stderr + 1e-12).all(), (freq, p)
    assert (freq[p == 0] == 0).all()


def test_sample_categorical_handles_a_single_entry_and_one_hot_rows():
    torch.manual_seed(1)
    one_hot = torch.zeros(50, 7)
    one_hot[torch.arange(50), torch.arange(50) % 7] = 1.0
    assert torch.equal(sample_categorical(one_hot)[:, 0], torch.arange(50) % 7)
    assert sample_categorical(torch.ones(3, 1)).tolist() == [[0], [0], [0]]


def test_fast_cpu_sampling_keeps_torch_errors_and_other_calls():
    with fast_cpu_sampling():
        with pytest.raises(RuntimeError, match="inf|nan"):  # an invalid row gets torch's own error
            torch.multinomial(torch.tensor([[0.5, float("nan")]]), 1)
        with pytest.raises(RuntimeError, match="sum of probabilities"):
            torch.multinomial(torch.zeros(1, 3), 1)
        assert torch.multinomial(torch.tensor([[0.0, 1.0, 0.0]]), 2, replacement=True).tolist() == [[1, 1]]  # torch's

"""ppo_core.models.cpu_attention: the float32 attention of bf16 CPU runs."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ppo_core import cpu_attention
from ppo_core.models.cpu_attention import float32_attention_on_cpu


@pytest.mark.parametrize("mask", ["causal", "bool", "float"])
def test_float32_attention_on_cpu_is_float32_attention_of_the_bf16_inputs(mask):
    """Inside the block a bf16 CPU attention is torch's float32 attention of the same (upcast) inputs, values
    and gradients, returned in bf16; float32 inputs get torch's kernel as they are."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=gen).bfloat16().requires_grad_() for _ in range(3))
    causal = torch.ones(5, 5).tril().bool()
    kwargs = {"causal": dict(is_causal=True), "bool": dict(attn_mask=causal),
              "float": dict(attn_mask=torch.zeros(5, 5).masked_fill(~causal, -math.inf).bfloat16())}[mask]
    with float32_attention_on_cpu():
        got = F.scaled_dot_product_attention(q, k, v, **kwargs)
        plain = F.scaled_dot_product_attention(q.detach().float(), k.detach().float(), v.detach().float(),
                                               is_causal=True)
    float_kwargs = {key: (m.float() if m.is_floating_point() else m) if key == "attn_mask" else m
                    for key, m in kwargs.items()}
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*leaves, **float_kwargs)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want.bfloat16(), atol=0, rtol=0)
    torch.testing.assert_close(plain, want.detach(), atol=0, rtol=0)  # float32 goes to torch untouched
    got.float().sum().backward()
    want.sum().backward()
    for mine, ref in zip((q, k, v), leaves):
        torch.testing.assert_close(mine.grad, ref.grad.bfloat16(), atol=0, rtol=0)


def test_float32_attention_on_cpu_can_be_switched_off():
    with float32_attention_on_cpu(enabled=False):
        assert F.scaled_dot_product_attention is cpu_attention._torch_sdpa


def _spy_on_torch_sdpa(monkeypatch) -> list[tuple]:
    """Record what torch's kernel is given inside the block: the inputs' dtypes and whether CPU autocast is on."""
    calls, torch_sdpa = [], cpu_attention._torch_sdpa

    def spy(query, key, value, *args, **kwargs):
        calls.append(((query.dtype, key.dtype, value.dtype), torch.is_autocast_enabled("cpu")))
        return torch_sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(cpu_attention, "_torch_sdpa", spy)
    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)  # the function the block swaps out, and back in
    return calls


def test_float32_inputs_under_bf16_autocast_get_float32_attention(monkeypatch):
    """Under CPU autocast to bf16, float32 inputs (a rotary model's query and key) would be cast down inside torch's
    attention: the block computes them in float32 with autocast off and returns bf16, as autocast's attention would."""
    calls = _spy_on_torch_sdpa(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 5, 8, generator=gen) for _ in range(2))
    v = torch.randn(2, 3, 5, 8, generator=gen).bfloat16()
    with torch.autocast("cpu", dtype=torch.bfloat16), float32_attention_on_cpu():
        got = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert calls == [((torch.float32,) * 3, False)]
    calls.clear()
    want = F.scaled_dot_product_attention(q, k, v.float(), is_causal=True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want.bfloat16(), atol=0, rtol=0)


def test_float32_attention_outside_autocast_is_left_alone(monkeypatch):
    calls = _spy_on_torch_sdpa(monkeypatch)
    q = torch.randn(1, 2, 4, 8)
    with float32_attention_on_cpu():
        out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert calls == [((torch.float32,) * 3, False)] and out.dtype == torch.float32


def test_a_rotary_model_under_bf16_autocast_gets_float32_attention(monkeypatch):
    """The case the dtype check once missed: Llama's rotary embedding turns its bf16 query and key float32 before
    attention; every layer's attention must still reach torch's kernel in float32, outside autocast."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config)
    calls = _spy_on_torch_sdpa(monkeypatch)
    with torch.autocast("cpu", dtype=torch.bfloat16), float32_attention_on_cpu():
        model.model(input_ids=torch.randint(0, 64, (2, 6)), use_cache=False)
    assert calls == [((torch.float32,) * 3, False)] * config.num_hidden_layers

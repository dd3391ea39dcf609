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

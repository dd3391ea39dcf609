"""Float32 attention for bf16 on the CPU, where torch's bf16 attention backward is slow.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)``, ``scaled_dot_product_attention`` runs in bf16, and
torch's CPU kernel for its bf16 backward costs over twice the float32 one (causal, ``(16, 4, 34, 64)``,
forward + backward on two cores: 8.2 ms against 3.6 ms), more than the rest of a small block's backward.
Within :func:`float32_attention_on_cpu`, attention on bf16 CPU tensors upcasts its inputs and casts its
output back: more precise and faster, while the matmuls around it keep bf16. transformers' attention calls
``torch.nn.functional.scaled_dot_product_attention`` at run time, so the block reaches every architecture
using it; GPU tensors and other dtypes go to torch's kernel unchanged.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..runtime.utils import swapped

_torch_sdpa = F.scaled_dot_product_attention  # the original, restored after every block


def _sdpa_float32_on_cpu(query, key, value, attn_mask=None, *args, **kwargs):
    """``scaled_dot_product_attention`` computed in float32 for bf16 CPU inputs; the output keeps their dtype."""
    if query.device.type != "cpu" or query.dtype != torch.bfloat16:
        return _torch_sdpa(query, key, value, attn_mask, *args, **kwargs)
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.float()
    with torch.autocast("cpu", enabled=False):
        out = _torch_sdpa(query.float(), key.float(), value.float(), attn_mask, *args, **kwargs)
    return out.to(query.dtype)


def float32_attention_on_cpu(enabled: bool = True):
    """Within the block, attention on bf16 CPU tensors runs in float32 (see the module docstring)."""
    return swapped(F, "scaled_dot_product_attention", _torch_sdpa, _sdpa_float32_on_cpu, enabled)


@contextlib.contextmanager
def scoring_precision(autocast: contextlib.AbstractContextManager, device: torch.device):
    """The scoring passes' precision: ``autocast`` (accelerate's), and on the CPU float32 attention for bf16 (faster
    there); sampling keeps plain autocast (forward only, where bf16 attention is faster)."""
    with autocast, float32_attention_on_cpu(device.type == "cpu"):
        yield

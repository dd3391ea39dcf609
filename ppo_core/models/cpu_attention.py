"""Float32 attention for bf16 on the CPU, where torch's bf16 attention backward is slow.

Under ``torch.autocast("cpu", dtype=torch.bfloat16)``, ``scaled_dot_product_attention`` runs in bf16, and
torch's CPU kernel for its bf16 backward costs over twice the float32 one (causal, ``(16, 4, 34, 64)``,
forward + backward on two cores: 8.2 ms against 3.6 ms), more than the rest of a small block's backward.
Within :func:`float32_attention_on_cpu`, a CPU attention that would run in bf16 upcasts its inputs and casts its
output back: more precise and faster, while the matmuls around it keep bf16. It would run in bf16 when an input is
bf16, or when CPU autocast to bf16 is on, whatever the inputs: a rotary model (Llama, Qwen, Mistral, ...) multiplies
the bf16 query and key by float32 cos/sin tables, so they reach attention in float32 and autocast casts them down
inside the call (the check once looked at the query's dtype alone and missed every rotary model). transformers'
attention calls ``torch.nn.functional.scaled_dot_product_attention`` at run time, so the block reaches every
architecture using it; GPU tensors and float32 attention outside autocast go to torch's kernel unchanged.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..runtime.utils import swapped

_torch_sdpa = F.scaled_dot_product_attention  # the original, restored after every block


def _runs_in_bf16(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether torch's attention would compute in bf16 on these CPU tensors: one of them is bf16, or CPU autocast to
    bf16 is on (it casts float32 inputs down)."""
    if any(t.dtype == torch.bfloat16 for t in (query, key, value)):
        return True
    return torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def _sdpa_float32_on_cpu(query, key, value, attn_mask=None, *args, **kwargs):
    """``scaled_dot_product_attention`` computed in float32 where torch would compute it in bf16 on the CPU; the
    output is bf16, as torch's would be."""
    if query.device.type != "cpu" or not _runs_in_bf16(query, key, value):
        return _torch_sdpa(query, key, value, attn_mask, *args, **kwargs)
    if attn_mask is not None and attn_mask.is_floating_point():
        attn_mask = attn_mask.float()
    with torch.autocast("cpu", enabled=False):
        out = _torch_sdpa(query.float(), key.float(), value.float(), attn_mask, *args, **kwargs)
    return out.to(torch.bfloat16)


def float32_attention_on_cpu(enabled: bool = True):
    """Within the block, attention on bf16 CPU tensors runs in float32 (see the module docstring)."""
    return swapped(F, "scaled_dot_product_attention", _torch_sdpa, _sdpa_float32_on_cpu, enabled)


@contextlib.contextmanager
def scoring_precision(autocast: contextlib.AbstractContextManager, device: torch.device):
    """The scoring passes' precision: ``autocast`` (accelerate's), and on the CPU float32 attention for bf16 (faster
    there); sampling keeps plain autocast (forward only, where bf16 attention is faster)."""
    with autocast, float32_attention_on_cpu(device.type == "cpu"):
        yield

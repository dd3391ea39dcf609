"""ppo_core.runtime.utils: ``swapped``, the scoped replacement of a library function that the CPU fast paths (sampling,
attention) are made of."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ppo_core import cpu_attention, generation
from ppo_core.models.cpu_attention import float32_attention_on_cpu
from ppo_core.models.generation import fast_cpu_sampling
from ppo_core.runtime.utils import swapped


@pytest.mark.parametrize("block, owner, name, original", [
    (fast_cpu_sampling, torch, "multinomial", generation._torch_multinomial),
    (float32_attention_on_cpu, F, "scaled_dot_product_attention", cpu_attention._torch_sdpa),
], ids=["fast_cpu_sampling", "float32_attention_on_cpu"])
def test_cpu_fast_paths_swap_torch_only_inside_the_block(block, owner, name, original):
    assert getattr(owner, name) is original
    with pytest.raises(RuntimeError, match="boom"), block():
        assert getattr(owner, name) is not original
        with block():  # nested: still swapped, restored by the outer block only
            pass
        assert getattr(owner, name) is not original
        raise RuntimeError("boom")
    assert getattr(owner, name) is original


def test_swapped_leaves_someone_elses_replacement_alone():
    class Owner:
        fn = staticmethod(abs)

    theirs = Owner.fn
    with swapped(Owner, "fn", len, round):  # Owner.fn is not the original it was told about
        assert Owner.fn is theirs
    assert Owner.fn is theirs
    with swapped(Owner, "fn", theirs, round, enabled=False):
        assert Owner.fn is theirs

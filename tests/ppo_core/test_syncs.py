"""Host syncs and collectives in the hot loops, counted on the CPU so that they cannot creep back.

A GPU waits for Python at every read of a device value (``tests/syncs.py`` counts them). Per PPO mini-batch the
trainer reads once (its decision: the global mean ratio, the skip, any non-finite statistic) and once more per
optimizer update (the gradient norm); a step adds a handful (the scores' check, the whitening's token count, the stats'
tokens, the legacy negative-KL warning); generation reads a batch's tokens back once. Under N processes a mini-batch
takes four collectives (the token count, the two passes of the variances, the decision). The transformers model's own
syncs (its forward and its generation loop) are not counted: they are not this project's.
"""

from __future__ import annotations

import pytest
import torch

from tests.ppo_core.test_trainer import make_batch, make_trainer
from tests.syncs import HostSyncs
from tests.tiny import PAD, random_queries

torch.set_num_threads(1)


def step_syncs(**config) -> HostSyncs:
    """The host syncs of the second step of a trainer on 8 samples (the first warms up)."""
    trainer = make_trainer(batch_size=8, **config)
    batch = make_batch(8)
    trainer.step(*batch)
    with HostSyncs() as syncs:
        for model in (trainer.model, trainer.ref_model):
            syncs.outside(model.pretrained_model.transformer)  # transformers' own forward
        trainer.step(*batch)
    return syncs


def test_a_step_reads_from_the_device_once_per_minibatch_and_once_per_update():
    few = step_syncs(mini_batch_size=4, ppo_epochs=1)  # 2 mini-batches, 2 updates
    many = step_syncs(mini_batch_size=2, ppo_epochs=2)  # 8 mini-batches, 8 updates
    # was 28: a bool(isfinite(...)) per statistic, int(max) and nonzero per pass, a masked_var check per variance
    assert (many.total - few.total) / (8 - 2) <= 2, (few.counts, many.counts)
    assert few.total - 2 * 2 <= 6, few.counts  # per step: 5 (+1 on a GPU, the stats' one copy to the host)


class TwinProcesses:
    """``ProcessGroup``'s collectives for two processes that hold the same samples, in one: a sum doubles, a gather
    repeats. A trainer given it computes what each of the two would, and its collectives are counted."""

    num_processes, process_index = 2, 0

    def __init__(self, device: torch.device):
        self.device, self.calls = device, 0

    def sum_across(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return 2 * x.detach()

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.cat([x.detach(), x.detach()])

    def gather_object(self, obj):
        self.calls += 1
        return [obj, obj]


def collectives_per_step(mini_batch_size: int, ppo_epochs: int) -> int:
    trainer = make_trainer(batch_size=8, mini_batch_size=mini_batch_size, ppo_epochs=ppo_epochs)
    trainer._group = group = TwinProcesses(trainer.current_device)
    trainer.step(*make_batch(8))
    return group.calls


def test_a_minibatch_takes_four_collectives_under_several_processes():
    """The token count, the two passes of both variances, and the decision (the mean ratio with the non-finite
    count): four collectives per mini-batch, where there were seven."""
    per_minibatch = (collectives_per_step(2, 2) - collectives_per_step(4, 1)) / (8 - 2)
    assert per_minibatch == 4


@pytest.mark.parametrize("n_queries,batch_size", [(2, 8), (6, 8), (6, 2)])
def test_generate_reads_the_tokens_back_once_per_batch(n_queries, batch_size):
    """The cut after EOS reads each batch's tokens back in one copy (it read each response's first EOS, twice)."""
    trainer = make_trainer()
    queries = random_queries(n_queries, seed=1)
    with HostSyncs() as syncs:
        syncs.outside(trainer.model.pretrained_model, "generate")  # transformers' generation loop
        responses = trainer.generate(queries, batch_size=batch_size, return_prompt=False, max_new_tokens=5,
                                     pad_token_id=PAD)
    assert len(responses) == n_queries
    assert syncs.total == -(-n_queries // batch_size), syncs.counts


def test_a_list_of_tensors_is_moved_in_one_copy():
    """``moved``: one copy of the concatenated tensors, split into views of it (here to the meta device, the one
    other device a CPU has); already there, the tensors themselves."""
    from ppo_core.runtime.utils import moved

    tensors = [torch.arange(n) for n in (3, 1, 4)]
    assert all(a is b for a, b in zip(moved(tensors, "cpu"), tensors))
    on_meta = moved(tensors, "meta")
    assert [t.shape for t in on_meta] == [t.shape for t in tensors] and {t.device.type for t in on_meta} == {"meta"}
    assert on_meta[0]._base is not None and all(t._base is on_meta[0]._base for t in on_meta)  # views of one copy

"""ppo_core.step.rollout: the step's batch of (query, response) sequences, its chunked passes and its mini-batches."""

from __future__ import annotations

import torch

from ppo_core.step.inputs import build_model_inputs, model_inputs
from ppo_core.step.rollout import PolicyOutputs, Rollout, concat_outputs
from tests.ppo_core.test_trainer import make_batch
from tests.tiny import PAD


def inputs_of(lengths: list[int]):
    queries = [torch.tensor([3, 4])] * len(lengths)
    responses = [torch.arange(10, 10 + n) for n in lengths]
    return model_inputs(queries, responses, pad_token_id=0)


def test_chunks_are_concatenated_field_by_field_entropy_included():
    """The chunks of a pass have their own response widths: each field is padded to the batch's (the entropy used
    to be dropped)."""
    inputs = inputs_of([1, 3, 2])
    parts = [PolicyOutputs(torch.ones(1, 1), torch.ones(1, 1), torch.full((1, 1), 2.0), None),
             PolicyOutputs(torch.ones(2, 3), torch.ones(2, 3), torch.full((2, 3), 2.0), None)]
    out = concat_outputs(parts, inputs)
    assert out.logprobs.shape == out.values.shape == out.entropy.shape == (3, 3)
    assert out.entropy[0].tolist() == [2.0, 0.0, 0.0] and out.hidden is None
    no_entropy = concat_outputs([p._replace(entropy=None) for p in parts], inputs)
    assert no_entropy.entropy is None


def test_a_minibatch_takes_its_samples_trimmed_to_their_longest_response_and_keeps_the_step_s_sizes():
    inputs = inputs_of([1, 4, 2, 3])
    mask = inputs.response_mask().float()
    per_sample = [torch.arange(16.0).view(4, 4) + k for k in range(5)]
    rollout = Rollout(inputs, mask, *per_sample, norm_length=torch.tensor(4))
    mb = rollout.minibatch(torch.tensor([2, 0]))
    assert mb.mask.shape == (2, 2) and mb.mask.tolist() == [[1.0, 1.0], [1.0, 0.0]]
    assert mb.advantages.tolist() == [[11.0, 12.0], [3.0, 4.0]]  # the 4th per-sample field: + 3
    assert mb.norm_length.item() == 4  # the global batch's, not the mini-batch's
    assert mb.inputs.input_ids.shape[0] == 2 and mb.inputs.host_lens.tolist() == inputs.host_lens[[2, 0]].tolist()


def test_a_rollout_mini_batch_is_every_tensor_sliced_by_hand():
    """``Rollout.minibatch(idx)``: the rows ``idx`` of every field, the response-aligned ones cut to the longest
    response among those rows (the optimiser's one indexing call)."""
    from ppo_core.step.rollout import Rollout

    queries, responses, _ = make_batch(n=6, seed=3)
    inputs = build_model_inputs(queries, responses, PAD)
    width = int(inputs.response_lens.max())
    gen = torch.Generator().manual_seed(0)
    rollout = Rollout(inputs, inputs.response_mask().float(), *(torch.randn(6, width, generator=gen) for _ in range(5)))
    idx = torch.tensor([4, 0, 3])  # responses of 5, 4 and 3 tokens, the longest has 6
    mb = rollout.minibatch(idx)
    cut = max(len(responses[i]) for i in idx.tolist())
    assert cut < width  # the trimming is exercised
    for got, given in zip(mb.inputs, inputs):
        assert got is given is None or torch.equal(got, given[idx])
    for name in ("mask", "old_logprobs", "old_values", "ref_logprobs", "advantages", "returns"):
        assert torch.equal(getattr(mb, name), getattr(rollout, name)[idx][:, :cut]), name

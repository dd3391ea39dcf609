"""ppo_core.step.rollout: the step's batch of (query, response) sequences, its chunked passes and its mini-batches."""

from __future__ import annotations

import pytest
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


def test_response_logprobs_is_the_public_scoring_pass_of_any_lm():
    """``ppo_core.response_logprobs``: each response token's log-probability under the full-vocabulary softmax of the
    model's own logits, 0 past a response's end, the same from a plain LM and from its value-head model, and without a
    draw from the global RNG (the wrapper's value head is made in a forked stream); an encoder-decoder scores the
    response after the decoder start token."""
    from ppo_core import AutoModelForCausalLMWithValueHead, response_logprobs
    from tests.tiny import random_queries, tiny_causal_lm, tiny_seq2seq_lm

    lm = tiny_causal_lm("llama").eval()
    queries, responses = random_queries(3, seed=1), random_queries(3, seed=2, min_len=1, max_len=4)
    state = torch.random.get_rng_state()
    got = response_logprobs(lm, queries, responses)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert got.shape == (3, max(len(r) for r in responses))
    for row, q, r in zip(got, queries, responses):
        with torch.no_grad():
            logits = lm(torch.cat([q, r])[None]).logits[0, len(q) - 1:-1]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, r[:, None])[:, 0]
        torch.testing.assert_close(row[:len(r)], expected, rtol=1e-5, atol=1e-5)
        assert (row[len(r):] == 0).all()
    torch.testing.assert_close(response_logprobs(AutoModelForCausalLMWithValueHead(lm), queries, responses), got)

    t5 = tiny_seq2seq_lm("t5").eval()
    got = response_logprobs(t5, queries, responses)
    for row, q, r in zip(got, queries, responses):
        start = torch.tensor([t5.config.decoder_start_token_id])
        with torch.no_grad():
            logits = t5(input_ids=q[None], decoder_input_ids=torch.cat([start, r])[None]).logits[0, :-1]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, r[:, None])[:, 0]
        torch.testing.assert_close(row[:len(r)], expected, rtol=1e-5, atol=1e-5)


def _tiny_gemma2():
    """A 2-layer Gemma-2: a final logit soft cap, which the sampling temperature must divide after (as the logits
    processor divides what the model outputs)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=0.5,
                          pad_token_id=0)
    return Gemma2ForCausalLM(config).eval()


@pytest.mark.parametrize("arch", ["llama", "gemma2", "t5"])
def test_response_logprobs_at_a_temperature_are_those_of_the_distribution_sampled(arch):
    """At ``temperature`` T the scoring pass is ``log_softmax(logits / T)`` of the model's own logits (Gemma-2's after
    its soft cap, T5's after its rescaled head): what ``generate(do_sample=True, temperature=T)`` samples from."""
    from ppo_core import response_logprobs
    from tests.tiny import random_queries, tiny_causal_lm, tiny_seq2seq_lm

    lm = {"llama": lambda: tiny_causal_lm("llama").eval(), "gemma2": _tiny_gemma2,
          "t5": lambda: tiny_seq2seq_lm("t5").eval()}[arch]()
    queries, responses = random_queries(3, seed=1), random_queries(3, seed=2, min_len=1, max_len=4)
    got = response_logprobs(lm, queries, responses, temperature=0.7)
    at_one = response_logprobs(lm, queries, responses)
    for row, row_at_one, q, r in zip(got, at_one, queries, responses):
        with torch.no_grad():
            if lm.config.is_encoder_decoder:
                start = torch.tensor([lm.config.decoder_start_token_id])
                logits = lm(input_ids=q[None], decoder_input_ids=torch.cat([start, r])[None]).logits[0, :-1]
            else:
                logits = lm(torch.cat([q, r])[None]).logits[0, len(q) - 1:-1]
        expected = torch.log_softmax(logits.float() / 0.7, -1).gather(-1, r[:, None])[:, 0]
        torch.testing.assert_close(row[:len(r)], expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(row[:len(r)], row_at_one[:len(r)], atol=1e-3)  # the temperature did something

"""Encoder-decoder policies (T5, BART): queries to the encoder, responses to the decoder, scored on the fast path
exactly as the full forward scores them, sampled and trained with the legacy API."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForSeq2SeqLM

from ppo_core import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, PPOConfig, PPOTrainer
from ppo_core.models.modeling import VALUE_HEAD_FILE
from ppo_core.step.inputs import build_seq2seq_inputs
from ppo_core.step.rollout import policy_outputs
from tests.ppo_core.test_trainer import LEGACY_KEYS, assert_all_finite
from tests.tiny import EOS, PAD, SEQ2SEQ_ARCHS, VOCAB, random_queries, tiny_causal_lm, tiny_seq2seq_lm, tiny_tokenizer

torch.set_num_threads(1)  # tiny models: extra threads only add spin-up cost


def value_model(arch: str = "t5", seed: int = 0) -> AutoModelForSeq2SeqLMWithValueHead:
    base = tiny_seq2seq_lm(arch, seed=seed)
    torch.manual_seed(seed + 1)
    return AutoModelForSeq2SeqLMWithValueHead(base)


def make_trainer(model=None, **overrides) -> PPOTrainer:
    options = dict(batch_size=4, mini_batch_size=2, ppo_epochs=2, learning_rate=1e-3, seed=0)
    return PPOTrainer(PPOConfig(**{**options, **overrides}), model or value_model(), tokenizer=tiny_tokenizer())


def batch(seed: int = 0):
    queries = random_queries(4, seed=seed, min_len=1, max_len=6)
    gen = torch.Generator().manual_seed(seed + 100)
    responses = [torch.randint(3, VOCAB, (k,), generator=gen) for k in (1, 6, 3, 4)]
    responses[2][-1] = EOS
    return queries, responses


def full_forward_logprobs(model, query, response):
    """One unpadded example through the legacy forward: ``log_softmax`` of the full logits at the response."""
    start = torch.tensor([model.config.decoder_start_token_id])
    logits, _, values = model(query[None], decoder_input_ids=torch.cat([start, response])[None])
    logprobs = torch.log_softmax(logits[0, :-1], -1).gather(-1, response[:, None]).squeeze(-1)  # (R,)
    return logprobs, values[0, :-1]


@pytest.mark.parametrize("arch", SEQ2SEQ_ARCHS)
def test_fast_path_matches_the_full_forward(arch):
    model = value_model(arch).eval()
    if arch == "t5":  # the T5 head sees the decoder output times d_model ** -0.5: folded into the logit scale
        assert model.lm_head().scale == pytest.approx(32 ** -0.5)
    queries, responses = batch()
    inputs = build_seq2seq_inputs(queries, responses, model.config.decoder_start_token_id, PAD)
    with torch.no_grad():
        out = policy_outputs(model, inputs, with_entropy=True, chunk_size=3)
        for i, (q, r) in enumerate(zip(queries, responses)):
            logprobs, values = full_forward_logprobs(model, q, r)
            torch.testing.assert_close(out.logprobs[i, :len(r)], logprobs, atol=1e-5, rtol=0)
            torch.testing.assert_close(out.values[i, :len(r)], values, atol=1e-5, rtol=0)
            assert torch.all(out.logprobs[i, len(r):] == 0) and torch.all(out.entropy[i, :len(r)] > 0)


@pytest.mark.parametrize("arch", ["t5", "bart"])
def test_fast_path_gradients_match_the_full_forward(arch):
    queries, responses = batch(seed=1)
    grads = []
    for fast in (True, False):
        model = value_model(arch).eval()
        if fast:
            inputs = build_seq2seq_inputs(queries, responses, model.config.decoder_start_token_id, PAD)
            total = policy_outputs(model, inputs).logprobs.sum()
        else:
            total = sum(full_forward_logprobs(model, q, r)[0].sum() for q, r in zip(queries, responses))
        total.backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], atol=1e-5, rtol=1e-4, msg=name)


def test_generate_returns_the_decoder_tokens_after_the_start_token():
    trainer = make_trainer(value_model("t5"))
    model = trainer.model.pretrained_model
    queries = random_queries(5, seed=2, min_len=1, max_len=7)  # mixed lengths: the encoder input is padded
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD)
    responses = trainer.generate(queries, batch_size=3, return_prompt=False, **kwargs)
    with_prompt = trainer.generate(queries, batch_size=3, **kwargs)  # no prompt in a decoder's output
    assert [r.tolist() for r in with_prompt] == [r.tolist() for r in responses]
    for query, response in zip(queries, responses):
        alone = model.generate(input_ids=query[None], attention_mask=torch.ones_like(query[None]), **kwargs)[0]
        assert alone[0] == model.config.decoder_start_token_id
        expected = alone[1:]
        if EOS in expected.tolist():
            expected = expected[: expected.tolist().index(EOS) + 1]
        assert response.tolist() == expected.tolist()  # batching and padding change nothing
    single = trainer.generate(queries[0], **kwargs)  # legacy: a (1, L) tensor (one sequence stops at its EOS)
    assert single.shape == (1, len(responses[0])) and single[0].tolist() == responses[0].tolist()


@pytest.mark.parametrize("arch,kl_penalty", [("t5", "kl"), ("bart", "full")])
def test_ppo_steps_on_an_encoder_decoder(arch, kl_penalty):
    model = value_model(arch)
    trainer = make_trainer(model, kl_penalty=kl_penalty)
    assert trainer.config.is_encoder_decoder and not trainer.config.is_peft_model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(2):
        queries = random_queries(4, seed=step)
        responses = trainer.generate(queries, return_prompt=False, max_new_tokens=5, do_sample=True, top_k=0,
                                     pad_token_id=PAD)
        stats = trainer.step(queries, responses, [torch.tensor(float(len(r))) for r in responses])
        assert not [k for k in LEGACY_KEYS if k not in stats]
        assert_all_finite(stats)
        assert stats["tokens/responses_len_mean"] == pytest.approx(sum(len(r) for r in responses) / 4)
        if step == 0:  # the reference is a copy of the policy; its frozen weights take the chunked
            # log-softmax path and the policy's the one-shot path (logprobs.py), which round differently
            assert abs(stats["objective/kl"]) < 1e-5
    assert stats["objective/kl"] != 0
    assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)
    assert all(torch.equal(p, before[n]) for n, p in trainer.ref_model.named_parameters())


def test_legacy_responses_with_the_start_token_warn():
    trainer = make_trainer()
    queries, responses = batch()
    legacy = [torch.cat([torch.tensor([PAD]), r]) for r in responses]  # what legacy TRL's generate returned
    with pytest.warns(UserWarning, match="decoder start token"):
        trainer.step(queries, legacy, [torch.tensor(1.0)] * 4)


def test_save_and_load_round_trip(tmp_path):
    model = value_model("t5").eval()
    with torch.no_grad():
        model.v_head.summary.weight.add_(1.0)
    model.save_pretrained(str(tmp_path))
    assert (tmp_path / VALUE_HEAD_FILE).is_file()
    loaded = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(str(tmp_path)).eval()
    state, expected = loaded.state_dict(), model.state_dict()
    assert state.keys() == expected.keys()
    for key in state:
        torch.testing.assert_close(state[key], expected[key], atol=0, rtol=0, msg=key)
    plain = AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path)).eval()
    query, decoder = torch.tensor([[5, 6, 7]]), torch.tensor([[PAD, 9, 10]])
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=query, decoder_input_ids=decoder).logits,
                                   model(query, decoder_input_ids=decoder)[0], atol=0, rtol=0)


def test_architecture_mismatches_and_a_missing_start_token_are_rejected():
    with pytest.raises(ValueError, match="wrap it with AutoModelForSeq2SeqLMWithValueHead"):
        AutoModelForCausalLMWithValueHead(tiny_seq2seq_lm("t5"))
    with pytest.raises(ValueError, match="wrap it with AutoModelForCausalLMWithValueHead"):
        AutoModelForSeq2SeqLMWithValueHead(tiny_causal_lm("gpt2"))
    model = value_model("t5")
    model.config.decoder_start_token_id = None
    model.transformers_model.generation_config.decoder_start_token_id = None
    with pytest.raises(ValueError, match="decoder_start_token_id"):
        make_trainer(model)

"""PPOTrainer: generation (padding, EOS, position ids), step() validation, stats and the loop's options."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import LogitsProcessor, LogitsProcessorList

from ppo_core import AutoModelForCausalLMWithValueHead, LengthSampler, PPOConfig, PPOTrainer
from ppo_core.step.inputs import build_model_inputs
from ppo_core.step.rollout import policy_outputs
from tests.tiny import ARCHS, EOS, PAD, VOCAB, random_queries, tiny_causal_lm, tiny_tokenizer, tiny_value_model

torch.set_num_threads(1)  # tiny models: extra threads only add spin-up cost

LEGACY_KEYS = [
    "objective/kl", "objective/kl_coef", "objective/entropy",
    "ppo/loss/policy", "ppo/loss/value", "ppo/loss/total",
    "ppo/policy/entropy", "ppo/policy/approxkl", "ppo/policy/policykl", "ppo/policy/clipfrac",
    "ppo/policy/advantages_mean", "ppo/returns/mean", "ppo/returns/var",
    "ppo/val/vpred", "ppo/val/error", "ppo/val/clipfrac", "ppo/val/mean", "ppo/val/var", "ppo/val/var_explained",
    "ppo/mean_scores", "ppo/std_scores", "ppo/mean_non_score_reward",
    "tokens/queries_len_mean", "tokens/responses_len_mean", "ppo/learning_rate",
]
TIME_KEYS = ["time/ppo/forward_pass", "time/ppo/compute_rewards", "time/ppo/compute_advantages",
             "time/ppo/optimize_step", "time/ppo/calc_stats", "time/ppo/total"]


def make_trainer(arch: str = "gpt2", model=None, tokenizer=None, seed: int = 0, **config):
    options = dict(batch_size=4, mini_batch_size=2, ppo_epochs=2, learning_rate=1e-3, seed=seed)
    options.update(config)
    trainer_kwargs = {k: options.pop(k) for k in ("ref_model", "optimizer", "lr_scheduler", "num_shared_layers")
                      if k in options}
    return PPOTrainer(PPOConfig(**options), model if model is not None else tiny_value_model(arch, seed=seed),
                      tokenizer=tokenizer or tiny_tokenizer(), **trainer_kwargs)


def make_batch(n: int = 4, seed: int = 0, max_response: int = 6):
    """``n`` random (query, response, score) triples with mixed lengths (responses need not be samples)."""
    gen = torch.Generator().manual_seed(seed + 1000)
    queries = random_queries(n, seed=seed)
    lengths = torch.randint(1, max_response + 1, (n,), generator=gen)
    responses = [torch.randint(3, VOCAB, (int(k),), generator=gen) for k in lengths]
    scores = list(torch.randn(n, generator=gen))
    return queries, responses, scores


def assert_all_finite(stats: dict):
    bad = [k for k, v in stats.items() if not np.all(np.isfinite(np.asarray(v, dtype=np.float64)))]
    assert not bad, f"non-finite stats: {bad}"


def params_snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------------
# generation
# ---------------------------------------------------------------------------------------------------
MARK = 3  # "w3" ends every query of the EOS tests and is never generated


class ForceEosAt(LogitsProcessor):
    """The row whose query is ``[..., 10 + k, MARK]`` samples EOS as its ``k``-th new token (0-based).

    Until then EOS, PAD and MARK are banned, so each response's first EOS is exactly at ``k``, whatever
    the left padding and the chunking of the batch.
    """

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, [EOS, PAD, MARK]] = -math.inf
        for i, row in enumerate(input_ids):
            end = int((row == MARK).nonzero()[-1])  # the query's last token
            k = int(row[end - 1]) - 10
            if input_ids.shape[1] - end - 1 == k:
                scores[i] = -math.inf
                scores[i, EOS] = 0.0
        return scores


def eos_queries(ks, seed=0):
    gen = torch.Generator().manual_seed(seed)
    prefixes = torch.randint(0, 5, (len(ks),), generator=gen)
    return [torch.cat([torch.randint(11, VOCAB, (int(p),), generator=gen), torch.tensor([10 + k, MARK])])
            for k, p in zip(ks, prefixes)]


@pytest.mark.parametrize("pad_token_id", [PAD, EOS])  # a distinct pad token, and the seed's pad = eos
def test_generate_cuts_each_response_after_its_first_eos(pad_token_id):
    trainer = make_trainer()
    ks = [0, 2, 4, 9, 1, 3]  # 9 >= max_new_tokens: that response never ends
    queries = eos_queries(ks)
    kwargs = dict(max_new_tokens=6, do_sample=True, top_k=0, top_p=1.0, pad_token_id=pad_token_id,
                  logits_processor=LogitsProcessorList([ForceEosAt()]))
    responses = trainer.generate(queries, return_prompt=False, **kwargs)  # chunks of 4 and 2, mixed widths
    assert isinstance(responses, list) and len(responses) == len(queries)
    for k, response in zip(ks, responses):
        assert len(response) == min(k + 1, 6)
        assert (response[-1] == EOS) == (k < 6)
        assert not torch.isin(response[:-1], torch.tensor([EOS, PAD, MARK])).any()

    full = trainer.generate(queries, return_prompt=True, **kwargs)
    for k, query, sequence in zip(ks, queries, full):
        assert torch.equal(sequence[:len(query)], query)  # the prompt, without its left padding
        response = sequence[len(query):]
        assert len(response) == min(k + 1, 6)
        assert not torch.isin(response[:-1], torch.tensor([EOS, PAD])).any()


def test_generate_without_forcing_has_no_pad_and_no_early_eos():
    trainer = make_trainer()
    queries = random_queries(7, seed=3)
    responses = trainer.generate(queries, return_prompt=False, batch_size=3, max_new_tokens=12, do_sample=True,
                                 top_k=0, top_p=1.0, suppress_tokens=[PAD], pad_token_id=PAD)
    assert all(1 <= len(r) <= 12 for r in responses)
    for response in responses:
        assert EOS not in response[:-1].tolist()
        assert PAD not in response.tolist()


def test_generate_single_tensor_and_rejections():
    trainer = make_trainer()
    query = torch.tensor([5, 6, 7])
    out = trainer.generate(query, max_new_tokens=4, do_sample=True, suppress_tokens=[EOS])
    assert out.shape == (1, 3 + 4)
    assert torch.equal(out[0, :3], query)
    out = trainer.generate(query, return_prompt=False, max_new_tokens=4, do_sample=True, suppress_tokens=[EOS])
    assert out.shape == (1, 4)
    with pytest.raises(ValueError, match="1-D"):
        trainer.generate(torch.stack([query, query]), max_new_tokens=2)
    with pytest.raises(ValueError, match="list"):
        trainer.generate([], max_new_tokens=2)


def test_generate_length_sampler_and_ref_response():
    trainer = make_trainer()
    queries = random_queries(5, seed=1)
    responses, ref_responses = trainer.generate(
        queries, length_sampler=LengthSampler(2, 4, seed=0), return_prompt=False, generate_ref_response=True,
        do_sample=True, suppress_tokens=[EOS])
    assert len(responses) == len(ref_responses) == 5
    assert all(len(r) in (2, 3) for r in responses + ref_responses)


def left_padded_logprobs(model, queries, responses):
    """Log-probs of the response tokens from one left-padded forward, position ids from the attention mask
    (what generation sees)."""
    sequences = [torch.cat([q, r]) for q, r in zip(queries, responses)]
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), PAD)
    attention_mask = torch.zeros_like(input_ids)
    for i, s in enumerate(sequences):
        input_ids[i, width - len(s):], attention_mask[i, width - len(s):] = s, 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model.pretrained_model(input_ids=input_ids, attention_mask=attention_mask,
                                    position_ids=position_ids).logits
    out = []
    for i, (q, r) in enumerate(zip(queries, responses)):
        first = width - len(sequences[i]) + len(q) - 1  # position predicting response token 0
        lp = torch.log_softmax(logits[i, first:first + len(r)], -1).gather(-1, r[:, None]).squeeze(-1)
        out.append(lp)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_scoring_positions_match_left_padded_generation(arch):
    model = tiny_value_model(arch).eval()
    queries = random_queries(4, seed=5, min_len=1, max_len=7)
    gen = torch.Generator().manual_seed(9)
    responses = [torch.randint(3, VOCAB, (k,), generator=gen) for k in (4, 1, 6, 3)]
    with torch.no_grad():
        right = policy_outputs(model, build_model_inputs(queries, responses, PAD))
        left = left_padded_logprobs(model, queries, responses)
    for i, r in enumerate(responses):
        torch.testing.assert_close(right.logprobs[i, :len(r)], left[i], atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_generation_scores_match_policy_outputs(arch):
    """The distribution the tokens were sampled from (KV-cached, left-padded) is the one step() scores."""
    model = tiny_value_model(arch).eval()
    queries = random_queries(3, seed=6, min_len=1, max_len=6)
    width = max(len(q) for q in queries)
    input_ids = torch.full((3, width), PAD)
    attention_mask = torch.zeros_like(input_ids)
    for i, q in enumerate(queries):
        input_ids[i, width - len(q):], attention_mask[i, width - len(q):] = q, 1
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.pretrained_model.generate(
            input_ids=input_ids, attention_mask=attention_mask, do_sample=True, max_new_tokens=5, top_k=0,
            suppress_tokens=[EOS, PAD], pad_token_id=PAD, output_logits=True, return_dict_in_generate=True)
        responses = list(out.sequences[:, width:])
        logits = torch.stack(out.logits, dim=1).float()  # (B, 5, V), raw
        sampled = torch.log_softmax(logits, -1).gather(-1, out.sequences[:, width:, None]).squeeze(-1)
        scored = policy_outputs(model, build_model_inputs(queries, responses, PAD)).logprobs
    torch.testing.assert_close(scored, sampled, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------------
# step(): validation
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer():
    return make_trainer()


def test_step_rejects_wrong_batch_sizes(trainer):
    queries, responses, scores = make_batch(4)
    with pytest.raises(ValueError, match=r"batch size \(4\).*queries \(3\)"):
        trainer.step(queries[:3], responses, scores)
    with pytest.raises(ValueError, match=r"batch size \(4\).*responses \(5\)"):
        trainer.step(queries, responses + responses[:1], scores)
    with pytest.raises(ValueError, match=r"batch size \(4\).*scores \(2\)"):
        trainer.step(queries, responses, scores[:2])
    with pytest.raises(ValueError, match="list"):
        trainer.step(torch.stack([q[:2] for q in queries]), responses, scores)


@pytest.mark.parametrize("bad_score,match", [(torch.tensor([1.0, 2.0]), "scalar"), (torch.ones(1, 1), "scalar"),
                                             (torch.tensor(float("nan")), "finite"),
                                             (torch.tensor(float("inf")), "finite"), ("high", "")])
def test_step_rejects_bad_scores(trainer, bad_score, match):
    queries, responses, scores = make_batch(4)
    scores[2] = bad_score
    with pytest.raises(ValueError, match=r"scores\[2\].*" + match):
        trainer.step(queries, responses, scores)


def test_step_accepts_one_element_scores_and_numbers(trainer):
    queries, responses, _ = make_batch(4)
    stats = trainer.step(queries, responses, [torch.tensor([1.0]), 2.0, torch.tensor(3), torch.tensor(4.0)])
    assert stats["ppo/mean_scores"] == pytest.approx(2.5)


def test_step_rejects_empty_responses_and_bad_tensors(trainer):
    queries, responses, scores = make_batch(4)
    responses[1] = torch.tensor([], dtype=torch.long)
    with pytest.raises(ValueError, match=r"responses\[1\].*empty"):
        trainer.step(queries, responses, scores)
    queries, responses, scores = make_batch(4)
    queries[0] = queries[0][None]
    with pytest.raises(ValueError, match=r"queries\[0\].*1-D"):
        trainer.step(queries, responses, scores)


def test_step_rejects_empty_queries(trainer):
    # the first response token is predicted from the last query position: without one there is nothing to
    # condition on, and position -1 would silently wrap around to the end of the padded sequence
    queries, responses, scores = make_batch(4)
    queries[3] = torch.tensor([], dtype=torch.long)
    with pytest.raises(ValueError, match=r"queries\[3\]"):
        trainer.step(queries, responses, scores)


def test_step_rejects_mismatched_response_masks(trainer):
    queries, responses, scores = make_batch(4)
    masks = [torch.ones(len(r)) for r in responses]
    masks[0] = torch.ones(len(responses[0]) + 1)
    with pytest.raises(ValueError, match=r"response_masks\[0\]"):
        trainer.step(queries, responses, scores, response_masks=masks)
    with pytest.raises(ValueError, match="response_masks"):
        trainer.step(queries, responses, scores, response_masks=masks[:2])


def test_constructor_rejects_bad_arguments():
    model, tok = tiny_value_model(), tiny_tokenizer()
    with pytest.raises(ValueError, match="PPOConfig"):
        PPOTrainer({"batch_size": 4}, model, tokenizer=tok)
    with pytest.raises(ValueError, match="AutoModelForCausalLMWithValueHead"):
        PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2), tiny_causal_lm(), tokenizer=tok)
    with pytest.raises(ValueError, match="tokenizer"):
        PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2), model, tokenizer=None)


# ---------------------------------------------------------------------------------------------------
# step(): stats
# ---------------------------------------------------------------------------------------------------
def test_step_stats_have_the_legacy_keys_and_are_finite():
    trainer = make_trainer()
    queries, responses, scores = make_batch(4)
    with torch.no_grad():  # legacy objective/entropy: the responses' summed NLL, averaged over samples
        trainer.model.eval()
        nll = [-torch.log_softmax(trainer.model(torch.cat([q, r])[None])[0][0, len(q) - 1:-1], -1)
               .gather(-1, r[:, None]).sum() for q, r in zip(queries, responses)]
    stats = trainer.step(queries, responses, scores)
    missing = [k for k in LEGACY_KEYS + TIME_KEYS if k not in stats]
    assert not missing
    assert_all_finite(stats)
    assert stats["objective/entropy"] > 0
    assert stats["objective/entropy"] == pytest.approx(torch.stack(nll).mean().item(), abs=1e-5)
    assert 0 < stats["ppo/policy/entropy"] <= math.log(VOCAB)  # a true entropy, per token
    assert stats["ppo/learning_rate"] == 1e-3
    assert stats["objective/kl_coef"] == pytest.approx(0.2)
    assert stats["ppo/mean_scores"] == pytest.approx(torch.stack(scores).mean().item(), abs=1e-6)
    assert stats["tokens/queries_len_mean"] == pytest.approx(np.mean([len(q) for q in queries]))
    assert stats["tokens/responses_len_mean"] == pytest.approx(np.mean([len(r) for r in responses]))
    assert stats["ppo/epochs"] == 2
    assert stats["ppo/policy/skipped_minibatches"] == 0
    # the first step: the policy is its own reference, so the KL is exactly 0
    assert stats["objective/kl"] == 0 and stats["ppo/mean_non_score_reward"] == 0
    stats2 = trainer.step(queries, responses, scores)
    assert_all_finite(stats2)
    assert stats2["objective/kl"] != 0  # the policy moved away from its reference


def test_log_stats_adds_raw_reward_statistics():
    trainer = make_trainer()
    queries, responses, _ = make_batch(4)
    rewards = [torch.tensor(x) for x in (1.0, 2.0, 4.0, 9.0)]
    stats = trainer.step(queries, responses, rewards)
    logs = trainer.log_stats(stats, {"query": ["a"] * 4, "response": ["b"] * 4}, rewards)
    # mean = 16 / 4 = 4 ; unbiased std = sqrt((9 + 4 + 0 + 25) / 3)
    assert logs["env/reward_mean"] == pytest.approx(4.0)
    assert logs["env/reward_std"] == pytest.approx(math.sqrt(38 / 3), rel=1e-6)
    assert all(k in logs for k in stats)


@pytest.mark.parametrize("tracker", ["wandb", "tensorboard", "mlflow"])
def test_log_stats_sends_each_tracker_what_legacy_sent(tracker, monkeypatch, fake_wandb):
    """wandb: everything (arrays become histograms) and the game_log table, no step; tensorboard: the scalars at
    ``current_step``; others: the scalars, no step (an array is no metric to them)."""
    trainer = make_trainer()
    queries, responses, _ = make_batch(4)
    rewards = [torch.tensor(x) for x in (1.0, 2.0, 4.0, 9.0)]
    stats = trainer.step(queries, responses, rewards)
    sent = []
    monkeypatch.setattr(trainer.accelerator, "log", lambda values, step=None: sent.append((values, step)))
    trainer.config.log_with = tracker  # after construction: no tracker to start here
    batch = {"query": ["q0", "q1", "q2", "q3"], "response": ["r0", "r1", "r2", "r3"], "id": [0, 1, 2, 3]}
    trainer.log_stats(stats, batch, rewards)
    (values, step), = sent
    if tracker == "wandb":
        assert step is None and isinstance(values["env/reward_dist"], np.ndarray)
        assert isinstance(values["objective/logprobs"], np.ndarray)  # a histogram in wandb
        table = values["game_log"]
        assert table.columns == ["query", "response", "reward"] and table.rows[3] == ["q3", "r3", 9.0]
        trainer.log_stats(stats, batch, rewards, columns_to_log=["id"])
        assert sent[-1][0]["game_log"].rows[0] == [0, 1.0]
        with pytest.raises(ValueError, match=r"columns_to_log \['label'\] are not all in the batch"):
            trainer.log_stats(stats, batch, rewards, columns_to_log=["label"])
    else:
        assert step == (trainer.current_step if tracker == "tensorboard" else None)
        assert "env/reward_dist" not in values and "objective/logprobs" not in values and "game_log" not in values
        assert values["env/reward_mean"] == pytest.approx(4.0)


@pytest.mark.parametrize("arch,dropout,precision", [
    ("gpt2", {}, "no"),  # GPT-2's default config has 0.1 dropout in embeddings, attention and residuals
    ("gpt2", dict(resid_pdrop=0.5, embd_pdrop=0.5, attn_pdrop=0.5), "no"),
    ("llama", dict(attention_dropout=0.5), "no"),  # a float attribute of the attention, not an nn.Dropout
    ("gpt_neox", dict(attention_dropout=0.5, hidden_dropout=0.5), "no"),
    ("gpt2", {}, "bf16"),  # rollout and loss forwards under the same bf16 autocast
    ("llama", {}, "bf16"),
])
def test_first_minibatch_has_ratio_one_on_cpu(arch, dropout, precision):
    """One epoch, one mini-batch: the loss forward sees exactly the rollout policy, so nothing is clipped.

    Dropout is disabled (PPOConfig.disable_dropout), whichever way the architecture applies it. Exact on CPUs; on a
    GPU the two passes may round differently (cuBLAS picks kernels by shape): there the ratio is expected within ~1e-5
    of 1 in float32 or TF32 and ~1e-2 in bf16 (not measured: no GPU here).
    """
    model = AutoModelForCausalLMWithValueHead(tiny_causal_lm(arch, **dropout))
    trainer = make_trainer(model=model, ppo_epochs=1, mini_batch_size=4,
                           accelerator_kwargs={"mixed_precision": precision})
    stats = trainer.step(*make_batch(4))
    assert stats["ppo/policy/approxkl"] < 1e-12
    assert abs(stats["ppo/policy/policykl"]) < 1e-6
    assert stats["ppo/policy/clipfrac"] == 0
    assert stats["ppo/policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("kl_penalty", ["kl", "full"])
def test_temperature_scores_every_pass_at_the_distribution_sampled(kl_penalty):
    """``PPOConfig.temperature`` T: the policy's and the reference's log-probabilities and the KL between them (the
    sampled tokens' or the whole vocabulary's) are those of ``softmax(logits / T)``, and the loss pass divides by T
    too, so the first ratio is still exactly 1. At T = 1 the numbers are legacy's, bit for bit."""
    t = 0.7

    def first_step(**config):
        ref = tiny_value_model(seed=5)  # another model: a KL that is not 0
        trainer = make_trainer(ppo_epochs=1, mini_batch_size=4, init_kl_coef=0.2, kl_penalty=kl_penalty,
                               ref_model=ref, **config)
        queries, responses, scores = make_batch(4)
        policy = copy.deepcopy(trainer.accelerator.unwrap_model(trainer.model))
        return trainer.step(queries, responses, scores), policy, ref, queries, responses

    stats, policy, ref, queries, responses = first_step(temperature=t)

    def logits(model, q, r):  # (len(r), V): the model's own logits at the response's positions, divided by T
        with torch.no_grad():
            return model.pretrained_model(torch.cat([q, r])[None]).logits[0, len(q) - 1:-1].float() / t

    logp = [torch.log_softmax(logits(policy, q, r), -1) for q, r in zip(queries, responses)]
    ref_logp = [torch.log_softmax(logits(ref, q, r), -1) for q, r in zip(queries, responses)]
    picked = [lp.gather(-1, r[:, None])[:, 0] for lp, r in zip(logp, responses)]
    ref_picked = [lp.gather(-1, r[:, None])[:, 0] for lp, r in zip(ref_logp, responses)]
    torch.testing.assert_close(torch.as_tensor(stats["objective/logprobs"]), torch.cat(picked), atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.as_tensor(stats["objective/ref_logprobs"]), torch.cat(ref_picked), atol=1e-5,
                               rtol=0)
    if kl_penalty == "kl":  # log p - log q of the sampled tokens, summed over each response
        kl = [(a - b).sum() for a, b in zip(picked, ref_picked)]
    else:  # sum_v p_v (log p_v - log q_v) at each token
        kl = [(lp.exp() * (lp - lq)).sum() for lp, lq in zip(logp, ref_logp)]
    assert stats["objective/kl"] == pytest.approx(float(torch.stack(kl).mean()), abs=1e-5)
    assert stats["ppo/policy/approxkl"] < 1e-12 and stats["ppo/policy/clipfrac"] == 0

    legacy, explicit = first_step()[0], first_step(temperature=1.0)[0]
    assert not np.allclose(np.asarray(legacy["objective/logprobs"]), np.asarray(stats["objective/logprobs"]))
    for key in ("objective/logprobs", "objective/kl", "ppo/loss/total", "ppo/policy/entropy"):
        assert np.array_equal(np.asarray(legacy[key]), np.asarray(explicit[key])), key


def test_batched_forward_pass_scores_at_the_config_temperature():
    """The legacy method a custom loop scores with (and the pipeline's held-out watch): the log-probabilities and the
    logits it returns are the temperature's, as step()'s."""
    trainer = make_trainer(temperature=0.5)
    queries, responses, _ = make_batch(4)
    with torch.no_grad():
        logprobs, logits, _, masks = trainer.batched_forward_pass(trainer.model, queries, responses, return_logits=True)
    for i, (q, r) in enumerate(zip(queries, responses)):
        with torch.no_grad():
            want = trainer.model.pretrained_model(torch.cat([q, r])[None]).logits[0, len(q) - 1:-1].float() / 0.5
        torch.testing.assert_close(logits[i, :len(r)], want, atol=1e-5, rtol=0)
        torch.testing.assert_close(logprobs[i, :len(r)], torch.log_softmax(want, -1).gather(-1, r[:, None])[:, 0],
                                   atol=1e-5, rtol=0)


def test_generate_warns_once_where_it_samples_at_another_temperature_than_the_config():
    trainer = make_trainer(temperature=0.7)
    queries = random_queries(2, seed=0)
    kwargs = dict(do_sample=True, max_new_tokens=3, pad_token_id=PAD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.generate(queries, temperature=0.7, **kwargs)  # the same temperature: nothing said
    with pytest.warns(UserWarning, match=r"sampling at temperature 1.0, and PPOConfig.temperature is 0.7.*"
                                         r"PPOConfig\(temperature=1.0\)"):
        trainer.generate(queries, **kwargs)  # the model's generation config: 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.generate(queries, temperature=1.3, **kwargs)  # said once
        trainer.generate(queries, do_sample=False, max_new_tokens=3, pad_token_id=PAD)  # greedy: no temperature


def test_padding_does_not_leak_into_the_stats():
    tok_a, tok_b = tiny_tokenizer(), tiny_tokenizer()
    tok_b.pad_token = "<unk>"  # a different pad id: the right padding gets a different filler token
    assert tok_a.pad_token_id != tok_b.pad_token_id
    batch = make_batch(4, seed=2)
    stats_a = make_trainer(tokenizer=tok_a).step(*batch)
    stats_b = make_trainer(tokenizer=tok_b).step(*batch)
    for key, value in stats_a.items():
        if not key.startswith("time/"):
            np.testing.assert_allclose(np.asarray(stats_b[key]), np.asarray(value), atol=1e-6, rtol=0, err_msg=key)


def test_padded_sample_scores_like_the_sample_alone():
    trainer = make_trainer()
    queries, responses, _ = make_batch(4, seed=3)
    model = trainer.model
    logprobs, _, values, masks = trainer.batched_forward_pass(model, queries, responses)
    for i, (q, r) in enumerate(zip(queries, responses)):
        alone_lp, _, alone_v, _ = trainer.batched_forward_pass(model, [q], [r])
        torch.testing.assert_close(logprobs[i, :len(r)], alone_lp[0], atol=1e-6, rtol=0)
        torch.testing.assert_close(values[i, :len(r)], alone_v[0], atol=1e-6, rtol=0)
        assert masks[i].sum() == len(r)


def test_ratio_threshold_skips_every_minibatch_and_leaves_the_model_unchanged():
    trainer = make_trainer(ratio_threshold=1e-3, ppo_epochs=2)
    before = params_snapshot(trainer.model)
    with pytest.warns(UserWarning, match="ratio_threshold"):
        stats = trainer.step(*make_batch(4))
    assert stats["ppo/policy/skipped_minibatches"] == 2 * 2  # epochs x mini-batches
    for name, param in trainer.model.named_parameters():
        torch.testing.assert_close(param, before[name], atol=0, rtol=0, msg=name)
    assert_all_finite(stats)


@pytest.mark.parametrize("last_policykl,expected_epochs", [(2e-6, 1), (1e-6, 4)])  # threshold: 1.5 * target_kl
def test_early_stopping_checks_the_last_minibatch_policykl_of_each_epoch(last_policykl, expected_epochs):
    """Legacy semantics: after each epoch, stop when the last mini-batch's ``policy/policykl`` exceeds
    ``1.5 * target_kl``. The estimate is noisy (it can be negative), so the test sets it."""
    trainer = make_trainer(batch_size=8, mini_batch_size=2, ppo_epochs=4, early_stopping=True, target_kl=1e-6)
    train_minibatch, calls = trainer.train_minibatch, []

    def with_policykl(*args, **kwargs):
        stats = train_minibatch(*args, **kwargs)
        calls.append(1)
        stats["policy/policykl"] = torch.tensor(last_policykl if len(calls) % 4 == 0 else 1.0)
        return stats

    trainer.train_minibatch = with_policykl
    stats = trainer.step(*make_batch(8))
    assert stats["ppo/epochs"] == expected_epochs and len(calls) == 4 * expected_epochs
    trainer.config.early_stopping = False
    assert trainer.step(*make_batch(8))["ppo/epochs"] == 4


@pytest.mark.parametrize("accumulation,expected_updates", [(1, 4), (2, 2)])
def test_gradient_accumulation(accumulation, expected_updates):
    model = tiny_value_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    updates = []
    optimizer.register_step_post_hook(lambda *_: updates.append(1))
    trainer = make_trainer(model=model, optimizer=optimizer, batch_size=8, mini_batch_size=2, ppo_epochs=1,
                           gradient_accumulation_steps=accumulation)
    before = params_snapshot(model)
    stats = trainer.step(*make_batch(8))
    assert_all_finite(stats)
    assert len(updates) == expected_updates  # 4 mini-batches, one optimizer step per `accumulation` of them
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def legacy_kl(policy, ref, queries, responses, mode):
    """``objective/kl`` from the full-vocabulary logits of both models (mean over samples of the summed
    per-token KL), and the number of response tokens."""
    totals = []
    for q, r in zip(queries, responses):
        sequence = torch.cat([q, r])[None]
        positions = torch.arange(len(q) - 1, len(q) - 1 + len(r))
        logp = torch.log_softmax(policy(sequence)[0][0, positions], -1)
        logq = torch.log_softmax(ref(sequence)[0][0, positions], -1)
        diff = (logp - logq).gather(-1, r[:, None]).squeeze(-1)
        per_token = {"kl": diff, "abs": diff.abs(), "mse": 0.5 * diff**2,
                     "full": F.kl_div(logq, logp, log_target=True, reduction="none").sum(-1)}[mode]
        totals.append(per_token.sum())
    return torch.stack(totals).mean().item(), sum(len(r) for r in responses)


@pytest.mark.parametrize("mode", ["kl", "abs", "mse", "full"])
def test_kl_penalty_modes(mode):
    ref = tiny_value_model(seed=7)  # a reference different from the policy: the KL is non-zero from step 1
    trainer = make_trainer(kl_penalty=mode, ref_model=ref, adap_kl_ctrl=False, init_kl_coef=0.3)
    queries, responses, scores = make_batch(4, seed=1)
    with torch.no_grad():
        trainer.model.eval()
        expected_kl, n_tokens = legacy_kl(trainer.model, ref, queries, responses, mode)
    stats = trainer.step(queries, responses, scores)
    assert_all_finite(stats)
    assert stats["objective/kl"] == pytest.approx(expected_kl, abs=1e-5)
    # mean_non_score_reward = masked mean of -beta * kl = -0.3 * (sum of kl) / tokens
    assert stats["ppo/mean_non_score_reward"] == pytest.approx(-0.3 * expected_kl * 4 / n_tokens, abs=1e-6)
    if mode != "kl":
        assert stats["objective/kl"] > 0


def test_score_scaling_norm_and_clip():
    queries, responses, _ = make_batch(4)
    scores = [torch.tensor(x) for x in (1.0, 2.0, 3.0, 4.0)]
    std = np.std([1, 2, 3, 4], ddof=1)  # 1.2910

    stats = make_trainer(use_score_scaling=True).step(queries, responses, scores)
    # scaled = s / std: mean 2.5 / 1.2910 = 1.9365, std 1
    assert stats["ppo/mean_scores"] == pytest.approx(2.5 / std, abs=1e-6)
    assert stats["ppo/std_scores"] == pytest.approx(1.0, abs=1e-6)

    stats = make_trainer(use_score_scaling=True, use_score_norm=True).step(queries, responses, scores)
    # normalised = (s - 2.5) / std: mean 0, std 1
    assert stats["ppo/mean_scores"] == pytest.approx(0.0, abs=1e-6)
    assert stats["ppo/std_scores"] == pytest.approx(1.0, abs=1e-6)

    trainer = make_trainer(score_clip=1.5)
    stats = trainer.step(queries, responses, scores)
    # clipped = [1, 1.5, 1.5, 1.5]: mean 1.375
    assert stats["ppo/mean_scores"] == pytest.approx(1.375, abs=1e-6)
    logs = trainer.log_stats(stats, {}, scores)
    assert logs["env/reward_mean"] == pytest.approx(2.5)  # env/ stats are the raw rewards

    trainer = make_trainer(use_score_scaling=True)
    trainer.step(queries, responses, scores)
    stats = trainer.step(queries, responses, [torch.tensor(x) for x in (5.0, 6.0, 7.0, 8.0)])
    # running std over 1..8 = 2.4495: mean 6.5 / 2.4495 = 2.6536
    assert stats["ppo/mean_scores"] == pytest.approx(6.5 / np.std(np.arange(1, 9), ddof=1), abs=1e-6)


def test_lr_scheduler_is_stepped_once_per_step():
    model = tiny_value_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    trainer = make_trainer(model=model, optimizer=optimizer, lr_scheduler=scheduler)
    batch = make_batch(4)
    assert trainer.step(*batch)["ppo/learning_rate"] == pytest.approx(1e-3)
    assert trainer.step(*batch)["ppo/learning_rate"] == pytest.approx(5e-4)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2.5e-4)


@pytest.mark.parametrize("schedule, rates", [
    ("linear", [1e-3, 0.75e-3, 0.5e-3, 0.25e-3]),  # down to 0 over the 4 calls: the last trains at a quarter
    ("cosine", [1e-3, 0.5e-3 * (1 + math.cos(math.pi / 4)), 0.5e-3, 0.5e-3 * (1 + math.cos(3 * math.pi / 4))]),
])
def test_lr_scheduler_type_spans_the_runs_step_calls(schedule, rates):
    # steps=16 rollouts of batch_size 4: 4 step() calls, whatever the mini-batches and epochs in each
    trainer = make_trainer(lr_scheduler_type=schedule, steps=16)
    seen = [trainer.step(*make_batch(4, seed=i))["ppo/learning_rate"] for i in range(4)]
    assert seen == pytest.approx(rates)
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.0, abs=1e-12)
    with pytest.warns(UserWarning, match="has run its schedule"):  # a fifth call trains at rate 0: said
        trainer.step(*make_batch(4))


def test_warmup_ratio_rises_from_zero_then_holds():
    trainer = make_trainer(lr_scheduler_type="constant_with_warmup", warmup_ratio=0.5, steps=16)  # 2 of 4 calls
    seen = [trainer.step(*make_batch(4, seed=i))["ppo/learning_rate"] for i in range(4)]
    assert seen == pytest.approx([0.0, 0.5e-3, 1e-3, 1e-3])


def test_the_constant_schedule_builds_no_scheduler_and_refuses_a_warmup():
    assert make_trainer().lr_scheduler is None  # legacy: the rate never moves
    with pytest.raises(ValueError, match=r"warmup_ratio must be 0 with lr_scheduler_type 'constant'.*"
                                         r"constant_with_warmup"):
        PPOConfig(warmup_ratio=0.1)
    with pytest.raises(ValueError, match=r"warmup_ratio must be in \[0, 1\]"):
        PPOConfig(lr_scheduler_type="linear", warmup_ratio=1.5)


def test_a_passed_lr_scheduler_and_a_schedule_in_the_config_are_refused_together():
    model = tiny_value_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    with pytest.raises(ValueError, match="two schedules for one rate"):
        make_trainer(model=model, optimizer=optimizer, lr_scheduler=scheduler, lr_scheduler_type="linear")


def test_step_with_response_masks_and_whitened_rewards():
    trainer = make_trainer(whiten_rewards=True)
    queries, responses, scores = make_batch(4, max_response=6)
    responses = [torch.cat([r, torch.tensor([5, 6])]) for r in responses]  # at least 3 tokens each
    masks = [torch.cat([torch.ones(len(r) - 1), torch.zeros(1)]) for r in responses]  # drop the last token
    stats = trainer.step(queries, responses, scores, response_masks=masks)
    assert_all_finite(stats)
    # the advantages are whitened over the tokens the masks keep, and only those enter the stats
    kept = int(sum(m.sum() for m in masks))
    advantages = torch.as_tensor(stats["ppo/policy/advantages"], dtype=torch.float64)
    assert advantages.numel() == kept == sum(len(r) - 1 for r in responses)
    assert advantages.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert advantages.std().item() == pytest.approx(1.0, abs=1e-5)  # unbiased, as masked_whiten's


def test_a_plain_ref_model_is_wrapped_and_num_shared_layers_is_ignored_with_a_warning():
    with pytest.warns(UserWarning, match="num_shared_layers"):
        trainer = make_trainer(ref_model=tiny_causal_lm(seed=3), num_shared_layers=1)
    assert isinstance(trainer.ref_model, AutoModelForCausalLMWithValueHead)
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())
    assert_all_finite(trainer.step(*make_batch(4)))


def test_num_shared_layers_freezes_the_shared_layers():
    trainer = make_trainer(num_shared_layers=1)
    frozen = trainer.model.pretrained_model.transformer.h[0].attn.c_attn.weight
    assert frozen is trainer.ref_model.pretrained_model.transformer.h[0].attn.c_attn.weight
    before = frozen.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.step(*make_batch(4))
    torch.testing.assert_close(frozen, before, atol=0, rtol=0)


class RecordTrainingMode(LogitsProcessor):
    def __init__(self, model):
        self.model, self.modes = model, []

    def __call__(self, input_ids, scores):
        self.modes.append(self.model.training)
        return scores


def test_generation_samples_in_eval_mode():
    """Responses must be sampled from the distribution step() scores them with (eval mode, no dropout),
    also when dropout is kept (disable_dropout=False) and after step() put the model in train mode."""
    model = AutoModelForCausalLMWithValueHead(tiny_causal_lm("gpt2", resid_pdrop=0.5))
    trainer = make_trainer(model=model, disable_dropout=False)
    recorder = RecordTrainingMode(model.pretrained_model)
    queries = random_queries(4)
    trainer.generate(queries, max_new_tokens=2, logits_processor=LogitsProcessorList([recorder]))
    trainer.step(*make_batch(4))
    trainer.generate(queries, max_new_tokens=2, logits_processor=LogitsProcessorList([recorder]))
    assert recorder.modes and not any(recorder.modes), recorder.modes


def test_gradient_checkpointing_gives_the_same_step():
    batch = make_batch(4)
    plain = make_trainer().step(*batch)
    trainer = make_trainer(gradient_checkpointing=True)
    assert trainer.model.pretrained_model.is_activation_checkpointing
    checkpointed = trainer.step(*batch)
    for key, value in plain.items():
        if not key.startswith("time/"):
            np.testing.assert_allclose(np.asarray(checkpointed[key]), np.asarray(value), atol=1e-6, rtol=0,
                                       err_msg=key)


def test_max_grad_norm_bounds_the_update():
    model = tiny_value_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # plain SGD: the update is the clipped gradient
    trainer = make_trainer(model=model, optimizer=optimizer, max_grad_norm=1e-3, ppo_epochs=1, mini_batch_size=4)
    before = params_snapshot(model)
    trainer.step(*make_batch(4))
    update = torch.sqrt(sum(((p - before[n]) ** 2).sum() for n, p in model.named_parameters()))
    assert 0 < update.item() <= 1e-3 * (1 + 1e-4)


def test_a_run_is_reproducible_on_cpu():
    """Two runs, the same numbers bit for bit: on CPUs (CUDA's atomics add in no fixed order)."""
    def run():
        trainer, all_stats = make_trainer(), []
        for step in range(2):
            queries = random_queries(4, seed=step)
            responses = trainer.generate(queries, return_prompt=False, max_new_tokens=4, do_sample=True, top_k=0)
            all_stats.append(trainer.step(queries, responses, [torch.tensor(float(len(r))) for r in responses]))
        return all_stats

    for first, second in zip(run(), run()):
        for key in first:
            if not key.startswith("time/"):
                np.testing.assert_array_equal(np.asarray(first[key]), np.asarray(second[key]), err_msg=key)


def test_large_negative_kl_is_warned_about_once():
    """Responses the reference likes far more than the policy (as filtered sampling produces) give a mean KL
    below -1: one warning naming the likely cause, not one per step."""
    from ppo_core import create_reference_model

    model = tiny_value_model("gpt2", seed=0)
    ref = create_reference_model(model)
    with torch.no_grad():
        ref.pretrained_model.lm_head.weight.mul_(20)  # a much sharper reference distribution
    trainer = make_trainer(model=model, ref_model=ref)
    queries = random_queries(4, seed=0)
    responses = [ref.generate(q[None], max_new_tokens=5, do_sample=False, pad_token_id=PAD,
                              eos_token_id=-1)[0, len(q):] for q in queries]  # the reference's favourites
    scores = [torch.tensor(0.0)] * 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = trainer.step(queries, responses, scores)
        trainer.step(queries, responses, scores)
    messages = [str(w.message) for w in caught if "KL divergence is negative" in str(w.message)]
    assert first["objective/kl"] < -1
    assert len(messages) == 1 and "top_k" in messages[0]


def test_reference_model_holds_no_optimizer_state():
    """The frozen reference is never handed to the optimizer: no gradients, no Adam moments for it."""
    trainer = make_trainer()
    trainer.step(*make_batch())
    optimized = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    ref_params = list(trainer.ref_model.parameters())
    assert ref_params and not optimized & {id(p) for p in ref_params}
    assert all(not p.requires_grad and p.grad is None for p in ref_params)
    assert all(id(p) not in {id(q) for q in ref_params} for p in trainer.optimizer.state)


def test_a_trainer_does_not_inherit_an_earlier_accelerators_settings():
    """accelerate's state is process-wide: without the reset, a trainer built after a bf16 one would silently run
    in bf16 too (and one asking for another precision would be refused). Alone, each starts from its own settings."""
    from accelerate import Accelerator

    from ppo_core.runtime.distributed import SingleProcess

    bf16 = make_trainer(accelerator_kwargs={"mixed_precision": "bf16"})
    assert bf16.accelerator.mixed_precision == "bf16"
    assert Accelerator().mixed_precision == "bf16"  # accelerate's own behaviour: the process's first settings stay
    plain = make_trainer()
    assert plain.accelerator.mixed_precision == "no"
    assert isinstance(plain._group, SingleProcess)  # one path to the other processes, alone too


def test_malloc_tuning_is_a_default_the_environment_turns_off(monkeypatch):
    """On the CPU a trainer keeps freed memory for reuse (glibc); PPO_CORE_TUNE_MALLOC=0 turns that off."""
    import platform

    from ppo_core import trainer as trainer_module
    from ppo_core.runtime.utils import keep_freed_memory_for_reuse

    applied = []
    monkeypatch.setattr(trainer_module, "keep_freed_memory_for_reuse",
                        lambda: applied.append(keep_freed_memory_for_reuse()) or applied[-1])
    make_trainer()
    monkeypatch.setenv("PPO_CORE_TUNE_MALLOC", "0")
    make_trainer()
    assert applied == [platform.libc_ver()[0] == "glibc", False]  # on glibc by default; never when turned off


def test_the_legacy_trainer_api_is_all_there(tmp_path):
    """What a TRL 0.11 loop calls or reads on its PPOTrainer, whichever module now holds it."""
    trainer = make_trainer()
    for name in ("prepare_dataloader", "generate", "step", "log_stats", "batched_forward_pass", "prepare_model_inputs",
                 "compute_rewards", "loss", "train_minibatch", "record_step_stats", "gather_stats",
                 "create_model_card", "_step_safety_checker"):
        assert callable(getattr(trainer, name)), name
    for name in ("config", "model", "ref_model", "tokenizer", "optimizer", "lr_scheduler", "dataloader", "dataset",
                 "data_collator", "accelerator", "current_device", "kl_ctl", "current_step", "is_distributed"):
        assert hasattr(trainer, name), name
    queries, responses, scores = make_batch()
    checked = trainer._step_safety_checker(4, queries, responses, scores)
    assert checked[2].shape == (4,) and checked[3] is None
    trainer.create_model_card(str(tmp_path), model_name="tiny")
    assert "# tiny" in (tmp_path / "README.md").read_text()


def test_num_generations_with_an_estimator_that_does_not_compare_them_is_warned_about():
    """GAE gives each sample its own baseline: num_generations=4 only repeats every prompt 4 times."""
    with pytest.warns(UserWarning, match=r"num_generations=4 with advantage_estimator 'gae', which does not compare "
                                         r"a prompt's samples"):
        make_trainer(batch_size=8, mini_batch_size=4, num_generations=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message="PPOTrainer: no dataset")
        make_trainer(batch_size=8, mini_batch_size=4, num_generations=4, advantage_estimator="grpo")

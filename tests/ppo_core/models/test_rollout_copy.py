"""The rollout copy (``PPOConfig.rollout_dtype``): generate() samples from a bf16 copy of the policy, brought up to date
whenever the policy's weights change, while step() computes exactly what it computes without it; the static cache's
padded widths (``models.generation.STATIC_CACHE_WIDTH``); and the rollout correction (``rollout_correction``), the
importance weights between the policy and the copy that sampled."""

from __future__ import annotations

import typing
import warnings

import numpy as np
import pytest
import torch

from ppo_core import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer
from ppo_core.algo.rollout_correction import sampling_stats, sampling_weights
from ppo_core.fields import ConfigError
from ppo_core.models import generation, rollout_copy
from ppo_core.models.generation import STATIC_CACHE_WIDTH, generate_batched
from ppo_core.models.rollout_copy import low_precision_copy, sync_weights
from tests.ppo_core.test_trainer import make_batch, make_trainer
from tests.tiny import (
    ARCHS,
    random_queries,
    randomize_lora,
    tiny_causal_lm,
    tiny_lora_config,
    tiny_tokenizer,
    tiny_value_model,
)

torch.set_num_threads(1)  # tiny models: extra threads only add spin-up cost

GREEDY = dict(max_new_tokens=5, do_sample=False)


def greedy(lm, queries, **kwargs) -> list[list[int]]:
    """``lm``'s greedy responses to ``queries``, as lists of ids."""
    out = generate_batched(lm, tiny_tokenizer(), queries, "cpu", None, 4, False, {**GREEDY, **kwargs})
    return [r.tolist() for r in out]


def rounded(model: torch.nn.Module, dtype=torch.bfloat16) -> torch.nn.Module:
    """A plain LM with ``model``'s weights rounded to ``dtype``: what the copy should be, made the usual way. Its
    buffers stay float32 (rotary frequencies), as ``from_pretrained(dtype=...)`` keeps them: rounded too, they would
    move near-ties of the greedy choice."""
    lm = tiny_causal_lm(model.config.model_type)  # the ARCHS are named as transformers' model types
    lm.load_state_dict(model.state_dict())
    for p in lm.parameters():
        p.data = p.data.to(dtype)
    return lm.eval()


@pytest.mark.parametrize("arch", ARCHS)
def test_the_copy_holds_the_weights_in_its_dtype_tied_frozen_and_apart(arch):
    model = tiny_causal_lm(arch)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    lm = low_precision_copy(model, torch.bfloat16)
    sync_weights(lm, model)
    params = dict(lm.named_parameters())
    assert {p.dtype for p in params.values()} == {torch.bfloat16}
    assert all(not p.requires_grad for p in params.values()) and not lm.training
    assert all(torch.equal(params[n], p.to(torch.bfloat16)) for n, p in model.named_parameters())
    assert not {p.data_ptr() for p in params.values()} & {p.data_ptr() for p in model.parameters()}
    assert all(torch.equal(p, before[n]) and p.dtype == torch.float32 for n, p in model.named_parameters())
    assert {b.dtype for b in lm.buffers()} == {b.dtype for b in model.buffers()}  # rotary frequencies stay float32
    if model.config.tie_word_embeddings:
        assert lm.get_output_embeddings().weight is lm.get_input_embeddings().weight
    assert lm.config.dtype == torch.bfloat16


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_samples_from_the_copy_and_it_follows_the_updates(arch):
    """Greedy responses: those of the policy's weights rounded to bf16, before the first step and after it (the copy
    synced); the policy's own weights stay float32, and step() trains them as before."""
    trainer = make_trainer(arch, rollout_dtype="bfloat16")
    policy = trainer.model.pretrained_model
    queries = random_queries(6, seed=3)
    for _ in range(2):
        out = trainer.generate(queries, return_prompt=False, **GREEDY)
        assert [r.tolist() for r in out] == greedy(rounded(policy), queries)
        before = {n: p.detach().clone() for n, p in policy.named_parameters()}
        trainer.step(*make_batch(4))
        assert any(not torch.equal(p, before[n]) for n, p in policy.named_parameters())
    assert {p.dtype for p in policy.parameters()} == {torch.float32}
    copy, weights = trainer._rollout.lm, dict(policy.named_parameters())
    synced = lambda: all(torch.equal(p, weights[n].to(torch.bfloat16)) for n, p in copy.named_parameters())  # noqa: E731
    assert not synced()  # the last step's update reaches the copy at the next generate(), not before
    trainer.generate(queries, return_prompt=False, **GREEDY)
    assert synced()


def test_the_copy_syncs_only_when_the_weights_changed(monkeypatch):
    """No copy between two generate() calls with no update between them; one after a step, and one after any in-place
    write to the weights (here a load_state_dict), which the step count alone would miss."""
    calls = []
    real = rollout_copy.sync_weights
    monkeypatch.setattr(rollout_copy, "sync_weights", lambda lm, model: (calls.append(1), real(lm, model)))
    trainer = make_trainer(rollout_dtype="bfloat16")
    queries = random_queries(4)
    trainer.generate(queries, **GREEDY)
    trainer.generate(queries, **GREEDY)
    assert len(calls) == 1
    trainer.step(*make_batch(4))
    trainer.generate(queries, **GREEDY)
    assert len(calls) == 2
    policy = trainer.model.pretrained_model
    policy.load_state_dict(tiny_causal_lm("gpt2", seed=7).state_dict())
    assert greedy(trainer._rollout_lm(), queries) == greedy(rounded(policy), queries)
    assert len(calls) == 3


def test_step_computes_the_same_with_or_without_the_copy():
    """The step's log-probs are the policy's own passes whatever samples: the same inputs give the same stats and the
    same weights, bit for bit (so the first ratio stays exactly 1), where no correction weighs the loss."""
    batch = make_batch(4)
    plain, copied = make_trainer(), make_trainer(rollout_dtype="bfloat16", rollout_correction=None)
    copied.generate(random_queries(4), **GREEDY)  # the copy exists and has sampled
    a, b = plain.step(*batch), copied.step(*batch)
    for key in a:
        if not key.startswith("time/"):
            np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)
    assert all(torch.equal(p, q) for p, q in zip(plain.model.parameters(), copied.model.parameters()))


def test_a_lora_policy_copy_has_its_adapter_merged_and_does_not_drift(tmp_path):
    """A LoRA policy's copy samples with the adapter merged into its bf16 base weights (no LoRA branch per token): its
    logits are the policy's within bf16 rounding, and two syncs of the same weights give the same copy bit for bit
    (each merge starts from the policy's base weights, not from the last merge)."""
    pytest.importorskip("peft")
    tiny_causal_lm("gpt2").save_pretrained(str(tmp_path))
    torch.manual_seed(1)
    model = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path), peft_config=tiny_lora_config())
    randomize_lora(model)
    trainer = PPOTrainer(PPOConfig(batch_size=4, mini_batch_size=2, learning_rate=1e-2, rollout_dtype="bfloat16"),
                         model, tokenizer=tiny_tokenizer())
    trainer.generate(random_queries(4), **GREEDY)
    lm, policy = trainer._rollout.lm, model.pretrained_model
    assert lm.dtype == torch.bfloat16 and all(m.merged for m in lm.modules() if hasattr(m, "merged_adapters"))
    x = torch.randint(3, 64, (3, 9))
    with torch.no_grad():
        want, got = policy(x).logits, lm(x).logits.float()
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    merged = {n: p.detach().clone() for n, p in lm.named_parameters()}
    sync_weights(lm, policy)
    assert all(torch.equal(p, merged[n]) for n, p in lm.named_parameters())


def test_rollout_dtype_is_checked_and_refused_under_zero3(monkeypatch):
    with pytest.raises(ConfigError, match="rollout_dtype"):
        PPOConfig(rollout_dtype="int8")
    monkeypatch.setattr("ppo_core.trainer.is_zero3", lambda accelerator: True)
    with pytest.raises(ValueError, match="rollout_dtype='bfloat16'.*ZeRO-3.*rollout_dtype=None"):
        make_trainer(rollout_dtype="bfloat16")  # the default, auto, is None there (rollout_choice)


def test_the_static_cache_is_padded_to_a_few_widths_where_it_compiles():
    assert generation.pad_multiple({"cache_implementation": "static"}, torch.device("cuda")) == STATIC_CACHE_WIDTH
    assert generation.pad_multiple({"cache_implementation": "static"}, torch.device("cpu")) == 1  # not compiled there
    assert generation.pad_multiple({"cache_implementation": "static", "disable_compile": True}, "cuda") == 1
    assert generation.pad_multiple({}, "cuda") == 1
    assert generation.pad_multiple({"cache_implementation": "dynamic"}, "cuda") == 1


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("padded", [False, True])
def test_the_static_cache_samples_what_the_dynamic_one_does(arch, padded, monkeypatch):
    """On the CPU in float32, cache_implementation="static" returns the tokens of the dynamic cache, greedy and sampled
    from the same seed, also with the batch padded to STATIC_CACHE_WIDTH as on a GPU (forced here); a single 1-D query
    keeps its legacy (1, L) result."""
    lm = tiny_causal_lm(arch).eval()
    if padded:
        monkeypatch.setattr(generation, "pad_multiple", lambda kwargs, device: STATIC_CACHE_WIDTH
                            if kwargs.get("cache_implementation") == "static" else 1)
    widths = []
    real = type(lm).generate
    monkeypatch.setattr(type(lm), "generate", lambda self, **kw: (widths.append(kw["input_ids"].shape[1]),
                                                                  real(self, **kw))[1])
    queries = random_queries(6, seed=4)
    static = greedy(lm, queries, cache_implementation="static")
    assert static == greedy(lm, queries)
    longest = max(len(q) for q in queries)
    assert widths[0] == (STATIC_CACHE_WIDTH if padded else longest) and widths[-1] == longest
    sampled = {}
    for cache in ("static", "dynamic"):
        torch.manual_seed(5)
        sampled[cache] = greedy(lm, queries, do_sample=True, top_k=0, cache_implementation=cache)
    assert sampled["static"] == sampled["dynamic"]
    one = generate_batched(lm, tiny_tokenizer(), queries[0], "cpu", None, 4, True,
                           {**GREEDY, "cache_implementation": "static"})
    assert one.shape == (1, len(queries[0]) + 5) and torch.equal(one[0, :len(queries[0])], queries[0])
    assert one[0, len(queries[0]):].tolist() == static[0]


# ---- the rollout correction: importance weights between the policy and the copy that sampled -----------------------

def test_sampling_weights_per_token_and_per_sequence_truncated_or_masked():
    old = torch.tensor([[0.0, -1.0, -2.0], [-1.0, -1.0, 0.0]])
    sampler = torch.tensor([[-0.5, -1.0, -1.0], [-2.0, -0.5, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # the last token of row 2 is padding
    token = torch.exp(old - sampler) * mask  # e^0.5, 1, e^-1 | e^1, e^-0.5, 0
    got = sampling_weights(old, sampler, mask, "token_truncate", 2.0)
    torch.testing.assert_close(got, torch.where(token > 2.0, 2.0, token) * mask)
    got = sampling_weights(old, sampler, mask, "token_mask", 2.0)
    torch.testing.assert_close(got, torch.where(token > 2.0, 0.0, token) * mask)  # e^1 > 2: that token is left out
    seq = torch.tensor([[np.exp(0.5 - 1.0)], [np.exp(1.0 - 0.5)]], dtype=torch.float32)  # padding not counted
    torch.testing.assert_close(sampling_weights(old, sampler, mask, "sequence_truncate", 1.5),
                               seq.clamp(max=1.5).expand(2, 3) * mask)
    torch.testing.assert_close(sampling_weights(old, sampler, mask, "sequence_mask", 1.5),
                               torch.where(seq > 1.5, 0.0, seq).expand(2, 3) * mask)
    with pytest.raises(ValueError, match="not one of"):
        sampling_weights(old, sampler, mask, "token", 2.0)


def test_sampling_stats_are_over_the_masked_tokens():
    old = torch.tensor([[0.0, -1.0], [-1.0, 0.0]])
    sampler = torch.tensor([[-0.5, -1.0], [-1.25, 9.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    weights = sampling_weights(old, sampler, mask, "token_truncate", 2.0)
    s = sampling_stats(old, sampler, weights, mask, lambda x: x, lambda x: x)
    assert s.logprob_diff_mean.item() == pytest.approx(0.75 / 3) and s.logprob_diff_max.item() == pytest.approx(0.5)
    on = weights[mask.bool()]
    assert s.weight_mean.item() == pytest.approx(on.mean().item())
    assert (s.weight_min.item(), s.weight_max.item()) == pytest.approx((on.min().item(), on.max().item()))


def test_the_policy_loss_takes_the_weights_into_each_tokens_loss():
    from ppo_core.algo.ppo_math import policy_loss

    g = torch.Generator().manual_seed(0)
    logprobs, old, adv = (torch.randn(3, 4, generator=g) for _ in range(3))
    mask = torch.ones(3, 4)
    plain = policy_loss(logprobs, old, adv, mask, 0.2)
    assert torch.equal(policy_loss(logprobs, old, adv, mask, 0.2, weights=torch.ones(3, 4)).loss, plain.loss)
    weights = torch.rand(3, 4, generator=g)
    weighted = policy_loss(logprobs, old, adv, mask, 0.2, weights=weights)
    per_token = -adv * torch.exp(logprobs - old)  # PPO's clipped surrogate, by hand
    clipped = -adv * torch.exp(logprobs - old).clamp(0.8, 1.2)
    torch.testing.assert_close(weighted.loss, (torch.max(per_token, clipped) * weights).mean())
    assert torch.equal(weighted.clipfrac, plain.clipfrac)  # the statistics stay the unweighted ones


def test_the_correction_reaches_the_update_and_reports_the_mismatch():
    """Weights zeroed for every token (token_mask, a cap below every ratio) leave a critic-free policy without a KL
    where it was; without the correction the same step moves it. The sampling/* stats measure the bf16 copy's
    distance from the policy: above 0, small."""
    queries = random_queries(4, seed=1)
    moved = {}
    for cap in (None, 1e-6):
        correction = {} if cap is None else {"rollout_correction": "token_mask", "rollout_correction_cap": cap}
        trainer = make_trainer("llama", rollout_dtype="bfloat16", advantage_estimator="dr_grpo", num_generations=2,
                               **correction)
        responses = trainer.generate(queries, return_prompt=False, max_new_tokens=5, do_sample=True, top_k=0)
        policy = trainer.model.pretrained_model
        before = {n: p.detach().clone() for n, p in policy.named_parameters()}
        stats = trainer.step([queries[0]] * 2 + [queries[1]] * 2, responses, [torch.tensor(float(i)) for i in range(4)])
        moved[cap] = any(not torch.equal(p, before[n]) for n, p in policy.named_parameters())
    assert moved[None] and not moved[1e-6]
    assert stats["sampling/importance_sampling_ratio/max"] == 0.0
    assert 0 < stats["sampling/sampling_logp_difference/mean"] <= stats["sampling/sampling_logp_difference/max"] < 0.1
    assert stats["time/ppo/sampling_pass"] > 0


def test_the_correction_needs_a_rollout_copy():
    from ppo_core.algo.choices import ROLLOUT_CORRECTIONS
    from ppo_core.config import _HINTS

    assert typing.get_args(typing.get_args(_HINTS["rollout_correction"])[0]) == ("auto", *ROLLOUT_CORRECTIONS)
    with pytest.raises(ConfigError, match="rollout_correction must be unset without rollout_dtype"):
        PPOConfig(rollout_dtype=None, rollout_correction="token_truncate")
    PPOConfig(rollout_dtype=None)  # auto: nothing to correct
    with pytest.raises(ConfigError, match="rollout_correction_cap must be > 0"):
        PPOConfig(rollout_dtype="bfloat16", rollout_correction="token_truncate", rollout_correction_cap=0)


def test_a_legacy_loss_override_beside_the_correction_is_warned_about_once():
    """A subclass's own legacy ``loss`` computes the policy loss in legacy's signature, where the weights have no
    place: the trainer says so once, and still reports the sampling/* stats."""
    class OwnLoss(PPOTrainer):
        def loss(self, old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns):
            return super().loss(old_logprobs, values, logits, vpreds, logprobs, mask, advantages, returns)

    options = dict(batch_size=4, mini_batch_size=2, ppo_epochs=1, rollout_dtype="bfloat16",
                   rollout_correction="token_truncate")
    trainer = OwnLoss(PPOConfig(**options), tiny_value_model(), tokenizer=tiny_tokenizer())
    with pytest.warns(UserWarning, match="importance weights: they do not reach the loss"):
        stats = trainer.step(*make_batch(4))
    assert "sampling/importance_sampling_ratio/mean" in stats
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        trainer.step(*make_batch(4, seed=1))


@pytest.mark.parametrize("temperature", [None, 0.7])
def test_a_float32_copy_s_correction_is_exactly_1_and_the_step_is_the_copy_free_one(temperature):
    """A float32 copy is the policy itself: every importance weight of the correction is exactly 1, and the step (stats
    and weights) is bit for bit the step without a copy, at any sampling temperature (the copy's pass divides by it
    too). A bf16 copy's weights differ from 1 and reach the update."""
    queries = random_queries(4, seed=2)
    setups = {"none": {}, "float32": {"rollout_dtype": "float32", "rollout_correction": "token_truncate"},
              "bfloat16": {"rollout_dtype": "bfloat16", "rollout_correction": "token_truncate"},
              "bfloat16 uncorrected": {"rollout_dtype": "bfloat16", "rollout_correction": None}}
    stats, weights = {}, {}
    for name, setup in setups.items():
        trainer = make_trainer("llama", advantage_estimator="dr_grpo", num_generations=2, temperature=temperature,
                               **setup)
        torch.manual_seed(0)
        trainer.generate(queries, return_prompt=False, max_new_tokens=5, do_sample=True, top_k=0,  # makes the copy
                         temperature=temperature or 1.0)
        responses = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([9, 8, 7]), torch.tensor([4, 4, 4, 4]),
                     torch.tensor([1, 2])]  # the same responses for every setup: only the correction differs
        stats[name] = trainer.step([queries[0]] * 2 + [queries[1]] * 2, responses,
                                   [torch.tensor(float(i)) for i in range(4)])
        weights[name] = [p.detach().clone() for p in trainer.model.pretrained_model.parameters()]
    ratio = "sampling/importance_sampling_ratio"
    assert stats["float32"][f"{ratio}/min"] == stats["float32"][f"{ratio}/max"] == 1.0
    assert stats["float32"]["sampling/sampling_logp_difference/max"] == 0.0
    assert all(torch.equal(p, q) for p, q in zip(weights["float32"], weights["none"]))
    for key in stats["none"]:
        if not key.startswith("time/"):
            np.testing.assert_array_equal(np.asarray(stats["float32"][key]), np.asarray(stats["none"][key]), key)
    assert stats["bfloat16"][f"{ratio}/min"] != 1.0 or stats["bfloat16"][f"{ratio}/max"] != 1.0
    assert any(not torch.equal(p, q) for p, q in zip(weights["bfloat16"], weights["bfloat16 uncorrected"]))


@pytest.mark.parametrize(("dtype", "correction", "device", "bf16", "zero3", "expected"), [
    ("auto", "auto", "cuda", True, False, ("bfloat16", "token_truncate")),  # the defaults on a GPU: the fast rollout
    ("auto", "auto", "cuda", False, False, (None, None)),  # a GPU without bf16 (T4, V100): the policy samples
    ("auto", "auto", "cuda", True, True, (None, None)),  # ZeRO-3: the weights are sharded, no whole copy to make
    ("auto", "auto", "cpu", False, False, (None, None)),  # a CPU: the policy samples, as TRL 0.11 did
    ("auto", "sequence_mask", "cuda", True, False, ("bfloat16", "sequence_mask")),  # an explicit value wins
    ("auto", None, "cuda", True, False, ("bfloat16", None)),
    ("float16", "auto", "cpu", False, False, ("float16", "token_truncate")),  # a copy samples: it is corrected
    (None, "auto", "cuda", True, False, (None, None)),
    ("auto", "token_mask", "cpu", False, False, (None, None)),  # no copy here: nothing to correct
])
def test_auto_rollout_is_a_corrected_bf16_copy_on_a_gpu_and_the_policy_elsewhere(dtype, correction, device, bf16,
                                                                                 zero3, expected):
    assert rollout_copy.rollout_choice(dtype, correction, device, bf16, zero3) == expected


@pytest.mark.parametrize(("kwargs", "copy_on_gpu", "expected"), [
    ({}, True, {"cache_implementation": "static"}),
    ({"cache_implementation": "auto"}, True, {"cache_implementation": "static"}),
    ({}, False, {}),  # transformers' default (dynamic)
    ({"cache_implementation": "auto", "top_k": 0}, False, {"top_k": 0}),
    ({"cache_implementation": "dynamic"}, True, {"cache_implementation": "dynamic"}),  # the user's wins
])
def test_generate_uses_the_static_cache_where_a_copy_samples_on_a_gpu(kwargs, copy_on_gpu, expected):
    assert rollout_copy.static_cache_by_default(kwargs, copy_on_gpu) == expected


def test_the_defaults_on_a_cpu_sample_from_the_policy_itself_as_trl_0_11_did():
    """PPOConfig's defaults are "auto": on this CPU the run's config holds None for both (no copy, no correction), and
    an explicit copy is what the run uses."""
    assert (PPOConfig().rollout_dtype, PPOConfig().rollout_correction) == ("auto", "auto")
    trainer = make_trainer()
    assert (trainer.config.rollout_dtype, trainer.config.rollout_correction, trainer._rollout) == (None, None, None)
    trainer = make_trainer(rollout_dtype="bfloat16")
    assert (trainer.config.rollout_dtype, trainer.config.rollout_correction) == ("bfloat16", "token_truncate")
    trainer = make_trainer(rollout_dtype="bfloat16", rollout_correction=None)
    assert (trainer.config.rollout_dtype, trainer.config.rollout_correction) == ("bfloat16", None)

"""The critic-free estimators inside the legacy loop: the seed's loop runs unchanged with G samples per prompt, the
value head is left alone, the KL goes where the estimator puts it, the loop learns, and a resumed run is exact."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

from ppo_core import AutoModelForCausalLMWithValueHead, AutoModelForSeq2SeqLMWithValueHead, PPOConfig, PPOTrainer
from tests.tiny import (
    random_queries,
    randomize_lora,
    tiny_causal_lm,
    tiny_lora_config,
    tiny_seq2seq_lm,
    tiny_tokenizer,
    tiny_value_model,
)

torch.set_num_threads(1)  # tiny models: extra threads only add spin-up cost

BUILT_IN = ["gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "dapo", "gspo",
            "cispo"]
CRITIC_FREE = BUILT_IN[1:]
TARGET = 7  # the rewarded token of the learning test


def grouped_queries(prompts: int, size: int, seed: int) -> list[torch.Tensor]:
    return [q for q in random_queries(prompts, seed=seed) for _ in range(size)]


def make_trainer(estimator: str, size: int = 4, batch: int = 16, seed: int = 0, **options) -> PPOTrainer:
    config = PPOConfig(batch_size=batch, mini_batch_size=batch // 2, learning_rate=1e-3, ppo_epochs=2, seed=seed,
                       advantage_estimator=estimator, num_generations=size, **options)
    return PPOTrainer(config, tiny_value_model("gpt2", seed=seed), tokenizer=tiny_tokenizer())


def rollout(trainer: PPOTrainer, step: int, size: int):
    queries = grouped_queries(trainer.config.batch_size // size, size, seed=step)
    responses = trainer.generate(queries, return_prompt=False, batch_size=len(queries), max_new_tokens=8,
                                 do_sample=True, top_k=0, top_p=1.0, pad_token_id=trainer.tokenizer.eos_token_id)
    return queries, responses, [(r == TARGET).sum().float() for r in responses]


def test_the_dataloader_yields_each_prompt_num_generations_times_in_a_row():
    rows = [{"input_ids": torch.tensor([3 + i, 4 + i]), "query": f"prompt {i}"} for i in range(12)]
    config = PPOConfig(batch_size=8, mini_batch_size=4, num_generations=4, advantage_estimator="grpo")
    trainer = PPOTrainer(config, tiny_value_model("gpt2"), tokenizer=tiny_tokenizer(), dataset=rows)
    batch = next(iter(trainer.dataloader))
    assert len(batch["query"]) == 8 and len(set(batch["query"])) == 2  # 8 / 4 prompts, each 4 times
    assert batch["query"][:4] == [batch["query"][0]] * 4 and batch["query"][4:] == [batch["query"][4]] * 4
    assert all(torch.equal(q, batch["input_ids"][0]) for q in batch["input_ids"][:4])


def test_step_names_the_block_that_is_not_one_prompt():
    trainer = make_trainer("grpo", size=4, batch=8)
    queries, responses, scores = rollout(trainer, 0, 4)
    queries[6] = torch.tensor([5, 6, 7])
    with pytest.raises(ValueError, match=r"^step: queries 4-7 \(group 1\) are not one prompt; with "
                                         r"num_generations=4 every 4 consecutive samples answer one query"):
        trainer.step(queries, responses, scores)


@pytest.mark.parametrize("estimator", CRITIC_FREE)
def test_critic_free_steps_leave_the_value_head_alone_and_report_no_value_stats(estimator):
    size = 1 if estimator == "reinforce_plus_plus" else 4
    trainer = make_trainer(estimator, size=size)
    head = {k: v.clone() for k, v in trainer.model.v_head.state_dict().items()}
    body = trainer.model.pretrained_model.lm_head.weight.detach().clone()
    stats = trainer.step(*rollout(trainer, 0, size))
    assert all(torch.equal(v, trainer.model.v_head.state_dict()[k]) for k, v in head.items())  # no value gradient
    assert all(p.grad is None and not p.requires_grad for p in trainer.model.v_head.parameters())  # frozen
    assert not torch.equal(body, trainer.model.pretrained_model.lm_head.weight)  # the policy trained
    assert not [k for k in stats if k.startswith(("ppo/val/", "ppo/returns/"))] and "ppo/loss/value" not in stats
    assert np.isfinite(stats["ppo/loss/policy"])
    # a KL with coefficient 0 (dr_grpo, dapo, gspo, cispo): no reference pass, so its KL is not measured (NaN), never
    # a made-up 0
    no_kl = ("dr_grpo", "dapo", "gspo", "cispo")
    assert np.isfinite(stats["objective/kl"]) == (estimator not in no_kl)
    kl_in_loss = estimator in ("grpo", "reinforce_plus_plus_baseline")  # the others: in the reward, or coefficient 0
    assert ("ppo/policy/kl_loss" in stats) == kl_in_loss


def test_the_kl_loss_term_is_k3_and_pulls_toward_the_reference():
    trainer = make_trainer("grpo", kl_loss_coef=1.0)
    stats = trainer.step(*rollout(trainer, 0, 4))
    # at the first mini-batch the policy is the reference: k3 = exp(0) - 0 - 1 = 0 exactly; later ones, >= 0
    assert stats["ppo/policy/kl_loss"] >= 0.0


@pytest.mark.slow
@pytest.mark.parametrize("estimator", CRITIC_FREE)
def test_the_seed_loop_learns_with_each_estimator(estimator):
    """The tiny rule task of test_learning: how often token w7 appears, with 4 samples per prompt."""
    size = 1 if estimator == "reinforce_plus_plus" else 4
    trainer = make_trainer(estimator, size=size)
    means = []
    for step in range(30):
        queries, responses, scores = rollout(trainer, step, size)
        trainer.step(queries, responses, scores)
        means.append(torch.stack(scores).mean().item())
    first, last = np.mean(means[:5]), np.mean(means[-5:])
    assert last > 2 * first and last > first + 0.5, f"{estimator}: mean score {first:.2f} -> {last:.2f}"


POSITIVE = (3, 4, 5)  # the seed loop's positive words: w3, w4, w5 of the tiny vocabulary's 61 words


@pytest.mark.slow
@pytest.mark.parametrize("estimator", BUILT_IN)
def test_switching_the_estimator_in_the_seed_loop_learns(estimator):
    """The seed's loop as a legacy user writes it, on the tiny GPT-2: every PPOConfig field at its legacy default but
    the learning rate (1e-3) and the two that switch the estimator; the score is the number of positive words in a
    24-token response (a random policy: ~0.9; at most 24). Each estimator's own defaults (its KL coefficient and
    place, its clip, its aggregation) must make it learn in 40 steps: above 3.0 at the end."""
    tokenizer = tiny_tokenizer()
    size = 1 if estimator in ("gae", "reinforce_plus_plus") else 4
    config = PPOConfig(learning_rate=1e-3, seed=0, advantage_estimator=estimator, num_generations=size)
    trainer = PPOTrainer(config, tiny_value_model("gpt2", seed=0), tokenizer=tokenizer)
    kwargs = dict(max_new_tokens=24, do_sample=True, top_k=0, top_p=1.0, pad_token_id=tokenizer.eos_token_id)
    means = []
    for step in range(40):
        queries = grouped_queries(config.batch_size // size, size, seed=step)
        responses = trainer.generate(queries, return_prompt=False, batch_size=len(queries), **kwargs)
        scores = [torch.isin(r, torch.tensor(POSITIVE)).sum().float() for r in responses]
        trainer.step(queries, responses, scores)
        means.append(torch.stack(scores).mean().item())
    assert means[0] < 1.5 and means[-1] > 3.0, f"{estimator}: mean score {means[0]:.2f} -> {means[-1]:.2f}"


def test_a_grpo_run_resumed_from_a_checkpoint_equals_the_uninterrupted_run_on_cpu(tmp_path):
    uninterrupted = make_trainer("grpo")
    expected = [uninterrupted.step(*rollout(uninterrupted, step, 4)) for step in range(3)][-1]
    first = make_trainer("grpo")
    for step in range(2):
        first.step(*rollout(first, step, 4))
    first.save_checkpoint(str(tmp_path / "ckpt"))
    resumed = make_trainer("grpo")
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    got = resumed.step(*rollout(resumed, 2, 4))
    for name, param in uninterrupted.model.state_dict().items():
        assert torch.equal(param, resumed.model.state_dict()[name]), name
    assert got["ppo/loss/total"] == expected["ppo/loss/total"]


def test_batch_sizes_must_be_multiples_of_num_generations():
    with pytest.raises(ValueError, match=r"PPOConfig.mini_batch_size must be a multiple of num_generations \(4\), "
                                         r"got 6"):
        PPOConfig(batch_size=12, mini_batch_size=6, num_generations=4, advantage_estimator="grpo")
    with pytest.raises(ValueError, match="num_generations must be >= 2 for advantage_estimator rloo, got 1"):
        PPOConfig(advantage_estimator="rloo")


@pytest.mark.parametrize("policy", ["lora-gpt2", "t5", "lora-t5"])
def test_grpo_steps_with_lora_and_encoder_decoder_policies(policy):
    """GRPO with its KL loss: against the adapter-disabled policy for LoRA (no reference copy), and through the
    encoder-decoder path; only the trainable weights move, never the value head."""
    peft = pytest.importorskip("peft") if policy.startswith("lora") else None
    if policy == "lora-gpt2":
        model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_causal_lm("gpt2"),
                                                                  peft_config=tiny_lora_config())
    elif policy == "t5":
        model = AutoModelForSeq2SeqLMWithValueHead(tiny_seq2seq_lm("t5"))
    else:
        model = AutoModelForSeq2SeqLMWithValueHead.from_pretrained(
            tiny_seq2seq_lm("t5"), peft_config=tiny_lora_config(target_modules=("q", "v")))
    if peft is not None:
        randomize_lora(model)  # a fresh adapter is the identity: make the policy differ from its reference
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = PPOConfig(batch_size=8, mini_batch_size=4, ppo_epochs=2, learning_rate=1e-2, seed=0,
                       advantage_estimator="grpo", num_generations=4, kl_loss_coef=0.1)
    trainer = PPOTrainer(config, model, tokenizer=tiny_tokenizer())
    assert (trainer.ref_model is None) == (peft is not None)
    for step in range(2):
        stats = trainer.step(*rollout(trainer, step, 4))
        assert np.isfinite(stats["ppo/loss/policy"]) and stats["ppo/policy/kl_loss"] >= 0
    assert stats["objective/kl"] != 0
    for name, param in model.named_parameters():
        trainable = ("lora_" in name) if peft is not None else not name.startswith("v_head.")
        assert torch.equal(param, before[name]) != trainable, name


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_generate_refuses_to_decode_a_group_greedily(estimator):
    """Greedy decoding gives every sample of a prompt the same response, so every advantage is 0: refused, whether
    do_sample=False is passed or is the model's generation default."""
    trainer = make_trainer(estimator, size=4, batch=8)
    queries = grouped_queries(2, 4, seed=0)
    with pytest.raises(ValueError, match=rf"^generate: greedy decoding \(do_sample=False\) gives num_generations=4 "
                                         rf"identical responses to each prompt, so {estimator}'s advantages are all 0"):
        trainer.generate(queries, return_prompt=False, max_new_tokens=4, do_sample=False)
    trainer.model.pretrained_model.generation_config.do_sample = False
    with pytest.raises(ValueError, match="greedy decoding"):
        trainer.generate(queries, return_prompt=False, max_new_tokens=4)
    gae = PPOTrainer(PPOConfig(batch_size=8, mini_batch_size=4), tiny_value_model("gpt2"), tokenizer=tiny_tokenizer())
    assert len(gae.generate(queries, return_prompt=False, max_new_tokens=4, do_sample=False)) == 8  # no groups


def test_the_share_of_groups_without_a_reward_spread_is_a_stat():
    """ppo/frac_reward_zero_std: the prompts whose samples all scored the same (no learning signal for a group
    estimator), as TRL's GRPO logs it; absent for PPO, which has no groups."""
    trainer = make_trainer("grpo", size=4, batch=16)
    queries, responses, _ = rollout(trainer, 0, 4)
    scores = [torch.tensor(v) for v in [1.0] * 4 + [0.0, 1.0, 0.0, 0.0] + [2.5] * 4 + [3.0, 3.0, 3.0, 3.5]]
    stats = trainer.step(queries, responses, scores)
    assert stats["ppo/frac_reward_zero_std"] == 0.5  # groups 0 and 2 of 4
    gae = PPOTrainer(PPOConfig(batch_size=16, mini_batch_size=8), tiny_value_model("gpt2"), tokenizer=tiny_tokenizer())
    assert "ppo/frac_reward_zero_std" not in gae.step(queries, responses, scores)


@pytest.mark.parametrize("estimator, options", [("dr_grpo", {}), ("grpo", {"kl_loss_coef": 0.0}),
                                                ("rloo", {"init_kl_coef": 0.0, "adap_kl_ctrl": False})])
def test_a_kl_with_coefficient_0_skips_the_reference_pass_and_changes_nothing_else(estimator, options):
    """Where the KL's coefficient is 0 (in the loss, or in the reward through a fixed controller) the reference pass
    would only feed the KL stats: it is skipped, those stats are NaN (not measured), the controller is left alone, and
    the update is bit for bit the one the pass would have given (a KL times 0 is 0)."""
    skipping, forced = make_trainer(estimator, **options), make_trainer(estimator, **options)
    forced._reference_in_use = lambda: True  # the same trainer, made to run the reference pass
    calls = []
    reference = skipping.reference_policy
    skipping.reference_policy = lambda: calls.append(1) or reference()
    batch = rollout(skipping, 0, 4)
    stats, forced_stats = skipping.step(*batch), forced.step(*batch)
    assert calls == []  # the reference model never ran
    for key in ("objective/kl", "objective/kl_dist", "objective/ref_logprobs"):
        assert np.isnan(stats[key]).all() and np.isfinite(forced_stats[key]).all(), key
    assert skipping.kl_ctl.value == skipping.config.init_kl_coef  # not updated from a KL never measured
    for (name, a), b in zip(skipping.model.named_parameters(), forced.model.parameters()):
        assert torch.equal(a, b), name
    assert stats["ppo/loss/total"] == forced_stats["ppo/loss/total"]


def test_the_reference_pass_runs_wherever_its_kl_counts():
    for estimator, options in [("grpo", {}), ("rloo", {}), ("dr_grpo", {"kl_loss_coef": 0.01}),
                               ("rloo", {"init_kl_coef": 0.0, "adap_kl_ctrl": True, "target": 6.0})]:
        trainer = make_trainer(estimator, **options)
        assert trainer._reference_in_use() == (options.get("init_kl_coef") != 0.0), (estimator, options)


@pytest.mark.parametrize("estimator, kl_in, coef", [("grpo", "loss", 0.04), ("rloo", "reward", 0.05),
                                                    ("reinforce_plus_plus_baseline", "loss", 0.001)])
def test_the_kl_coefficients_reported_are_those_applied(estimator, kl_in, coef):
    """`objective/kl_coef` is the coefficient the rewards were shaped with (0 where the KL is in the loss; it used to
    report the unused legacy controller's 0.2), `objective/kl_loss_coef` the loss's; the adaptive controller moves
    only where it sets the coefficient in effect."""
    trainer = make_trainer(estimator)
    stats, values = [], []
    for step in range(2):
        stats.append(trainer.step(*rollout(trainer, step, 4)))
        values.append(trainer.kl_ctl.value)
    if kl_in == "loss":
        assert [s["objective/kl_coef"] for s in stats] == [0.0, 0.0]
        assert [s["objective/kl_loss_coef"] for s in stats] == pytest.approx([coef, coef])
        assert [s["ppo/mean_non_score_reward"] for s in stats] == [0.0, 0.0]  # nothing in the rewards
        assert values == [0.0, 0.0]  # the legacy controller, unused: left at its 0 (no KL in the rewards)
    else:
        assert "objective/kl_loss_coef" not in stats[0]
        assert stats[0]["objective/kl_coef"] == pytest.approx(coef) and values[0] != coef  # adaptive: it moved
        assert stats[1]["objective/kl_coef"] == pytest.approx(values[0], rel=1e-6)  # and step 1 shaped with it


def test_cispo_s_loss_with_another_estimator_caps_the_weight_at_cispo_s_cap_not_the_clip_range():
    """`loss_type: cispo` with grpo: the cap on the importance weight is CISPO's own parameter (5.0), not the clip's
    upper eps (which falls back to cliprange, 0.2: every weight capped at 0.2, the ratio's gradient signal gone)."""
    from ppo_core.algo.ppo_math import policy_loss

    def cap_of(**options):
        resolved = PPOConfig(batch_size=8, mini_batch_size=4, advantage_estimator="grpo", num_generations=2,
                             **options).resolved
        old = torch.zeros(1, 4)
        logprobs = old + torch.log(torch.tensor([1.5, 3.0, 4.5, 6.0]))  # ratios 1.5 .. 6
        loss = policy_loss(logprobs, old, torch.ones(1, 4), torch.ones(1, 4), resolved.cliprange,
                           cliprange_high=resolved.epsilon_high, kind=resolved.policy_loss,
                           **resolved.policy_loss_kwargs)
        return resolved.policy_loss_kwargs["cap"], loss.clipfrac.item()

    assert cap_of(loss_type="cispo") == (5.0, 0.25)  # only the ratio of 6 is capped
    assert cap_of(policy_loss="cispo") == (5.0, 0.25)
    assert cap_of(loss_type="cispo", policy_loss_kwargs={"cap": 2.0}) == (2.0, 0.75)  # its own parameter
    assert cap_of(loss_type="cispo", epsilon_high=4.0) == (4.0, 0.5)  # TRL's meaning of epsilon_high there
    assert PPOConfig(batch_size=8, mini_batch_size=4, advantage_estimator="grpo", num_generations=2,
                     loss_type="dapo").resolved.epsilon_high == 0.2  # the clip's: cliprange


def test_a_window_without_a_token_makes_no_optimizer_step_and_says_so():
    """DAPO's dynamic sampling leaves out every group whose samples scored alike: in a step where all did, no
    mini-batch has a token. Its loss is 0, but Adam would still move the weights on the momentum of the steps before;
    no backward and no optimizer step run, the stats count the empty mini-batches, and the step warns once."""
    trainer = make_trainer("dapo", size=4, batch=16)
    queries, responses, scores = rollout(trainer, 0, 4)
    spread = [torch.tensor(float(i % 4)) for i in range(16)]  # every group has a spread: trains
    first = trainer.step(queries, responses, spread)
    assert first["ppo/policy/empty_minibatches"] == 0
    before = [p.detach().clone() for p in trainer.model.parameters()]
    flat = [torch.tensor(float(i // 4)) for i in range(16)]  # each group one score: nothing to train on
    with pytest.warns(UserWarning, match=r"step 2: no mini-batch had a token to train on .* did not move"):
        stats = trainer.step(queries, responses, flat)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    assert stats["ppo/policy/empty_minibatches"] == 4  # 2 epochs of 2 mini-batches
    assert stats["ppo/frac_responses_left_out"] == 1.0 and np.isfinite(stats["ppo/loss/policy"])


def test_dr_grpo_divides_by_the_length_limit_the_same_in_every_step():
    """Dr. GRPO's constant is the responses' length limit: max_completion_length, else the max_new_tokens generate()
    was called with; not the step's longest response, which would weigh a token by the other responses of its step.
    Without either, each step's longest response, with a warning once."""
    from ppo_core.algo.advantages import norm_length
    from ppo_core.runtime.distributed import SingleProcess

    alone = SingleProcess(torch.device("cpu"))
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    config = PPOConfig(batch_size=8, mini_batch_size=4, advantage_estimator="dr_grpo", num_generations=2)
    assert norm_length(config, mask, alone, generated=8) == 8
    assert int(norm_length(config, mask, alone)) == 2  # the fallback: this batch's longest
    assert norm_length(dataclasses.replace(config, max_completion_length=24), mask, alone, generated=8) == 24
    trainer = make_trainer("dr_grpo", size=4)
    queries, responses, scores = rollout(trainer, 0, 4)  # generate(..., max_new_tokens=8)
    assert trainer._generated_max_new_tokens == 8
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no warning: the constant is known
        warnings.filterwarnings("ignore", message=".*no dataset is provided.*")
        trainer.step(queries, responses, scores)
    outside = make_trainer("dr_grpo", size=4)  # responses generated elsewhere: no limit known
    with pytest.warns(UserWarning, match="divides by its longest response instead.*Set max_completion_length"):
        outside.step(queries, responses, scores)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        outside.step(queries, responses, scores)  # once


def test_with_the_kl_in_the_loss_objective_kl_is_the_loss_s_estimator():
    """GRPO trains on k3 (kl_estimator) in its loss: objective/kl measures k3 too, not kl_penalty's k1, so what is
    logged is what is penalised. The reference differs from the policy, so that the two estimates differ."""
    config = PPOConfig(batch_size=8, mini_batch_size=4, advantage_estimator="grpo", num_generations=4, seed=0)
    trainer = PPOTrainer(config, tiny_value_model("gpt2", seed=0), ref_model=tiny_value_model("gpt2", seed=1),
                         tokenizer=tiny_tokenizer())
    stats = trainer.step(*rollout(trainer, 0, 4))
    logprobs, ref = torch.as_tensor(stats["objective/logprobs"]), torch.as_tensor(stats["objective/ref_logprobs"])
    d = logprobs - ref
    k3 = (torch.expm1(-d) + d).sum() / 8  # the per-sample sum's mean
    assert stats["objective/kl"] == pytest.approx(float(k3), rel=1e-5)
    assert abs(float(d.sum() / 8) - float(k3)) > 1e-3  # k1 would be another number


def test_dynamic_sampling_judges_the_scores_after_the_overlong_penalty():
    """DAPO's order: the overlong penalty shapes the scores first, then dynamic sampling leaves out the groups whose
    shaped scores are all alike. A group that scored 1.0 four times, one of its answers overlong, has a spread once
    penalised: it stays in the loss; the same group with no overlong answer has none and is left out."""
    config = PPOConfig(batch_size=8, mini_batch_size=8, advantage_estimator="dapo", num_generations=4,
                       max_completion_length=8, overlong_buffer_len=4)
    queries = grouped_queries(2, 4, seed=0)
    ones = [torch.tensor(1.0)] * 4 + [torch.tensor(float(i)) for i in range(4)]

    def left_out(lengths: list[int]) -> float:
        trainer = PPOTrainer(config, tiny_value_model("gpt2"), tokenizer=tiny_tokenizer())
        responses = [torch.full((n,), 5) for n in lengths]
        return trainer.step(queries, responses, ones)["ppo/frac_responses_left_out"]

    assert left_out([8, 3, 3, 3, 3, 3, 3, 3]) == 0.0  # the first response is overlong: its group has a spread
    assert left_out([3] * 8) == 0.5  # no penalty: the first group is one score, left out

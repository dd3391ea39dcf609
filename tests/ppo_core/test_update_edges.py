"""The update at its edges, through ``step()`` as a user calls it: mini-batches left without a token (a critic's too,
``response_masks`` alone, a whole window), the last batch of a pass over ``trainer.dataloader``, early stopping and
the ratio threshold under gradient accumulation, and the settings a run resolves once (issue 45)."""

from __future__ import annotations

import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch

from ppo_core import PPOConfig, PPOTrainer
from ppo_core.algo.registry import settings
from ppo_core.runtime.distributed import SingleProcess
from ppo_core.step.rollout import PolicyOutputs, Rollout
from ppo_core.step.update import minibatch_decision, ppo_loss, window_divisors
from tests.tiny import EOS, random_queries, tiny_tokenizer, tiny_value_model

torch.set_num_threads(1)  # tiny models: extra threads only add spin-up cost

ALONE = SingleProcess(torch.device("cpu"))


def batch(n: int, lengths: list[int] | None = None, eos: list[bool] | None = None, seed: int = 0):
    """``n`` queries, responses of ``lengths`` tokens (4 by default) ending with EOS where ``eos`` says (all by
    default), and scores 0, 1, 2, ..."""
    g = torch.Generator().manual_seed(seed)
    lengths = lengths or [4] * n
    eos = eos or [True] * n
    queries = random_queries(n, seed=seed)
    responses = [torch.randint(3, 64, (k,), generator=g) for k in lengths]
    for response, ends in zip(responses, eos):
        if ends:
            response[-1] = EOS
    return queries, responses, [torch.tensor(float(i)) for i in range(n)]


def trainer_for(**options) -> PPOTrainer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no dataset: legacy's warning
        return PPOTrainer(PPOConfig(learning_rate=1e-2, seed=0, **options), tiny_value_model("gpt2"),
                          tokenizer=tiny_tokenizer())


def weights(trainer: PPOTrainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])


# ---- 1-2. a mini-batch without a token skips, whatever emptied it and whichever estimator -------------------------
def test_a_critic_s_empty_minibatch_is_skipped_not_raised():
    """GAE with ``mask_truncated_completions``: mini-batches of one sample, two of four cut at the length limit, so
    two mini-batches of each epoch have no token. Their value statistics (variances over no token) must not stop the
    step: they run no backward, and the step's statistics are those of the mini-batches that trained."""
    trainer = trainer_for(batch_size=4, mini_batch_size=1, ppo_epochs=2, mask_truncated_completions=True)
    before = weights(trainer)
    stats = trainer.step(*batch(4, eos=[False, True, False, True]))
    assert stats["ppo/policy/empty_minibatches"] == 2 * 2
    for key in ("ppo/returns/var", "ppo/val/var", "ppo/val/var_explained", "ppo/loss/value", "ppo/loss/total"):
        assert math.isfinite(stats[key]), key
    assert not torch.equal(weights(trainer), before)  # the other two trained


@pytest.mark.parametrize("estimator,generations", [("gae", 1), ("grpo", 2), ("dr_grpo", 2), ("rloo", 2)])
def test_response_masks_alone_can_empty_a_minibatch_which_is_then_skipped(estimator, generations):
    """One process, no gradient accumulation, mini-batches of 2 out of 4 samples, three of them masked whole by the
    user: at least one mini-batch of each epoch has no token, and skips; the step completes."""
    trainer = trainer_for(batch_size=4, mini_batch_size=2, ppo_epochs=2, advantage_estimator=estimator,
                          num_generations=generations)
    queries, responses, scores = batch(4)
    if generations > 1:
        queries = [queries[i - i % generations] for i in range(4)]
    masks = [torch.zeros(len(r), dtype=torch.long) for r in responses]
    masks[1] = torch.ones(len(responses[1]), dtype=torch.long)
    before = weights(trainer)
    stats = trainer.step(queries, responses, scores, response_masks=masks)
    assert stats["ppo/policy/empty_minibatches"] >= 2  # one per epoch at least
    assert all(math.isfinite(v) for k, v in stats.items() if isinstance(v, float) and not k.startswith("objective"))
    assert not torch.equal(weights(trainer), before)


def test_a_window_with_no_token_anywhere_steps_nothing_under_accumulation():
    """DAPO, gradient accumulation 2, every group scoring alike: dynamic sampling leaves every sample out of the loss.
    Every window is empty (its divisors fall back to 1, not 0): the step warns, reports every mini-batch empty with
    finite statistics, and the weights do not move (Adam would move them on a zero gradient)."""
    trainer = trainer_for(batch_size=8, mini_batch_size=2, gradient_accumulation_steps=2, ppo_epochs=2,
                          advantage_estimator="dapo", num_generations=2, max_completion_length=8)
    queries, responses, _ = batch(8)
    queries = [queries[i - i % 2] for i in range(8)]
    before = weights(trainer)
    with pytest.warns(UserWarning, match="no mini-batch had a token to train on"):
        stats = trainer.step(queries, responses, [torch.tensor(1.0)] * 8)
    assert stats["ppo/policy/empty_minibatches"] == 8
    assert math.isfinite(stats["ppo/loss/policy"]) and math.isfinite(stats["ppo/policy/approxkl"])
    assert np.isfinite(stats["ppo/policy/ratio"]).all()  # each mini-batch's own: divided by 1, not by 0
    assert torch.equal(weights(trainer), before)


def test_a_mix_of_empty_and_full_windows_reports_the_full_ones_means():
    """The step's training statistics are means over the windows that trained: an empty window's zeros (its sums over
    no token) do not dilute them. Mini-batches of one sample, no accumulation, one epoch, two of four samples masked
    whole: the step's mean ratio is about 1 (a first epoch's), not about 1/2."""
    trainer = trainer_for(batch_size=4, mini_batch_size=1, ppo_epochs=1)
    queries, responses, scores = batch(4)
    masks = [torch.ones(len(r), dtype=torch.long) for r in responses]
    masks[0] = torch.zeros_like(masks[0])
    masks[2] = torch.zeros_like(masks[2])
    stats = trainer.step(queries, responses, scores, response_masks=masks)
    assert stats["ppo/policy/empty_minibatches"] == 2
    assert stats["ppo/policy/ratio_mean"] == pytest.approx(1.0, abs=0.05)


# ---- 3. the last batch of a pass over trainer.dataloader accumulates as any other --------------------------------
def test_gradient_accumulation_holds_on_the_dataloader_s_last_batch():
    """The seed's loop over ``trainer.dataloader``: 8 rows, batches of 4, mini-batches of 1, accumulation 2. Each
    ``step()`` makes 4 / 2 = 2 optimizer updates, the second (the loader's last batch) too: accelerate's default
    would sync at every mini-batch of the last batch."""
    rows = [{"input_ids": q} for q in random_queries(8, seed=3)]
    config = PPOConfig(batch_size=4, mini_batch_size=1, gradient_accumulation_steps=2, ppo_epochs=1, seed=0)
    trainer = PPOTrainer(config, tiny_value_model("gpt2"), tokenizer=tiny_tokenizer(), dataset=rows,
                         data_collator=lambda rows: {"input_ids": [r["input_ids"] for r in rows]})
    counted = []
    optimizer_step = trainer.optimizer.step
    trainer.optimizer.step = lambda *a, **k: (counted.append(1), optimizer_step(*a, **k))[1]
    per_step = []
    for rows in trainer.dataloader:
        _, responses, scores = batch(4, seed=len(per_step))
        before = len(counted)
        trainer.step(rows["input_ids"], responses, scores)
        per_step.append(len(counted) - before)
    assert per_step == [2, 2]


# ---- 4. early stopping and the ratio threshold read the window's mean, not a mini-batch's share --------------------
def epochs_run(mini_batch_size: int, accumulation: int, target_kl: float | None) -> tuple[float, float]:
    """``(epochs run, the policy KL early stopping compared after the second epoch)`` of one step on a fixed batch of
    8, with early stopping at ``target_kl`` (None: a target never reached), plain SGD."""
    config = PPOConfig(batch_size=8, mini_batch_size=mini_batch_size, gradient_accumulation_steps=accumulation,
                       ppo_epochs=3, seed=0, early_stopping=True, target_kl=target_kl or 1e9)
    model = tiny_value_model("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = PPOTrainer(config, model, tokenizer=tiny_tokenizer(),
                             optimizer=torch.optim.SGD(model.parameters(), lr=3.0))
    seen = []
    early_stop = trainer._early_stop
    trainer._early_stop = lambda kl: (seen.append(float(kl)), early_stop(kl))[1]
    stats = trainer.step(*batch(8, lengths=[3, 9, 5, 7, 4, 8, 6, 2]))
    return stats["ppo/epochs"], (seen[1] if len(seen) > 1 else math.nan)


def test_early_stopping_is_decided_on_the_window_s_mean_policy_kl_however_the_batch_is_split():
    """The policy KL after the second epoch, measured on the whole backward batch (mini 8, GA 1), is K. Split into
    (mini 4, GA 2), the last mini-batch's share of its window differs from K; a threshold half-way between the two
    stops one split and not the other if the share is read. Both must run the same epochs."""
    _, whole = epochs_run(8, 1, None)
    _, split = epochs_run(4, 2, None)
    assert split == pytest.approx(whole, rel=1e-4)  # what the trainer compares: the window's mean, either way
    assert whole > 0
    # thresholds just below and just above the mean (a share here reads about 4% off it): one decision for both splits
    for factor, epochs in ((0.97, 2), (1.03, 3)):
        target = factor * whole / 1.5  # it stops above 1.5 * target_kl
        assert epochs_run(8, 1, target)[0] == epochs_run(4, 2, target)[0] == epochs


def test_the_ratio_threshold_compares_the_minibatch_s_own_mean_ratio():
    """A window of 10 tokens under gradient accumulation 2, this mini-batch holding 8 of them, every ratio 1.2: its
    mean ratio is 1.2, below a threshold of 1.5 (its share of the window's mean, 8 * 1.2 / 5 = 1.92, is above)."""
    config = PPOConfig(batch_size=4, mini_batch_size=2, gradient_accumulation_steps=2)
    mask = torch.tensor([[1.0] * 4, [1.0] * 4])  # 8 tokens here; the window's other mini-batch holds 2
    window = torch.cat([mask, torch.tensor([[1.0, 1.0, 0, 0], [0.0] * 4])])
    divisors = window_divisors(window, ALONE, 2)
    assert divisors.tokens.item() == 5.0  # 10 tokens over 2 backward passes
    log_ratio = torch.full((2, 4), math.log(1.2))
    zeros = torch.zeros(2, 4)
    mb = Rollout(None, mask, zeros, zeros, None, torch.ones(2, 4), zeros)
    _, _, stats = ppo_loss(config, ALONE, mb, PolicyOutputs(log_ratio, zeros, None, None), divisors)
    decision = minibatch_decision(stats, ratio_threshold=1.5, group=ALONE)
    assert decision.ratio_mean == pytest.approx(1.2) and not decision.skipped


# ---- 5. a KL coefficient where the KL does not go ------------------------------------------------------------------
def test_init_kl_coef_with_the_kl_in_the_loss_is_not_kept_nor_reported():
    """``init_kl_coef`` is the KL's coefficient in the rewards: with GRPO's KL in the loss it applies nowhere. The
    resolved value is 0 (what is in effect), the trainer warns once naming it, and ``objective/kl_coef`` says 0."""
    config = PPOConfig(batch_size=4, mini_batch_size=2, advantage_estimator="grpo", num_generations=2,
                       init_kl_coef=0.1)
    assert config.resolved.init_kl_coef == 0.0 and config.init_kl_coef == 0.1  # the field stays as given
    with pytest.warns(UserWarning, match=r"init_kl_coef=0.1 .* not used"):
        trainer = PPOTrainer(config, tiny_value_model("gpt2"), tokenizer=tiny_tokenizer())
    assert trainer.resolved.init_kl_coef == 0.0 and trainer.config.init_kl_coef == 0.0
    assert trainer.kl_ctl.value == 0.0


def grpo_update(kl_loss_coef: float, reference_seed: int) -> torch.Tensor:
    """The weight change of one GRPO step at ``kl_loss_coef``, against a reference model of ``reference_seed``."""
    config = PPOConfig(batch_size=4, mini_batch_size=4, ppo_epochs=1, seed=0, advantage_estimator="grpo",
                       num_generations=2, kl_loss_coef=kl_loss_coef)
    model = tiny_value_model("gpt2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = PPOTrainer(config, model, ref_model=tiny_value_model("gpt2", seed=reference_seed),
                             tokenizer=tiny_tokenizer(), optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
    before = weights(trainer)
    queries, responses, scores = batch(4)
    stats = trainer.step([queries[i - i % 2] for i in range(4)], responses, scores)
    return weights(trainer) - before, stats


def test_kl_loss_coef_0_with_grpo_adds_no_kl_term():
    """``kl_loss_coef: 0`` switches GRPO's KL term off: the update does not depend on the reference at all (no
    ``policy/kl_loss``, no reference pass), where with GRPO's 0.04 it does."""
    off_a, stats = grpo_update(0.0, reference_seed=5)
    off_b, _ = grpo_update(0.0, reference_seed=6)
    assert torch.equal(off_a, off_b)
    assert "ppo/policy/kl_loss" not in stats and math.isnan(stats["objective/kl"])
    on_a, on_stats = grpo_update(0.04, reference_seed=5)
    on_b, _ = grpo_update(0.04, reference_seed=6)
    assert not torch.equal(on_a, on_b) and on_stats["ppo/policy/kl_loss"] > 0  # the test can tell


# ---- 6. what a run trains with is resolved once, and read by all ---------------------------------------------------
def test_a_run_s_resolved_settings_are_one_object_and_fixed():
    trainer = trainer_for(batch_size=4, mini_batch_size=2, advantage_estimator="grpo", num_generations=2)
    assert settings(trainer.config) is trainer.resolved  # the loss, the rewards and the checkpoint read this one
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"trainer\.config\.cliprange .*fixed when the trainer"):
        trainer.config.cliprange = 0.5
    with pytest.raises(dataclasses.FrozenInstanceError, match="advantage_estimator"):
        trainer.config.advantage_estimator = "gae"
    assert trainer.resolved.cliprange == 0.2 and trainer.config.cliprange == 0.2
    trainer.config.ratio_threshold = 5.0  # a field the step reads as it goes still follows an edit, as legacy's
    assert trainer.config.ratio_threshold == 5.0
    copy = dataclasses.replace(trainer.config, cliprange=0.3)  # a new config from the run's: free to build on
    copy.cliprange = 0.4
    assert copy.resolved.cliprange == 0.4


# ---- 7. Dr. GRPO divides by a constant ------------------------------------------------------------------------------
def test_dr_grpo_s_normaliser_counts_every_sequence_masked_or_not():
    """Dr. GRPO's loss is sum(token losses) / (B * L), B the mini-batch's sequences, masked whole or not (TRL's
    ``per_token_loss.size(0) * max_completion_length``): a token weighs the same whatever else its step masked."""
    from ppo_core.algo.ppo_math import aggregate

    loss = torch.ones(4, 3)
    mask = torch.tensor([[1.0, 1, 1], [0, 0, 0], [0, 0, 0], [1, 0, 0]])
    assert aggregate(loss, mask, "seq-mean-token-sum-norm", norm_length=3).item() == pytest.approx(4 / (4 * 3))


def test_dr_grpo_s_update_of_a_token_does_not_depend_on_rows_masked_elsewhere():
    """Two steps on the same batch, the second with two more samples masked whole: with Dr. GRPO's constant
    normaliser, the gradient of the kept samples is the same in both (as a sum over them, divided by the same B * L);
    with a divisor counting the sequences that have a token it would be 4/2 = 2x larger."""
    def update(masked: list[int]) -> torch.Tensor:
        config = PPOConfig(batch_size=4, mini_batch_size=4, ppo_epochs=1, seed=0, advantage_estimator="dr_grpo",
                           num_generations=2, max_completion_length=8, scale_rewards="none")
        model = tiny_value_model("gpt2")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = PPOTrainer(config, model, tokenizer=tiny_tokenizer(),
                                 optimizer=torch.optim.SGD(model.parameters(), lr=1.0))
        queries, responses, _ = batch(4)
        masks = [torch.zeros(len(r)) if i in masked else torch.ones(len(r)) for i, r in enumerate(responses)]
        before = weights(trainer)
        # the masked group's scores are alike: its advantages are 0, so it adds nothing where it is kept either
        trainer.step([queries[i - i % 2] for i in range(4)], responses,
                     [torch.tensor(s) for s in (0.0, 1.0, 2.0, 2.0)], response_masks=masks)
        return weights(trainer) - before

    kept, masked = update([]), update([2, 3])
    assert kept.abs().max() > 0
    assert torch.allclose(kept, masked, atol=1e-7, rtol=1e-5)


# ---- 8. DAPO's overlong penalty measures the response, not the tokens the loss trains on ----------------------------
def test_the_overlong_penalty_measures_the_whole_response_whatever_response_masks_leave_out():
    """A 10-token response under L_max 10 and a buffer of 4 is 4 tokens into the buffer: penalty -1. Its mask
    leaving 6 of them out (a tool's output) does not make it shorter."""
    trainer = trainer_for(batch_size=2, mini_batch_size=2, ppo_epochs=1, advantage_estimator="dapo",
                          num_generations=2, max_completion_length=10, overlong_buffer_len=4)
    queries, responses, scores = batch(2, lengths=[10, 10])
    queries = [queries[0], queries[0]]
    masks = [torch.ones(10, dtype=torch.long), torch.cat([torch.ones(4), torch.zeros(6)]).long()]
    stats = trainer.step(queries, responses, scores, response_masks=masks)
    assert stats["ppo/overlong_penalty_mean"] == pytest.approx(-1.0)


# ---- 9. the window's divisors are global counts ---------------------------------------------------------------------
class OtherProcess:
    """This process and one other holding ``other`` ((tokens, sequences with a token)) of the window."""

    num_processes = 2

    def __init__(self, other: list[float]):
        self.other = torch.tensor(other)

    def sum_across(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.other


def test_window_divisors_are_the_global_window_s_counts_over_processes_and_accumulation():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])  # 4 tokens, 2 sequences here
    two = window_divisors(mask, OtherProcess([12.0, 3.0]), 1)  # 12 tokens in 3 sequences there
    assert (two.tokens.item(), two.sequences.item()) == (8.0, 2.5)  # (4 + 12) / 2, (2 + 3) / 2
    accumulated = window_divisors(mask, OtherProcess([12.0, 3.0]), 2)
    assert (accumulated.tokens.item(), accumulated.sequences.item()) == (4.0, 1.25)
    alone = window_divisors(mask, ALONE, 2)
    assert (alone.tokens.item(), alone.sequences.item()) == (2.0, 1.0)
    empty = window_divisors(torch.zeros(2, 3), OtherProcess([0.0, 0.0]), 2)  # no token anywhere: 1, not 0
    assert (empty.tokens.item(), empty.sequences.item()) == (1.0, 1.0)

"""One update, however the batch is split: a step's weight update depends on its backward batch only, not on how that
batch is split into mini-batches and gradient-accumulation steps (and processes: tests/ppo_core/runtime/
test_distributed.py runs the two-process cells of the same matrix).

Each cell is one `step()` on a fixed batch of 8 samples whose responses are 3 to 24 tokens long, one of them masked
whole (`response_masks`), with fixed scores, `ppo_epochs=1` and plain SGD (the update is the gradient itself), for
every registered estimator and every loss aggregation. TRL 0.11 divided each mini-batch by its own token count and
averaged the mini-batches, which weighs a token of a short mini-batch more than one of a long one: the same batch
then moved the weights by up to 31% otherwise under (mini 2, GA 4) than under (mini 8, GA 1).

The masked cells leave mini-batches without a token under the finer splits (5 of the 8 samples masked whole: at
mini-batches of 2, one at least is empty): GAE's critic with truncated responses masked, every estimator with
`response_masks` alone, and the batch as the last one of a pass over `trainer.dataloader` (where accelerate's default
would step the optimizer at every mini-batch).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from ppo_core import PPOConfig, PPOTrainer
from ppo_core.algo.choices import LOSS_AGGREGATIONS
from ppo_core.algo.registry import get_estimator
from tests.ppo_core.test_trainer_estimators import BUILT_IN
from tests.tiny import EOS, tiny_tokenizer, tiny_value_model

torch.set_num_threads(1)  # tiny models: extra threads only add spin-up cost

LENGTHS = [3, 24, 5, 17, 9, 12, 4, 21]  # uneven, so that mini-batches hold different numbers of tokens
MASKED = 5  # the sample whose response the loss leaves out whole
SPLITS = [(8, 1), (4, 2), (2, 4)]  # (mini_batch_size, gradient_accumulation_steps): one backward batch of 8
TWO_PROCESS_SPLITS = [(4, 1), (2, 2)]  # per process, over 4 samples each: the same global backward batch of 8
# float32 rounding of sums over the same terms in other orders, relative to the update's largest element
TOLERANCE = 1e-5


def fixed_batch(num_generations: int, masked: tuple[int, ...] = (MASKED,), truncated: tuple[int, ...] = ()):
    """8 queries (each prompt ``num_generations`` times in a row), responses of ``LENGTHS`` tokens (ending with EOS but
    the ``truncated`` ones, or where none is, the even ones), scores, and response masks leaving ``masked`` out."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (int(n),), generator=g) for n in torch.randint(2, 6, (8,), generator=g)]
    queries = [prompts[i - i % num_generations] for i in range(8)]
    responses = [torch.randint(3, 64, (n,), generator=g) for n in LENGTHS]  # no EOS among them
    for i in (i for i in range(8) if (i not in truncated if truncated else i % 2)):
        responses[i][-1] = EOS
    scores = [torch.tensor(s) for s in torch.randn(8, generator=g).tolist()]
    masks = [torch.zeros(n, dtype=torch.long) if i in masked else torch.ones(n, dtype=torch.long)
             for i, n in enumerate(LENGTHS)]
    return queries, responses, scores, masks


def update(estimator: str, aggregation: str | None, mini_batch_size: int, accumulation: int, num_processes: int = 1,
           process_index: int = 0, masked: tuple[int, ...] = (MASKED,), truncated: tuple[int, ...] = (),
           from_dataloader: bool = False) -> torch.Tensor:
    """The weight change of one step: every weight, flattened (the critic-free estimators freeze the value head).
    Under N processes (tests/distributed_step.py's ``split`` scenario) process p steps on samples
    ``[p * 8 / N, (p + 1) * 8 / N)`` with ``mini_batch_size`` and ``accumulation`` of its own.

    ``masked``: the samples ``response_masks`` leave out whole; ``truncated``: those cut at the length limit (no EOS),
    left out by ``mask_truncated_completions`` where any is; ``from_dataloader``: the queries are the one batch of a
    pass over ``trainer.dataloader`` (its last), as the seed's loop steps."""
    groups = 2 if get_estimator(estimator).needs_groups or estimator == "reinforce_plus_plus_baseline" else 1
    batch_size = 8 // num_processes
    config = PPOConfig(batch_size=batch_size, mini_batch_size=mini_batch_size,
                       gradient_accumulation_steps=accumulation, ppo_epochs=1, advantage_estimator=estimator,
                       num_generations=groups, loss_aggregation=aggregation, max_completion_length=24, seed=0,
                       mask_truncated_completions=bool(truncated))
    model = tiny_value_model("gpt2")
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    part = slice(process_index * batch_size, (process_index + 1) * batch_size)
    queries, responses, scores, masks = (x[part] for x in fixed_batch(groups, masked, truncated))
    rows = [{"input_ids": q} for q in queries[::groups]] if from_dataloader else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no dataset: legacy's warning
        trainer = PPOTrainer(config, model, tokenizer=tiny_tokenizer(), optimizer=optimizer, dataset=rows,
                             data_collator=lambda rows: {"input_ids": [r["input_ids"] for r in rows]})
    if not from_dataloader:
        trainer.step(queries, responses, scores, response_masks=masks)
    for loaded in trainer.dataloader or ():  # one batch a pass, the last: stepped while the loader is on it
        trainer.step(loaded["input_ids"], responses, scores, response_masks=masks)
    return torch.cat([p.detach().flatten() for p in model.parameters()]) - before


def cells() -> list[tuple[str, str]]:
    """The matrix: every built-in estimator with every loss aggregation."""
    return [(estimator, aggregation) for estimator in BUILT_IN for aggregation in LOSS_AGGREGATIONS]


@pytest.mark.parametrize("estimator,aggregation", cells())
def test_the_update_is_the_backward_batch_s_however_it_is_split(estimator, aggregation):
    whole = update(estimator, aggregation, *SPLITS[0])
    scale = whole.abs().max()
    assert scale > 0  # the batch trains
    for split in SPLITS[1:]:
        difference = (update(estimator, aggregation, *split) - whole).abs().max() / scale
        assert difference < TOLERANCE, f"(mini {split[0]}, GA {split[1]}): {difference:.2e} of the update"


EMPTYING = (0, 2, 4, 5, 6)  # 5 of 8 samples without a token: at mini-batches of 2, one mini-batch at least is empty


def masked_cells() -> list[tuple[str, dict]]:
    """The masked matrix: GAE's critic with truncation masking, every estimator with response masks alone, and the
    last batch of a pass over the dataloader with and without a critic."""
    return ([("gae", {"truncated": EMPTYING, "masked": ()})]
            + [(estimator, {"masked": EMPTYING}) for estimator in BUILT_IN]
            + [(estimator, {"from_dataloader": True}) for estimator in ("gae", "grpo")])


@pytest.mark.parametrize("estimator,case", masked_cells(),
                         ids=lambda x: x if isinstance(x, str) else "-".join(sorted(x)))
def test_the_update_of_a_masked_batch_is_its_backward_batch_s_however_it_is_split(estimator, case):
    whole = update(estimator, None, *SPLITS[0], **case)
    scale = whole.abs().max()
    assert scale > 0  # the batch trains
    for split in SPLITS[1:]:
        difference = (update(estimator, None, *split, **case) - whole).abs().max() / scale
        assert difference < TOLERANCE, f"(mini {split[0]}, GA {split[1]}): {difference:.2e} of the update"

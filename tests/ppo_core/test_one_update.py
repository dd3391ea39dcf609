"""One update, however the batch is split: a step's weight update depends on its backward batch only, not on how that
batch is split into mini-batches and gradient-accumulation steps (and processes: tests/ppo_core/runtime/
test_distributed.py runs the two-process cells of the same matrix).

Each cell is one `step()` on a fixed batch of 8 samples whose responses are 3 to 24 tokens long, one of them masked
whole (`response_masks`), with fixed scores, `ppo_epochs=1` and plain SGD (the update is the gradient itself), for
every registered estimator and every loss aggregation. TRL 0.11 divided each mini-batch by its own token count and
averaged the mini-batches, which weighs a token of a short mini-batch more than one of a long one: the same batch
then moved the weights by up to 31% otherwise under (mini 2, GA 4) than under (mini 8, GA 1).
"""

from __future__ import annotations

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


def fixed_batch(num_generations: int):
    """8 queries (each prompt ``num_generations`` times in a row), responses of ``LENGTHS`` tokens (the odd ones ending
    with EOS), scores, and response masks with sample ``MASKED`` left out."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 64, (int(n),), generator=g) for n in torch.randint(2, 6, (8,), generator=g)]
    queries = [prompts[i - i % num_generations] for i in range(8)]
    responses = [torch.randint(3, 64, (n,), generator=g) for n in LENGTHS]
    for i in range(1, 8, 2):
        responses[i][-1] = EOS
    scores = [torch.tensor(s) for s in torch.randn(8, generator=g).tolist()]
    masks = [torch.ones(n, dtype=torch.long) for n in LENGTHS]
    masks[MASKED] = torch.zeros(LENGTHS[MASKED], dtype=torch.long)
    return queries, responses, scores, masks


def update(estimator: str, aggregation: str, mini_batch_size: int, accumulation: int, num_processes: int = 1,
           process_index: int = 0) -> torch.Tensor:
    """The weight change of one step: every weight, flattened (the critic-free estimators freeze the value head).
    Under N processes (tests/distributed_step.py's ``split`` scenario) process p steps on samples
    ``[p * 8 / N, (p + 1) * 8 / N)`` with ``mini_batch_size`` and ``accumulation`` of its own."""
    groups = 2 if get_estimator(estimator).needs_groups or estimator == "reinforce_plus_plus_baseline" else 1
    batch_size = 8 // num_processes
    config = PPOConfig(batch_size=batch_size, mini_batch_size=mini_batch_size,
                       gradient_accumulation_steps=accumulation, ppo_epochs=1, advantage_estimator=estimator,
                       num_generations=groups, loss_aggregation=aggregation, max_completion_length=24, seed=0)
    model = tiny_value_model("gpt2")
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    trainer = PPOTrainer(config, model, tokenizer=tiny_tokenizer(), optimizer=optimizer)
    part = slice(process_index * batch_size, (process_index + 1) * batch_size)
    queries, responses, scores, masks = (x[part] for x in fixed_batch(groups))
    trainer.step(queries, responses, scores, response_masks=masks)
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

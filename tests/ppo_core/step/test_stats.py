"""The step's statistics (``ppo_core.step.stats``): over N processes (threads standing in for them) the sample and token
statistics are those of one process over the global batch; alone, every helper returns the plain numbers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ppo_core.runtime.distributed import SingleProcess
from ppo_core.step.stats import gather_samples, gather_tokens, mean_over_processes, reward_stats, step_stats
from tests.ppo_core.runtime.test_distributed import in_threads

ALONE = SingleProcess(torch.device("cpu"))


def batch(lengths: list[int], seed: int) -> dict:
    """``step_stats``' tensors for responses of ``lengths`` tokens, float64, ``(B, max length)``."""
    gen = torch.Generator().manual_seed(seed)
    width, b = max(lengths), len(lengths)
    masks = (torch.arange(width)[None] < torch.tensor(lengths)[:, None]).double()
    rand = lambda: torch.randn(b, width, generator=gen, dtype=torch.float64) * masks  # noqa: E731
    return dict(scores=torch.randn(b, generator=gen, dtype=torch.float64), logprobs=rand() - 2, ref_logprobs=rand() - 2,
                non_score_reward=rand(), kls=rand(), masks=masks, advantages=rand(),
                query_lens=torch.tensor([3.0, 5.0, 4.0][:b]), response_lens=torch.tensor(lengths, dtype=torch.float))


def train_stats() -> list[dict]:
    keys = ("policy/ratio_mean", "val/error", "returns/var", "loss/total")
    return [{k: torch.tensor(0.5 + i) for k in keys} | {"policy/skipped": torch.tensor(float(i == 1))}
            for i in range(2)]


def test_stats_over_two_processes_are_those_of_the_global_batch():
    shards = [batch([4, 2, 3], seed=0), batch([1, 1, 2], seed=1)]
    width = 4
    pad = lambda t: torch.nn.functional.pad(t, (0, width - t.shape[1])) if t.ndim == 2 else t  # noqa: E731
    whole = {k: torch.cat([pad(shards[0][k]), pad(shards[1][k])]) for k in shards[0]}
    expected = step_stats(0.1, **whole, train_stats=train_stats(), mini_batch_size=3, group=ALONE)
    got = in_threads(lambda g: step_stats(0.1, **shards[g.process_index], train_stats=train_stats(),
                                          mini_batch_size=3, group=g))
    per_sample = ("objective/kl", "objective/kl_dist", "objective/entropy", "ppo/mean_scores", "ppo/std_scores",
                  "tokens/queries_dist", "tokens/responses_len_mean", "ppo/mean_non_score_reward")
    histograms = ("objective/logprobs", "objective/ref_logprobs", "ppo/policy/advantages")
    for stats in got:
        for key in per_sample + histograms:
            # float32 where the samples are gathered in float32, as in the trainer
            torch.testing.assert_close(stats[key].double(), expected[key].double(), rtol=0, atol=1e-6, msg=key)
    assert got[0]["ppo/epochs"] == 2.0 and expected["ppo/epochs"] == 1.0  # 2 mini-batches of 3: 1 or 2 per epoch
    assert got[0]["ppo/policy/skipped_minibatches"] == 1


def test_alone_the_gathers_return_the_tensors_themselves():
    """Bit for bit, dtypes and devices kept: the one-process statistics did not move with the single code path."""
    samples = (torch.randn(5, dtype=torch.float64), torch.arange(5.0))
    assert gather_samples(ALONE, *samples) == samples
    tokens = (torch.randn(7, dtype=torch.float64), torch.randn(7))
    for got, given in zip(gather_tokens(ALONE, *tokens), tokens):
        assert torch.equal(got, given) and got.dtype == given.dtype
    stats = {"a": torch.tensor(1 / 3), "b": torch.tensor(2 / 3, dtype=torch.float64), "hist": torch.arange(3.0),
             "n": 4}
    got = mean_over_processes(stats, ALONE)
    assert got.keys() == stats.keys() and got["n"] == 4 and got["hist"] is stats["hist"]
    for key in ("a", "b"):
        assert torch.equal(got[key], stats[key]) and got[key].dtype == stats[key].dtype


def test_mean_over_processes_averages_the_scalars_only():
    got = in_threads(lambda g: mean_over_processes({"x": torch.tensor(float(g.process_index)),
                                                    "dist": torch.arange(2.0) + g.process_index}, g))
    for stats, index in zip(got, (0, 1)):
        assert stats["x"] == 0.5 and torch.equal(stats["dist"], torch.arange(2.0) + index)


@pytest.mark.parametrize("rewards", [[torch.tensor(1.0), torch.tensor(3.0)], torch.tensor([1.0, 3.0]), [1.0, 3.0]])
def test_reward_stats_of_a_list_or_a_tensor(rewards):
    stats = reward_stats(rewards, ALONE)
    assert stats["env/reward_mean"] == 2.0 and stats["env/reward_std"] == pytest.approx(np.sqrt(2.0))
    np.testing.assert_array_equal(stats["env/reward_dist"], [1.0, 3.0])

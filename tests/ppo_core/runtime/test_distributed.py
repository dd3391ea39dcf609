"""PPO under N processes: what ``step`` does over N shards equals one process over the global batch.

Two kinds of test. The cross-process helpers run in one process, with threads standing in for the
processes (``ThreadGroup``): exact enough for float64 comparisons at 1e-12. ``step`` itself runs in two
real processes (``accelerate launch``, gloo on CPU, ``tests/distributed_step.py``) and is compared with
one process over the same 8 samples: float32, three steps, so the stated tolerance is
``rtol = atol = 1e-5`` (measured worst: about a sixth of it); the two processes agree bit for bit.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from ppo_core.algo.ppo_math import gae_advantages, policy_loss, token_mean, value_loss
from ppo_core.core import masked_mean, masked_var, masked_whiten
from ppo_core.runtime.distributed import (
    ProcessGroup,
    SingleProcess,
    gather_ragged,
    mean_across,
    on_every_process,
    raise_if_any,
    tokens_per_process,
)
from tests import distributed_step, launching

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tests" / "distributed_step.py"
RTOL = ATOL = 1e-5  # two processes vs one, float32 (see the module docstring)


# ---------------------------------------------------------------------------------------------------
# the helpers, with threads as processes
# ---------------------------------------------------------------------------------------------------
class ThreadGroup:
    """``ProcessGroup``'s methods for ``n`` threads of one process: each collective waits for all of them."""

    def __init__(self, index: int, shared: dict):
        self.process_index, self.num_processes, self._shared = index, shared["n"], shared
        self.device = torch.device("cpu")

    def _exchange(self, value) -> list:
        slots, barrier = self._shared["slots"], self._shared["barrier"]
        slots[self.process_index] = value
        barrier.wait()
        values = list(slots)
        barrier.wait()  # nobody overwrites a slot before everyone has read them all
        return values

    def sum_across(self, x):
        return torch.stack(self._exchange(x.detach().clone())).sum(0)

    def gather(self, x):
        return torch.cat(self._exchange(x.detach().clone()))

    def gather_object(self, obj):
        return self._exchange(obj)


def in_threads(fn, n: int = 2) -> list:
    """``[fn(group_0), ..., fn(group_{n-1})]``, run concurrently; an exception is returned in place of a result."""
    shared = {"n": n, "slots": [None] * n, "barrier": threading.Barrier(n, timeout=30)}
    results: list = [None] * n

    def run(i):
        try:
            results[i] = fn(ThreadGroup(i, shared))
        except Exception as exc:  # noqa: BLE001 - returned to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def sharded_batch(seed: int = 0):
    """A float64 ``(5, 6)`` batch and mask, and its shards ``[:3]`` / ``[3:]`` each cut to its own longest row.

    Shard 0 holds 14 valid tokens, shard 1 holds 4 (shifted by +2): per-shard means weight tokens differently
    than the batch mean.
    """
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 4, 4, 3, 1])
    mask = (torch.arange(6)[None] < lengths[:, None]).double()
    values = torch.randn(5, 6, generator=gen, dtype=torch.float64)
    values[3:] += 2.0  # the shards' own statistics differ from the batch's
    values = values * mask
    shards = [(values[:3, :6], mask[:3, :6]), (values[3:, :3], mask[3:, :3])]
    return values, mask, shards


def test_masked_statistics_over_shards_equal_those_of_the_batch():
    values, mask, shards = sharded_batch()
    got = in_threads(lambda g: (masked_mean(*shards[g.process_index], sum_across=g.sum_across),
                                masked_var(*shards[g.process_index], sum_across=g.sum_across),
                                masked_whiten(*shards[g.process_index], sum_across=g.sum_across)))
    mean, var, white = masked_mean(values, mask), masked_var(values, mask), masked_whiten(values, mask)
    for shard_mean, shard_var, _ in got:
        torch.testing.assert_close(shard_mean, mean, rtol=0, atol=1e-12)
        torch.testing.assert_close(shard_var, var, rtol=0, atol=1e-12)
    whitened = [got[0][2] * shards[0][1], got[1][2] * shards[1][1]]
    torch.testing.assert_close(whitened[0], (white * mask)[:3, :6], rtol=0, atol=1e-12)
    torch.testing.assert_close(whitened[1], (white * mask)[3:, :3], rtol=0, atol=1e-12)
    # the per-shard statistics differ: the test would catch a helper that ignored sum_across
    assert abs(masked_mean(*shards[1]) - mean) > 1 and abs(masked_var(*shards[0]) - var) > 0.1


def test_identity_sum_across_is_bit_for_bit_the_one_process_path():
    values, mask, _ = sharded_batch(seed=1)
    values, mask = values.float(), mask.float()
    same = lambda x: x  # noqa: E731
    assert torch.equal(masked_mean(values, mask, sum_across=same), masked_mean(values, mask))
    assert torch.equal(masked_var(values, mask, sum_across=same), masked_var(values, mask))
    assert torch.equal(masked_whiten(values, mask, sum_across=same), masked_whiten(values, mask))
    with pytest.raises(ValueError, match="axis"):
        masked_mean(values, mask, axis=1, sum_across=same)


@pytest.mark.parametrize("whiten_rewards", [False, True])
def test_gae_over_shards_whitens_with_the_global_batch(whiten_rewards):
    rewards, mask, shards = sharded_batch(seed=2)
    values = torch.randn(5, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    value_shards = [values[:3, :6], values[3:, :3]]
    got = in_threads(lambda g: gae_advantages(value_shards[g.process_index], shards[g.process_index][0],
                                              shards[g.process_index][1], 0.9, 0.8, whiten_rewards, g.sum_across))
    full = gae_advantages(values, rewards, mask, 0.9, 0.8, whiten_rewards)
    for got_shard, rows, width in ((got[0], slice(0, 3), 6), (got[1], slice(3, 5), 3)):
        torch.testing.assert_close(got_shard.advantages, full.advantages[rows, :width], rtol=0, atol=1e-12)
        torch.testing.assert_close(got_shard.returns * shards[rows.start // 3][1],
                                   (full.returns * mask)[rows, :width], rtol=0, atol=1e-12)


def test_losses_over_shards_average_to_the_global_token_mean_and_its_gradient():
    """DDP averages the per-process gradients: with ``n_tokens = n / N`` that average is the global one."""
    old, mask, shards = sharded_batch(seed=4)
    advantages = torch.randn(5, 6, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    new = (old + 0.3 * torch.randn(5, 6, generator=torch.Generator().manual_seed(6), dtype=torch.float64))
    cut = [(slice(0, 3), 6), (slice(3, 5), 3)]

    def shard_loss(g):
        rows, width = cut[g.process_index]
        logprobs = new[rows, :width].clone().requires_grad_()
        m = shards[g.process_index][1]
        n_tokens = tokens_per_process(m, g)
        pg = policy_loss(logprobs, old[rows, :width], advantages[rows, :width], m, 0.2, n_tokens)
        vf = value_loss(logprobs, old[rows, :width], advantages[rows, :width], m, 0.2, n_tokens)
        (pg.loss + vf.loss).backward()
        return pg, vf, logprobs.grad

    got = in_threads(shard_loss)
    logprobs = new.clone().requires_grad_()
    pg, vf = policy_loss(logprobs, old, advantages, mask, 0.2), value_loss(logprobs, old, advantages, mask, 0.2)
    (pg.loss + vf.loss).backward()
    for field in ("loss", "clipfrac", "approxkl", "policykl", "ratio_mean"):
        mean_over_shards = (getattr(got[0][0], field) + getattr(got[1][0], field)) / 2
        torch.testing.assert_close(mean_over_shards, getattr(pg, field), rtol=0, atol=1e-12, msg=field)
    torch.testing.assert_close((got[0][1].loss + got[1][1].loss) / 2, vf.loss, rtol=0, atol=1e-12)
    grads = [g[2] / 2 for g in got]  # DDP: the mean over the 2 processes
    torch.testing.assert_close(grads[0], logprobs.grad[:3, :6], rtol=0, atol=1e-12)
    torch.testing.assert_close(grads[1], logprobs.grad[3:, :3], rtol=0, atol=1e-12)
    # per-process means (legacy) would not: 14 vs 4 tokens
    local = [policy_loss(new[r, :w], old[r, :w], advantages[r, :w], s[1], 0.2).loss for (r, w), s in zip(cut, shards)]
    assert abs((local[0] + local[1]) / 2 - pg.loss) > 1e-3


def test_gather_ragged_and_mean_across():
    parts = [torch.arange(6.0).reshape(2, 3), torch.arange(10.0, 12.0).reshape(2, 1)]
    got = in_threads(lambda g: (gather_ragged(parts[g.process_index], g),
                                mean_across(parts[g.process_index][:, :1], g)))
    expected = torch.tensor([[0.0, 1, 2, 10], [3, 4, 5, 11]])
    for ragged, mean in got:
        assert torch.equal(ragged, expected)
        assert torch.equal(mean, torch.tensor([[5.0], [7.0]]))


def test_an_error_on_one_process_raises_on_all_with_its_message():
    errors = [None, ValueError("step: scores[0] is nan")]
    got = in_threads(lambda g: raise_if_any(errors[g.process_index], g))
    for result in got:
        assert isinstance(result, ValueError) and str(result) == "process 1 of 2: step: scores[0] is nan"
    assert in_threads(lambda g: raise_if_any(None, g)) == [None, None]
    error = FloatingPointError("x")
    with pytest.raises(FloatingPointError) as info:  # one process: the error itself
        raise_if_any(error, SingleProcess(torch.device("cpu")))
    assert info.value is error


def test_a_check_run_on_every_process_raises_on_all_or_returns_its_result():
    def check(index):
        if index == 1:
            raise ValueError("bad input")
        return index

    got = in_threads(lambda g: on_every_process(g, check, g.process_index))
    assert all(isinstance(r, ValueError) and str(r) == "process 1 of 2: bad input" for r in got)
    assert in_threads(lambda g: on_every_process(g, lambda x: x + 1, g.process_index)) == [1, 2]


def test_a_single_process_group_returns_what_it_is_given():
    """Alone, the trainer goes the same way as with N processes: the collectives return their input (detached
    copies, as the real ones), and the helpers give the one-process numbers exactly."""
    group = ProcessGroup.current("cpu")  # torch.distributed is not running here
    assert isinstance(group, SingleProcess) and (group.num_processes, group.process_index) == (1, 0)
    x = torch.randn(3, 4, requires_grad=True)
    for out in (group.sum_across(x), group.gather(x), mean_across(x, group), gather_ragged(x, group)):
        assert torch.equal(out, x) and out.data_ptr() != x.data_ptr() and not out.requires_grad
    obj = {"shuffle": torch.arange(3)}
    assert group.gather_object(obj) == [obj]
    raise_if_any(None, group)


def test_the_wandb_game_log_holds_every_process_s_rows_in_process_order(fake_wandb):
    """``log_stats`` with wandb: each process gathers its batch's columns and rewards; the main process alone logs one
    table of them all (legacy's ``gather_object``)."""
    import types

    from ppo_core.legacy import LegacyMethods

    sent = []

    class Logger(LegacyMethods):  # the attributes log_stats reads, as PPOTrainer sets them
        def __init__(self, group):
            self._group, self.current_step = group, 0
            self.config = types.SimpleNamespace(log_with="wandb")
            self.accelerator = types.SimpleNamespace(is_main_process=group.process_index == 0,
                                                     log=lambda values, step=None: sent.append(values))

    def log(group):
        i = group.process_index
        batch = {"query": [f"q{2 * i}", f"q{2 * i + 1}"], "response": [f"r{2 * i}", f"r{2 * i + 1}"]}
        rewards = torch.tensor([2.0 * i, 2.0 * i + 1])
        return Logger(group).log_stats({"objective/kl": 0.5}, batch, rewards)["env/reward_mean"]

    assert in_threads(log) == [1.5, 1.5]  # (0 + 1 + 2 + 3) / 4 on both
    (values,) = sent
    assert values["game_log"].rows == [["q0", "r0", 0.0], ["q1", "r1", 1.0], ["q2", "r2", 2.0], ["q3", "r3", 3.0]]


def test_one_process_divides_token_means_by_its_own_count_in_the_values_dtype():
    """``tokens_per_process`` is None alone: ``token_mean`` then divides by the mask's sum in the values' dtype,
    the one-process number exactly, where a float32 count would not be (float64 values, a fractional mask)."""
    group = SingleProcess(torch.device("cpu"))
    values = torch.randn(4, 5, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mask = torch.rand(4, 5, generator=torch.Generator().manual_seed(1)).float()  # e.g. a user's soft response_masks
    assert tokens_per_process(mask, group) is None
    n_tokens = mask.detach().float().sum() / group.num_processes  # what N processes would pass
    assert token_mean(values, mask, tokens_per_process(mask, group)) == masked_mean(values, mask)
    assert token_mean(values, mask, n_tokens) != masked_mean(values, mask)  # why it is None


# ---------------------------------------------------------------------------------------------------
# step() in two processes
# ---------------------------------------------------------------------------------------------------
def launch(scenario: str, out_dir: Path, timeout: float = 120) -> tuple[int, str, float]:
    """Run ``distributed_step.py`` in 2 CPU processes; ``(exit code, output, seconds)``. A hang fails the test."""
    return launching.finish(launching.start([str(SCRIPT), str(out_dir), scenario]), timeout,
                            f"{scenario} (2 processes)")


def load_ranks(out_dir: Path) -> list[dict]:
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


def assert_stats_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        assert np.array_equal(np.asarray(value), np.asarray(b[key]), equal_nan=True), key  # NaN: not measured


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """One launch of the ``global+shuffled`` scenario: its directory and the two processes' results."""
    out_dir = tmp_path_factory.mktemp("two_processes")
    code, output, _ = launch("global+shuffled", out_dir)
    assert code == 0, output[-3000:]
    return out_dir, load_ranks(out_dir)


@pytest.mark.slow
def test_two_processes_equal_one_process_over_the_global_batch(two_process_run):
    _, ranks = two_process_run
    one = distributed_step.run_global(1)
    for name, expected in one.items():
        # the two processes hold the same weights and report the same stats, bit for bit
        for key, param in ranks[0][name]["params"].items():
            assert torch.equal(param, ranks[1][name]["params"][key]), (name, key)
        for a, b in zip(ranks[0][name]["stats"], ranks[1][name]["stats"]):
            assert_stats_equal(a, b)
        # ... and equal one process over the same 8 samples
        got = ranks[0][name]
        for step, (a, b) in enumerate(zip(got["stats"], expected["stats"])):
            assert a.keys() == b.keys()
            for key in a:
                np.testing.assert_allclose(np.asarray(a[key], dtype=np.float64), np.asarray(b[key], dtype=np.float64),
                                           rtol=RTOL, atol=ATOL, err_msg=f"{name}, step {step}: {key}")
        for key, param in expected["params"].items():
            torch.testing.assert_close(got["params"][key], param, rtol=RTOL, atol=ATOL, msg=f"{name}: {key}")
    # the scenarios did what they are named for
    assert sum(s["ppo/policy/skipped_minibatches"] for s in one["skip"]["stats"]) > 0
    assert min(s["ppo/epochs"] for s in one["early_stop"]["stats"]) < 4
    assert [s["ppo/learning_rate"] for s in one["linear_lr"]["stats"]] == pytest.approx([1.0, 2 / 3, 1 / 3])


@pytest.mark.slow
def test_two_processes_shuffle_their_own_samples_and_resume_from_one_checkpoint(two_process_run):
    out_dir, results = two_process_run
    ranks = [r["shuffled"] for r in results]
    assert [r["shuffle_seed"] for r in ranks] == [0, 1]  # config.seed + process_index
    assert len(torch.load(out_dir / "ckpt.pt" / "trainer.pt", weights_only=True)["processes"]) == 2
    for rank in ranks:  # every process resumed its own state: same weights and stats as never stopping
        for key, param in rank["params"].items():
            assert torch.equal(param, rank["resumed_params"][key]), key
        assert_stats_equal(rank["stats"], rank["resumed_stats"])
    for key, param in ranks[0]["params"].items():
        assert torch.equal(param, ranks[1]["params"][key]), key


@pytest.mark.slow
def test_a_bad_input_on_one_process_stops_both_with_its_message(tmp_path):
    timeout = 120
    code, output, seconds = launch("bad_input", tmp_path, timeout=timeout)
    assert code != 0
    # both processes raise the failing process's error (process 0 does not wait for it in a collective)
    assert output.count("ValueError: process 1 of 2: step: scores[0] is nan") >= 2, output[-3000:]
    assert seconds < timeout / 2, f"took {seconds:.0f} s"
    assert not (tmp_path / "rank0.pt").exists() and not (tmp_path / "rank1.pt").exists()


@pytest.mark.slow
def test_ddp_processes_stay_equal_when_a_window_ends_in_a_skipped_minibatch(tmp_path):
    """With gradient accumulation DDP all-reduces a window's gradients in the backward of its last mini-batch (the
    others run under ``no_sync``). When the ratio threshold skips that one, a zero-loss backward must still run:
    without it each process stepped with its own gradients and the replicas drifted apart for good."""
    code, output, _ = launch("window_skip", tmp_path)
    assert code == 0, output[-3000:]
    ranks = load_ranks(tmp_path)
    for a, b in zip(ranks[0]["stats"], ranks[1]["stats"]):
        assert_stats_equal(a, b)
        assert a["ppo/policy/skipped_minibatches"] == 2  # the second mini-batch of each epoch's window
    initial = distributed_step.tiny_value_model("gpt2", seed=0).state_dict()
    for key, param in ranks[0]["params"].items():
        assert torch.equal(param, ranks[1]["params"][key]), key
    assert any(not torch.equal(param, initial[key]) for key, param in ranks[0]["params"].items())  # updates applied


def test_the_collectives_warning_is_ignored_within_the_block_only():
    """Under DeepSpeed the trainer's methods run in ``deprecated_collectives_ignored``: the filter it adds is gone
    once the block ends, so a trainer changes no process-wide warnings setting."""
    from ppo_core.runtime.distributed import deprecated_collectives_ignored

    message = "`torch.distributed.all_gather_into_tensor` is deprecated. Please use all_gather_single instead."
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with deprecated_collectives_ignored():
            warnings.warn(message, FutureWarning)
            warnings.warn("another FutureWarning", FutureWarning)
        with deprecated_collectives_ignored(enabled=False):
            warnings.warn(message, FutureWarning)
        warnings.warn(message, FutureWarning)
    assert [str(w.message) for w in caught] == ["another FutureWarning", message, message]
    assert warnings.filters == before


@pytest.mark.slow
def test_two_processes_make_the_one_process_update_however_each_splits_its_share(tmp_path):
    """The two-process cells of the split matrix (tests/ppo_core/test_one_update.py): each process holds 4 of the 8
    samples (process 0 the longer responses) and splits them as (mini 4, GA 1) or (mini 2, GA 2); the update is the
    one process's (mini 8, GA 1) for every estimator and aggregation, to float32 rounding."""
    from tests.ppo_core.test_one_update import SPLITS, TOLERANCE, TWO_PROCESS_SPLITS, cells, update

    code, output, _ = launch("split", tmp_path, timeout=600)
    assert code == 0, output[-3000:]
    ranks = load_ranks(tmp_path)
    for estimator, aggregation in cells():
        whole = update(estimator, aggregation, *SPLITS[0])
        for split in TWO_PROCESS_SPLITS:
            got = ranks[0][(estimator, aggregation, split)]
            assert torch.equal(got, ranks[1][(estimator, aggregation, split)])  # the replicas agree
            difference = float((got - whole).abs().max() / whole.abs().max())
            assert difference < TOLERANCE, f"{estimator}, {aggregation}, 2 x (mini {split[0]}, GA {split[1]}): " \
                                           f"{difference:.2e} of the update"

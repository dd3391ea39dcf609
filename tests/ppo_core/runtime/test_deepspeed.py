"""PPO under DeepSpeed ZeRO-2 and ZeRO-3 (accelerate), on CPUs: 2 processes over gloo, ``DS_ACCELERATOR=cpu``.

Each stage is one launch of ``tests/distributed_step.py deepspeed`` with the shipped config
(``configs/zero2.yaml``, ``configs/zero3.yaml``; 2 processes, no mixed precision), compared as the DDP test
compares: the two processes end with the same full weights (gathered from the shards under ZeRO-3) and the
same stats, which equal one process without DeepSpeed over the same global batch within
``rtol = atol = 1e-5`` (measured worst: about 0.15 of it, for both stages, as for DDP: DeepSpeed averages the
gradients over the processes in float32, in another order than one process sums them). Then two rounds of
``generate`` (policy and reference) and ``step`` with the whole-vocabulary KL, and a step with an infinite
gradient. Gradient accumulation, which DeepSpeed does itself, is checked in one process against no DeepSpeed.

A launch takes about 15-25 s on 2 cores. DeepSpeed compiles nothing: on CPUs
``ppo_core.runtime.distributed.cpu_backend`` keeps it from building its shared-memory all-reduce op (about a minute
on a fresh machine), which ZeRO training never uses.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("deepspeed")

from tests import (
    distributed_step,
    launching,
)
from tests.ppo_core.runtime.test_distributed import assert_stats_equal, load_ranks

torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tests" / "distributed_step.py"
RTOL = ATOL = 1e-5  # two DeepSpeed processes vs one plain process, float32 (see the module docstring)
TIMEOUT = 300  # generous: other work may share the 2 cores


def launch_deepspeed(config: str, scenario: str, out_dir: Path, num_processes: int = 2,
                     mixed_precision: str = "no") -> tuple[int, str, float]:
    """Run ``distributed_step.py`` under ``configs/{config}.yaml`` on CPUs; ``(exit code, output, seconds)``."""
    proc = launching.start([str(SCRIPT), str(out_dir), scenario], num_processes, config,
                           mixed_precision=mixed_precision)
    return launching.finish(proc, TIMEOUT, f"{config}/{scenario}")


def assert_close_stats(got: list[dict], expected: list[dict], what: str) -> None:
    for step, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_allclose(np.asarray(a[key], dtype=np.float64), np.asarray(b[key], dtype=np.float64),
                                       rtol=RTOL, atol=ATOL, err_msg=f"{what}, step {step}: {key}")


@pytest.fixture(scope="module")
def one_process() -> dict:
    """``run_global`` in this process, without DeepSpeed: what both stages must reproduce."""
    return distributed_step.run_global(1)


@pytest.mark.slow
@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_two_deepspeed_processes_equal_one_process_and_generate_from_gathered_weights(config, one_process, tmp_path):
    code, output, _ = launch_deepspeed(config, "deepspeed", tmp_path)
    assert code == 0, output[-3000:]
    ranks = load_ranks(tmp_path)
    for name, expected in one_process.items():
        if config == "zero3" and "rollout_dtype" in distributed_step.CONFIGS[name]:  # no whole weights to copy
            assert all("under ZeRO-3 each process holds a shard of them" in r[name]["refused"] for r in ranks)
            continue
        for key, param in ranks[0][name]["params"].items():  # same full weights and stats on both processes
            assert param.numel() > 0 and torch.equal(param, ranks[1][name]["params"][key]), (name, key)
        for a, b in zip(ranks[0][name]["stats"], ranks[1][name]["stats"]):
            assert_stats_equal(a, b)
        assert_close_stats(ranks[0][name]["stats"], expected["stats"], f"{config}/{name}")
        for key, param in expected["params"].items():
            torch.testing.assert_close(ranks[0][name]["params"][key], param, rtol=RTOL, atol=ATOL, msg=f"{name}: {key}")

    rollout = [r["rollout"] for r in ranks]
    for key, param in rollout[0]["params"].items():
        assert torch.equal(param, rollout[1]["params"][key]), key
    for a, b in zip(rollout[0]["stats"], rollout[1]["stats"]):
        assert_stats_equal(a, b)
        assert all(np.isfinite(np.asarray(v, dtype=np.float64)).all() for v in a.values())
    assert rollout[0]["stats"][1]["objective/kl"] > 0  # the whole-vocabulary KL, once the policy has moved
    if config == "zero3":
        # the policy's and the reference's LM heads were shards outside a forward, so the scoring forward and the
        # full KL gathered them; generation fetched nothing layer by layer (gathered once per call), a step did
        assert rollout[0]["heads_sharded"] == [True, True]
        assert rollout[0]["generate_fetches"] == 0 and rollout[0]["step_fetches"] > 0
    else:  # ZeRO-2 shards no weight
        assert rollout[0]["heads_sharded"] == [False, False] and rollout[0]["step_fetches"] == 0

    # an infinite gradient in mini-batch 2 stops the step on both processes before its update (DeepSpeed skips it)
    for rank in ranks:
        error = rank["non_finite"]["error"]
        assert error is not None and "mini-batch 2: non-finite gradient norm (inf) before the update; the weights " \
                                     "hold this step's first 1 mini-batch update, not this one" in error, error
        after, before = rank["non_finite"]["after"], rank["non_finite"]["before"]
        assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())
        assert any(not torch.equal(after[k], before[k]) for k in after)  # mini-batch 1's update only
    assert all(torch.equal(v, ranks[1]["non_finite"]["after"][k]) for k, v in ranks[0]["non_finite"]["after"].items())
    assert [rank["collectives_filters"] for rank in ranks] == [0, 0]  # no process-wide warnings filter left


@pytest.mark.slow
@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_a_deepspeed_run_resumed_from_a_checkpoint_equals_the_uninterrupted_run(config, tmp_path):
    """DeepSpeed saves and loads its module through the value-head model's ``state_dict``/``load_state_dict``
    (legacy TRL's keys, no ``pretrained_model.`` prefix): the resumed step equals the uninterrupted one."""
    code, output, _ = launch_deepspeed(config, "deepspeed+resume", tmp_path)
    assert code == 0, output[-3000:]
    for rank in (r["shuffled"] for r in load_ranks(tmp_path)):
        assert "transformer.wte.weight" in rank["params"] and "v_head.summary.weight" in rank["params"]
        for key, param in rank["params"].items():
            assert param.numel() > 0 and torch.equal(param, rank["resumed_params"][key]), key
        assert_stats_equal(rank["stats"], rank["resumed_stats"])


@pytest.mark.slow
def test_deepspeed_accumulates_and_skips_mini_batches_as_the_trainer_does(tmp_path):
    """Under DeepSpeed the engine accumulates over ``gradient_accumulation_steps`` mini-batches and steps in the
    backward of a window's last one; a window whose last mini-batch the ratio threshold skips must still apply
    its other ones (a zero-loss backward), as without DeepSpeed: one process, the same numbers bit for bit."""
    code, output, _ = launch_deepspeed("zero2", "accumulation", tmp_path, num_processes=1)
    assert code == 0, output[-3000:]
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    expected = distributed_step.run_accumulation()
    for a, b in zip(got["stats"], expected["stats"], strict=True):
        assert_stats_equal(a, b)
    assert sum(s["ppo/policy/skipped_minibatches"] for s in expected["stats"]) > 0
    for key, param in expected["params"].items():
        assert torch.equal(got["params"][key], param), key


@pytest.mark.slow
def test_under_zero2_bf16_the_reference_has_the_policy_s_dtype(tmp_path):
    """DeepSpeed's bf16 engine holds the policy's weights in bf16; the ZeRO-2 reference, whole on the device, must
    too: a float32 copy costs twice the memory, runs float32 matmuls, and at step 0, where the policy is its own
    reference, gives a KL that is not zero. One process on the CPU (DeepSpeed's CPU accelerator has bf16)."""
    code, output, _ = launch_deepspeed("zero2", "reference_dtype", tmp_path, num_processes=1, mixed_precision="bf16")
    assert code == 0, output[-3000:]
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert got["stats"]["objective/kl"] == 0 and got["stats"]["ppo/mean_non_score_reward"] == 0
    assert got["dtypes"] == {"policy": ["torch.bfloat16"], "reference": ["torch.bfloat16"]}

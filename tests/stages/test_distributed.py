"""The training stages under `accelerate launch` with 2 CPU processes (gloo): the command dvc.yaml would run
with the one documented change, one set of artifacts, the PPO global batch = ppo.batch_size per process x 2,
and an error on one process ending both with its message (no hang). The ppo stage also under DeepSpeed ZeRO-2 and
ZeRO-3 (`--config_file configs/zero3.yaml`, `DS_ACCELERATOR=cpu`; skipped without deepspeed): the artifacts of the
DDP run, and a run killed mid-way and rerun ending with the bytes of an uninterrupted one."""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from transformers import AutoModelForCausalLM

from stages.ppo.checkpoints import STATE, WORK_ROLLOUTS, rollout_file
from stages.shared.artifacts import PPO_MODEL, PPO_ROLLOUTS, PPO_STATS, SFT_METRICS, SFT_MODEL
from tests import launching
from tests.conftest import ROOT
from tests.stages.test_resume import digests, params_file, remove_outputs_as_dvc_does

pytestmark = pytest.mark.slow

# The ppo stage under DeepSpeed vs DDP (float32, 2 processes, 4 steps). Measured: ZeRO-3 equal bit for bit (every
# artifact), ZeRO-2 the same rollouts and stats, weights within 6e-8, but GPT-2's key biases within 1.6e-6: their true
# gradient is 0, and Adam turns the float noise in it (reduced in another order) into steps of about lr.
STATS_TOL = dict(rtol=1e-5, atol=1e-6)
WEIGHTS_TOL = dict(rtol=1e-5, atol=1e-5)


def start_stage(stage: str, params: Path, cwd: Path, config: str | None = None) -> subprocess.Popen:
    """`accelerate launch ... --num_processes 2 -m stages STAGE` on CPU, output piped: DDP over gloo, or under
    DeepSpeed with `configs/{config}.yaml` (see `tests/launching.py`)."""
    return launching.start(["-m", "stages", stage, "--params", str(params)], 2, config, cwd,
                           env={"TQDM_DISABLE": "1", "PYTHONPATH": str(ROOT)})


def launch_stage(stage: str, params: Path, cwd: Path, timeout: float = 300,
                 config: str | None = None) -> tuple[int, str]:
    """:func:`start_stage`, to its end: (exit code, output); a hang fails the test."""
    code, output, _ = launching.finish(start_stage(stage, params, cwd, config), timeout, f"{stage} (2 processes)")
    return code, output


# ppo.steps counts rollouts per process, as in the seed: ceil(16 / 4) = 4 steps of 2 x 4 rollouts; a checkpoint
# every 2 steps (a killed run resumes mid-way)
PPO_CHANGES = dict(ppo__batch_size=4, ppo__mini_batch_size=2, ppo__steps=16, checkpoint__ppo_every=2)
PPO_STEPS = 4
NOT_COMPARED = ("data/logs/", "data/checkpoints/")  # wall-clock times; the state of a run in progress


def ppo_project(tiny_run: Path, root: Path) -> tuple[Path, Path]:
    """A copy of tiny_run without the ppo stage's outputs, as `dvc repro` leaves it; (root, its params file)."""
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints"))
    remove_outputs_as_dvc_does(root, "ppo")
    return root, params_file(root, **PPO_CHANGES)


@pytest.fixture(scope="module")
def ppo_run(tiny_run, tmp_path_factory):
    """`ppo_run(config)`: (root, output) of the ppo stage run to its end in 2 processes, under DDP (config None) or
    `configs/{config}.yaml`; each one launched once for the module."""
    done: dict[str | None, tuple[Path, str]] = {}

    def run(config: str | None) -> tuple[Path, str]:
        if config not in done:
            if config is not None:
                pytest.importorskip("deepspeed")
            root, params = ppo_project(tiny_run, tmp_path_factory.mktemp(config or "ddp") / "project")
            code, output = launch_stage("ppo", params, root, config=config)
            assert code == 0, output[-3000:]
            done[config] = root, output
        return done[config]

    return run


def test_ppo_stage_in_two_processes(ppo_run):
    """ppo.batch_size 4 per process: each step's rollouts hold the global batch of 8, written once."""
    root, output = ppo_run(None)
    assert output.count(f"ppo: {PPO_STEPS} steps") == 1  # the summary line: one process reports
    rollouts = pd.read_parquet(root / PPO_ROLLOUTS)
    assert sorted(p.name for p in (root / PPO_ROLLOUTS).iterdir()) == [rollout_file(i) for i in range(PPO_STEPS)]
    assert rollouts.groupby("step").size().tolist() == [8] * PPO_STEPS
    assert rollouts.groupby("step")["query"].nunique().tolist() == [8] * PPO_STEPS  # two shards, not one twice
    assert pd.read_parquet(root / PPO_STATS)["step"].tolist() == list(range(PPO_STEPS))
    AutoModelForCausalLM.from_pretrained(root / PPO_MODEL)
    assert not list(root.rglob(".*tmp-*"))


@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_ppo_stage_under_deepspeed_matches_ddp(config, ppo_run):
    """The same artifacts as under DDP, once: every rollout the same text, the stats within STATS_TOL, the policy
    saved whole (ZeRO-3 gathers its shards) and within WEIGHTS_TOL of DDP's, loadable by plain transformers."""
    root, output = ppo_run(config)
    ddp, _ = ppo_run(None)
    assert output.count(f"ppo: {PPO_STEPS} steps") == 1
    assert digests(root, NOT_COMPARED).keys() == digests(ddp, NOT_COMPARED).keys()
    got, expected = pd.read_parquet(root / PPO_ROLLOUTS), pd.read_parquet(ddp / PPO_ROLLOUTS)
    pd.testing.assert_frame_equal(got.drop(columns=["score", "kl"]), expected.drop(columns=["score", "kl"]))
    for column in ("score", "kl"):
        np.testing.assert_allclose(got[column], expected[column], **STATS_TOL, err_msg=column)
    got, expected = pd.read_parquet(root / PPO_STATS), pd.read_parquet(ddp / PPO_STATS)
    assert list(got.columns) == list(expected.columns)
    for column in got.columns:  # a number per step, or a histogram's list
        for step, (a, b) in enumerate(zip(got[column], expected[column])):
            np.testing.assert_allclose(np.asarray(a, dtype=float), np.asarray(b, dtype=float), **STATS_TOL,
                                       err_msg=f"step {step}: {column}")
    policy, reference = (AutoModelForCausalLM.from_pretrained(r / PPO_MODEL).state_dict() for r in (root, ddp))
    assert policy.keys() == reference.keys()
    for name, weight in policy.items():
        assert weight.numel() > 0 and weight.shape == reference[name].shape, name
        torch.testing.assert_close(weight, reference[name], **WEIGHTS_TOL, msg=name)
    assert not (root / "data" / "checkpoints").exists()  # the finished run deleted its state
    assert not list(root.rglob(".*tmp-*"))


@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_ppo_stage_under_deepspeed_killed_and_rerun_equals_uninterrupted_on_cpu(config, ppo_run, tiny_run, tmp_path):
    """SIGKILL to every process a random moment after step 3's rollouts were written (mid-step, mid-checkpoint or
    mid-publishing), the outputs dvc deletes deleted, the stage rerun: every artifact equals the uninterrupted
    run's, byte for byte (DeepSpeed's checkpoint restores the fp32 weights and Adam's state exactly)."""
    whole, _ = ppo_run(config)
    root, params = ppo_project(tiny_run, tmp_path / "project")
    seed = random.SystemRandom().randrange(1 << 30)  # the stages seed the global RNG of this process
    delay = random.Random(seed).uniform(0.0, 0.25)
    where = f"(seed {seed}: killed {delay:.3f} s after step 3 was written)"
    proc = start_stage("ppo", params, root, config=config)
    deadline = time.monotonic() + 300
    while not (root / WORK_ROLLOUTS / rollout_file(2)).exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.01)
    time.sleep(delay)
    launching.kill_tree(proc)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL, f"the stage ended before the kill {where}"
    state = root / "data" / "checkpoints" / "ppo" / STATE  # absent if killed after the run published and deleted it
    if state.exists():  # one layout: trainer.pt beside the engine's state, here DeepSpeed's own checkpoint
        assert sorted(p.name for p in state.iterdir()) == ["engine", "trainer.pt"], where
        assert (state / "engine" / "shards").is_dir() and not (state / "engine" / "state.pt").exists(), where

    interrupted = state.exists()
    remove_outputs_as_dvc_does(root, "ppo")
    code, output = launch_stage("ppo", params, root, config=config)
    assert code == 0, output[-3000:]
    assert (f"note: ppo: resuming from data/checkpoints/ppo/{STATE} at step" in output) == interrupted, where
    assert digests(root, NOT_COMPARED) == digests(whole, NOT_COMPARED), where
    assert not list(root.rglob(".*tmp-*")), "a killed writer's temporary file was left behind"


def test_sft_stage_in_two_processes(tiny_run, tmp_path):
    """sft.batch_size 16 per process = the one-process run's 32: close eval loss, one model written."""
    root = tmp_path / "project"
    shutil.copytree(tiny_run / "data" / "raw", root / "data" / "raw")
    params = params_file(tmp_path, sft__batch_size=16)
    code, output = launch_stage("sft", params, root)
    assert code == 0, output[-3000:]
    assert sum(line.startswith("sft: ") for line in output.splitlines()) == 1  # one summary: the main process's
    two = json.loads((root / SFT_METRICS).read_text())
    one = json.loads((tiny_run / SFT_METRICS).read_text())
    assert two["eval_loss"] == pytest.approx(one["eval_loss"], rel=0.02)
    AutoModelForCausalLM.from_pretrained(root / SFT_MODEL)


def test_a_scorer_failing_on_one_process_ends_both(tiny_run, tmp_path):
    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints"))
    remove_outputs_as_dvc_does(root, "ppo")
    (root / "rank_scorer.py").write_text(
        "import math, os\n\ndef score(texts):\n"
        "    return [math.nan if os.environ['RANK'] == '1' else 1.0 for _ in texts]\n")
    params = params_file(tmp_path, ppo__batch_size=4, ppo__mini_batch_size=2, ppo__steps=8, scorer__source="callable",
                         scorer__name="rank_scorer:score")
    code, output = launch_stage("ppo", params, root, timeout=180)  # a hang fails the test at the timeout
    assert code != 0
    assert "error: ppo: PPO step 1: scorer (callable rank_scorer:score) returned nan for text 0" in output
    assert not (root / PPO_MODEL).exists()


def test_kept_columns_reach_each_process_s_rewards_and_rollouts(tiny_run, tmp_path):
    """data.prompts.keep in 2 processes (issue 47): each process scores its own share of the batch against its own
    prompts' answers (the scorer returns 1 only then), and the rollouts, gathered in process order, hold them. With
    several weighted functions, each function's stats are over both processes' rollouts, not the first's share."""
    from stages import prepare, tokenize
    from stages.shared.params import load_params
    from tests.stages.test_columns import WORDS, answer_of, write_prompts

    root = tmp_path / "project"
    shutil.copytree(tiny_run, root, ignore=shutil.ignore_patterns("checkpoints"))
    remove_outputs_as_dvc_does(root, "ppo")
    (root / "row_scorer.py").write_text(
        "def accuracy(completions, answer, prompts, **kwargs):\n"
        "    return [float(a == sum(map(ord, p)) % 97) for p, a in zip(prompts, answer)]\n"
        "def length(completions, prompts, **kwargs):\n"
        "    return [float(len(p)) for p in prompts]\n")
    source = root / "qa.jsonl"
    write_prompts(source, [f"{w} {i}" for i in range(4) for w in WORDS])
    functions = {"correct": {"name": "row_scorer:accuracy", "weight": 1.0},
                 "size": {"name": "row_scorer:length", "weight": 0.01}}
    params = params_file(tmp_path, ppo__batch_size=4, ppo__mini_batch_size=2, ppo__steps=8, scorer__source="combined",
                         scorer__name=None, scorer__functions=functions, data__prompts__source=str(source),
                         data__prompts__columns={"query": "question"}, data__prompts__keep=["answer", "meta"],
                         data__n_eval_prompts=8, tokenize__max_query_tokens=None, tokenize__truncation="refuse")
    loaded = load_params(params)
    assert loaded.data.prompts.keep == ["answer", "meta"] and loaded.tokenize.max_query_tokens is None
    prepare.run(loaded, root)
    tokenize.run(loaded, root)
    code, output = launch_stage("ppo", params, root, timeout=300)
    assert code == 0, output[-3000:]
    rollouts = pd.read_parquet(root / PPO_ROLLOUTS)
    assert rollouts.groupby("step").size().tolist() == [8, 8]  # both processes' shares
    assert (rollouts["answer"] == rollouts["query"].map(answer_of)).all() and (rollouts["reward_correct"] == 1.0).all()
    lengths = rollouts["query"].str.len()
    assert rollouts["reward_size"].tolist() == lengths.astype(float).tolist()
    assert rollouts["score"].tolist() == pytest.approx((1.0 + 0.01 * lengths).tolist())
    stats = pd.read_parquet(root / PPO_STATS)
    by_step = rollouts.groupby("step")["reward_size"]
    assert stats["rewards/size/mean"].tolist() == pytest.approx(by_step.mean().tolist())  # all 8, not process 0's 4
    assert stats["rewards/size/std"].tolist() == pytest.approx(by_step.std(ddof=1).tolist())

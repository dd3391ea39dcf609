"""The default pipeline, run as a user runs it on a fresh clone (`make run`: `dvc repro` with params.yaml as committed).

It learns: the reward model ranks held-out pairs well above chance, and the PPO policy beats the SFT policy on the
reward model and on the gold score it never saw. And it reproduces: the committed dvc.lock is what the run produces, so
`git status` stays clean, `dvc status` has nothing to do, and `dvc exp show` / `dvc exp diff` compare experiments with
real baseline metrics. What is hashed must be the same on every machine the guarantee covers (docs/reproducibility.md,
"Same inputs, same bytes"): the code, params and commands everywhere; the data prepare and tokenize write (no floating
point) everywhere; the trained models and everything after them where the floating-point kernels are those the lock was
written with (`stages.shared.numerics.LOCK_KERNELS`: params.yaml's `numerics.kernels: portable`, so any x86-64 CPU with
AVX2); elsewhere (another architecture, no AVX2) it warns which stages' outputs differ.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from stages.shared import numerics
from tests.conftest import cpu_only
from tests.pipeline.test_smoke import dvc, exp_show_header, run

ROOT = Path(__file__).resolve().parents[2]
FLOAT_FREE = ("prepare", "tokenize")  # outputs that no floating-point kernel computes


def fresh_clone(target: Path) -> Path:
    """The tracked files of the repository (what `git clone` gives), committed in a new repo at `target`."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for name in filter(None, files.split("\0")):
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target / name)
    run("git", "init", "-q", cwd=target)
    run("git", "add", "-A", cwd=target)
    run("git", "commit", "-qm", "clone", cwd=target)
    return target


def lock_entries(lock: dict, stage: str) -> dict:
    """A stage's lock entry with what it ran with set apart from what it wrote: its inputs (cmd, params, and the deps
    that no stage writes: code and the user's data) and its outputs (an upstream output a stage depends on is compared
    where the stage writing it is)."""
    written = {out["path"] for entry in lock["stages"].values() for out in entry.get("outs", [])}
    entry = dict(lock["stages"][stage])
    entry["deps"] = [dep for dep in entry.get("deps", []) if dep["path"] not in written]
    return {"inputs": {k: v for k, v in entry.items() if k != "outs"}, "outs": entry.get("outs")}


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A fresh clone where `dvc repro` has run the default pipeline."""
    repo = fresh_clone(tmp_path_factory.mktemp("default") / "clone")
    with cpu_only():  # the committed lock is a CPU run's (stages.shared.numerics.LOCK_KERNELS)
        out = dvc("repro", cwd=repo).stdout
    assert "Running stage 'ppo'" in out and "Running stage 'report'" in out
    return repo


@pytest.mark.slow
def test_make_run_ends_with_the_report(clone):
    page = (clone / "data" / "report" / "index.html").read_text()
    assert page.count("<svg") >= 7 and "Win rate of PPO over SFT" in page  # the charts; the seconds per step:
    assert len(list((clone / "data" / "logs" / "report").glob("step-seconds-*.svg"))) == 1  # linked, not inline


@pytest.mark.slow
def test_the_reward_model_ranks_held_out_pairs_well_above_chance(clone):
    metrics = json.loads((clone / "data" / "reward" / "metrics.json").read_text())
    assert metrics["pairs"]["eval"] == 200 and metrics["accuracy"] >= 0.7  # chance: 0.5; measured 0.79-0.88 (seeds)


@pytest.mark.slow
def test_ppo_beats_sft_on_the_reward_model_and_on_the_gold_score(clone):
    metrics = json.loads((clone / "data" / "eval" / "metrics.json").read_text())
    sft = metrics["sft"]  # the top level is the PPO policy's
    assert metrics["reward"] - sft["reward"] >= 1.0  # measured +2.5
    assert metrics["gold"] - sft["gold"] >= 1.0  # measured +4.6: not only the proxy went up
    assert metrics["win_rate"] >= 0.8 and metrics["kl"] > 0


@pytest.mark.slow
def test_a_fresh_run_reproduces_the_committed_lock_on_cpu(clone):
    committed = YAML(typ="safe", pure=True).load(subprocess.run(
        ["git", "show", "HEAD:dvc.lock"], cwd=clone, capture_output=True, text=True, check=True).stdout)
    produced = YAML(typ="safe", pure=True).load((clone / "dvc.lock").read_text())
    assert set(produced["stages"]) == set(committed["stages"])
    for stage in committed["stages"]:  # what each stage ran with: code, data deps, params and command
        assert lock_entries(produced, stage)["inputs"] == lock_entries(committed, stage)["inputs"], stage
    for stage in FLOAT_FREE:
        assert lock_entries(produced, stage)["outs"] == lock_entries(committed, stage)["outs"], stage
    probe = ("import json; from pathlib import Path; from stages.shared import numerics; "  # as a stage process does
             "from stages.shared.params import load_params; numerics.configure_from(Path('params.yaml')); "
             "numerics.set_threads(load_params('params.yaml').numerics.threads); print(json.dumps(numerics.current()))")
    kernels = json.loads(run(sys.executable, "-c", probe, cwd=clone).stdout)  # as in a stage process
    same_kernels = numerics.covered(kernels)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU") if Path("/proc/cpuinfo").exists() else "unknown CPU"
    if same_kernels:  # the guarantee covers this machine: every byte, and git sees nothing to commit
        assert run("git", "status", "--porcelain", cwd=clone).stdout == ""
        warnings.warn(f"the committed dvc.lock was reproduced byte for byte on {cpu} ({kernels})")
    else:  # not covered: say what differs, as evidence for docs/reproducibility.md's statement
        different = [s for s in committed["stages"]
                     if lock_entries(produced, s)["outs"] != lock_entries(committed, s)["outs"]]
        warnings.warn(f"{cpu} ({kernels}) computes with other float kernels than the committed lock's "
                      f"({numerics.LOCK_KERNELS}); stages whose outputs differ: {different}")


def ordinary_prompts(n: int = 200) -> list[str]:
    """``n`` distinct ordinary English prompts, 4 to 8 words, none of the synthetic grammar's."""
    asks = ("tell me about", "write a line on", "describe", "what do you think of", "give me a word for")
    things = ("the weather in spring", "an old wooden boat", "my neighbour's garden", "a quiet morning at the lake",
              "the last train home", "a birthday cake", "the city at night", "a letter from a friend")
    people = ("", " for a child", " for my aunt", " in one sentence", " as a poem")
    return [f"{a} {t}{p}".strip() for a in asks for t in things for p in people][:n]


@pytest.mark.slow
def test_own_prompts_run_to_the_end_on_the_first_try_and_stay_held_out(clone, tmp_path):
    """A user's 200-line JSONL of ordinary prompts in the shipped params.yaml: `dvc repro` runs to the end on the
    first try (the held-out count is capped at 25% of the prompts, the prompt-length limit follows the model's
    context), and no held-out prompt is a training prompt, as evaluate measures and the report says."""
    import pandas as pd

    own = tmp_path / "own"
    shutil.copytree(clone, own, symlinks=True)
    prompts = ordinary_prompts()
    (own / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    yaml = YAML()
    params = yaml.load((own / "params.yaml").read_text())
    params["data"]["prompts"].update(source="prompts.jsonl", columns={"query": "prompt"}, n=None)
    with open(own / "params.yaml", "w") as fh:
        yaml.dump(params, fh)
    with cpu_only():
        dvc("repro", cwd=own)
    metrics = json.loads((own / "data" / "eval" / "metrics.json").read_text())
    assert metrics["heldout"] == {"prompts": 50, "in_train": 0}  # 25% of 200, none trained on
    train = pd.read_parquet(own / "data" / "tokenized" / "train.parquet")["query"]
    held_out = pd.read_parquet(own / "data" / "tokenized" / "eval.parquet")["query"]
    assert len(train) == 150 and not set(train) & set(held_out)
    assert "Over 50 held-out prompts, none of them a training prompt." in \
        (own / "data" / "report" / "index.html").read_text()


@pytest.mark.slow
def test_a_ppo_experiment_compares_in_100_columns(clone):
    """`dvc exp show --only-changed` (docs/sweeps.md's command) after a PPO experiment on the default pipeline, where
    the evaluation metrics move: the param and each metric that moved in a 100-column terminal, none cut off. Runs
    last: it leaves the experiment applied to the workspace."""
    dvc("exp", "run", "-S", "ppo.learning_rate=0.0001", cwd=clone)
    header, table = exp_show_header(clone)
    rows = json.loads(dvc("exp", "show", "--json", cwd=clone).stdout)
    ours = next(rev for row in rows for exp in (row.get("experiments") or []) for rev in exp["revs"])
    before = next(row for row in rows if row.get("experiments"))["data"]["metrics"]["data/eval/metrics.json"]["data"]
    after = ours["data"]["metrics"]["data/eval/metrics.json"]["data"]
    moved = [key for key in after if not isinstance(after[key], dict) and after[key] != before[key]]
    assert {"gold", "reward", "kl", "length"} <= set(moved)  # (the win rate may land on the same 0.955)
    assert header == ["Experiment", *moved, "ppo.learning_rate"], table
    assert "…" not in table and max(map(len, table.splitlines())) <= 100, table

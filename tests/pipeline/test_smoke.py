"""End to end through DVC, as a user drives it: the project copied to a fresh git repo (tiny params) runs `dvc repro`;
then, each test leaving the workspace as it found it: a no-op repro, a forced rerun that trains again, a killed
`dvc repro` that resumes, a failing stage that says how to get its outputs back, reward code under rewards/ that
makes ppo and evaluate stale, `dvc exp run -S`, a queued sweep that reruns nothing upstream of ppo, the docs'
sweep and comparison, the sweep's page, and a sweep on a user's own prompts and scorer (in 120 columns, its page at
1400 px)."""

from __future__ import annotations

import hashlib
import html
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {
    **{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "DVC_STAGE")},  # the copy's code, not ROOT's
    # `python3` in dvc.yaml's commands must be this venv's, as it is with the venv activated
    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    "DVC_NO_ANALYTICS": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
    "GIT_AUTHOR_NAME": "ci", "GIT_AUTHOR_EMAIL": "ci@example.invalid",
    "GIT_COMMITTER_NAME": "ci", "GIT_COMMITTER_EMAIL": "ci@example.invalid",
}
STAGES = ("sources", "prepare", "sft", "reward", "tokenize", "ppo", "evaluate", "report")
PPO_OUTPUTS = ["data/models/ppo/model.safetensors", "data/ppo/stats.parquet", "data/ppo/curves.csv",
               "data/ppo/metrics.json", "data/ppo/rollouts/step-00000.parquet", "data/ppo/rollouts/step-00001.parquet"]


def run(*args: str, cwd: Path, check: bool = True, env: dict[str, str] = ENV) -> subprocess.CompletedProcess:
    result = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True)
    if check:
        assert result.returncode == 0, f"{' '.join(args)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def dvc(*args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    return run(sys.executable, "-m", "dvc", *args, cwd=cwd, check=check)


def readme_line(start: str) -> str:
    """The docs' command line that starts with ``start`` (the first of README.md, then of docs/*.md, where the guides
    hold the commands the README links to), to run as the user types it (``bash -c``)."""
    docs = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
    return next(line for doc in docs for line in doc.read_text().splitlines() if line.startswith(start))


def exp_show_header(repo: Path, columns: int = 100) -> tuple[list[str], str]:
    """The docs' `dvc exp show` (docs/sweeps.md) in a terminal of ``columns``: (its header's columns, the whole
    table)."""
    table = run("bash", "-c", readme_line("dvc exp show "), cwd=repo, env={**ENV, "COLUMNS": str(columns)}).stdout
    return next(line for line in table.splitlines() if "Experiment" in line).split(), table


def ran(output: str) -> list[str]:
    """The stages DVC ran (not skipped nor restored from its run-cache), in order, from its output; but the sources
    stage, which DVC runs first at every `dvc repro` of the pipeline (it hashes the user's own files:
    `always_changed`)."""
    found = [line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")]
    return [name for name in found if name != "sources"]


def status(repo: Path) -> dict:
    """`dvc status`, less the sources stage's "always changed" (the one thing it always says)."""
    found = json.loads(dvc("status", "--json", cwd=repo).stdout)
    assert found.pop("sources", None) == ["always changed"], found
    return found


def contents(repo: Path, paths: list[str]) -> dict[str, bytes]:
    return {path: (repo / path).read_bytes() for path in paths}


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A fresh git repo holding the project with the tiny params, where `dvc repro` has run and its lock is
    committed (as on main)."""
    repo = tmp_path_factory.mktemp("dvc") / "repo"
    repo.mkdir()
    for name in ("dvc.yaml", "pyproject.toml", ".gitignore", ".dvcignore"):
        shutil.copy(ROOT / name, repo / name)
    for package in ("stages", "ppo_core", "rewards"):
        shutil.copytree(ROOT / package, repo / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "tests" / "fixtures" / "params.tiny.yaml", repo / "params.yaml")
    run("git", "init", "-q", cwd=repo)
    dvc("init", "-q", cwd=repo)
    dvc("config", "core.analytics", "false", cwd=repo)
    run("git", "add", "-A", cwd=repo)
    run("git", "commit", "-qm", "tiny project", cwd=repo)  # dvc exp run needs a commit
    out = dvc("repro", cwd=repo).stdout
    assert ran(out) == list(STAGES[1:])
    run("git", "add", "dvc.lock", cwd=repo)
    run("git", "commit", "-qm", "lock", cwd=repo)
    return repo


def sft_samples(repo: Path) -> pd.DataFrame:
    """evaluate's held-out samples of the SFT policy, with their scores."""
    samples = pd.read_parquet(repo / "data" / "eval" / "samples.parquet")
    return samples[samples["policy"] == "sft"].reset_index(drop=True)


def assert_clean(repo: Path) -> None:
    """Nothing for dvc to do, and nothing for git to commit."""
    assert status(repo) == {}
    assert run("git", "status", "--porcelain", cwd=repo).stdout == ""


@pytest.mark.slow
def test_repro_leaves_no_state_and_a_second_repro_does_nothing(repo):
    assert not (repo / "data" / "checkpoints").exists()  # every training stage finished, and deleted its state
    assert (repo / "data" / "logs" / "ppo" / "timings.csv").exists()  # kept, but not an output
    assert_clean(repo)
    out = dvc("repro", cwd=repo).stdout
    assert ran(out) == [] and out.count("didn't change, skipping") == len(STAGES) - 1  # all but sources


@pytest.mark.slow
def test_forced_rerun_trains_again(repo):
    """`dvc repro -f -s ppo` runs every step again (nothing to resume) and, deterministic, gives the same bytes."""
    before = contents(repo, PPO_OUTPUTS)
    result = dvc("repro", "-f", "-s", "ppo", cwd=repo)
    assert ran(result.stdout) == ["ppo"] and "resuming" not in result.stderr
    assert "ppo: 2 steps, reward" in result.stdout
    assert contents(repo, PPO_OUTPUTS) == before
    assert_clean(repo)


@pytest.mark.slow
def test_killed_repro_resumes(repo):
    """`dvc repro` of new params killed (the whole process group, SIGKILL) during ppo, then `dvc repro` again: the
    stage resumes from its checkpoint, which DVC neither deleted nor cached, and ends with the outputs of an
    uninterrupted run (`dvc repro -f` afterwards: nothing left to resume, every step runs again)."""
    params = (repo / "params.yaml").read_text()
    (repo / "params.yaml").write_text(params.replace("learning_rate: 0.0003", "learning_rate: 0.0002"))
    try:
        proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=ENV,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        state, deadline = repo / "data" / "checkpoints" / "ppo" / "state", time.monotonic() + 300
        while not state.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "ppo ended before its first checkpoint"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rerun = dvc("repro", cwd=repo)
        assert ran(rerun.stdout) == ["ppo", "evaluate", "report"]
        assert "resuming from data/checkpoints/ppo/state at step 1" in rerun.stderr
        assert not (repo / "data" / "checkpoints" / "ppo").exists()
        resumed = contents(repo, PPO_OUTPUTS)
        forced = dvc("repro", "-f", "-s", "ppo", cwd=repo)
        assert "resuming" not in forced.stderr and contents(repo, PPO_OUTPUTS) == resumed
    finally:
        (repo / "params.yaml").write_text(params)
    assert ran(dvc("repro", cwd=repo).stdout) == []  # the committed params: restored from DVC's run-cache
    assert_clean(repo)


@pytest.mark.slow
def test_the_state_of_an_interrupted_forced_run_goes_once_dvc_restored_the_outputs(repo):
    """`dvc repro -f -s ppo` killed after a checkpoint, then `dvc repro`: DVC restores ppo's outputs from its run-cache
    (the same params and inputs), so ppo never runs to resume from its state or delete it. The next stage that runs
    deletes that state, saying so."""
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", "-f", "-s", "ppo"], cwd=repo, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    state, deadline = repo / "data" / "checkpoints" / "ppo" / "state", time.monotonic() + 300
    while not state.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "ppo ended before its first checkpoint"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert ran(dvc("repro", cwd=repo).stdout) == [] and state.exists()  # restored, not run: the state stays
    report = dvc("repro", "-f", "-s", "report", cwd=repo)
    assert "note: report: deleted data/checkpoints/ppo, the state of an interrupted ppo run" in report.stderr
    assert not (repo / "data" / "checkpoints").exists()
    assert_clean(repo)


@pytest.mark.slow
def test_a_failing_stage_says_how_to_restore_its_outputs(repo):
    """DVC deletes a stage's outputs before running it; when the stage then fails on bad input, its one-line error says
    so and how to get them back, and `dvc checkout ppo` does. A params error stops the first stage, sources, which
    keeps its outputs (persist): nothing of the workspace is deleted then, and nothing needs restoring."""
    before = contents(repo, PPO_OUTPUTS)
    params = (repo / "params.yaml").read_text()
    (repo / "params.yaml").write_text(params.replace("learning_rate: 0.0003", "learning_rate: fast"))
    try:
        result = dvc("repro", cwd=repo, check=False)
        error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert result.returncode != 0 and error == [
            "error: sources: params.yaml: ppo.learning_rate must be a number, got 'fast' (str)"], result.stderr[-2000:]
        assert contents(repo, PPO_OUTPUTS) == before and status(repo) != {}  # ppo never ran: the params changed
    finally:
        (repo / "params.yaml").write_text(params)
    assert_clean(repo)
    # valid params, but more rollouts per step than the 32 train prompts: only the ppo stage itself can tell
    (repo / "params.yaml").write_text(params.replace("  batch_size: 8\n  mini_batch_size: 4",
                                                     "  batch_size: 64\n  mini_batch_size: 4"))
    try:
        result = dvc("repro", cwd=repo, check=False)
        error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        assert len(error) == 1 and error[0].startswith("error: ppo: data/tokenized/train.parquet: ") and \
            error[0].endswith(" (dvc removed this stage's outputs before running it: `dvc checkout ppo` restores the "
                              "last ones)"), result.stderr[-2000:]
        assert not (repo / "data" / "models" / "ppo").exists()
        dvc("checkout", "ppo", cwd=repo)
        assert contents(repo, PPO_OUTPUTS) == before
    finally:
        (repo / "params.yaml").write_text(params)
    assert_clean(repo)


@pytest.mark.slow
def test_a_typo_in_the_checkpoint_section_stops_repro(repo):
    """Every params section is tracked by a stage that reads it, so a bad value anywhere stops `dvc repro`."""
    params = (repo / "params.yaml").read_text()
    (repo / "params.yaml").write_text(params.replace("ppo_every: 1 ", "ppo_every: -1 "))
    try:
        result = dvc("repro", cwd=repo, check=False)
        assert result.returncode != 0 and "checkpoint.ppo_every must be >= 0" in result.stderr
        dvc("checkout", "ppo", cwd=repo)
    finally:
        (repo / "params.yaml").write_text(params)
    assert_clean(repo)


@pytest.mark.slow
def test_reward_code_under_rewards_is_a_dep_of_ppo_and_evaluate(repo):
    """With `scorer.name: rewards.example:keyword_sentiment`, editing rewards/example.py makes ppo and evaluate (and
    only what follows them) stale, and the rerun's rollouts and evaluation are scored by the edited function."""
    params, example = (repo / "params.yaml").read_text(), (repo / "rewards" / "example.py").read_text()
    (repo / "params.yaml").write_text(params.replace("source: reward_model\n  name: null",
                                                     "source: callable\n  name: rewards.example:keyword_sentiment"))
    try:
        result = dvc("repro", cwd=repo)
        # the reward stage tracks the scorer's source: a callable needs no reward model, and it trains none (seconds)
        assert ran(result.stdout) == ["reward", "ppo", "evaluate", "report"] and "warning" not in result.stderr
        assert "reward: not trained: nothing scores with the reward model" in result.stderr + result.stdout
        assert status(repo) == {}
        first = pd.read_parquet(repo / "data" / "ppo" / "rollouts" / "step-00000.parquet")
        first_sft = sft_samples(repo)

        (repo / "rewards" / "example.py").write_text(example.replace('"good", ', '"good", "the", '))
        stale = status(repo)
        assert set(stale) == {"ppo", "evaluate"}
        assert all({"changed deps": {"rewards": "modified"}} in stale[stage] for stage in stale)
        result = dvc("repro", cwd=repo)
        assert ran(result.stdout) == ["ppo", "evaluate", "report"] and "resuming" not in result.stderr
        edited = pd.read_parquet(repo / "data" / "ppo" / "rollouts" / "step-00000.parquet")
        # the same first batch (same policy, same seed): its scores now count "the" as positive
        assert (edited["response"] == first["response"]).all()
        the = (first["query"] + first["response"]).str.lower().str.count(r"\bthe\b")
        assert (edited["score"] == first["score"] + the).all() and the.sum() > 0
        # and so do evaluate's scores of the SFT policy's held-out samples (the same samples: SFT did not change)
        edited_sft = sft_samples(repo)
        assert (edited_sft["response"] == first_sft["response"]).all()
        the = (first_sft["query"] + first_sft["response"]).str.lower().str.count(r"\bthe\b")
        assert (edited_sft["score"] == first_sft["score"] + the).all() and the.sum() > 0
    finally:
        (repo / "params.yaml").write_text(params)
        (repo / "rewards" / "example.py").write_text(example)
    result = dvc("repro", cwd=repo)
    assert ran(result.stdout) == []  # back to the committed params and code: restored from DVC's run-cache
    assert_clean(repo)


@pytest.mark.slow
def test_exp_run_reruns_only_ppo_and_evaluate(repo):
    out = dvc("exp", "run", "-n", "smoke", "-S", "ppo.learning_rate=0.00002", cwd=repo).stdout
    assert ran(out) == ["ppo", "evaluate", "report"]
    rows = json.loads(dvc("exp", "show", "--json", cwd=repo).stdout)
    experiments = [rev for row in rows for exp in (row.get("experiments") or []) for rev in exp["revs"]]
    smoke = next(rev for rev in experiments if rev["name"] == "smoke")
    metrics = smoke["data"]["metrics"]["data/eval/metrics.json"]["data"]
    assert list(metrics) == ["win_rate", "gold", "reward", "kl", "length", "sft", "heldout"]  # dvc's columns' order
    assert smoke["data"]["params"]["params.yaml"]["data"]["ppo"]["learning_rate"] == 2e-05
    baseline = next(row for row in rows if row.get("experiments"))  # HEAD: its metrics are there to compare with
    before = baseline["data"]["metrics"]["data/eval/metrics.json"]["data"]
    assert before["win_rate"] >= 0
    # the docs' comparison reads whole in a 100-column terminal: every metric that moved, and the param
    header, table = exp_show_header(repo)
    moved = [key for key in metrics if metrics[key] != before[key]]  # the tiny run's policy moves little
    assert "kl" in moved and header == ["Experiment", *moved, "ppo.learning_rate"], table
    assert "…" not in table and max(map(len, table.splitlines())) <= 100, table
    run("git", "checkout", "--", "params.yaml", "dvc.lock", cwd=repo)
    dvc("checkout", cwd=repo)
    assert_clean(repo)


@pytest.mark.slow
def test_a_queued_sweep_runs_no_stage_upstream_of_ppo(repo):
    """`dvc exp run --queue` over two ppo values, then `--run-all`: each experiment runs in its own copy of the repo,
    where DVC restores prepare, sft, reward and tokenize from its cache instead of rerunning them."""
    dvc("exp", "run", "--queue", "-S", "ppo.learning_rate=0.0001,0.0005", cwd=repo)
    out = dvc("exp", "run", "--run-all", cwd=repo).stdout
    assert ran(out) == ["ppo", "evaluate", "report"] * 2, out[-3000:]
    names = [rev["name"] for row in json.loads(dvc("exp", "show", "--json", cwd=repo).stdout)
             for exp in (row.get("experiments") or []) for rev in exp["revs"]]
    assert len(names) >= 2
    assert_clean(repo)


@pytest.mark.slow
def test_the_readme_s_queued_sweep_compares_in_100_columns(repo):
    """The docs' sweep as a user types it (`dvc exp run --queue -S 'ppo.learning_rate=...' && dvc queue start`,
    then `dvc queue status` until both are done) and its `dvc exp show` line in a 100-column terminal: Experiment, the
    metrics that moved and the swept param, none cut off (a queued experiment adds a State column to drop)."""
    run("bash", "-c", readme_line("dvc exp run --queue "), cwd=repo)
    deadline = time.monotonic() + 600
    while any(state in dvc("queue", "status", cwd=repo).stdout for state in ("Queued", "Running")):
        assert time.monotonic() < deadline, "the queued sweep did not finish in 10 minutes"
        time.sleep(2)
    assert "Failed" not in dvc("queue", "status", cwd=repo).stdout
    rows = json.loads(dvc("exp", "show", "--json", cwd=repo).stdout)
    revs = rows + [rev for row in rows for exp in (row.get("experiments") or []) for rev in exp["revs"]]
    evaluations = [rev["data"]["metrics"]["data/eval/metrics.json"]["data"] for rev in revs]
    moved = [key for key in evaluations[0] if len({json.dumps(e[key]) for e in evaluations}) > 1]
    header, table = exp_show_header(repo)
    assert "kl" in moved and header == ["Experiment", *moved, "ppo.learning_rate"], table
    assert "…" not in table and max(map(len, table.splitlines())) <= 100, table
    assert_clean(repo)


@pytest.mark.slow
def test_the_sweep_page_shows_the_experiments_side_by_side(repo):
    """`rlhf report --experiments` after the sweep: the experiments as dvc exp show lists them, the params that differ
    as params.yaml writes them (an int as an int), their evaluation and their curves overlaid, each legend naming its
    experiment only (its params are in the table), read through DVC's API."""
    dvc("exp", "run", "--temp", "-n", "epochs", "-S", "ppo.ppo_epochs=1", cwd=repo)  # an int param differs too
    out = run(sys.executable, "-m", "stages", "report", "--experiments", cwd=repo).stdout
    assert "params differ -> data/report/experiments.html" in out
    page = (repo / "data" / "report" / "experiments.html").read_text()
    assert ">ppo.<wbr>learning_<wbr>rate<" in page and "0.0005" in page and "0.0001" in page
    assert '<th class="param">ppo.<wbr>ppo_<wbr>epochs</th>' in page
    assert '<td class="param">1</td>' in page and '<td class="param">2</td>' in page
    assert '<td class="param">1.0</td>' not in page and '<td class="param">2.0</td>' not in page  # exp_show's 1, 2
    assert ">epochs</text>" in page and "ppo_epochs=" not in page  # a legend: the experiment's name only
    assert "PPO reward (reward model)" in page
    assert page.count("<svg") == 3 and "<script" not in page
    assert_clean(repo)


@pytest.mark.slow
def test_where_main_s_results_are_not_in_the_cache_the_workspace_is_the_baseline(repo, tmp_path):
    """On a machine whose float kernels compute other bytes than main's lock (native kernels on another CPU, another
    architecture: docs/reproducibility.md, "Same inputs, same bytes"), main's results are in no cache. Simulated on a
    copy of the repo without its cache or experiments, whose pipeline reruns with ATen's unvectorised kernels and one
    thread (the tiny params are native: the environment decides), then one experiment: the docs' `dvc exp show` line
    still fits 100 columns with main's row all `!`, and the sweep page lists the workspace's results, labelled, as the
    baseline."""
    from stages.report.sweep import WORKSPACE_BASELINE

    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, symlinks=True)
    dvc("exp", "remove", "-A", cwd=copy)
    run("git", "checkout", "-q", "--", ".", cwd=copy)  # main's params, as a fresh clone has them
    shutil.rmtree(copy / ".dvc" / "cache")
    shutil.rmtree(copy / ".dvc" / "tmp", ignore_errors=True)  # DVC's own cache of exp show's results too
    run(sys.executable, "-m", "dvc", "repro", "-f", cwd=copy, env={**ENV, "ATEN_CPU_CAPABILITY": "default",
                                                                   "OMP_NUM_THREADS": "1"})
    assert "data/eval/metrics.json" in run("git", "diff", "--stat", cwd=copy).stdout or \
        "dvc.lock" in run("git", "status", "--porcelain", cwd=copy).stdout  # other bytes than main's
    dvc("exp", "run", "--queue", "-S", "ppo.learning_rate=0.0001", cwd=copy)
    dvc("queue", "start", cwd=copy)
    deadline = time.monotonic() + 600
    while any(state in dvc("queue", "status", cwd=copy).stdout for state in ("Queued", "Running")):
        assert time.monotonic() < deadline, "the queued experiment did not finish in 10 minutes"
        time.sleep(2)
    header, table = exp_show_header(copy)
    main_row = next(line for line in table.splitlines() if line.strip().startswith(("main", "master")))
    assert main_row.count("!") == len(header) - 2, table  # every metric missing but the param
    assert "…" not in table and max(map(len, table.splitlines())) <= 100, table
    run(sys.executable, "-m", "stages", "report", "--experiments", cwd=copy)
    page = html.unescape((copy / "data" / "report" / "experiments.html").read_text())
    assert page.count(WORKSPACE_BASELINE) >= 2  # its row, and the legend of its curves


def run_queue(repo: Path, *overrides: str) -> None:
    """`dvc exp run --queue -S ...` then `dvc queue start`, as the docs' sweep, waiting until none is queued or
    running; none failed."""
    dvc("exp", "run", "--queue", *(arg for value in overrides for arg in ("-S", value)), cwd=repo)
    dvc("queue", "start", cwd=repo)
    deadline = time.monotonic() + 600
    while any(state in dvc("queue", "status", cwd=repo).stdout for state in ("Queued", "Running")):
        assert time.monotonic() < deadline, "the queued sweep did not finish in 10 minutes"
        time.sleep(2)
    assert "Failed" not in dvc("queue", "status", cwd=repo).stdout


@pytest.mark.slow
def test_a_sweep_on_own_prompts_and_scorer_compares_in_120_columns_and_its_page_reads_at_1400_px(repo, tmp_path):
    """A user's own prompts (JSONL) and scorer (rewards/my_scorer.py), committed with params.yaml and the lock of
    their run as docs/sweeps.md says, then the scorer edited (staged, so the experiments get it) and a three-value
    learning-rate sweep queued: the docs' `dvc exp show` fits 120 columns, none cut off (the `rewards` dep's column,
    a hash that differs from main's, dropped); the sweep page, in a 1400 px Chromium window, has every chart at the
    page's width and its table within the page, results first."""
    from tests.stages.test_report import BROWSER, layout

    copy = tmp_path / "own"
    shutil.copytree(repo, copy, symlinks=True)
    dvc("exp", "remove", "-A", cwd=copy)
    run("git", "checkout", "-q", "--", ".", cwd=copy)
    (copy / "my_prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{who} {verb} {how}"}) + "\n"
                                                   for who in ("the film", "this movie", "the plot", "the cast")
                                                   for verb in ("was", "felt", "seemed") for how in ("so", "quite")))
    scorer = "def positivity(texts):\n    return [float(t.count('good')) / (1 + len(t.split())) for t in texts]\n"
    (copy / "rewards" / "my_scorer.py").write_text(scorer)
    params = (copy / "params.yaml").read_text()
    own = params.replace("    source: synthetic\n    split: train\n    columns: {query: query}",
                         "    source: my_prompts.jsonl\n    split: train\n    columns: {query: prompt}")
    own = own.replace("scorer:\n  source: reward_model\n  name: null",
                      "scorer:\n  source: callable\n  name: rewards.my_scorer:positivity")
    assert own.count("my_") == 2
    (copy / "params.yaml").write_text(own)
    run("git", "add", "-A", cwd=copy)
    run("git", "commit", "-qm", "own prompts and scorer", cwd=copy)
    dvc("repro", cwd=copy)
    run("git", "commit", "-qam", "the lock of our own run", cwd=copy)
    (copy / "rewards" / "my_scorer.py").write_text(scorer.replace("'good'", "'great'"))
    run("git", "add", "rewards/my_scorer.py", cwd=copy)
    run_queue(copy, "ppo.learning_rate=0.0001,0.0003,0.001")
    rows = json.loads(dvc("exp", "show", "--json", cwd=copy).stdout)
    revs = rows + [rev for row in rows for exp in (row.get("experiments") or []) for rev in exp["revs"]]
    assert len(revs) == 5  # the workspace, main and the three experiments
    evaluations = [rev["data"]["metrics"]["data/eval/metrics.json"]["data"] for rev in revs]
    moved = [key for key in evaluations[0] if len({json.dumps(e[key]) for e in evaluations}) > 1]
    header, table = exp_show_header(copy, columns=120)
    assert header == ["Experiment", *moved, "ppo.learning_rate"], table
    assert "…" not in table and max(map(len, table.splitlines())) <= 120, table
    run(sys.executable, "-m", "stages", "report", "--experiments", cwd=copy)
    if BROWSER is None:
        pytest.skip("no chromium: the sweep page's layout is unchecked")
    sizes = layout(copy / "data" / "report" / "experiments.html", tmp_path / "profile")
    assert len(sizes["charts"]) >= 2 and all(width >= sizes["page"] - 1 for width, _ in sizes["charts"]), sizes
    assert sizes["table"] <= sizes["page"], sizes
    lefts = dict(sizes["headers"])
    assert lefts["win rate"] < lefts["ppo.learning_rate"], lefts


@pytest.mark.slow
@pytest.mark.parametrize("where", ["in the project", "outside it"])
def test_an_edit_to_a_local_data_file_reruns_prepare(repo, tmp_path, where):
    """`data.prompts.source: my_prompts.jsonl`, then the file is edited in place: DVC cannot know the path from
    dvc.yaml, so the sources stage, which DVC runs at every repro, hashes it into data/sources/data.json, a dep of
    prepare; prepare reruns and its prompts are the edited ones. Unedited, prepare is skipped."""
    file = (repo if where == "in the project" else tmp_path) / "my_prompts.jsonl"
    file.write_text("".join(json.dumps({"query": f"the movie number {i} was"}) + "\n" for i in range(30)))
    source = "my_prompts.jsonl" if where == "in the project" else str(file)
    params = (repo / "params.yaml").read_text()
    (repo / "params.yaml").write_text(params.replace("    source: synthetic\n    split: train\n    columns: {query: "
                                                     "query}", f"    source: {source}\n    split: train\n    columns: "
                                                     "{query: query}"))
    assert source in (repo / "params.yaml").read_text()
    try:
        assert ran(dvc("repro", "prepare", cwd=repo).stdout) == ["prepare"]
        assert ran(dvc("repro", "prepare", cwd=repo).stdout) == []  # the same bytes: nothing to rerun
        file.write_text(file.read_text().replace("movie number 7 was", "film number 7 felt"))
        assert ran(dvc("repro", "prepare", cwd=repo).stdout) == ["prepare"]
        prompts = pd.concat([pd.read_parquet(repo / "data" / "raw" / f"prompts_{part}.parquet")
                             for part in ("train", "eval")])
        assert "the film number 7 felt" in set(prompts["query"]) and len(prompts) == 30
        recorded = json.loads((repo / "data" / "sources" / "data.json").read_text())["prompts"]
        assert recorded == {"source": source, "sha256": hashlib.sha256(b"my_prompts.jsonl\0" + file.read_bytes())
                            .hexdigest()}
    finally:
        (repo / "params.yaml").write_text(params)
        file.unlink()
    dvc("repro", "prepare", cwd=repo)  # the committed params: restored from DVC's run-cache
    dvc("checkout", cwd=repo)
    assert_clean(repo)

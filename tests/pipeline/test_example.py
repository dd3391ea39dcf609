"""The real-model examples, examples/sentiment and examples/verifiable, hold to the root pipeline: the same stages (but
`sources`, with their fetch stage first: `fetch`, `fetch_tasks`), each with the root's code deps (two directories up),
params and outputs, and the fetch stage's outputs where the root reads data/sources; a params file with the root's keys;
and the stages and the CLI, run there, see its pipeline. A change to the root's dvc.yaml or params.yaml that an example
misses fails here, naming the example and the stage or key."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import pytest
from ruamel.yaml import YAML

from stages import fetch, fetch_tasks
from stages.shared.params import load_params
from stages.shared.pipeline import stages
from tests.pipeline.test_dvcyaml import executed_files, outs
from tests.stages.test_cli import run_module

ROOT = Path(__file__).resolve().parents[2]
UP = "../../"  # an example's dvc.yaml names the repository's code from its own directory
LOAD = YAML(typ="safe", pure=True).load
ROOT_STAGES = LOAD((ROOT / "dvc.yaml").read_text())["stages"]
SHARED = [name for name in ROOT_STAGES if name != "sources"]


class Example(NamedTuple):
    """One real-model example: its directory, its fetch stage (a module of stages/ of the same name), what that stage
    writes (as the module names it) and what each shared stage reads of it in place of the root's
    data/sources/*.json."""

    name: str
    fetch: ModuleType
    outs: list[Path]
    from_fetch: dict[str, list[str]]

    @property
    def dir(self) -> Path:
        return ROOT / "examples" / self.name

    @property
    def fetch_stage(self) -> str:
        return self.fetch.__name__.rpartition(".")[2]

    @property
    def stages(self) -> dict:
        return LOAD((self.dir / "dvc.yaml").read_text())["stages"]


EXAMPLES = [
    # sentiment: ppo reads nothing of fetch (its scorer is the reward model); evaluate the MiniLM judge, which
    # rewards/sentiment.py reads
    Example("sentiment", fetch, [fetch.BASE_MODEL, fetch.SFT_TEXTS, fetch.PAIRS, fetch.PROMPTS, fetch.JUDGE],
            {"prepare": [str(fetch.SFT_TEXTS), str(fetch.PAIRS), str(fetch.PROMPTS)], "sft": [str(fetch.BASE_MODEL)],
             "evaluate": [str(fetch.JUDGE)]}),
    # verifiable: its scorer and judges are functions of rewards/ (a code dep), which read nothing fetched
    Example("verifiable", fetch_tasks, [fetch_tasks.BASE_MODEL, fetch_tasks.SFT_ROWS, fetch_tasks.PAIRS,
                                        fetch_tasks.PROMPTS],
            {"prepare": [str(fetch_tasks.SFT_ROWS), str(fetch_tasks.PAIRS), str(fetch_tasks.PROMPTS)],
             "sft": [str(fetch_tasks.BASE_MODEL)]}),
]
SENTIMENT, VERIFIABLE = EXAMPLES
each_example = pytest.mark.parametrize("example", EXAMPLES, ids=lambda e: e.name)


def code_deps(stage: dict) -> list[str]:
    return [d for d in stage["deps"] if not d.startswith("data/")]


def data_deps(stage: dict) -> list[str]:
    return [d for d in stage["deps"] if d.startswith("data/")]


@each_example
def test_the_example_runs_the_root_stages_but_sources_after_its_fetch_stage(example):
    assert list(example.stages) == [example.fetch_stage, *SHARED]
    for name, spec in example.stages.items():
        assert spec["cmd"] == f"python3 -m stages {name}"


@each_example
@pytest.mark.parametrize("name", SHARED)
def test_a_shared_stage_has_the_root_s_code_params_and_outputs(example, name):
    """The same command with the same deps, so `dvc repro` here reruns exactly what it reruns at the root."""
    root, here = ROOT_STAGES[name], example.stages[name]
    assert code_deps(here) == [UP + d for d in code_deps(root)]
    assert here["params"] == root["params"]
    assert here.get("outs", []) == root.get("outs", []) and here.get("metrics", []) == root.get("metrics", [])


@each_example
@pytest.mark.parametrize("name", SHARED)
def test_a_shared_stage_reads_fetch_s_outputs_where_the_root_reads_data_sources(example, name):
    expected = []
    for dep in data_deps(ROOT_STAGES[name]):
        expected += example.from_fetch.get(name, []) if dep.startswith("data/sources/") else [dep]  # one at most
    assert data_deps(example.stages[name]) == expected


@each_example
def test_fetch_writes_what_the_code_names_and_every_data_dep_is_an_earlier_output(example):
    assert outs(example.stages[example.fetch_stage]) == [str(p) for p in example.outs]
    seen: list[str] = []
    for name, spec in example.stages.items():
        for dep in data_deps(spec):
            assert any(dep == o or dep.startswith(o + "/") for o in seen), f"{name} depends on {dep}"
        seen += outs(spec)


def test_the_sentiment_judge_is_read_where_fetch_writes_it():
    from rewards.sentiment import JUDGE_HEAD

    assert JUDGE_HEAD.parent == fetch.JUDGE


@each_example
def test_fetch_code_deps_are_exactly_what_it_executes(example):
    """`python3 -m stages fetch` runs stages/__main__.py, then stages/fetch.py (which imports rewards/sentiment.py for
    the judge; fetch_tasks: rewards/verifiable.py, the checker): those files and their imports, each named once, and
    nothing else."""
    deps = code_deps(example.stages[example.fetch_stage])
    assert all(d.startswith(UP) for d in deps) and len(set(deps)) == len(deps)
    assert {d.removeprefix(UP) for d in deps} == executed_files(["stages.__main__", example.fetch.__name__])


# The mappings whose keys are the user's to choose (or absent: model.lora null, evaluate.judges and scorer.functions {};
# a table's columns name its row shape: text, prompt/completion or messages for sft)
FREE_FORM = {"model.lora", "evaluate.judges", "scorer.functions", "ppo.tracker_kwargs", "ppo.accelerator_kwargs",
             "ppo.project_kwargs", "ppo.push_to_hub_if_best_kwargs",
             *(f"data.{table}.columns" for table in ("sft", "pairs", "prompts"))}


def keys(node: dict, prefix: str = "") -> list[str]:
    """The dotted keys of a params file, in order (the free-form mappings as one key)."""
    out = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        out += keys(value, path + ".") if isinstance(value, dict) and path not in FREE_FORM else [path]
    return out


@each_example
def test_the_example_params_have_the_root_s_keys_and_point_at_fetch_s_outputs(example):
    """The same keys in the same order (a diff of the two files shows values only; a key the root gains the example
    must have too), loaded and checked as the stages load them."""
    assert keys(LOAD((example.dir / "params.yaml").read_text())) == keys(LOAD((ROOT / "params.yaml").read_text()))
    params = load_params(example.dir / "params.yaml")
    assert params.model.name_or_path == str(example.fetch.BASE_MODEL)
    sources = [params.data.sft.source, params.data.pairs.source, params.data.prompts.source]
    assert sources == example.from_fetch["prepare"]
    assert not params.data.is_synthetic


def test_the_sentiment_params_judge_by_vader_and_minilm_in_the_precision_the_hardware_has():
    """auto: bf16 autocast on a CPU with native bf16 (the example's kernels are native), float32 on one without."""
    from stages.shared import auto

    params = load_params(SENTIMENT.dir / "params.yaml")
    assert params.evaluate.judges == {"gold": "rewards.sentiment:vader", "minilm": "rewards.sentiment:minilm"}
    assert params.model.mixed_precision == "auto" and params.numerics.kernels == "native"
    used = auto.mixed_precision("auto", "native", auto.machine())[0]
    assert used == ("bf16" if auto.machine().cpu_bf16 or auto.machine().cuda_bf16 else None)
    assert params.ppo_config.accelerator_kwargs == ({"mixed_precision": used} if used else {})


def test_the_verifiable_params_reward_the_kept_answer_and_report_accuracy():
    """The scorer is the checker on each prompt's kept answer plus the format bonus, combined (each reported apart), a
    group estimator samples several answers per prompt, the prompts go through the chat template,
    evaluate holds out at least 200 problems and reports pass@k, and the policy judged is the last one (keep: best would
    choose it on held-out prompts)."""
    params = load_params(VERIFIABLE.dir / "params.yaml")
    assert params.data.prompts.keep == ["answer"] and params.chat.template
    assert set(params.data.sft.columns) == {"prompt", "completion"}
    assert params.scorer.source == "combined" and params.evaluate.judges == {}
    assert {name: (f["name"], f["weight"]) for name, f in params.scorer.functions.items()} == {
        "correct": ("rewards.verifiable:accuracy", 1.0), "format": ("rewards.verifiable:answer_format", 0.1)}
    assert params.ppo_config.advantage_estimator == "dr_grpo" and params.ppo_config.num_generations >= 2
    assert params.data.n_eval_prompts >= 200 and params.evaluate.n_prompts >= 200
    assert params.data.prompts.n * 0.25 >= params.data.n_eval_prompts  # prepare holds out at most 25%
    assert params.evaluate.samples_per_prompt > 1 and params.evaluate.pass_at_k
    assert params.evaluate.success_threshold == 1.0 and params.watch.keep == "last"


@each_example
def test_the_stages_read_the_dvc_yaml_of_the_directory_they_run_in(example, monkeypatch, tmp_path):
    """Run in an example's directory (as its dvc.yaml runs them), the stages see its pipeline, code deps named from the
    repository as the root's are (what the checkpoint fingerprints hash); anywhere else, the root's."""
    monkeypatch.chdir(example.dir)
    here = stages()
    assert list(here) == [example.fetch_stage, *SHARED]
    assert "stages/ppo/__init__.py" in here["ppo"].code and "ppo_core/trainer.py" in here["ppo"].code
    for name in SHARED:
        assert here[name].code == tuple(code_deps(ROOT_STAGES[name])), name
    assert here["sft"].data == (example.fetch.BASE_MODEL, Path("data/raw/sft.parquet"))
    for cwd, dvc_yaml in ((ROOT, None), (tmp_path, None), (tmp_path / "other", "stages:\n  a:\n    cmd: make a\n")):
        cwd.mkdir(exist_ok=True)
        if dvc_yaml:  # a DVC project that is not this one's: its stages do not run `python3 -m stages`
            (cwd / "dvc.yaml").write_text(dvc_yaml)
        monkeypatch.chdir(cwd)
        assert list(stages()) == list(ROOT_STAGES), cwd


def commands(cwd: Path) -> list[str]:
    """The commands `python3 -m stages --help` lists when run in ``cwd``."""
    result = run_module("--help", cwd=cwd)
    assert result.returncode == 0, result.stderr
    listed = result.stdout.split("Commands:")[1]
    return [line.split()[0] for line in listed.splitlines() if line.startswith("  ") and line.split()]


@each_example
def test_the_cli_lists_the_fetch_stage_in_its_example_only(example):
    assert commands(example.dir) == [example.fetch_stage, *SHARED]
    stage = example.fetch_stage
    help_text = " ".join(run_module(stage, "--help", cwd=example.dir).stdout.split())
    assert f"Reads: params numerics, seed. Writes: {', '.join(outs(example.stages[stage]))}." in help_text
    assert run_module(stage, "--help", cwd=ROOT).returncode == 2  # no such command at the root
    other = next(e for e in EXAMPLES if e is not example)
    assert run_module(stage, "--help", cwd=other.dir).returncode == 2  # nor in the other example


def test_the_cli_at_the_root_lists_the_root_s_stages():
    assert commands(ROOT) == [*ROOT_STAGES, "status"]  # what changed in the sources, which the examples have not


def test_each_example_is_a_dvc_project_of_its_own():
    """The root's DVC (dvc status, repro, exp show) sees the root's stages and params.yaml only: with an example's
    collected too, `dvc exp show` named every param by its file (`params.yaml:ppo.learning_rate`) and `dvc status`
    listed the example's stages as never run. Each example's own project sees its stages."""
    from dvc.repo import Repo

    with Repo(str(ROOT)) as root:
        assert {Path(stage.path) for stage in root.index.stages} == {ROOT / "dvc.yaml"}
        assert {Path(params.fs_path) for params in root.index.params} == {ROOT / "params.yaml"}
    for example in EXAMPLES:
        with Repo(str(example.dir)) as repo:
            assert {Path(stage.path) for stage in repo.index.stages} == {example.dir / "dvc.yaml"}
            assert {stage.name for stage in repo.index.stages} == set(example.stages)

"""examples/sentiment, the real-model example, holds to the root pipeline: the same stages (but `sources`, with `fetch`
first), each with the root's code deps (two directories up), params and outputs, and fetch's outputs where the root
reads data/sources; a params file with the root's keys; and the stages and the CLI, run there, see its pipeline. A
change to the root's dvc.yaml or params.yaml that the example misses fails here, naming the stage or key."""

from __future__ import annotations

from pathlib import Path

import pytest
from ruamel.yaml import YAML

from stages import fetch
from stages.shared.params import load_params
from stages.shared.pipeline import stages
from tests.pipeline.test_dvcyaml import executed_files, outs
from tests.stages.test_cli import run_module

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sentiment"
UP = "../../"  # the example's dvc.yaml names the repository's code from its own directory
LOAD = YAML(typ="safe", pure=True).load
ROOT_STAGES = LOAD((ROOT / "dvc.yaml").read_text())["stages"]
EXAMPLE_STAGES = LOAD((EXAMPLE / "dvc.yaml").read_text())["stages"]
SHARED = [name for name in ROOT_STAGES if name != "sources"]
# What each stage reads from fetch here, in place of the root's data/sources/*.json (ppo: nothing, its scorer is the
# reward model; evaluate: the MiniLM judge, which rewards/sentiment.py reads)
FROM_FETCH = {"prepare": [str(fetch.SFT_TEXTS), str(fetch.PAIRS), str(fetch.PROMPTS)], "sft": [str(fetch.BASE_MODEL)],
              "evaluate": [str(fetch.JUDGE)]}


def code_deps(stage: dict) -> list[str]:
    return [d for d in stage["deps"] if not d.startswith("data/")]


def data_deps(stage: dict) -> list[str]:
    return [d for d in stage["deps"] if d.startswith("data/")]


def test_the_example_runs_the_root_stages_but_sources_after_fetch():
    assert list(EXAMPLE_STAGES) == ["fetch", *SHARED]
    for name, spec in EXAMPLE_STAGES.items():
        assert spec["cmd"] == f"python3 -m stages {name}"


@pytest.mark.parametrize("name", SHARED)
def test_a_shared_stage_has_the_root_s_code_params_and_outputs(name):
    """The same command with the same deps, so `dvc repro` here reruns exactly what it reruns at the root."""
    root, example = ROOT_STAGES[name], EXAMPLE_STAGES[name]
    assert code_deps(example) == [UP + d for d in code_deps(root)]
    assert example["params"] == root["params"]
    assert example.get("outs", []) == root.get("outs", []) and example.get("metrics", []) == root.get("metrics", [])


@pytest.mark.parametrize("name", SHARED)
def test_a_shared_stage_reads_fetch_s_outputs_where_the_root_reads_data_sources(name):
    expected = []
    for dep in data_deps(ROOT_STAGES[name]):
        expected += FROM_FETCH.get(name, []) if dep.startswith("data/sources/") else [dep]  # one at most
    assert data_deps(EXAMPLE_STAGES[name]) == expected


def test_fetch_writes_what_the_code_names_and_every_data_dep_is_an_earlier_output():
    assert outs(EXAMPLE_STAGES["fetch"]) == [str(p) for p in (fetch.BASE_MODEL, fetch.SFT_TEXTS, fetch.PAIRS,
                                                               fetch.PROMPTS, fetch.JUDGE)]
    from rewards.sentiment import JUDGE_HEAD

    assert JUDGE_HEAD.parent == fetch.JUDGE
    seen: list[str] = []
    for name, spec in EXAMPLE_STAGES.items():
        for dep in data_deps(spec):
            assert any(dep == o or dep.startswith(o + "/") for o in seen), f"{name} depends on {dep}"
        seen += outs(spec)


def test_fetch_code_deps_are_exactly_what_it_executes():
    """`python3 -m stages fetch` runs stages/__main__.py, then stages/fetch.py (which imports rewards/sentiment.py for
    the judge): those files and their imports, each named once, and nothing else."""
    deps = code_deps(EXAMPLE_STAGES["fetch"])
    assert all(d.startswith(UP) for d in deps) and len(set(deps)) == len(deps)
    assert {d.removeprefix(UP) for d in deps} == executed_files(["stages.__main__", "stages.fetch"])


# The mappings whose keys are the user's to choose (or absent: model.lora null, evaluate.judges {})
FREE_FORM = {"model.lora", "evaluate.judges", "ppo.tracker_kwargs", "ppo.accelerator_kwargs", "ppo.project_kwargs",
             "ppo.push_to_hub_if_best_kwargs"}


def keys(node: dict, prefix: str = "") -> list[str]:
    """The dotted keys of a params file, in order (the free-form mappings as one key)."""
    out = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        out += keys(value, path + ".") if isinstance(value, dict) and path not in FREE_FORM else [path]
    return out


def test_the_example_params_have_the_root_s_keys_and_point_at_fetch_s_outputs():
    """The same keys in the same order (a diff of the two files shows values only; a key the root gains the example
    must have too), loaded and checked as the stages load them."""
    assert keys(LOAD((EXAMPLE / "params.yaml").read_text())) == keys(LOAD((ROOT / "params.yaml").read_text()))
    params = load_params(EXAMPLE / "params.yaml")
    assert params.model.name_or_path == str(fetch.BASE_MODEL)
    assert [params.data.sft.source, params.data.pairs.source, params.data.prompts.source] == FROM_FETCH["prepare"]
    assert not params.data.is_synthetic
    assert params.evaluate.judges == {"gold": "rewards.sentiment:vader", "minilm": "rewards.sentiment:minilm"}
    assert params.model.mixed_precision == "bf16"
    assert params.ppo_config.accelerator_kwargs == {"mixed_precision": "bf16"}


def test_the_stages_read_the_dvc_yaml_of_the_directory_they_run_in(monkeypatch, tmp_path):
    """Run in examples/sentiment (as its dvc.yaml runs them), the stages see its pipeline, code deps named from the
    repository as the root's are (what the checkpoint fingerprints hash); anywhere else, the root's."""
    monkeypatch.chdir(EXAMPLE)
    here = stages()
    assert list(here) == ["fetch", *SHARED]
    assert "stages/ppo/__init__.py" in here["ppo"].code and "ppo_core/trainer.py" in here["ppo"].code
    for name in SHARED:
        assert here[name].code == tuple(code_deps(ROOT_STAGES[name])), name
    assert here["sft"].data == (fetch.BASE_MODEL, Path("data/raw/sft.parquet"))
    for cwd, dvc_yaml in ((ROOT, None), (tmp_path, None), (tmp_path / "other", "stages:\n  a:\n    cmd: make a\n")):
        cwd.mkdir(exist_ok=True)
        if dvc_yaml:  # a DVC project that is not this one's: its stages do not run `python3 -m stages`
            (cwd / "dvc.yaml").write_text(dvc_yaml)
        monkeypatch.chdir(cwd)
        assert list(stages()) == list(ROOT_STAGES), cwd


def test_the_cli_lists_fetch_in_the_example_only():
    def commands(cwd: Path) -> list[str]:
        result = run_module("--help", cwd=cwd)
        assert result.returncode == 0, result.stderr
        listed = result.stdout.split("Commands:")[1]
        return [line.split()[0] for line in listed.splitlines() if line.startswith("  ") and line.split()]

    assert commands(EXAMPLE) == ["fetch", *SHARED]
    assert commands(ROOT) == [*ROOT_STAGES, "status"]  # what changed in the sources, which the example has not
    help_text = " ".join(run_module("fetch", "--help", cwd=EXAMPLE).stdout.split())
    assert f"Reads: params numerics, seed. Writes: {', '.join(outs(EXAMPLE_STAGES['fetch']))}." in help_text
    assert run_module("fetch", "--help", cwd=ROOT).returncode == 2  # no such command at the root


def test_the_example_is_a_dvc_project_of_its_own():
    """The root's DVC (dvc status, repro, exp show) sees the root's stages and params.yaml only: with the example's
    collected too, `dvc exp show` named every param by its file (`params.yaml:ppo.learning_rate`) and `dvc status`
    listed the example's stages as never run. The example's own project sees its stages."""
    from dvc.repo import Repo

    with Repo(str(ROOT)) as root, Repo(str(EXAMPLE)) as example:
        assert {Path(stage.path) for stage in root.index.stages} == {ROOT / "dvc.yaml"}
        assert {Path(params.fs_path) for params in root.index.params} == {ROOT / "params.yaml"}
        assert {Path(stage.path) for stage in example.index.stages} == {EXAMPLE / "dvc.yaml"}
        assert {stage.name for stage in example.index.stages} == set(EXAMPLE_STAGES)

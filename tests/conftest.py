"""Fixtures of the stage tests: tiny params, and one tiny pipeline run shared by the tests that read its outputs; and
the CPU-only rule: a test named ``*_on_cpu`` runs with no GPU visible."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

import stages  # noqa: F401 - first, before torch: the stages' environment (offline, OpenMP) for the tests too

os.environ["HF_HUB_OFFLINE"] = "1"  # never download, whatever the caller's environment says
os.environ.setdefault("TQDM_DISABLE", "1")  # quiet progress bars (tqdm reads TQDM_* as defaults)

ROOT = Path(__file__).resolve().parents[1]
TINY_PARAMS = ROOT / "tests" / "fixtures" / "params.tiny.yaml"


@contextlib.contextmanager
def cpu_only():
    """No GPU for the block, in this process and in the ones it starts. Bit-for-bit claims (the first PPO ratio exactly
    1, a resumed run equal to an uninterrupted one, two runs byte-identical) hold on CPUs: on a GPU cuBLAS picks its
    kernels by shape and CUDA's atomics add in no fixed order, so runs agree within float tolerances instead
    (docs/reproducibility.md, "Same inputs, same bytes"). Tests of such claims are named ``*_on_cpu`` and run here, as
    do the runs they compare against."""
    import torch

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CUDA_VISIBLE_DEVICES", "")  # the processes a test starts
        patch.setattr(torch.cuda, "is_available", lambda: False)  # this one (the stages and accelerate ask it)
        _forget_accelerate_device()  # accelerate chose its device when its state was made: choose again, and after
        try:
            yield
        finally:
            _forget_accelerate_device()


def _forget_accelerate_device() -> None:
    """Drop accelerate's process-wide state (its device included) in a process that runs alone."""
    from accelerate.state import AcceleratorState, PartialState

    if PartialState._shared_state and PartialState().num_processes == 1:
        AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(autouse=True)
def _cpu_only_by_name(request):
    """The tests named ``*_on_cpu`` run within :func:`cpu_only`."""
    with cpu_only() if request.node.originalname.endswith("_on_cpu") else contextlib.nullcontext():
        yield


@pytest.fixture
def fake_wandb(monkeypatch):
    """``import wandb`` gives a stand-in whose ``Table`` keeps its columns and rows (wandb is not installed here)."""
    import sys
    import types

    class Table:
        def __init__(self, columns, rows):
            self.columns, self.rows = columns, rows

    module = types.SimpleNamespace(Table=Table)
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


@pytest.fixture(scope="session")
def tiny_params():
    from stages.shared.params import load_params

    return load_params(TINY_PARAMS)


@pytest.fixture(scope="session")
def tiny_run(tiny_params, tmp_path_factory) -> Path:
    """A project root where every stage has run once, in order, on the tiny params.

    Each stage sees only the params sections dvc.yaml says it tracks; reading any other fails the run, so a stage
    cannot come to depend on a section without dvc.yaml rerunning it when that section changes.
    """
    import importlib

    root = tmp_path_factory.mktemp("tiny_run")
    with cpu_only():  # the run the byte-identity tests (``*_on_cpu``) compare theirs with
        for name, params in params_per_stage(tiny_params).items():
            importlib.import_module(f"stages.{name}").run(params, root)
    return root


def write_params(root: Path, changes: dict[str, object]) -> Path:
    """The tiny params with dotted keys set ({"ppo.steps": 48}; a key not in the file is added, e.g. to test an
    unknown key), written as root/params.yaml in ruamel's round-trip mode (comments and order kept)."""
    from ruamel.yaml import YAML

    yaml = YAML()
    data = yaml.load(TINY_PARAMS.read_text())
    for key, value in changes.items():
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[leaf] = value
    path = root / "params.yaml"
    with path.open("w") as fh:
        yaml.dump(data, fh)
    return path


def params_per_stage(params) -> dict:
    """{stage: params with every section the stage does not track in dvc.yaml replaced by an Untracked}."""
    import dataclasses

    from ruamel.yaml import YAML

    from stages.shared.params import SECTIONS

    declared = YAML(typ="safe", pure=True).load((ROOT / "dvc.yaml").read_text())["stages"]
    out = {}
    for name, stage in declared.items():
        tracked = {key.split(".")[0] for key in stage["params"]}
        out[name] = dataclasses.replace(params, **{s: Untracked(s, name) for s in SECTIONS if s not in tracked})
    return out


class Untracked:
    """Stands in for a params section a stage does not track: any use of it fails, naming both."""

    def __init__(self, section: str, stage: str):
        self.message = f"stage '{stage}' reads params section '{section}', which dvc.yaml does not track for it"

    def __getattr__(self, attr):
        if attr == "message":
            raise AttributeError(attr)
        raise AssertionError(self.message)

    def __iter__(self):
        raise AssertionError(self.message)

    def __getitem__(self, key):
        raise AssertionError(self.message)

"""Fixtures of the stage tests: tiny params, and one tiny pipeline run shared by the tests that read its outputs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"  # never download, whatever the caller's environment says
os.environ.setdefault("TQDM_DISABLE", "1")  # quiet progress bars (tqdm reads TQDM_* as defaults)

ROOT = Path(__file__).resolve().parents[1]
TINY_PARAMS = ROOT / "tests" / "fixtures" / "params.tiny.yaml"


@pytest.fixture(scope="session")
def tiny_params():
    from stages.params import load_params

    return load_params(TINY_PARAMS)


@pytest.fixture(scope="session")
def tiny_run(tiny_params, tmp_path_factory) -> Path:
    """A project root where every stage has run once, in order, on the tiny params."""
    from stages import evaluate, ppo, prepare, reward, sft, tokenize

    root = tmp_path_factory.mktemp("tiny_run")
    for stage in (prepare, sft, reward, tokenize, ppo, evaluate):
        stage.run(tiny_params, root)
    return root

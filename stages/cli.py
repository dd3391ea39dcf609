"""The `rlhf` command (also `python -m stages`): one subcommand per pipeline stage.

Each subcommand reads a params file, runs its stage from the current directory (the project root) and prints
one summary line. Bad input (params, data, a missing upstream artifact) prints one `error:` line and exits
with status 2; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path
from typing import Annotated

import typer

from stages.common import StageError
from stages.params import load_params

app = typer.Typer(
    help="RLHF pipeline stages: prepare -> sft -> reward -> tokenize -> ppo -> evaluate. "
    "`dvc repro` runs them in order; each one can also run alone.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
ParamsPath = Annotated[Path, typer.Option("--params", help="Params file (YAML 1.2), one section per stage.")]
Debug = Annotated[bool, typer.Option("--debug", help="On error, show the traceback instead of one line.")]
DEFAULT_PARAMS = Path("params.yaml")


def _run(stage: str, params_path: Path, debug: bool) -> None:
    start = time.perf_counter()
    try:
        summary = importlib.import_module(f"stages.{stage}").run(load_params(params_path))
    except StageError as err:
        if debug:
            raise
        typer.echo(f"error: {stage}: {err}{restore_hint()}", err=True)
        raise typer.Exit(2) from None
    if os.environ.get("RANK", "0") == "0":  # under `accelerate launch`, the main process reports
        typer.echo(f"{stage}: {summary} [{time.perf_counter() - start:.1f} s]")


def restore_hint() -> str:
    """Under `dvc repro` (which sets DVC_STAGE): DVC deleted the stage's outputs before running it, and says so."""
    stage = os.environ.get("DVC_STAGE")
    if not stage:
        return ""
    return f" (dvc removed this stage's outputs before running it: `dvc checkout {stage}` restores the last ones)"


@app.command()
def prepare(params: ParamsPath = DEFAULT_PARAMS, debug: Debug = False) -> None:
    """Build the raw datasets: SFT texts, preference pairs, PPO prompts (train and held-out eval).

    Reads: params sections seed, data; the files or Hugging Face datasets named in data (none by default).

    Writes: data/raw/sft.parquet, pairs.parquet, prompts_train.parquet, prompts_eval.parquet.
    """
    _run("prepare", params, debug)


@app.command()
def sft(params: ParamsPath = DEFAULT_PARAMS, debug: Debug = False) -> None:
    """Supervised fine-tuning of the policy on the SFT texts (causal LM loss, transformers.Trainer).

    Reads: params sections seed, model, sft; data/raw/sft.parquet.

    Writes: data/models/sft (model and tokenizer), data/sft/metrics.json.
    """
    _run("sft", params, debug)


@app.command()
def reward(params: ParamsPath = DEFAULT_PARAMS, debug: Debug = False) -> None:
    """Train the reward model (SFT model plus a scalar head) on the pairs with the Bradley-Terry loss.

    Reads: params sections seed, reward; data/raw/pairs.parquet, data/models/sft.

    Writes: data/models/reward, data/reward/metrics.json (held-out pairwise accuracy).
    """
    _run("reward", params, debug)


@app.command()
def tokenize(params: ParamsPath = DEFAULT_PARAMS, debug: Debug = False) -> None:
    """Tokenize the PPO prompts with the policy's tokenizer (truncate, drop too short ones).

    Reads: params sections seed, tokenize; data/raw/prompts_train.parquet, prompts_eval.parquet, data/models/sft.

    Writes: data/tokenized/train.parquet, eval.parquet (columns query, input_ids).
    """
    _run("tokenize", params, debug)


@app.command()
def ppo(params: ParamsPath = DEFAULT_PARAMS, debug: Debug = False) -> None:
    """PPO on the train prompts with ppo_core: generate, score, step(), as in the seed loop.

    Reads: params sections seed, data, scorer, generation, ppo; data/tokenized/train.parquet, data/models/sft,
    data/models/reward (when scorer.source is reward_model).

    Writes: data/models/ppo, data/ppo/rollouts/step-*.parquet, data/ppo/stats.parquet, data/ppo/curves.csv,
    data/ppo/timings.csv, data/ppo/metrics.json.
    """
    _run("ppo", params, debug)


@app.command()
def evaluate(params: ParamsPath = DEFAULT_PARAMS, debug: Debug = False) -> None:
    """Compare the SFT and PPO policies on the held-out prompts: reward, gold score, win rate, KL, length.

    Reads: params sections seed, data, generation, evaluate; data/tokenized/eval.parquet, data/models/sft,
    data/models/ppo, data/models/reward.

    Writes: data/eval/samples.parquet, data/eval/metrics.json.
    """
    _run("evaluate", params, debug)

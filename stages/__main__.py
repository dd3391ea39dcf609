"""`python3 -m stages <stage>`: the form dvc.yaml uses, so queued experiments run their own copy of the code.

Which `python3` runs it depends on the user's PATH (DVC hands the command to a shell), so this module first makes
sure it runs in the project's environment: with a virtual environment `.venv` in the project directory or above it
(the one `make` builds; a queued experiment's copy lies under the project's `.dvc/tmp/exps/`), it re-runs itself
with that environment's Python; without one, the Python it was given must have the project's packages, or it stops
with a one-line hint. Then, before torch loads, it sets the float kernels that params.yaml's `numerics` asks for
(stages/shared/numerics.py). Kept to the standard library until then: it runs before any dependency is known to be
importable. The `rlhf` command is this `main` too.
"""

import importlib.util
import os
import sys
from pathlib import Path

REEXEC = "RLHF_STAGES_PYTHON"  # set to the Python this module re-ran itself with
REQUIRED = ("typer", "torch", "transformers", "accelerate", "pyarrow", "ruamel")


def project_venv(start: Path):
    """The nearest `.venv` at or above `start` that holds a Python, or None."""
    for folder in (start, *start.parents):
        python = folder / ".venv" / "bin" / "python"
        if python.exists():
            return folder / ".venv"
    return None


def main() -> None:
    venv = project_venv(Path(__file__).resolve().parents[1])
    if venv is not None and Path(sys.prefix).resolve() != venv.resolve() and not os.environ.get(REEXEC):
        python = str(venv / "bin" / "python")
        os.environ[REEXEC] = python  # once: a Python that does not report the venv as its prefix must not loop
        os.execv(python, [python, "-m", "stages", *sys.argv[1:]])
    missing = [name for name in REQUIRED if importlib.util.find_spec(name) is None]
    if missing:
        print(f"error: {sys.executable} lacks the project's packages ({', '.join(missing)}); run `make install` (or "
              "`pip install -e .`) and activate that environment (`source .venv/bin/activate`)", file=sys.stderr)
        raise SystemExit(2)
    from stages.shared import numerics

    numerics.configure_from(numerics.params_path(sys.argv[1:]))
    from stages.shared.cli import INTERRUPTED, app

    try:
        app(prog_name="python3 -m stages" if Path(sys.argv[0]).name == "__main__.py" else Path(sys.argv[0]).name)
    except SystemExit as end:
        if end.code != INTERRUPTED:
            raise
        # Leave now with 130. Not through the interpreter's exit: a KeyboardInterrupt (Ctrl-C, or SIGTERM made one)
        # that went through code a C extension ran (PyRun_*) leaves CPython set to kill itself with SIGINT at its
        # exit, whatever the exit code: a job scheduler would read "killed by SIGINT", not 130. The stage cleaned up
        # in its context managers (temporaries, locks) before SystemExit got here.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(INTERRUPTED)


if __name__ == "__main__":
    main()

"""`python -m stages <stage>`: the form dvc.yaml uses, so queued experiments run their own copy of the code."""

from stages.cli import app

app(prog_name="python -m stages")

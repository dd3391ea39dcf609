"""The pipeline's stages: prepare -> sft -> reward -> tokenize -> ppo -> evaluate (see dvc.yaml and stages/cli.py)."""

import os

# Nothing is downloaded from the Hugging Face hub unless the user asks (HF_HUB_OFFLINE=0); set before any
# hub client is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# CPU threads that sleep rather than spin while they wait. Measured on the default SFT step (2 cores, 2 threads):
# about 10% slower than spinning on an idle machine, 5-8x faster when another busy process shares the cores
# (spinning threads wait on descheduled peers). Read when torch loads OpenMP, so set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

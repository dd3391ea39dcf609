"""The pipeline's stages: prepare -> sft -> reward -> tokenize -> ppo -> evaluate (see dvc.yaml and stages/cli.py)."""

import os

# Nothing is downloaded from the Hugging Face hub unless the user asks (HF_HUB_OFFLINE=0); set before any
# hub client is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

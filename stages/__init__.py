"""The pipeline's stages, one module (or package) per stage of dvc.yaml: sources -> prepare -> sft -> reward ->
tokenize -> ppo -> evaluate -> report, and the example's fetch; what they share is in ``stages.shared``."""

import os
import sys

# Nothing is downloaded from the Hugging Face hub unless the user asks (HF_HUB_OFFLINE=0); set before any
# hub client is imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# CPU threads that sleep rather than spin while they wait. Measured on the default SFT step (2 cores, 2 threads):
# about 10% slower than spinning on an idle machine, 5-8x faster when another busy process shares the cores
# (spinning threads wait on descheduled peers). Read when torch loads OpenMP, so set before torch is imported.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# A quiet terminal: transformers' warnings at its own level are mostly about choices the stages make on purpose
# (a new reward head "MISSING" from the SFT checkpoint, a default loss type), and its loading/saving progress bars
# are walls of text in a log; the stages say what they do themselves. Set TRANSFORMERS_VERBOSITY=warning to see them.
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
if not sys.stderr.isatty():
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
# DeepSpeed, when installed, warns at every import on a machine without an accelerator that it falls back to the
# CPU. Where no GPU device exists that is the only choice: say it, so its warnings mean something again.
if not any(os.path.exists(device) for device in ("/dev/nvidiactl", "/dev/kfd")):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

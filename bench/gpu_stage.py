"""One run of the ppo stage for bench/gpu_check.sh: a variant of the params, timed, measured, written as one JSON line.

    python bench/gpu_stage.py --root PROJECT --name bf16 --params P.yaml \
        --set 'ppo.accelerator_kwargs={mixed_precision: bf16}' --json OUT
    accelerate launch --config_file configs/zero2.yaml --num_processes 1 bench/gpu_stage.py --root ...  # DeepSpeed

PROJECT holds the outputs of the stages before ppo (the tiny pipeline of gpu_check.sh). The JSON line: the variant,
pass (the stage finished and every statistic is finite) or the error, seconds per step (the stage's whole loop:
generate, score, step, checkpoint), response tokens generated per second, peak GPU memory (MiB, torch's allocator),
MFU of the PPO update (model FLOPs of the epochs' forward and backward passes over the optimize time, against the
GPU's dense peak for the compute dtype; None where the GPU is not in PEAK_TFLOPS), and the first step's KL (0 where
the policy's and the reference's log-probs come out of the same kernels, how far rounding takes them otherwise; NaN
where the KL's coefficient is 0 and the reference pass is skipped) and approximate KL (the policy's own movement over
that step's epochs, averaged over its mini-batches).

A variant with ``model.lora`` first reruns the reward stage with it (untimed), as `dvc repro` would: ``model`` is one
of that stage's params, and a LoRA policy scores with the reward stage's adapter on its own base weights.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from ruamel.yaml import YAML

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import PEAK_TFLOPS, peak_flops  # noqa: F401  (bench/ is this script's folder: on sys.path)


def params_with(path: Path, changes: list[str], out: Path) -> Path:
    """The params file ``path`` with ``key.sub=YAML value`` changes, written to ``out``."""
    yaml = YAML()
    data = yaml.load(path.read_text())
    for change in changes:
        key, value = change.split("=", 1)
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[leaf] = YAML(typ="safe", pure=True).load(value)
    with out.open("w") as fh:
        yaml.dump(data, fh)
    return out


def measure(root: Path, params, seconds: float) -> dict:
    """Per-step numbers of a finished run in ``root`` (its stats and timings)."""
    from ppo_core.runtime.utils import tf32_supported
    from stages.shared.artifacts import PPO_STATS, PPO_TIMINGS, SFT_MODEL

    stats, timings = pd.read_parquet(root / PPO_STATS), pd.read_csv(root / PPO_TIMINGS)
    world = max(1, int(torch.distributed.get_world_size()) if torch.distributed.is_initialized() else 1)
    batch = params.ppo["batch_size"] * world
    response_tokens = float((stats["tokens/responses_len_mean"] * batch).sum())
    update_tokens = (stats["ppo/epochs"] * batch * (stats["tokens/queries_len_mean"]
                                                    + stats["tokens/responses_len_mean"])).median()
    from safetensors import safe_open

    with safe_open(str(root / SFT_MODEL / "model.safetensors"), framework="pt") as fh:
        n_params = sum(math.prod(fh.get_slice(k).get_shape()) for k in fh.keys())
    flops_per_token = (4 if params.model.lora else 6) * n_params  # forward 2N, backward 4N (2N: no weight grads)
    mixed = (params.ppo.get("accelerator_kwargs") or {}).get("mixed_precision") or _launch_precision()
    dtype = mixed if mixed in ("bf16", "fp16") else ("tf32" if tf32_supported("cuda") and params.ppo["tf32"]
                                                     else "fp32")
    peak = peak_flops(dtype)
    optimize_s = float(timings["time/ppo/optimize_step"].median())
    finite = all_finite(stats)
    return {"pass": bool(finite), "error": None if finite else "non-finite statistics", "dtype": dtype,
            "s_per_step": seconds / len(stats), "tokens_per_s": response_tokens / seconds,
            "peak_gpu_mib": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
            "mfu_update": (flops_per_token * update_tokens / optimize_s / peak) if peak else None,
            "first_kl": float(stats["objective/kl"].iloc[0]),
            "first_approxkl": float(stats["ppo/policy/approxkl"].iloc[0])}


def all_finite(stats: pd.DataFrame) -> bool:
    """Every statistic of every step finite, but for the reference's (``REFERENCE_STATS``) where they are NaN in every
    step: a run whose KL has coefficient 0 skips the reference pass and leaves them unmeasured (dapo, gspo, cispo)."""
    from ppo_core.step.stats import REFERENCE_STATS

    def finite(column: str) -> bool:
        return all(np.isfinite(np.asarray(v, dtype=float)).all() for v in stats[column])

    def unmeasured(column: str) -> bool:
        return column in REFERENCE_STATS and all(np.isnan(np.asarray(v, dtype=float)).all() for v in stats[column])

    return all(finite(column) or unmeasured(column) for column in stats.columns)


def _launch_precision() -> str | None:
    """The mixed precision accelerate launch set (the config file's, or --mixed_precision)."""
    import os

    return os.environ.get("ACCELERATE_MIXED_PRECISION")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, required=True, help="project with the stages before ppo done")
    parser.add_argument("--name", required=True, help="the variant's name in the table")
    parser.add_argument("--params", type=Path, required=True, help="params file the variant starts from")
    parser.add_argument("--set", action="append", default=[], help="key.sub=YAML value, e.g. model.lora={r: 8, ...}")
    parser.add_argument("--json", type=Path, required=True, help="file the JSON line is appended to")
    args = parser.parse_args()

    import stages  # noqa: F401 - the stages' environment first
    from stages import ppo
    from stages.shared.params import load_params
    from stages.shared.runtime import process_state

    state = process_state()
    path = params_with(args.params, args.set, args.root / f"params.{args.name}.yaml")
    result = {"variant": args.name, "pass": False}
    try:
        params = load_params(path)
        if params.model.lora:
            from stages import reward

            print(reward.run(params, args.root), file=sys.stderr)
        start = time.perf_counter()
        ppo.run(params, args.root)
        result |= measure(args.root, params, time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - a failing variant is a row of the table, not the end of the check
        result["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    if state.is_main_process:
        with args.json.open("a") as fh:
            fh.write(json.dumps(result) + "\n")
        print(json.dumps(result))
    sys.exit(0 if result["pass"] else 1)


if __name__ == "__main__":
    main()

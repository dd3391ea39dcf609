#!/usr/bin/env bash
# The GPU check of issue #5, for a machine with a CUDA GPU (run from the repository root, venv active or not):
#   1. the whole tiny pipeline (tests/fixtures/params.tiny.yaml) on the GPU, stage by stage, timed;
#   2. the PPO benchmark (bench/ppo_step.py, ppo_core) on the 32k and base shapes in fp32 and bf16, plus LoRA;
# and prints one markdown table to paste into bench/README.md (also written to $OUT/gpu_check.md when OUT is set).
# Exits 1 without a GPU; DRY_RUN=1 runs it on the CPU with one tiny-shape benchmark step (checks the script).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || command -v python )}
export HF_HUB_OFFLINE=1 DVC_NO_ANALYTICS=1 TQDM_DISABLE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${DRY_RUN:-}" ]; then
  "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: no CUDA GPU visible')"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
out=${OUT:-$work}

device=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU")')
echo "## pipeline (tiny params) on $device" | tee "$out/gpu_check.md"
echo "| stage | seconds | summary |" | tee -a "$out/gpu_check.md"
echo "|---|---|---|" | tee -a "$out/gpu_check.md"
mkdir -p "$work/project"
for stage in prepare sft reward tokenize ppo evaluate; do
  start=$(date +%s%N)
  line=$(cd "$work/project" && "$PY" -m stages "$stage" --params "$OLDPWD/tests/fixtures/params.tiny.yaml" | tail -1)
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  echo "| $stage | $((ms / 1000)).$(( ms % 1000 / 100 )) | ${line#*: } |" | tee -a "$out/gpu_check.md"
done

echo | tee -a "$out/gpu_check.md"
echo "## PPO benchmark (ppo_core, batch 64, mini-batch 16, 4 epochs, 24 new tokens)" | tee -a "$out/gpu_check.md"
runs=("32k" "32k --bf16" "base" "base --bf16" "base --bf16 --lora")
steps=(--steps 5 --warmup 2)
if [ -n "${DRY_RUN:-}" ]; then runs=("tiny" "tiny --lora"); steps=(--steps 1 --warmup 0); fi
for i in "${!runs[@]}"; do
  # shellcheck disable=SC2086
  "$PY" bench/ppo_step.py --impl ppo_core --shape ${runs[$i]} "${steps[@]}" --json "$work/run$i.json" >&2
done
"$PY" - "$work" "${#runs[@]}" <<'PYEOF' | tee -a "$out/gpu_check.md"
import json, sys
work, n = sys.argv[1], int(sys.argv[2])
print("| shape | dtype | LoRA | median s/step | generate s/step | gen tokens/s | peak GPU MiB |")
print("|---|---|---|---|---|---|---|")
for i in range(n):
    r = json.load(open(f"{work}/run{i}.json"))
    print(f"| {r['shape']} | {r['dtype']} | {'yes' if r.get('lora') else 'no'} | {r['median_s_per_step']:.3f} | "
          f"{r['median_gen_s']:.3f} | {r['gen_tokens_per_s']:.0f} | {r['peak_gpu_mb'] or 0:.0f} |")
PYEOF

#!/usr/bin/env bash
# The GPU check, for a machine with a CUDA GPU (run from the repository root, venv active or not):
#   1. the whole tiny pipeline (tests/fixtures/params.tiny.yaml) on the GPU, stage by stage, timed;
#   2. the ppo stage on that pipeline's outputs in every precision and engine a GPU run can take: float32 (TF32 where
#      the GPU has it), bf16, fp16, LoRA + bf16, DeepSpeed ZeRO-2 and ZeRO-3 (bf16) on one GPU, and the critic-free
#      losses whose math differs from PPO's (grpo, dapo, gspo; cispo in bf16), G=4; one table: pass or
#      the error, s/step, tokens/s, peak GPU memory, MFU of the update, and the first step's KL and approximate KL
#      (0 on a CPU; on a GPU, how far rounding takes them from 0);
#   3. the PPO benchmark (bench/ppo_step.py, ppo_core) on the 32k and base shapes in fp32 and bf16, plus LoRA;
# and prints markdown tables to paste into bench/README.md (also written to $OUT/gpu_check.md when OUT is set).
# Exits 1 without a GPU, or when a stage variant fails (after printing every table). DRY_RUN=1 runs it on the CPU:
# the tiny pipeline, the variants a CPU can run (float32, bf16, LoRA + bf16, ZeRO-2 and ZeRO-3 in float32 over gloo;
# fp16 needs a GPU's GradScaler and is listed as skipped) and one tiny-shape benchmark step (checks the script).
# STEPS (default 16) sets the ppo steps of each variant; VARIANTS (names, space-separated) runs only those variants;
# BENCH=0 skips the benchmark (3.): a rerun of what failed.
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
params="$PWD/tests/fixtures/params.tiny.yaml"

device=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU")')
echo "## pipeline (tiny params) on $device" | tee "$out/gpu_check.md"
echo "| stage | seconds | summary |" | tee -a "$out/gpu_check.md"
echo "|---|---|---|" | tee -a "$out/gpu_check.md"
mkdir -p "$work/project"
for stage in prepare sft reward tokenize ppo evaluate; do
  start=$(date +%s%N)
  line=$(cd "$work/project" && "$PY" -m stages "$stage" --params "$params" | tail -1)
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  echo "| $stage | $((ms / 1000)).$(( ms % 1000 / 100 )) | ${line#*: } |" | tee -a "$out/gpu_check.md"
done

# 2. the ppo stage, one variant per row: name | launcher (plain, or an accelerate config) | params changes
steps=$(( ${STEPS:-16} * 8 ))  # ppo.steps counts samples; the tiny params' batch is 8
lora='model.lora={r: 8, alpha: 16, dropout: 0.0, target_modules: [c_attn]}'
bf16='ppo.accelerator_kwargs={mixed_precision: bf16}'
variants=(
  "fp32|plain|"
  "bf16|plain|$bf16"
  "fp16|plain|ppo.accelerator_kwargs={mixed_precision: fp16}"
  "lora+bf16|plain|$lora;$bf16"
  "zero2|zero2|"
  "zero3|zero3|"
  "grpo|plain|ppo.advantage_estimator=grpo;ppo.num_generations=4"
  "dapo|plain|ppo.advantage_estimator=dapo;ppo.num_generations=4"
  "gspo|plain|ppo.advantage_estimator=gspo;ppo.num_generations=4"
  "cispo+bf16|plain|ppo.advantage_estimator=cispo;ppo.num_generations=4;$bf16"
)
ds_precision=bf16
if [ -n "${DRY_RUN:-}" ]; then ds_precision=no; fi  # DeepSpeed's CPU accelerator: float32 over gloo
: > "$work/variants.jsonl"
for entry in "${variants[@]}"; do
  IFS='|' read -r name launcher changes <<< "$entry"
  if [ -n "${VARIANTS:-}" ] && [[ " $VARIANTS " != *" $name "* ]]; then continue; fi
  if [ -n "${DRY_RUN:-}" ] && [ "$name" = fp16 ]; then
    echo "{\"variant\": \"fp16\", \"pass\": null, \"error\": \"skipped: needs a GPU (accelerate gives a CPU no GradScaler)\"}" \
      >> "$work/variants.jsonl"
    continue
  fi
  run="$work/variant-$name"
  cp -r "$work/project" "$run"
  rm -rf "$run/data/checkpoints" "$run/data/ppo" "$run/data/models/ppo"
  args=(bench/gpu_stage.py --root "$run" --name "$name" --params "$params" --json "$work/variants.jsonl"
        --set "ppo.steps=$steps")
  IFS=';' read -r -a sets <<< "$changes"
  for change in "${sets[@]}"; do [ -n "$change" ] && args+=(--set "$change"); done
  if [ "$launcher" = plain ]; then
    "$PY" "${args[@]}" >&2 || true
  else  # DeepSpeed on one GPU (DS_ACCELERATOR=cpu and gloo on a CPU)
    env ${DRY_RUN:+DS_ACCELERATOR=cpu} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} "$PY" -m accelerate.commands.launch \
      --config_file "configs/$launcher.yaml" --num_processes 1 --mixed_precision "$ds_precision" \
      --main_process_port "$(( 29500 + RANDOM % 1000 ))" "${args[@]}" >&2 || true
  fi
done
echo | tee -a "$out/gpu_check.md"
echo "## ppo stage on one $device ($(( steps / 8 )) steps of 8 samples, tiny params)" | tee -a "$out/gpu_check.md"
set +e
"$PY" - "$work/variants.jsonl" <<'PYEOF' | tee -a "$out/gpu_check.md"
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
fmt = lambda v, f: "-" if v is None else format(v, f)
print("| variant | result | s/step | tokens/s | peak GPU MiB | MFU (update) | step-1 KL | step-1 approxKL |")
print("|---|---|---|---|---|---|---|---|")
for r in rows:
    result = "pass" if r["pass"] else ("skipped" if r["pass"] is None else f"FAIL: {r.get('error')}")
    print(f"| {r['variant']} ({r.get('dtype', '-')}) | {result} | {fmt(r.get('s_per_step'), '.3f')} | "
          f"{fmt(r.get('tokens_per_s'), '.0f')} | {fmt(r.get('peak_gpu_mib'), '.0f')} | "
          f"{fmt(r.get('mfu_update'), '.2%')} | {fmt(r.get('first_kl'), '.2e')} | {fmt(r.get('first_approxkl'), '.2e')} |")
sys.exit(1 if any(r["pass"] is False for r in rows) else 0)
PYEOF
variants_ok=${PIPESTATUS[0]}
set -e

if [ "${BENCH:-1}" = 0 ]; then exit "$variants_ok"; fi
echo | tee -a "$out/gpu_check.md"
echo "## PPO benchmark (ppo_core, batch 64, mini-batch 16, 4 epochs, 24 new tokens)" | tee -a "$out/gpu_check.md"
runs=("32k" "32k --bf16" "base" "base --bf16" "base --bf16 --lora")
bench_steps=(--steps 5 --warmup 2)
if [ -n "${DRY_RUN:-}" ]; then runs=("tiny" "tiny --lora"); bench_steps=(--steps 1 --warmup 0); fi
for i in "${!runs[@]}"; do
  # shellcheck disable=SC2086
  "$PY" bench/ppo_step.py --impl ppo_core --shape ${runs[$i]} "${bench_steps[@]}" --json "$work/run$i.json" >&2
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
exit "$variants_ok"

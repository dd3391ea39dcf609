#!/usr/bin/env bash
# Issue 37's GPU run, one shot: real models' shapes (bench/configs/, random weights) on the realistic work (64 prompts
# of 112-144 tokens, 256 new tokens, mini-batches of 16, 4 PPO epochs, bf16 autocast), against TRL.
#   1. the main shape (Qwen2.5-0.5B's, 151,936-token vocabulary), interleaved rounds (bench/compare.py --bf16): ppo_core's
#      PPO step (GAE, value head) under autocast with its defaults (on a CUDA GPU with bf16, rollout_dtype "auto" is a
#      bf16 rollout copy sampled with the compiled static cache, its samples corrected by truncated importance weights),
#      the same step with bf16 weights trained through float32 masters (weights_dtype "bfloat16": no autocast casts,
#      the policy samples itself with the static cache; the issue "The GPU step near the hardware's limit"'s first
#      lever), its GRPO round (G=4) both ways, beside TRL 0.11.4's PPOTrainer and TRL 1.16's GRPOTrainer; seconds by
#      phase (generate, log-prob passes, update), tokens/s per GPU (all tokens of the step over its wall time,
#      NeMo-RL's), the update's MFU (counted FLOPs, bench/common.update_flops), each step's peak memory;
#   2. one PPO step with bf16 weights under torch.profiler at that shape (bench/profile_step.py): where the update's
#      time goes with the lever (the defaults' profile of 2026-11-28 is in bench/README.md);
#   3. the rollout engines at that shape (bench/rollout.py: HF generate under autocast, then on a bf16 copy: generate,
#      static cache, static cache compiled by transformers);
#   4. while BUDGET seconds last: SmolLM2-360M's shape against both TRLs, then Qwen2.5-1.5B's (ppo_core alone, its
#      defaults beside sampling from the policy: rollout_dtype None, TRL 0.11's sampling and the default before).
# (Each decoder layer compiled, measured on 2026-11-27, made the update slower: bench/README.md; no longer run here.)
# The peers come from carried wheels (bench/peers.sh download, then `carry: [.whl]`), each in its own --target
# directory under this machine's torch; without .whl the TRL rows are skipped with a note.
# Everything lands in $OUT (or bench/results/gpu_real): gpu_real.md (the tables), gpu_real.log, json.tar.gz.
# DRY_RUN=1 runs it on a CPU at test size (tests/bench/test_gpu_real.py); without DRY_RUN it wants a CUDA GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || command -v python3 )}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 TQDM_DISABLE=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
BUDGET=${BUDGET:-480}  # seconds: a section after the first starts only while its estimate fits in what is left
out=${OUT:-$PWD/bench/results/gpu_real}
mkdir -p "$out"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
md="$out/gpu_real.md" log="$out/gpu_real.log"
: > "$md"; : > "$log"
if [ -n "${DRY_RUN:-}" ]; then
  main=tiny_qwen2 others=(tiny_qwen2) big=tiny_qwen2 rounds=(--steps 1 --warmup 1) threads=2 estimate=0
else
  "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'gpu_real: no CUDA GPU visible')" || exit 1
  main=qwen2.5_0.5b others=(smollm2_360m) big=qwen2.5_1.5b rounds=(--steps 2 --warmup 1) threads=8 estimate=1
fi
say() { echo "$@" | tee -a "$log"; }
fits() { [ "$estimate" = 0 ] || [ $(( SECONDS + $1 )) -le "$BUDGET" ]; }  # $1: the section's estimated seconds
section() {  # a title, then the command; its output to the log, its table (OUT.md) to gpu_real.md
  local title=$1 stem=$2; shift 2
  say "== $title (at ${SECONDS} s)"
  "$@" --out "$work/$stem" >> "$log" 2>&1 || say "   (exit $?: see gpu_real.log)"
  { echo "## $title"; echo; cat "$work/$stem.md" 2>/dev/null || echo "(no table: see gpu_real.log)"; echo; } >> "$md"
}

say "== machine"
{ nvidia-smi -L 2>/dev/null; "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'GPU', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)"; } 2>&1 | tee -a "$log"
if ls "${WHL:-.whl}"/trl011/*.whl > /dev/null 2>&1; then
  PYTHON="$PY" bench/peers.sh install "$work/peers" >> "$log" 2>&1 \
    && export TRL_SITE="$work/peers/trl011" TRL_GRPO_SITE="$work/peers/trl116" \
    || say "   peers' install failed: TRL rows skipped (see gpu_real.log)"
else
  say "   no wheels in ${WHL:-.whl}/ (bench/peers.sh download): TRL rows skipped"
fi
cmp=("$PY" bench/compare.py --bf16 --max-others 1 --threads "$threads" --timeout 300 "${rounds[@]}")

section "$main: PPO and GRPO with ppo_core's defaults and with bf16 weights, against TRL (bf16)" compare_main \
  "${cmp[@]}" --shapes "$main" --impls ppo_core ppo_core_bf16w trl grpo grpo_bf16w trl_grpo
if fits 45; then section "$main: one PPO step with bf16 weights under the profiler" profile "$PY" \
  bench/profile_step.py --shape "$main" --bf16-weights --threads "$threads"; fi
if fits 100; then section "$main: rollout engines" rollout "$PY" bench/rollout.py --shape "$main" --bf16 --rounds 2 \
  --threads "$threads" --engines generate generate_bf16w static_bf16w compiled_bf16w; fi
for shape in "${others[@]}"; do
  if fits 120; then section "$shape: PPO and GRPO with ppo_core's defaults against TRL (bf16)" "compare_$shape" \
    "${cmp[@]}" --shapes "$shape" --impls ppo_core trl grpo trl_grpo; fi
done
if fits 100; then section "$big: ppo_core PPO, its defaults and sampling from the policy (bf16)" compare_big \
  "${cmp[@]}" --shapes "$big" --impls ppo_core ppo_core_policy_sampling; fi
say "== done at ${SECONDS} s"
tar -czf "$out/json.tar.gz" -C "$work" $(cd "$work" && ls *.json 2>/dev/null) 2>/dev/null
grep -q "failed" "$md" && exit 1 || exit 0

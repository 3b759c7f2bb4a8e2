#!/usr/bin/env bash
# One command for one lent GPU (the H200 test machine's image as it is: Python 3.12, torch 2.11,
# transformers 5.17, no megatron-core, flash-attn or TransformerEngine, no network; docs/gpu.md),
# under 8 minutes. Every step has a fixed time limit; every step's exit status counts, and a step
# that runs out of time is a failure (nothing is skipped for time). Steps:
#
#   install  the wheels of tests/gpu/prepare.sh (megatron-core 0.19.2, transformers 5.24.0), when
#            $CSBP_GPU_WHEELS (default tests/gpu/wheels) holds any: `pip install --no-index
#            --no-deps --target $OUT/site`, then $OUT/site on PYTHONPATH
#   env      tests/gpu/gpu_env.py runtime: versions, flash-attn / TE installed or not, every
#            requirement of the installed wheels met here                        ($OUT/env.json)
#   kernels  tests/gpu/check_kernels.py: Flex forward and backward, with the lse, against dense
#            fp64 at 4K and 32K rows in bf16 (tiled and math at 4K; flash-attn where installed,
#            else "not installed")                                               ($OUT/gpu_kernels.json)
#   gpt      tests/gpu/check_te_spec.py: block_diffusion_attention inside a megatron-core GPT, local
#            spec, bf16, forward + backward against the same weights in fp64 (TE spec where TE is
#            installed, else "not installed")                                    ($OUT/te_spec.json)
#   resume   tests/gpu/check_resume.py: the plugin's trainer on 1 GPU (nccl, local spec): training,
#            a save after each step and a resume equal to the uninterrupted run bit for bit
#                                                                                ($OUT/resume.json)
#   speed    tests/gpu/check_speed.py: block_diffusion_attention time, TFLOP/s and peak memory
#            against dense causal SDPA at 8K, 32K and 128K tokens                ($OUT/speed.json)
#   moe      tests/gpu/check_reference_moe.py: the MoE layer's rate against the planner's assumed
#            0.30 (docs/planner.md row (f))                                      ($OUT/reference_moe.json)
#   reference_kernels  tests/gpu/check_reference_kernels.py: Flex / flash-attn rate ratio for the
#            planner; needs flash-attn, else "not installed"                     ($OUT/reference_kernels.json)
#
# Then one JSON of results, $OUT/gpu_results.json, and one summary line; exit 0 only when no step
# failed. "not installed" is never a pass: it is listed by name.
#
#   bash tests/gpu/run_all.sh                 (needs CUDA; writes under ${OUT:-gpu_report})
#   bash tests/gpu/run_all.sh --cpu-dry-run   (every step's script at tiny size on CPU, no GPU: CI)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR="${OUT:-gpu_report}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
MODE=gpu
if [ "${1:-}" = "--cpu-dry-run" ]; then MODE=cpu-dry-run; fi
LOG="$OUT_DIR/gpu_check.log"
STEPS="$OUT_DIR/steps.tsv"
: > "$STEPS"
start=$(date +%s)
export PYTHONUNBUFFERED=1

# step NAME LIMIT_S JSON COMMAND...: run COMMAND under `timeout LIMIT_S`, its output into the log,
# and record its exit status (124: out of time, a failure like any other nonzero status).
step() {
  local name=$1 limit=$2 json=$3 t0 rc
  shift 3
  echo "== $name (limit ${limit} s): $*" | tee -a "$LOG"
  t0=$(date +%s)
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$limit" "$json" >> "$STEPS"
}
# not_run NAME WHY: a step that cannot run here, recorded with the reason (never a pass)
not_run() { printf '%s\tnot_run\t0\t0\t%s\n' "$1" "$2" >> "$STEPS"; echo "== $1: $2" | tee -a "$LOG"; }

{
  echo "run_all.sh $MODE, $(date -u '+%Y-%m-%d %H:%M UTC'), git $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  if [ "$MODE" = gpu ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1; fi
} > "$LOG"

if [ "$MODE" = gpu ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "No CUDA device: nothing ran (use --cpu-dry-run on CPU)." | tee -a "$LOG"
  exit 2
fi

# install: the carried wheels, exactly as the image needs them (no index, no dependencies)
WHEELS="${CSBP_GPU_WHEELS:-tests/gpu/wheels}"
WHEELS_ABS=""
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  WHEELS_ABS="$(cd "$WHEELS" && pwd)"
  # installed under the output folder, not beside the wheels: the unpacked packages (~70 MB) must not
  # travel with the next device call that carries tests/gpu/wheels (64 MiB at most)
  SITE="$OUT_DIR/site"
  rm -rf "$SITE"
  step install 40 "" "$PY" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
    --target "$SITE" "$WHEELS_ABS"/*.whl
  export PYTHONPATH="$PWD:$SITE:${PYTHONPATH:-}"
else
  echo "no wheels in $WHEELS: this environment's own megatron-core and transformers" | tee -a "$LOG"
  export PYTHONPATH="$PWD:${PYTHONPATH:-}"
fi

step env "$([ "$MODE" = gpu ] && echo 45 || echo 120)" env.json "$PY" tests/gpu/gpu_env.py runtime --out "$OUT_DIR/env.json" \
  --wheel-dir "$WHEELS_ABS"

if [ "$MODE" = cpu-dry-run ]; then
  # limits for a shared 2-core CI host (a loaded one ran the resume step in 209 s); they bound hangs,
  # the GPU limits below are the ones that bound the visit
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  step kernels 240 gpu_kernels.json "$PY" tests/gpu/check_kernels.py --device cpu --lengths 256 --block-size 16 \
    --heads 4 --groups 2 --head-dim 32 --math-max-rows 256 --no-timing --out "$OUT_DIR/gpu_kernels.json"
  step gpt 240 te_spec.json "$PY" tests/gpu/check_te_spec.py --device cpu --seq-length 64 --hidden-size 64 \
    --out "$OUT_DIR/te_spec.json"
  step resume 400 resume.json "$PY" tests/gpu/check_resume.py --device cpu --timeout 190 --out "$OUT_DIR/resume.json"
  step speed 120 speed.json "$PY" tests/gpu/check_speed.py --device cpu --tokens 128 --block-size 16 --heads 4 \
    --groups 2 --head-dim 32 --reps 1 --out "$OUT_DIR/speed.json"
  step moe 120 reference_moe.json "$PY" tests/gpu/check_reference_moe.py --device cpu --experts 4 \
    --tokens-per-expert 32 --hidden 64 --ffn 32 --no-timing --out "$OUT_DIR/reference_moe.json"
  not_run reference_kernels "not applicable: CUDA kernel rates (dry run)"
else
  # limits: 40 (install) + 45 (env) + 90 + 60 + 130 + 85 + 30 = 480 s: 8 minutes at the very most on the
  # image (no flash-attn); where flash-attn is installed, reference_kernels adds up to 60 s
  step kernels 90 gpu_kernels.json "$PY" tests/gpu/check_kernels.py --lengths 4096 32768 --tiled-max-rows 4096 \
    --kernels flex flash tiled --no-timing --time-budget 85 --out "$OUT_DIR/gpu_kernels.json"
  step gpt 60 te_spec.json "$PY" tests/gpu/check_te_spec.py --out "$OUT_DIR/te_spec.json"
  step resume 130 resume.json "$PY" tests/gpu/check_resume.py --timeout 63 --out "$OUT_DIR/resume.json"
  step speed 85 speed.json "$PY" tests/gpu/check_speed.py --out "$OUT_DIR/speed.json"
  step moe 30 reference_moe.json "$PY" tests/gpu/check_reference_moe.py --out "$OUT_DIR/reference_moe.json"
  if "$PY" -c "import flash_attn" 2>/dev/null; then
    step reference_kernels 60 reference_kernels.json "$PY" tests/gpu/check_reference_kernels.py \
      --out "$OUT_DIR/reference_kernels.json"
  else
    not_run reference_kernels "not installed: flash-attn (the Flex / flash-attn rate ratio needs it)"
  fi
fi

"$PY" tests/gpu/gpu_env.py summary --mode "$MODE" --out-dir "$OUT_DIR" --seconds "$(( $(date +%s) - start ))" \
  2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"

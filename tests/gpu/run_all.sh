#!/usr/bin/env bash
# One command for one lent GPU (the H200 test machine's image as it is: Python 3.12, torch 2.11,
# transformers 5.17, no megatron-core, flash-attn or TransformerEngine, no network; docs/gpu.md),
# under 6 minutes (the GPU limits below sum to 345 s, plus 2 s of kill grace a step: a 15-minute
# visit holds a rerun). Every step has a fixed time limit (`timeout -k 2`); every step's exit status
# counts, a step that runs out of time is a failure (nothing is skipped for time) and still leaves
# its JSON (the script's own, or one saying it was killed). Steps:
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
#            against dense causal SDPA at 8K tokens                              ($OUT/speed.json)
#   speed_long  the same at 32K and 128K tokens: only with `--only speed_long` (a second call)
#   moe      tests/gpu/check_reference_moe.py: the MoE layer's rate against the planner's assumed
#            0.30 (docs/planner.md row (f))                                      ($OUT/reference_moe.json)
#   reference_kernels  tests/gpu/check_reference_kernels.py: Flex / flash-attn rate ratio for the
#            planner; needs flash-attn: only with `--only reference_kernels`  ($OUT/reference_kernels.json)
#
# Then one JSON of results, $OUT/gpu_results.json, and one summary line; exit 0 only when no step
# failed. "not installed" is never a pass: it is listed by name.
#
#   bash tests/gpu/run_all.sh                 (needs CUDA; writes under ${OUT:-gpu_report})
#   bash tests/gpu/run_all.sh --cpu-dry-run   (every step's script at tiny size on CPU, no GPU: CI)
#   bash tests/gpu/run_all.sh --cuda-shaped   (the same on the CUDA-shaped CPU device, bf16, nccl:
#                                              tests/cuda_shaped.py, docs/testing.md)
#   --only STEP [--limit S]   install (where wheels are) and STEP alone, STEP's limit S if given
#   --plan                    print each step, its limit and command; run nothing
set -uo pipefail
cd "$(dirname "$0")/../.."
MODE=gpu ONLY="" LIMIT="" PLAN=0
STEPS_ALL="install env kernels gpt resume speed moe speed_long reference_kernels"
while [ $# -gt 0 ]; do
  case "$1" in
    --cpu-dry-run) MODE=cpu-dry-run ;;
    --cuda-shaped) MODE=cuda-shaped ;;
    --plan) PLAN=1 ;;
    --only) ONLY="${2:-}"; shift
      case " $STEPS_ALL " in *" $ONLY "*) ;; *) echo "error: --only must be one of: $STEPS_ALL (got '$ONLY')"; exit 2 ;; esac ;;
    --limit) LIMIT="${2:-}"; shift
      case "$LIMIT" in ''|*[!0-9]*|0) echo "error: --limit must be a whole number of seconds > 0 (got '$LIMIT')"; exit 2 ;; esac ;;
    *) echo "error: run_all.sh: unknown argument '$1' (--cpu-dry-run, --cuda-shaped, --only STEP, --limit S, --plan)"; exit 2 ;;
  esac
  shift
done
if [ -n "$LIMIT" ] && [ -z "$ONLY" ]; then echo "error: --limit needs --only STEP (it sets that step's limit)"; exit 2; fi
OUT_DIR="${OUT:-gpu_report}"
if [ "$PLAN" = 0 ]; then mkdir -p "$OUT_DIR"; OUT_DIR="$(cd "$OUT_DIR" && pwd)"; fi
PY="${PYTHON:-$(command -v python3 || command -v python)}"
LOG="$OUT_DIR/gpu_check.log"
STEPS="$OUT_DIR/steps.tsv"
KILL_AFTER=2  # seconds between timeout's TERM and its KILL: a killed step's trainer must not outlive it
[ "$PLAN" = 1 ] || : > "$STEPS"
start=$(date +%s)
export PYTHONUNBUFFERED=1

# wants NAME: whether this call runs step NAME (every default step, or the --only one)
wants() {
  if [ -n "$ONLY" ]; then [ "$1" = "$ONLY" ] || [ "$1" = install ]; return; fi
  case "$1" in speed_long|reference_kernels) return 1 ;; esac
}
# step NAME LIMIT JSON COMMAND...: run COMMAND under `timeout -k KILL_AFTER LIMIT`, its output into
# the log, and record its exit status (124, 137: out of time, a failure like any other nonzero
# status). A step that leaves no JSON gets one saying why.
step() {
  local name=$1 limit=$2 json=$3 t0 rc
  shift 3
  wants "$name" || return 0
  if [ "$name" = "$ONLY" ] && [ -n "$LIMIT" ]; then limit=$LIMIT; fi
  if [ "$PLAN" = 1 ]; then echo "step $name $limit $KILL_AFTER $*"; return 0; fi
  echo "== $name (limit ${limit} s): $*" | tee -a "$LOG"
  t0=$(date +%s)
  timeout -k "$KILL_AFTER" "$limit" "$@" 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  if [ -n "$json" ] && [ ! -s "$OUT_DIR/$json" ]; then
    local why="exit $rc, the script wrote no JSON"
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then why="killed: ran out of its $limit s limit (exit $rc)"; fi
    printf '{"ok": false, "error": "%s"}\n' "$why" > "$OUT_DIR/$json"
  fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$limit" "$json" >> "$STEPS"
}
# not_run NAME WHY: a step that cannot run here, recorded with the reason (never a pass)
not_run() {
  if [ -n "$ONLY" ] && [ "$1" != "$ONLY" ]; then return 0; fi
  if [ "$PLAN" = 1 ]; then echo "not_run $1 $2"; return 0; fi
  printf '%s\tnot_run\t0\t0\t%s\n' "$1" "$2" >> "$STEPS"; echo "== $1: $2" | tee -a "$LOG"
}

if [ "$PLAN" = 0 ]; then
  {
    echo "run_all.sh $MODE${ONLY:+ --only $ONLY}, $(date -u '+%Y-%m-%d %H:%M UTC'), git $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    if [ "$MODE" = gpu ]; then nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1; fi
  } > "$LOG"
  if [ "$MODE" = gpu ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "No CUDA device: nothing ran (use --cpu-dry-run on CPU)." | tee -a "$LOG"
    exit 2
  fi
fi

# install: the carried wheels, exactly as the image needs them (no index, no dependencies)
WHEELS="${CSBP_GPU_WHEELS:-tests/gpu/wheels}"
WHEELS_ABS=""
if compgen -G "$WHEELS/*.whl" > /dev/null || [ "$PLAN" = 1 ]; then
  WHEELS_ABS="$(cd "$WHEELS" 2>/dev/null && pwd || echo "$WHEELS")"
  # installed under the output folder, not beside the wheels: the unpacked packages (~70 MB) must not
  # travel with the next device call that carries tests/gpu/wheels (64 MiB at most)
  SITE="$OUT_DIR/site"
  [ "$PLAN" = 1 ] || rm -rf "$SITE"
  step install "$([ "$MODE" = gpu ] && echo 15 || echo 60)" "" "$PY" -m pip install --quiet --no-index --no-deps \
    --no-compile --no-cache-dir --target "$SITE" "$WHEELS_ABS"/*.whl
  export PYTHONPATH="$PWD:$SITE:${PYTHONPATH:-}"
else
  [ "$PLAN" = 1 ] || echo "no wheels in $WHEELS: this environment's own megatron-core and transformers" | tee -a "$LOG"
  export PYTHONPATH="$PWD:${PYTHONPATH:-}"
fi
if [ "$MODE" = cuda-shaped ]; then
  # every Python process of the run (the trainer's too) starts as the CUDA-shaped device
  export PYTHONPATH="$PWD/tests/cuda_shaped_site:$PYTHONPATH" CSBP_CUDA_SHAPED=1
fi

step env "$([ "$MODE" = gpu ] && echo 20 || echo 120)" env.json "$PY" tests/gpu/gpu_env.py runtime --out "$OUT_DIR/env.json" \
  --wheel-dir "$WHEELS_ABS"

if [ "$MODE" != gpu ]; then
  # tiny sizes; limits for a shared 2-core CI host (a loaded one ran the resume step in 209 s): they
  # bound hangs, the GPU limits below are the ones that bound the visit. The CUDA-shaped device has
  # no compiled Flex (no CUDA kernel runs): its attention is the tiled kernel, in bf16.
  export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
  if [ "$MODE" = cpu-dry-run ]; then
    DEV=(--device cpu) KERNELS=(--kernels flex flash tiled) KERNEL=() BF16=(--bf16)
  else
    DEV=(--device cuda) KERNELS=(--kernels tiled) KERNEL=(--kernel tiled) BF16=(--bf16)
  fi
  step kernels 240 gpu_kernels.json "$PY" tests/gpu/check_kernels.py "${DEV[@]}" "${KERNELS[@]}" --lengths 256 \
    --block-size 16 --heads 4 --groups 2 --head-dim 32 --math-max-rows 256 --wide-rows 64 --no-timing \
    --out "$OUT_DIR/gpu_kernels.json"
  step gpt 240 te_spec.json "$PY" tests/gpu/check_te_spec.py "${DEV[@]}" "${KERNEL[@]}" --seq-length 64 \
    --hidden-size 64 --out "$OUT_DIR/te_spec.json"
  step resume 400 resume.json "$PY" tests/gpu/check_resume.py "${DEV[@]}" "${KERNEL[@]}" "${BF16[@]}" --tiny --timeout 380 \
    --out "$OUT_DIR/resume.json"
  for s in speed speed_long; do
    step "$s" 120 "$s.json" "$PY" tests/gpu/check_speed.py "${DEV[@]}" "${KERNEL[@]}" --tokens 128 --block-size 16 \
      --heads 4 --groups 2 --head-dim 32 --reps 1 --out "$OUT_DIR/$s.json"
  done
  step moe 120 reference_moe.json "$PY" tests/gpu/check_reference_moe.py "${DEV[@]}" --experts 4 \
    --tokens-per-expert 32 --hidden 64 --ffn 32 --no-timing --out "$OUT_DIR/reference_moe.json"
  not_run reference_kernels "not applicable: CUDA kernel rates ($MODE)"
else
  # limits (estimates, no GPU has run them; docs/gpu.md "Time limits"): install 15 + env 20 +
  # kernels 80 + gpt 55 + resume 110 + speed 50 + moe 15 = 345 s, each step at most KILL_AFTER more:
  # 359 s. Cold Flex compiles (10-30 s a forward + backward pair) dominate: kernels 2 pairs (4K, 32K)
  # and the 512-wide layer on the tiled kernel, gpt 2, resume 2 cold + 2 from inductor's cache, speed 2.
  step kernels 80 gpu_kernels.json "$PY" tests/gpu/check_kernels.py --lengths 4096 32768 --tiled-max-rows 4096 \
    --kernels flex flash tiled --no-timing --time-budget 70 --out "$OUT_DIR/gpu_kernels.json"
  step gpt 55 te_spec.json "$PY" tests/gpu/check_te_spec.py --out "$OUT_DIR/te_spec.json"
  step resume 110 resume.json "$PY" tests/gpu/check_resume.py --timeout 105 --out "$OUT_DIR/resume.json"
  step speed 50 speed.json "$PY" tests/gpu/check_speed.py --tokens 8192 --out "$OUT_DIR/speed.json"
  step moe 15 reference_moe.json "$PY" tests/gpu/check_reference_moe.py --out "$OUT_DIR/reference_moe.json"
  step speed_long 150 speed_long.json "$PY" tests/gpu/check_speed.py --tokens 32768 131072 --out "$OUT_DIR/speed_long.json"
  if "$PY" -c "import flash_attn" 2>/dev/null && [ "$ONLY" != reference_kernels ]; then
    not_run reference_kernels "not run in this call: its 60 s would pass the 6 minutes; --only reference_kernels"
  elif "$PY" -c "import flash_attn" 2>/dev/null; then
    step reference_kernels 60 reference_kernels.json "$PY" tests/gpu/check_reference_kernels.py \
      --out "$OUT_DIR/reference_kernels.json"
  else
    not_run reference_kernels "not installed: flash-attn (the Flex / flash-attn rate ratio needs it)"
  fi
fi

[ "$PLAN" = 1 ] && exit 0
"$PY" tests/gpu/gpu_env.py summary --mode "$MODE${ONLY:+ --only $ONLY}" --out-dir "$OUT_DIR" \
  --seconds "$(( $(date +%s) - start ))" 2>&1 | tee -a "$LOG"
exit "${PIPESTATUS[0]}"

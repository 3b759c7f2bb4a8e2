#!/usr/bin/env bash
# One command for a lent GPU (one H200; under 8 minutes): every partial-attention kernel (tiled,
# flex, flash-attn; math at 4K) against dense fp64 attention at L = 4K and 32K rows in bf16,
# forward and backward, then each kernel's TFLOP/s on the mask's allowed pairs against torch SDPA
# flash causal at the same length: one JSON file, $OUT/gpu_kernels.json (tests/gpu/check_kernels.py
# states the tolerances and their error model). Then the end-to-end bf16 check of
# block_diffusion_attention (tests/gpu/test_gpu_equivalence.py) with the time left (before it, the
# TE-spec model path: tests/gpu/check_te_spec.py, $OUT/te_spec.json); then the CPU
# default kernel (cpu_flash) against SDPA on the host's CPU ($OUT/cpu_kernel_rate.json). Step 1b
# measures the planner's fitted reference-baseline kernel rates ($OUT/reference_kernels.json); step
# 1b' checks that the MoE layer runs at the rate the planner assumes, i.e. is not the fitted fixed
# time per step of the paper's DiffusionGemma runs ($OUT/reference_moe.json).
#
#   bash tests/gpu/run_all.sh                 (needs CUDA; writes under ${OUT:-gpu_report})
#   bash tests/gpu/run_all.sh --cpu-dry-run   (the same script at tiny L on CPU, no timings: CI)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR="${OUT:-gpu_report}"
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
start=$(date +%s)

if [ "${1:-}" = "--cpu-dry-run" ]; then
  python tests/gpu/check_kernels.py --device cpu --lengths 256 --block-size 16 --heads 4 --groups 2 \
    --head-dim 32 --math-max-rows 256 --no-timing --out "$OUT_DIR/gpu_kernels.json" || exit $?
  # the MoE-rate step's script at tiny size: torch's grouped GEMM against the per-expert loop, and
  # the planner's expert time per step it compares with (no timing)
  python tests/gpu/check_reference_moe.py --device cpu --experts 4 --tokens-per-expert 32 --hidden 64 \
    --ffn 32 --no-timing --out "$OUT_DIR/reference_moe.json" || exit $?
  # the TE-spec step's script at tiny size: local spec bf16 vs fp32 only (no TE on CPU)
  exec python tests/gpu/check_te_spec.py --device cpu --seq-length 64 --hidden-size 64 --out "$OUT_DIR/te_spec.json"
fi

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "No CUDA device: nothing ran (use --cpu-dry-run on CPU)." | tee "$OUT_DIR/gpu_check.log"
  exit 2
fi
{
  echo "date: $(date -u '+%Y-%m-%d %H:%M UTC'), git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
} > "$OUT_DIR/gpu_check.log"

# Worst case under 8 minutes: the fixed steps' timeouts sum to 450 s (260 + 60 + 40 + 90); steps 2
# and 3 take only what is left of 450 / 470 s.
# 1. kernels vs fp64 and speed (writes the JSON after every cell: a timeout keeps what finished)
timeout 260 python tests/gpu/check_kernels.py --time-budget 240 --out "$OUT_DIR/gpu_kernels.json" 2>&1 | tee -a "$OUT_DIR/gpu_check.log"
kernels_rc=${PIPESTATUS[0]}

# 1b. the planner's fitted reference-baseline kernel rates: compiled Flex vs flash-attn (planner/reference.py)
timeout 60 python tests/gpu/check_reference_kernels.py --out "$OUT_DIR/reference_kernels.json" 2>&1 | tee -a "$OUT_DIR/gpu_check.log"

# 1b'. the MoE layer is NOT the planner's fitted fixed time per step (REFERENCE_DG_FIXED_STEP_S): torch
# grouped GEMM, a per-expert loop and the routed layer at DiffusionGemma 26B's expert shape, 8192 tokens
# per expert, against the profile's assumed grouped_gemm_efficiency 0.30 (moe_share_of_fixed_time ~ 0)
timeout 40 python tests/gpu/check_reference_moe.py --out "$OUT_DIR/reference_moe.json" 2>&1 | tee -a "$OUT_DIR/gpu_check.log"

# 1c. the TE-spec model path: TE layer spec + block-diffusion core attention, forward + backward in
# bf16 against the local spec on the same weights (bound from bf16 rounding: tests/gpu/check_te_spec.py)
timeout 90 python tests/gpu/check_te_spec.py --out "$OUT_DIR/te_spec.json" 2>&1 | tail -5 | tee -a "$OUT_DIR/gpu_check.log"
te_rc=${PIPESTATUS[0]}

# 2. end to end: block_diffusion_attention in bf16 vs the dense reference, with what is left of 7.5 min
left=$(( 450 - ($(date +%s) - start) ))
eq_rc=0
if [ "$left" -gt 30 ]; then
  timeout "$left" python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_equivalence.py 2>&1 | tail -25 | tee -a "$OUT_DIR/gpu_check.log"
  eq_rc=${PIPESTATUS[0]}
else
  echo "test_gpu_equivalence.py skipped: ${left}s left" | tee -a "$OUT_DIR/gpu_check.log"
fi
# 3. the CPU kernel (cpu_flash, the CPU default) against SDPA's CPU flash kernel on this machine's
# unshared cores, with what is left of 8 minutes (tiled / cpu_flash / SDPA per allowed pair, L = 2K, 4K)
left=$(( 470 - ($(date +%s) - start) ))
if [ "$left" -gt 20 ]; then
  timeout "$(( left < 60 ? left : 60 ))" python -m megatron_csbp.bench.kernel_rate --seq-lengths 2048 4096 \
    --json "$OUT_DIR/cpu_kernel_rate.json" 2>&1 | tee -a "$OUT_DIR/gpu_check.log"
else
  echo "cpu kernel rate skipped: ${left}s left" | tee -a "$OUT_DIR/gpu_check.log"
fi
echo "kernels exit $kernels_rc, TE spec exit $te_rc, end-to-end exit $eq_rc, total $(( $(date +%s) - start )) s" | tee -a "$OUT_DIR/gpu_check.log"
[ "$kernels_rc" -eq 0 ] && [ "$te_rc" -eq 0 ] && [ "$eq_rc" -eq 0 ]

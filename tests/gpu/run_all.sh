#!/usr/bin/env bash
# GPU check for a lent GPU (one H200 or H100): equivalence of the block-aware attention in bf16
# against the dense reference, then a single-GPU attention benchmark; writes a markdown report.
# Budget: under 8 minutes in total (each part has its own timeout).
#
#   bash tests/gpu/run_all.sh [OUT_DIR]      (default OUT_DIR: ${OUT:-gpu_report})
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT_DIR="${1:-${OUT:-gpu_report}}"
mkdir -p "$OUT_DIR"
REPORT="$OUT_DIR/gpu_report.md"
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
start=$(date +%s)

{
  echo "# GPU check: block-aware attention"
  echo
  echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
  echo "- git: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/- gpu: /'
  python -c "import torch; print('- torch', torch.__version__, 'cuda', torch.version.cuda)"
  echo
} > "$REPORT"

if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "**No CUDA device: nothing ran.**" >> "$REPORT"
  cat "$REPORT"
  exit 2
fi

echo "## 1. bf16 equivalence vs the dense reference (tests/gpu/test_gpu_equivalence.py)" >> "$REPORT"
echo '```' >> "$REPORT"
timeout 240 python -m pytest -q -p no:cacheprovider tests/gpu/test_gpu_equivalence.py 2>&1 | tail -25 >> "$REPORT"
eq_rc=${PIPESTATUS[0]}
echo '```' >> "$REPORT"
echo "exit status: $eq_rc" >> "$REPORT"
echo >> "$REPORT"

echo "## 2. attention benchmark (tests/gpu/bench_attention.py)" >> "$REPORT"
timeout 240 python tests/gpu/bench_attention.py --out "$OUT_DIR/attention_bench.json" > "$OUT_DIR/attention_bench.log" 2>&1
bench_rc=$?
python - "$OUT_DIR/attention_bench.json" >> "$REPORT" <<'PY'
import json, sys
try:
    data = json.load(open(sys.argv[1]))
except Exception as e:
    print(f"no benchmark result ({e}); see attention_bench.log"); sys.exit(0)
print(f"device: {data['device']}, torch {data['torch']}. TFLOP/s on each call's real work "
      "(block diffusion: L*(L+B) allowed pairs; causal: (2L)^2/2), forward 4*H*d flops per pair, fwd+bwd 3.5x.\n")
print("| L | B | H/G/d | block-diffusion fwd ms (TFLOP/s) | fwd+bwd | compiled flex fwd | fwd+bwd | causal flash 2L fwd | fwd+bwd |")
print("|---|---|---|---|---|---|---|---|---|")
def cell(x):
    return x.get("error", "")[:60] if "error" in x else f"{x['ms']:.2f} ({x['tflops']:.0f})"
for r in data["rows"]:
    print(f"| {r['L']} | {r['B']} | {r['H']}/{r['G']}/{r['d']} | {cell(r['block_diffusion_fwd'])} | "
          f"{cell(r['block_diffusion_fwd_bwd'])} | {cell(r['block_diffusion_compiled_fwd'])} | "
          f"{cell(r['block_diffusion_compiled_fwd_bwd'])} | {cell(r['causal_flash_fwd'])} | {cell(r['causal_flash_fwd_bwd'])} |")
PY
echo "exit status: $bench_rc" >> "$REPORT"
echo >> "$REPORT"
echo "total wall time: $(( $(date +%s) - start )) s" >> "$REPORT"
cat "$REPORT"
[ "$eq_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]

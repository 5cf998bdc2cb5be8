#!/usr/bin/env bash
# H200 check of calibration on the GPU: `dynamo-kvtc bench calibrate` on random-initialised real shapes, 200K tokens
# each: wall time split (load, capture, checkpoint, PCA, DP, save), tokens/s, peak GPU memory and peak host RSS.
# Run through the device tool from the repository root (no wheels needed: torch and transformers are there):
#   command: bash integration/gpu/calibrate_check.sh
# Llama-3.1-70B does not fit one H200 (141 GB of bf16 weights beside 107 GB of float64 Grams): its first 40 layers
# (llama-3.1-70b@40, 73 GB of weights, p = 40960) run instead. Budget: ~9 minutes; a shape still running at the
# budget is stopped and reported as such, the others keep their results. Writes $OUT/bench-calibrate.json and .log.
set -uo pipefail
OUT=${OUT:-out/calibrate}
SHAPES=${SHAPES:-llama-3.1-8b,mistral-nemo-12b,llama-3.1-70b@40}
TOKENS=${TOKENS:-200000}
BUDGET_S=${BUDGET_S:-550}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
timeout $((BUDGET_S + 30)) python3 -m dynamo_kvtc.cli.main bench calibrate --device cuda --tokens "$TOKENS" \
  --shapes "$SHAPES" --budget-s "$BUDGET_S" --no-progress --out-dir /tmp/kvtc-bench-cal \
  --json "$OUT/bench-calibrate.json" >"$OUT/bench-calibrate.log" 2>&1
rc=$?
grep -E "^(==|   )" "$OUT/bench-calibrate.log"
tail -5 "$OUT/bench-calibrate.log"
echo "exit status $rc"
exit $rc

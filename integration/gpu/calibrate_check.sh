#!/usr/bin/env bash
# H200 check of calibration on the GPU: `dynamo-kvtc bench calibrate` on random-initialised real shapes, 200K tokens
# each: wall time split (load, capture, checkpoint, PCA, DP, save), tokens/s, peak GPU memory and peak host RSS.
# Run through the device tool from the repository root (no wheels needed: torch and transformers are there):
#   command: bash integration/gpu/calibrate_check.sh
# Llama-3.1-70B does not fit one H200 (141 GB of bf16 weights beside 107 GB of float64 Grams): its first 40 layers
# (llama-3.1-70b@40, 73 GB of weights, p = 40960) run instead. Budget: ~9 minutes; a shape still running at the
# budget is stopped and reported as such, the others keep their results. Writes $OUT/bench-calibrate.json and .log.
# CHECK=1 instead: the GPU path against the CPU one on one model (shape:smollm2-135m, random weights drawn on the CPU,
# so both see the same model; bf16 on both, rank 2048: the randomized PCA): the CPU run on the host's cores, then the
# GPU run with --reference to it; $OUT/compare-gpu.json's results[0].reference holds principal angles, plan ranks and
# DP-sample errors of the two (~3-5 minutes).
set -uo pipefail
OUT=${OUT:-out/calibrate}
SHAPES=${SHAPES:-llama-3.1-8b,mistral-nemo-12b,llama-3.1-70b@40}
TOKENS=${TOKENS:-200000}
BUDGET_S=${BUDGET_S:-550}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [ "${CHECK:-0}" = 1 ]; then
  common=(--dtype bfloat16 --shapes smollm2-135m --tokens 16384 --rank 2048 --ratios 16,32,64 --no-progress)
  python3 -m dynamo_kvtc.cli.main bench calibrate --device cpu "${common[@]}" --out-dir /tmp/kvtc-cmp-cpu \
    --json "$OUT/compare-cpu.json" >"$OUT/compare.log" 2>&1 &&
  python3 -m dynamo_kvtc.cli.main bench calibrate --device cuda "${common[@]}" --out-dir /tmp/kvtc-cmp-gpu \
    --reference /tmp/kvtc-cmp-cpu/shape_smollm2-135m --json "$OUT/compare-gpu.json" >>"$OUT/compare.log" 2>&1
  rc=$?
  grep -E "^(==|   )" "$OUT/compare.log"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results'][0]; print(json.dumps(r.get('reference'), indent=1))" "$OUT/compare-gpu.json"
  exit $rc
fi
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

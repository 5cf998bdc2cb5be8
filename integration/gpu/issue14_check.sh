#!/usr/bin/env bash
# H200 check of issue 14 (faster than a raw copy) in ONE device call: the new GPU tests, `bench gpu` for the NeMo-12B
# shape (8 x 8K, 16x, projections as DYN_KVTC_PROJECTION says, a 4-layer-group variant, the green-context curve),
# `bench tiers` (host/disk tiers against the codec's own restore and the raw tiers), then, with the time left, a
# short `bench serve` (issue 15). Run through the device tool from the repository root:
#   carry [".whl"], command: bash integration/gpu/issue14_check.sh
# The wheels plus the shipped calibrations exceed the 64 MiB a call carries: untrack the calibrations for the call
#   git rm -r -q --cached calibrations && echo /calibrations/ >> .git/info/exclude   (afterwards: git reset -q; drop the line)
# Budget: TOTAL_S (default 540 s); each part stops at its own deadline and keeps what it has.
# Writes to $OUT: env.txt, pytest-gpu.log, bench-gpu.{json,log}, bench-tiers.{json,log}, serve.{json,png,log}.
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-out/issue14}
TOTAL_S=${TOTAL_S:-540}
export DYN_KVTC_PROJECTION=${DYN_KVTC_PROJECTION:-fp8}
mkdir -p "$OUT"
el() { echo $(($(date +%s) - T0)); }
left() { echo $((TOTAL_S - $(el))); }
step() { echo "== [$(el)s] $*"; }
die() { echo "!! FATAL: $*"; exit 1; }

step "install wheels from .whl/"
ls .whl/*.whl >/dev/null 2>&1 || die "no wheels in .whl/ (run with carry [\".whl\"])"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || die "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import torch; from dynamo_kvtc.codec.gpu.fused import fused_status; print(fused_status('cuda'))"
} 2>&1 | tee "$OUT/env.txt"

step "GPU tests (streaming restore, FP8 projections, fused codec, tiers on CUDA)"
timeout 110 python3 -m pytest -q -p no:cacheprovider -m "not model" tests/test_restore_stream.py \
  tests/test_projection.py tests/test_gpu_fused.py tests/test_tiers.py -k "not bench_tiers and not many_concurrent" \
  >"$OUT/pytest-gpu.log" 2>&1
TEST_STATUS=$?
tail -3 "$OUT/pytest-gpu.log"

step "bench gpu (NeMo-12B 8x8K, projection $DYN_KVTC_PROJECTION, 4-group variant, green contexts)"
B=$(( $(left) - 200 )); [ "$B" -gt 260 ] && B=260
timeout $((B + 40)) python3 -m dynamo_kvtc.cli.main bench gpu --shapes mistral-nemo-12b --configs 8x8192 \
  --layer-groups 4 --codec-sms 16,32,64 --repeat 3 --budget-s "$B" --json "$OUT/bench-gpu.json" \
  >"$OUT/bench-gpu.log" 2>&1
GPU_STATUS=$?
grep -vE "^(WARNING|INFO|[0-9-]+ [0-9:]+ NIXL)" "$OUT/bench-gpu.log" | tail -25

step "bench tiers (one 8K NeMo-12B sequence, host + disk, raw baselines, codec's own restore)"
mkdir -p /tmp/kvtc-disk
timeout $(( $(left) > 150 ? 120 : $(left) - 30 )) python3 -m dynamo_kvtc.cli.main bench tiers --device cuda \
  --synthetic mistral-nemo-12b --tokens 8192 --ratios 16 --disk-dir /tmp/kvtc-disk --repeat 3 \
  --json "$OUT/bench-tiers.json" >"$OUT/bench-tiers.log" 2>&1
TIERS_STATUS=$?
grep -vE "^(WARNING|INFO|[0-9-]+ [0-9:]+ NIXL)" "$OUT/bench-tiers.log" | tail -8

L=$(left)
if [ "$L" -gt 60 ]; then
  step "bench serve, short (Llama-3.1-8B shape, multi-round QA, budgets 1.25 and 0.125; stops in $((L - 10))s)"
  timeout $((L - 10)) python3 -m dynamo_kvtc.cli.main bench serve --model llama-3.1-8b --device cuda \
    --workload multi-round-qa --param users=8 --param rounds=3 --param system=1000 --param history=6000 \
    --param question=50 --param answer=64 --param qps=1.0 --budgets 1.25,0.125 --systems none,raw,kvtc16,policy \
    --json "$OUT/serve.json" --plot "$OUT/serve.png" >"$OUT/serve.log" 2>&1
  echo "serve exit $?"
  grep -vE "^(WARNING|INFO|[0-9-]+ [0-9:]+ NIXL)" "$OUT/serve.log" | tail -15
fi
step "done: tests=$TEST_STATUS gpu=$GPU_STATUS tiers=$TIERS_STATUS; files: $(ls "$OUT" | tr '\n' ' ')"

#!/usr/bin/env bash
# H200 run of the serving benchmark (issue 15): `dynamo-kvtc bench serve` for the Llama-3.1-8B shape (random weights,
# synthetic calibration: speed only), multi-round QA in LMBenchmark's shape, a host-budget sweep, every system.
# Run through the device tool from the repository root:
#   command: bash integration/gpu/serve_check.sh            (carry [".whl"] for nvCOMP/NIXL: the measured path;
#                                                             without it blobs are entropy-coded by zlib on the host)
# With the wheels the shipped calibrations must be untracked for the call as perf_check.sh says.
# Knobs (environment): MODEL (llama-3.1-8b | mistral-nemo-12b), WORKLOAD (multi-round-qa | lmbench | conversation |
# long-doc-qa), PARAMS (generator KEY=VALUE list), BUDGETS, SYSTEMS, QPS, EXTRA (more bench serve arguments),
# TESTS=0 to skip the GPU test, PROFILE=1 for one offload/restore per system with stage timings first, TOTAL_S (default 470: the run stops there; the JSON keeps every finished run),
# PLAN (several runs in one call, see below).
# The short check of 2026-12-01 (docs/serving.md) took 14-18 s per run for 24 requests of ~5K tokens; the default
# here (24 requests of ~9.4K tokens) should take ~25 s per run. Split a longer sweep over calls with SYSTEMS=...
# Writes to $OUT: env.txt, pytest-serve.log, serve-<model>-<workload>.{json,png,log}, trace.jsonl.
# Exit status: 0 all good, 1 setup failure, 2 GPU test failed, 3 benchmark failed or ran out of time.
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-out/serve}
TOTAL_S=${TOTAL_S:-470}
MODEL=${MODEL:-llama-3.1-8b}
WORKLOAD=${WORKLOAD:-multi-round-qa}
QPS=${QPS:-1.0}
PARAMS=${PARAMS:-users=8 rounds=3 system=1000 history=8000 question=50 answer=64 qps=$QPS}
BUDGETS=${BUDGETS:-1.25,0.25,0.125,0.05}
SYSTEMS=${SYSTEMS:-none,raw,kvtc16,policy}  # 13 runs of ~25 s on the H200; add kvtc32, raw_blob in a second call
EXTRA=${EXTRA:-}
mkdir -p "$OUT"
el() { echo $(($(date +%s) - T0)); }
step() { echo "== [$(el)s] $*"; }
die() { echo "!! FATAL: $*"; exit 1; }

if ls .whl/*.whl >/dev/null 2>&1; then
  step "install wheels from .whl/"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || die "wheel install failed"
  export PYTHONPATH=/tmp/site:$PWD
else
  step "no .whl/: nvCOMP and NIXL absent (blobs entropy-coded by zlib on the host, no disk tier)"
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1

step "environment"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  nproc; free -g | head -2
  python3 -c "import torch, dynamo_kvtc.bench.serve.run as r; assert torch.cuda.is_available(); print('IMPORTS OK', torch.__version__, torch.cuda.get_device_name(0))"
  python3 -c "from dynamo_kvtc.codec.entropy import nvcomp_available; print('nvcomp', nvcomp_available())"
} 2>&1 | tee "$OUT/env.txt"
grep -q "IMPORTS OK" "$OUT/env.txt" || die "import check failed (output above)"

TEST_STATUS=0
if [ "${TESTS:-1}" != 0 ]; then
  step "GPU test of the engine loop (tests/test_bench_serve.py -m gpu)"
  timeout 150 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_bench_serve.py >"$OUT/pytest-serve.log" 2>&1 \
    || TEST_STATUS=2
  tail -3 "$OUT/pytest-serve.log"
fi

if [ "${PROFILE:-0}" != 0 ]; then
  step "one offload + restore per system, stage timings (integration/gpu/restore_profile.py)"
  timeout 240 python3 integration/gpu/restore_profile.py --model "$MODEL" --tokens "${PROFILE_TOKENS:-9104}" \
    --json "$OUT/restore-profile.json" 2>&1 | grep -vE "^(WARNING|INFO)" | tail -15
fi

# PLAN: runs separated by ';', each "MODEL WORKLOAD BUDGETS SYSTEMS [QPS-list|-] [KEY=VALUE,...]" (default: the one
# run the knobs above describe; PARAMS apply to a run of WORKLOAD without its own parameters). Each run gets its own serve-<model>-<workload>[-qps][-N].{json,png,log}
# (-N: the Nth run of the same model and workload in this call); a run that is cut short by TOTAL_S keeps the runs it
# finished in its JSON. An lmbench run without a QPS list sweeps the preset's rates (0.5,1,2).
PLAN=${PLAN:-"$MODEL $WORKLOAD $BUDGETS $SYSTEMS"}  # PLAN=- runs nothing (a call for the test or the profile only)
[ "$PLAN" = "-" ] && PLAN=""
BENCH_STATUS=0
IFS=';' read -ra RUNS <<<"$PLAN"
for run in "${RUNS[@]}"; do
  read -r M W B S Q P <<<"$run"
  [ "$Q" = "-" ] && Q=""
  [ -z "$M" ] && continue
  LEFT=$((TOTAL_S - $(el)))
  [ "$LEFT" -lt 20 ] && { step "no time left for: $run"; BENCH_STATUS=3; break; }
  NAME="serve-$M-$W${Q:+-qps}"
  N=2
  while [ -e "$OUT/$NAME.json" ] || [ -e "$OUT/$NAME.log" ]; do NAME="serve-$M-$W${Q:+-qps}-$N"; N=$((N + 1)); done
  QARGS=()
  [ -n "$Q" ] && QARGS=(--qps "$Q")
  ARGS=()
  if [ -n "$P" ]; then for p in ${P//,/ }; do ARGS+=(--param "$p"); done
  elif [ "$W" = "$WORKLOAD" ]; then for p in $PARAMS; do ARGS+=(--param "$p"); done; fi
  step "dynamo-kvtc bench serve --model $M --workload $W budgets $B systems $S ${Q:+qps $Q} (stops in ${LEFT}s)"
  timeout "$LEFT" python3 -m dynamo_kvtc.cli.main bench serve --model "$M" --device cuda --workload "$W" \
    "${ARGS[@]}" "${QARGS[@]}" --budgets "$B" --systems "$S" --save-trace "$OUT/trace-$W.jsonl" \
    --json "$OUT/$NAME.json" --plot "$OUT/$NAME.png" $EXTRA >"$OUT/$NAME.log" 2>&1 || BENCH_STATUS=3
  grep -vE "^(WARNING|INFO)" "$OUT/$NAME.log" | tail -25
done

step "done: test=$TEST_STATUS bench=$BENCH_STATUS; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
[ "$TEST_STATUS" -ne 0 ] && exit 2
[ "$BENCH_STATUS" -ne 0 ] && exit 3
exit 0

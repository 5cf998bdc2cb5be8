#!/usr/bin/env bash
# shellcheck disable=SC2317  # the check_* functions are called by name ("check_$c")
# The one entry point for GPU runs on the H200 machine (integration/gpu/README.md says which check does what, what it
# costs and how its results come back). From the repository root, in ONE device call:
#
#   bash integration/gpu/run.sh [--dry-run] [--smoke] CHECK [CHECK ...]
#
# CHECK: tests | codec | gpu | tiers | serve | handoff | grants | pool | profile | calibrate | compare [OLD_TREE]
#        (OLD_TREE and grants' old tree: .old)
#
# It installs the wheels of $WHEEL_DIR (.whl) once, writes $OUT/env.txt once, then runs the checks in the order given
# against ONE deadline (TOTAL_S seconds from its start): each check gets at most its own cap (<CHECK>_S) and never more
# than leaves the later checks their minimum; a check that cannot get its minimum is skipped with a "SKIP" line.
# Every check writes into $OUT/<check>/; $OUT/summary.txt lists each check's status, seconds and files. When more
# than 8 files are under $OUT (what one device call brings back), everything is packed into $OUT/results.tar.gz and
# summary.txt, env.txt and each check's main result are copied beside it.
#
# --dry-run  print what each check would run (with its granted seconds) and run nothing
# --smoke    a code check on a machine without a GPU: bench gpu under DYN_KVTC_BENCH_SMOKE=1, codec and tiers on
#            the CPU, small shapes; the numbers are meaningless
#
# Exit status: 0 every check ran and passed, 1 setup failed, 2 a check failed, 3 none failed but some were skipped.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
ROOT=$PWD
T0=$(date +%s)

usage() { sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; }
DRY=0
SMOKE=${SMOKE:-0}
CHECKS=()
OLD_TREE=${OLD_TREE:-.old}
while [ $# -gt 0 ]; do
  case $1 in
    --dry-run) DRY=1 ;;
    --smoke) SMOKE=1 ;;
    -h | --help) usage; exit 0 ;;
    tests | codec | gpu | tiers | serve | handoff | grants | pool | profile | calibrate) CHECKS+=("$1") ;;
    compare)
      CHECKS+=(compare)
      if [ $# -gt 1 ] && [ -d "$2" ]; then OLD_TREE=$2; shift; fi ;;
    compare=*) CHECKS+=(compare); OLD_TREE=${1#compare=} ;;
    *) echo "unknown check or option: $1 (run.sh --help)"; exit 1 ;;
  esac
  shift
done
[ ${#CHECKS[@]} -eq 0 ] && { usage; exit 1; }

# ------------------------------------------------------------------------------------------------- knobs
OUT=${OUT:-out/gpu}
TOTAL_S=${TOTAL_S:-540}      # the deadline all checks share (the device tool stops a command at 600 s)
RESERVE_S=${RESERVE_S:-15}   # kept at the end for packing the results
PY=${PY:-python3}
WHEELS=${WHEELS:-1}          # 0: no install (the packages must already import)
WHEEL_DIR=${WHEEL_DIR:-.whl}
if [ "$SMOKE" != 0 ]; then
  export DYN_KVTC_BENCH_SMOKE=1
  DEV=cpu
else
  DEV=cuda
fi
if [ "$SMOKE" != 0 ]; then  # docs/serving.md's CPU run on the tiny shape
  MODEL=${MODEL:-tiny} BUDGETS=${BUDGETS:-1.25,0.125} SYSTEMS=${SYSTEMS:-none,raw,kvtc16}
  PARAMS=${PARAMS:-users=6 rounds=3 system=64 history=1024 question=16 answer=8 qps=1}
  SERVE_EXTRA=${SERVE_EXTRA:---token-budget 1024 --max-seqs 4 --span-tokens 256 --window 32}
  PROFILE_TOKENS=${PROFILE_TOKENS:-1024} CODEC_TOKENS=${CODEC_TOKENS:-1024} TIERS_TOKENS=${TIERS_TOKENS:-1024}
  TIERS_SHAPES=${TIERS_SHAPES:-smollm2-135m} CODEC_NEMO=${CODEC_NEMO:-0} TEST_FILES=${TEST_FILES:-tests/test_gpu.py}
  PREFILL_DEVICE=${PREFILL_DEVICE:-cpu} DECODE_DEVICE=${DECODE_DEVICE:-cpu} HANDOFF_SHAPES=${HANDOFF_SHAPES:-smollm2-135m}
  HANDOFF_TOKENS=${HANDOFF_TOKENS:-1024} HANDOFF_RANK=${HANDOFF_RANK:-256} HANDOFF_REPEAT=${HANDOFF_REPEAT:-1}
  LINKS=${LINKS:-0,2}
  CALIBRATE_SHAPES=${CALIBRATE_SHAPES:-smollm2-135m} CALIBRATE_TOKENS=${CALIBRATE_TOKENS:-2048}
  export UCX_NET_DEVICES=${UCX_NET_DEVICES:-lo}
fi
# tests
TEST_FILES=${TEST_FILES:-tests/test_gpu.py tests/test_gpu_connector.py tests/test_gpu_fused.py tests/test_projection.py \
tests/test_restore_stream.py tests/test_handoff_device.py tests/test_handoff_stream.py tests/test_bench_serve.py \
tests/test_tiers.py}
TEST_MARK=${TEST_MARK:-not model}
TEST_K=${TEST_K-not bench_tiers and not many_concurrent}
# codec (bench codec: the reference path's stage timings, per entropy codec)
CODEC_TAGS=${CODEC_TAGS:-deflate gdeflate ans}
CODEC_TOKENS=${CODEC_TOKENS:-8192}
CODEC_NEMO=${CODEC_NEMO:-1}          # also the NeMo-12B shape at 16x, ANS
CODEC_HOST=${CODEC_HOST:-1}          # also the CPU path on the GPU machine's host
# gpu (bench gpu)
if [ "$SMOKE" != 0 ]; then
  GPU_SHAPES=${GPU_SHAPES:-smollm2-135m} GPU_CONFIGS=${GPU_CONFIGS:-2x256} GPU_LAYER_GROUPS=${GPU_LAYER_GROUPS:-2}
  GPU_REPEAT=${GPU_REPEAT:-2} GPU_EXTRA=${GPU_EXTRA:---cpu-tokens 64}
fi
GPU_SHAPES=${GPU_SHAPES:-mistral-nemo-12b}   # all: the benchmark's default three shapes
GPU_CONFIGS=${GPU_CONFIGS:-8x8192}           # all: its default 8x8192,2x16384
GPU_LAYER_GROUPS=${GPU_LAYER_GROUPS:-4}
GPU_CODEC_SMS=${GPU_CODEC_SMS:-16,32,64}
GPU_REPEAT=${GPU_REPEAT:-3}
GPU_SKIP=${GPU_SKIP:-}                       # e.g. "codec choice,cpu path"
GPU_EXTRA=${GPU_EXTRA:-}
FUSED_SMOKE=${FUSED_SMOKE:-1}                # one strict fused round trip first: stops early if Triton breaks
# tiers (bench tiers)
TIERS_SHAPES=${TIERS_SHAPES:-mistral-nemo-12b}
TIERS_TOKENS=${TIERS_TOKENS:-8192}
TIERS_REPEAT=${TIERS_REPEAT:-3}
# serve (bench serve; names as the retired serve_check.sh had them)
MODEL=${MODEL:-llama-3.1-8b}
WORKLOAD=${WORKLOAD:-multi-round-qa}
QPS=${QPS:-1.0}
PARAMS=${PARAMS:-users=8 rounds=3 system=1000 history=8000 question=50 answer=64 qps=$QPS}
BUDGETS=${BUDGETS:-1.25,0.25,0.125,0.05}
SYSTEMS=${SYSTEMS:-none,raw,kvtc16,policy}
SERVE_EXTRA=${SERVE_EXTRA:-${EXTRA:-}}
PLAN=${PLAN:-"$MODEL $WORKLOAD $BUDGETS $SYSTEMS"}
# calibrate (bench calibrate)
CALIBRATE_SHAPES=${CALIBRATE_SHAPES:-llama-3.1-8b,mistral-nemo-12b,llama-3.1-70b@40}
CALIBRATE_TOKENS=${CALIBRATE_TOKENS:-200000}
# handoff (bench transfer + the UCX probe)
PREFILL_DEVICE=${PREFILL_DEVICE:-cuda:0}
DECODE_DEVICE=${DECODE_DEVICE:-cuda:0}
HANDOFF_SHAPES=${HANDOFF_SHAPES:-mistral-nemo-12b}
HANDOFF_TOKENS=${HANDOFF_TOKENS:-8192,32768}
LINKS=${LINKS:-0,100,200,400}
REPLAY=${REPLAY:-}
HANDOFF_RANK=${HANDOFF_RANK:-10240}
HANDOFF_LAYER_GROUPS=${HANDOFF_LAYER_GROUPS:-4}
HANDOFF_REPEAT=${HANDOFF_REPEAT:-2}
HANDOFF_TESTS=${HANDOFF_TESTS:-1}
PROBE=${PROBE:-1}
PROBE_TLS=${PROBE_TLS:-default,cuda_ipc+cuda_copy+tcp,default@UCX_RMA_PPLN_ENABLE=y,cuda_ipc+cuda_copy+tcp@UCX_RMA_PPLN_ENABLE=y}
# grants (integration/handoff/grant_pairs.py: the hand-off on OLD_TREE and on this tree, alternating pairs)
GRANTS_PAIRS=${GRANTS_PAIRS:-3}
GRANTS_ARGS=${GRANTS_ARGS:---shapes $HANDOFF_SHAPES --tokens 8192 --prefill-device $PREFILL_DEVICE --decode-device \
$DECODE_DEVICE --rank $HANDOFF_RANK --layer-groups $HANDOFF_LAYER_GROUPS --repeat 5 --timeout 120}
GRANTS_UCX=${GRANTS_UCX:-UCX_TLS=cuda_ipc,cuda_copy,tcp UCX_RMA_PPLN_ENABLE=y}  # the H200 probe's fastest (performance.md)
# pool (bench pool: a real mooncake_master on loopback; the wheels of prepare.sh --pool)
POOL_SHAPE=${POOL_SHAPE:-llama-3.1-8b}
POOL_TOKENS=${POOL_TOKENS:-8192}
POOL_REPEAT=${POOL_REPEAT:-5}
POOL_LAYER_GROUPS=${POOL_LAYER_GROUPS:-4}
POOL_SEGMENT_GB=${POOL_SEGMENT_GB:-4}
# profile (restore_profile.py)
PROFILE_MODEL=${PROFILE_MODEL:-$MODEL}
PROFILE_TOKENS=${PROFILE_TOKENS:-9104}
PROFILE_SYSTEMS=${PROFILE_SYSTEMS:-raw,raw_blob,kvtc16}
# compare (the same bench gpu on OLD_TREE and on this tree, alternating)
if [ "$SMOKE" != 0 ]; then
  COMPARE_SHAPE=${COMPARE_SHAPE:-smollm2-135m} COMPARE_CONFIG=${COMPARE_CONFIG:-2x256} COMPARE_REPEAT=${COMPARE_REPEAT:-2}
  COMPARE_PAIRS=${COMPARE_PAIRS:-2} COMPARE_EXTRA=${COMPARE_EXTRA:---cpu-tokens 64}
fi
COMPARE_SHAPE=${COMPARE_SHAPE:-mistral-nemo-12b}
COMPARE_CONFIG=${COMPARE_CONFIG:-8x8192}
COMPARE_LAYER_GROUPS=${COMPARE_LAYER_GROUPS:-1}
COMPARE_REPEAT=${COMPARE_REPEAT:-5}
COMPARE_SKIP=${COMPARE_SKIP-accuracy $COMPARE_SHAPE,nvCOMP sync check,overlap check,codec choice,layer-group variant,cpu path}
COMPARE_PAIRS=${COMPARE_PAIRS:-3}    # at most this many old/new pairs; fewer when time runs short (at least one)
COMPARE_RUN_S=${COMPARE_RUN_S:-90}   # the first run's limit; later runs plan with the slowest measured run
COMPARE_EXTRA=${COMPARE_EXTRA:-}

# each check's minimum (skipped below it) and cap (seconds; override with <CHECK>_S)
declare -A MIN=([tests]=45 [codec]=40 [gpu]=120 [tiers]=45 [serve]=60 [handoff]=90 [profile]=45 [compare]=130
  [calibrate]=120 [grants]=120 [pool]=60)
declare -A CAP=([tests]=${TESTS_S:-240} [codec]=${CODEC_S:-150} [gpu]=${GPU_S:-330} [tiers]=${TIERS_S:-150}
  [serve]=${SERVE_S:-470} [handoff]=${HANDOFF_S:-390} [profile]=${PROFILE_S:-240} [compare]=${COMPARE_S:-$TOTAL_S}
  [calibrate]=${CALIBRATE_S:-$TOTAL_S} [grants]=${GRANTS_S:-$TOTAL_S} [pool]=${POOL_S:-300})
if [ "$SMOKE" != 0 ]; then MIN[gpu]=30; MIN[compare]=60; fi

# ------------------------------------------------------------------------------------------------- helpers
DRY_T=0  # --dry-run: the seconds each check was granted, as if it had used them all
el() { echo $(($(date +%s) - T0 + DRY_T)); }
left() { echo $((TOTAL_S - RESERVE_S - $(el))); }
step() { echo "== [$(el)s] $*"; }
die() { echo "!! FATAL: $*"; exit 1; }
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
: >"$OUT/summary.txt"
KEEP=("summary.txt" "env.txt")   # copied beside results.tar.gz when the results are packed
note() { echo "$*" | tee -a "$OUT/summary.txt"; }

# x LOG SECONDS CMD...: run CMD under a deadline (SIGINT first: the benchmarks write their JSON on the way out),
# its output to LOG; --dry-run prints it instead
x() {
  local log=$1 secs=$2
  shift 2
  if [ "$DRY" = 1 ]; then
    printf '   + timeout %ss' "$secs"; printf ' %q' "$@"; printf ' >%s\n' "$log"
    return 0
  fi
  if [ "$secs" -lt 5 ]; then  # (timeout 0 would mean no limit at all)
    echo "!! no time left for: ${*:1:6} ..." | tee "$log"
    return 124
  fi
  timeout -s INT -k 20 "$secs" "$@" >"$log" 2>&1
}
quiet() { grep -vE "(NIXL INFO|^INFO|^WARNING|^[0-9-]+ [0-9:]+ NIXL|^\[[0-9.]+\] \[)" "$@"; }

# grant NAME INDEX: seconds for the check at INDEX of CHECKS, or nothing when it must be skipped
grant() {
  local name=$1 i=$2 later=0 j l g
  for ((j = i + 1; j < ${#CHECKS[@]}; j++)); do later=$((later + ${MIN[${CHECKS[$j]}]})); done
  l=$(left)
  g=$((l - later))
  [ "$g" -gt "${CAP[$name]}" ] && g=${CAP[$name]}
  if [ "$g" -lt "${MIN[$name]}" ]; then  # the earlier check goes first: take from the later ones' minimums
    g=$l
    [ "$g" -gt "${CAP[$name]}" ] && g=${CAP[$name]}
  fi
  [ "$g" -ge "${MIN[$name]}" ] && echo "$g"
}

# ------------------------------------------------------------------------------------------------- setup, once
step "run.sh ${CHECKS[*]} (TOTAL_S=$TOTAL_S, OUT=$OUT$([ "$SMOKE" != 0 ] && echo ", smoke")$([ $DRY = 1 ] && echo ", dry run"))"
if [ "$WHEELS" != 0 ] && ls "$WHEEL_DIR"/*.whl >/dev/null 2>&1; then
  step "install wheels from $WHEEL_DIR/: $(find "$WHEEL_DIR" -maxdepth 1 -name '*.whl' -printf '%f\n' | sed 's/-.*//' | sort | tr '\n' ' ')"
  if [ "$DRY" = 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$WHEEL_DIR"/*.whl || die "wheel install failed"
    # prepare.sh --pool drops mooncake's second copy of its etcd wrapper (10 MB): the store's name links to the other
    for lib in /tmp/site/mooncake_transfer_engine_non_cuda.libs/libetcd_wrapper-*.so; do
      [ -e "$lib" ] && [ ! -e /tmp/site/mooncake/libetcd_wrapper.so ] && ln -s "$lib" /tmp/site/mooncake/libetcd_wrapper.so
    done
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  step "no wheels installed ($WHEEL_DIR/*.whl absent or WHEELS=0): nvCOMP/NIXL only if already importable"
fi
BASE_PYTHONPATH=${PYTHONPATH:-}
export PYTHONPATH=$ROOT${BASE_PYTHONPATH:+:$BASE_PYTHONPATH}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

commit_of() {  # a tree's commit: its COMMIT file (prepare.sh writes them), else git where .git travelled
  if [ -f "$1/COMMIT" ]; then cat "$1/COMMIT"
  elif [ -e "$1/.git" ]; then git -C "$1" describe --always --dirty --abbrev=12 2>/dev/null || echo unknown
  elif [ "$1" = . ] && [ -f "$WHEEL_DIR/COMMIT" ]; then cat "$WHEEL_DIR/COMMIT"
  else echo unknown; fi
}
code_hash() {  # sha256 over dynamo_kvtc/**/*.py (path + content): the same on this machine for the same code
  (cd "$1" && find dynamo_kvtc -name '*.py' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
}
step "environment -> $OUT/env.txt"
{
  date -u +"date %Y-%m-%dT%H:%M:%SZ"
  echo "commit $(commit_of .)  code-sha256 $(code_hash .)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.sm --format=csv,noheader 2>/dev/null \
    || echo "no nvidia-smi"
  echo "cpus $(nproc); $(free -g 2>/dev/null | awk '/^Mem/ {print "memory " $2 " GiB"}')"
  "$PY" integration/gpu/env_check.py
  env | grep -E "^(DYN_KVTC_|UCX_)" | sort
} 2>&1 | tee "$OUT/env.txt"
grep -q "IMPORTS OK" "$OUT/env.txt" || [ "$DRY" = 1 ] || die "import check failed (output above)"

# ------------------------------------------------------------------------------------------------- checks
# each takes its directory and its seconds; returns 0 (passed) or not; KEEP+=(files worth bringing back on their own)
check_tests() {
  local d=$1 s=$2 st=0
  # shellcheck disable=SC2086  # TEST_FILES is a list of paths
  x "$d/pytest.log" "$s" "$PY" -m pytest -q -p no:cacheprovider -rs --continue-on-collection-errors \
    -m "$TEST_MARK" ${TEST_K:+-k "$TEST_K"} $TEST_FILES || st=$?
  [ "$DRY" = 1 ] && return 0
  grep -E "^(FAILED|ERROR)" "$d/pytest.log" | head -20
  tail -1 "$d/pytest.log"
  KEEP+=("tests/pytest.log")
  return "$st"
}

check_codec() {
  local d=$1 s=$2 st=0 end=$(($(el) + $2)) tag dev=$DEV
  for tag in $CODEC_TAGS; do
    x "$d/codec-smollm2-$tag.log" $((end - $(el))) "$PY" -m dynamo_kvtc.cli.main bench codec --device "$dev" \
      --synthetic smollm2-135m --tokens "$CODEC_TOKENS" --tag "$tag" --json "$d/bench-codec-$dev-smollm2-$tag.json" \
      || st=$?
    [ "$DRY" = 0 ] && quiet "$d/codec-smollm2-$tag.log" | tail -6
  done
  if [ "$CODEC_NEMO" != 0 ]; then
    x "$d/codec-nemo-ans.log" $((end - $(el))) "$PY" -m dynamo_kvtc.cli.main bench codec --device "$dev" \
      --synthetic mistral-nemo-12b --tokens "$CODEC_TOKENS" --ratios 16 --tag ans \
      --json "$d/bench-codec-$dev-nemo-ans.json" || st=$?
    [ "$DRY" = 0 ] && quiet "$d/codec-nemo-ans.log" | tail -4
  fi
  if [ "$CODEC_HOST" != 0 ] && [ "$dev" != cpu ]; then
    x "$d/codec-host-cpu.log" $((end - $(el))) "$PY" -m dynamo_kvtc.cli.main bench codec --device cpu \
      --synthetic smollm2-135m --tokens "$CODEC_TOKENS" --ratios 16 --repeat 1 \
      --json "$d/bench-codec-host-cpu-smollm2.json" || st=$?
    [ "$DRY" = 0 ] && quiet "$d/codec-host-cpu.log" | tail -3
  fi
  return "$st"
}

fused_smoke() {  # one strict round trip through the Triton kernels against the reference path
  DYN_KVTC_FUSED_STRICT=1 x "$1/fused-smoke.log" 120 "$PY" integration/gpu/fused_smoke.py --device cuda
}

# gpu_args ARRAY-NAME: the bench gpu arguments the knobs describe
gpu_args() {
  local -n a=$1
  a=()
  [ "$GPU_SHAPES" != all ] && a+=(--shapes "$GPU_SHAPES")
  [ "$GPU_CONFIGS" != all ] && a+=(--configs "$GPU_CONFIGS")
  a+=(--layer-groups "$GPU_LAYER_GROUPS" --codec-sms "$GPU_CODEC_SMS" --repeat "$GPU_REPEAT")
  [ -n "$GPU_SKIP" ] && a+=(--skip "$GPU_SKIP")
  # shellcheck disable=SC2206  # GPU_EXTRA is a list of arguments
  [ -n "$GPU_EXTRA" ] && a+=($GPU_EXTRA)
}

check_gpu() {
  local d=$1 s=$2 st=0 t args
  t=$(el)
  if [ "$FUSED_SMOKE" != 0 ] && [ "$SMOKE" = 0 ]; then
    if ! fused_smoke "$d"; then
      [ "$DRY" = 0 ] && { tail -25 "$d/fused-smoke.log"; echo "!! fused smoke failed: bench gpu not run"; }
      KEEP+=("gpu/fused-smoke.log")
      return 2
    fi
    [ "$DRY" = 0 ] && tail -1 "$d/fused-smoke.log"
    s=$((s - ($(el) - t)))
  fi
  gpu_args args
  # optional parts stop 40 s before the hard limit; the JSON is rewritten after every configuration
  x "$d/bench-gpu.log" "$s" "$PY" -m dynamo_kvtc.cli.main bench gpu "${args[@]}" --budget-s $((s > 100 ? s - 40 : s / 2)) \
    --json "$d/bench-gpu.json" --plot "$d/bench-gpu.png" || st=$?
  [ "$DRY" = 1 ] && return 0
  grep -E "^(bench gpu|ceilings)" "$d/bench-gpu.log"
  if grep -q "^=== summary" "$d/bench-gpu.log"; then
    sed -n '/^=== summary/,$p' "$d/bench-gpu.log"
  else
    echo "!! bench gpu did not finish (status $st); last lines of its log:"
    quiet "$d/bench-gpu.log" | tail -30
  fi
  KEEP+=("gpu/bench-gpu.json")
  return "$st"
}

check_tiers() {
  local d=$1 s=$2 st=0 end=$(($(el) + $2)) shape
  mkdir -p /tmp/kvtc-disk
  for shape in $TIERS_SHAPES; do
    x "$d/tiers-$shape.log" $((end - $(el))) "$PY" -m dynamo_kvtc.cli.main bench tiers --device "$DEV" \
      --synthetic "$shape" --tokens "$TIERS_TOKENS" --ratios 16 --repeat "$TIERS_REPEAT" --disk-dir /tmp/kvtc-disk \
      --json "$d/bench-tiers-$DEV-$shape.json" || st=$?
    [ "$DRY" = 0 ] && quiet "$d/tiers-$shape.log" | tail -8
    KEEP+=("tiers/bench-tiers-$DEV-$shape.json")
  done
  return "$st"
}

# PLAN: runs separated by ';', each "MODEL WORKLOAD BUDGETS SYSTEMS [QPS-list|-] [KEY=VALUE,...]"; PARAMS apply to a
# run of WORKLOAD without its own parameters. Each run: serve-<model>-<workload>[-qps][-N].{json,png,log} (-N: the
# Nth run of the same model and workload in one call). An lmbench run without a QPS list sweeps 0.5,1,2.
check_serve() {
  local d=$1 s=$2 st=0 end=$(($(el) + $2)) run M W B S Q P name l n
  local -a runs qargs pargs extra
  # shellcheck disable=SC2206  # SERVE_EXTRA is a list of arguments
  extra=($SERVE_EXTRA)
  IFS=';' read -ra runs <<<"$PLAN"
  for run in "${runs[@]}"; do
    read -r M W B S Q P <<<"$run"
    [ -z "$M" ] && continue
    [ "$Q" = "-" ] && Q=""
    l=$((end - $(el)))
    [ "$l" -lt 20 ] && { echo "!! no time left for: $run"; st=3; break; }
    name="serve-$M-$W${Q:+-qps}"
    n=2  # a second run of the same model and workload in one call gets -2, -3, ... instead of overwriting the first
    while [ -e "$d/$name.json" ] || [ -e "$d/$name.log" ]; do name="serve-$M-$W${Q:+-qps}-$n"; n=$((n + 1)); done
    qargs=()
    [ -n "$Q" ] && qargs=(--qps "$Q")
    pargs=()
    if [ -n "$P" ]; then for p in ${P//,/ }; do pargs+=(--param "$p"); done
    elif [ "$W" = "$WORKLOAD" ]; then for p in $PARAMS; do pargs+=(--param "$p"); done; fi
    echo "   bench serve --model $M --workload $W budgets $B systems $S ${Q:+qps $Q} (stops in ${l}s)"
    x "$d/$name.log" "$l" "$PY" -m dynamo_kvtc.cli.main bench serve --model "$M" --device "$DEV" --workload "$W" \
      "${pargs[@]}" "${qargs[@]}" --budgets "$B" --systems "$S" --save-trace "$d/trace-$W.jsonl" \
      --json "$d/$name.json" --plot "$d/$name.png" "${extra[@]}" || st=$?
    [ "$DRY" = 0 ] && quiet "$d/$name.log" | tail -25
    KEEP+=("serve/$name.json")
  done
  return "$st"
}

check_handoff() {
  local d=$1 s=$2 st=0 end=$(($(el) + $2)) best tls kv l
  "$PY" -c "import zmq, dynamo_kvtc.bench.transfer; from dynamo_kvtc.transport.nixl_io import import_nixl; import_nixl()" \
    >"$d/imports.log" 2>&1 || [ "$DRY" = 1 ] || {
    tail -3 "$d/imports.log"
    echo "!! NIXL or zmq does not import: carry the NIXL wheel (and a pyzmq cp312 wheel if the image lacks it)"
    return 1
  }
  export UCX_PROTO_INFO=${UCX_PROTO_INFO:-y}  # UCX prints the protocols it picks: did the READs go by cuda_ipc?
  if [ "$PROBE" != 0 ] && [ -z "${UCX_TLS:-}" ]; then
    # two processes on one GPU READ at ~3.3 Gb/s with UCX's defaults: measure each candidate transport between
    # these two devices and run the benchmark on the fastest (docs/performance.md, issue 17)
    echo "   UCX transport probe ($PREFILL_DEVICE -> $DECODE_DEVICE): $PROBE_TLS"
    x "$d/probe.jsonl" $((end - $(el) < 200 ? end - $(el) : 200)) "$PY" integration/gpu/ucx_probe.py "$d/probe" \
      "$PREFILL_DEVICE" "$DECODE_DEVICE" --client-timeout 60 --tls "$PROBE_TLS"
    if [ "$DRY" = 0 ]; then
      cut -c1-240 "$d/probe.jsonl"
      best=$("$PY" -c "import json, sys
rows = []
for x in open(sys.argv[1]):
    try: rows.append(json.loads(x))
    except ValueError: pass
ok = [r for r in rows if r.get('ok')]
print(max(ok, key=lambda r: r['gbps_GBs'])['tls'] if ok else 'default')" "$d/probe.jsonl" 2>/dev/null || echo default)
      tls=${best%%@*}
      [ "$tls" != default ] && export UCX_TLS=${tls//+/,}
      if [ "$best" != "$tls" ]; then for kv in $(echo "${best#*@}" | tr '@' ' '); do export "${kv?}"; done; fi
      echo "probe: fastest $best (UCX_TLS=${UCX_TLS:-default})" | tee -a "$OUT/env.txt"
    fi
  fi
  if [ "$HANDOFF_TESTS" != 0 ]; then
    l=$((end - $(el) - 60))
    [ "$l" -gt 150 ] && l=150
    if [ "$l" -ge 30 ]; then
      x "$d/pytest-handoff.log" "$l" "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_handoff_device.py \
        tests/test_handoff_policy.py tests/test_handoff_stream.py || st=2
      [ "$DRY" = 0 ] && tail -4 "$d/pytest-handoff.log"
    fi
  fi
  l=$((end - $(el)))
  [ "$l" -lt 30 ] && { echo "!! no time left for bench transfer"; return 3; }
  local -a rep=()
  [ -n "$REPLAY" ] && rep=(--replay-gbps "$REPLAY")
  x "$d/bench-transfer-handoff.log" "$l" "$PY" -m dynamo_kvtc.cli.main bench transfer --shapes "$HANDOFF_SHAPES" \
    --tokens "$HANDOFF_TOKENS" --link-gbps "$LINKS" --prefill-device "$PREFILL_DEVICE" \
    --decode-device "$DECODE_DEVICE" --rank "$HANDOFF_RANK" --layer-groups "$HANDOFF_LAYER_GROUPS" \
    --repeat "$HANDOFF_REPEAT" --timeout 60 "${rep[@]}" --json "$d/bench-transfer-handoff.json" || st=3
  [ "$DRY" = 1 ] && return 0
  quiet "$d/bench-transfer-handoff.log" | grep -v "^[|+]" | tail -20
  # the table is printed last (UCX's protocol tables also start with "|")
  sed -n '/^| shape | prompt/,$p' "$d/bench-transfer-handoff.log" | grep "^|" | tee "$d/table.md"
  echo "UCX protocol lines naming cuda_ipc: $(grep -c cuda_ipc "$d/bench-transfer-handoff.log")" | tee -a "$OUT/env.txt"
  KEEP+=("handoff/bench-transfer-handoff.json" "handoff/table.md")
  return "$st"
}

# the hand-off latency of OLD_TREE against this tree, alternating pairs (grant_pairs.py; sealed, CURVE channel)
check_grants() {
  local d=$1 s=$2 st=0
  [ -d "$OLD_TREE/dynamo_kvtc" ] || [ "$DRY" = 1 ] || { echo "!! $OLD_TREE/dynamo_kvtc is missing (prepare.sh --old REV)"; return 1; }
  echo "   old $OLD_TREE: commit $(commit_of "$OLD_TREE"); $GRANTS_UCX" | tee -a "$OUT/env.txt"
  # shellcheck disable=SC2086  # GRANTS_UCX is a list of NAME=VALUE
  env $GRANTS_UCX true  # (a malformed list fails here, before the runs)
  # shellcheck disable=SC2086
  x "$d/grant-pairs.log" "$s" env $GRANTS_UCX "$PY" integration/handoff/grant_pairs.py "$d/grant-pairs.json" \
    --old "$OLD_TREE" --new "$ROOT" --pairs "$GRANTS_PAIRS" --bench-args "$GRANTS_ARGS" --run-timeout $((s / 2)) || st=$?
  [ "$DRY" = 0 ] && grep -E "^\||median|ratio" "$d/grant-pairs.log" | tail -20
  KEEP+=("grants/grant-pairs.json")
  return "$st"
}

# bench pool on the GPU: two stores restore through a real mooncake_master on loopback (TCP), sealed kvtc vs raw
check_pool() {
  local d=$1 s=$2 st=0
  x "$d/bench-pool.log" "$s" "$PY" -m dynamo_kvtc.cli.main bench pool --device "$DEV" --synthetic "$POOL_SHAPE" \
    --tokens "$POOL_TOKENS" --repeat "$POOL_REPEAT" --layer-groups "$POOL_LAYER_GROUPS" --shape "$POOL_SHAPE" \
    --segment-gb "$POOL_SEGMENT_GB" --json "$d/bench-pool.json" || st=$?
  [ "$DRY" = 0 ] && quiet "$d/bench-pool.log" | grep -vE "^[IWE][0-9]{4} " | tail -16
  KEEP+=("pool/bench-pool.json")
  return "$st"
}

check_profile() {
  local d=$1 s=$2 st=0
  x "$d/restore-profile.log" "$s" "$PY" integration/gpu/restore_profile.py --model "$PROFILE_MODEL" \
    --tokens "$PROFILE_TOKENS" --systems "$PROFILE_SYSTEMS" --device "$DEV" --json "$d/restore-profile.json" || st=$?
  [ "$DRY" = 0 ] && quiet "$d/restore-profile.log" | tail -15
  KEEP+=("profile/restore-profile.json")
  return "$st"
}

# calibration on the GPU: bench calibrate on random-weight real shapes (each in its own child process; a shape still
# running at the check's end is stopped and reported, the others keep their results). The full Llama-3.1-70B does not
# fit one H200 (141 GB of bf16 weights beside 107 GB of float64 moments): its first 40 layers run instead.
check_calibrate() {
  local d=$1 s=$2 st=0
  x "$d/bench-calibrate.log" "$s" "$PY" -m dynamo_kvtc.cli.main bench calibrate --device "$DEV" \
    --tokens "$CALIBRATE_TOKENS" --shapes "$CALIBRATE_SHAPES" --budget-s $((s - 20)) --no-progress \
    --out-dir /tmp/kvtc-bench-cal --json "$d/bench-calibrate.json" || st=$?
  [ "$DRY" = 0 ] && quiet "$d/bench-calibrate.log" | grep -E "^(==|   )" | tail -20
  KEEP+=("calibrate/bench-calibrate.json")
  return "$st"
}

# the same bench gpu command on OLD_TREE (a plain copy of an older checkout) and on this tree, old/new alternating
check_compare() {
  local d=$1 s=$2 st=0 end=$(($(el) + $2)) pair=0 slow=$COMPARE_RUN_S side dir t l
  local -a args
  [ -d "$OLD_TREE/dynamo_kvtc" ] || [ "$DRY" = 1 ] || {
    echo "!! $OLD_TREE/dynamo_kvtc is missing: put an older checkout there (README: compare)"
    return 1
  }
  # shellcheck disable=SC2206  # COMPARE_EXTRA is a list of arguments
  args=(bench gpu --shapes "$COMPARE_SHAPE" --configs "$COMPARE_CONFIG" --layer-groups "$COMPARE_LAYER_GROUPS"
    --repeat "$COMPARE_REPEAT" ${COMPARE_SKIP:+--skip "$COMPARE_SKIP"} --budget-s 600 $COMPARE_EXTRA)
  echo "   old $OLD_TREE: commit $(commit_of "$OLD_TREE") code-sha256 $(code_hash "$OLD_TREE" 2>/dev/null)" \
    | tee -a "$OUT/env.txt"
  echo "   command (both trees): dynamo-kvtc ${args[*]}" | tee "$d/command.txt"
  while [ "$pair" -lt "$COMPARE_PAIRS" ]; do
    l=$((end - $(el)))
    if [ "$pair" -gt 0 ] && [ "$l" -lt $((2 * slow + 10)) ]; then
      echo "   stop after $pair pair(s): ${l}s left, a pair needs ~$((2 * slow))s"
      break
    fi
    pair=$((pair + 1))
    for side in old new; do
      dir=$ROOT
      [ "$side" = old ] && dir=$(cd "$OLD_TREE" && pwd)
      l=$((end - $(el)))
      [ "$side" = old ] && l=$((l / 2))  # the new run of the pair gets as long as the old one
      [ "$l" -gt $((slow + 60)) ] && l=$((slow + 60))
      [ "$l" -lt 15 ] && { echo "!! no time left for $side $pair"; st=3; break 2; }
      t=$(el)
      (cd "$dir" && PYTHONPATH=$dir${BASE_PYTHONPATH:+:$BASE_PYTHONPATH} \
        x "$d/$side-$pair.log" "$l" "$PY" -m dynamo_kvtc.cli.main "${args[@]}" --json "$d/$side-$pair.json") \
        || st=$?
      t=$(($(el) - t))
      [ "$t" -gt "$slow" ] && [ "$DRY" = 0 ] && slow=$t
      echo "   $side $pair: ${t}s (exit ${st})"
    done
  done
  [ "$DRY" = 1 ] && return 0
  "$PY" integration/gpu/compare_table.py "$d" "$OLD_TREE" | tee "$d/table.md"
  KEEP+=("compare/table.md" "compare/compare.json")
  return "$st"
}

# ------------------------------------------------------------------------------------------------- run them
RC=0
for ((i = 0; i < ${#CHECKS[@]}; i++)); do
  c=${CHECKS[$i]}
  g=$(grant "$c" "$i")
  if [ -z "$g" ]; then
    note "SKIP $c: needs at least ${MIN[$c]}s, $(left)s left of TOTAL_S=$TOTAL_S"
    [ "$RC" = 0 ] && RC=3
    continue
  fi
  mkdir -p "$OUT/$c"
  step "$c (up to ${g}s; $(left)s left)"
  t=$(el)
  "check_$c" "$OUT/$c" "$g"
  st=$?
  if [ "$DRY" = 1 ]; then
    DRY_T=$((DRY_T + g))
    note "DRY $c ${g}s"
  elif [ "$st" = 0 ]; then
    note "PASS $c $(($(el) - t))s $OUT/$c/"
  else
    note "FAIL $c (status $st) $(($(el) - t))s $OUT/$c/"
    RC=2
  fi
done

# ------------------------------------------------------------------------------------------------- bring back
step "done in $(el)s"
n=$(find "$OUT" -type f | wc -l)
if [ "$DRY" = 0 ] && [ "$n" -gt 8 ]; then  # the device call brings back 8 files: pack, keep the main ones beside
  tar -C "$OUT" -czf /tmp/results.tar.gz . && {
    keep=/tmp/run-keep
    rm -rf "$keep" && mkdir -p "$keep"
    for f in "${KEEP[@]}"; do [ -f "$OUT/$f" ] && cp "$OUT/$f" "$keep/${f//\//-}"; done
    rm -rf "${OUT:?}"/* && mv /tmp/results.tar.gz "$OUT/" && cp "$keep"/* "$OUT/" 2>/dev/null
    # at most 7 beside the archive
    find "$OUT" -maxdepth 1 -type f ! -name results.tar.gz | sort | tail -n +8 | xargs -r rm -f
    echo "$n files packed into $OUT/results.tar.gz (tar -xzf it); beside it: $(find "$OUT" -maxdepth 1 -type f -printf '%f ')"
  }
fi
cat "$OUT/summary.txt"
exit $RC

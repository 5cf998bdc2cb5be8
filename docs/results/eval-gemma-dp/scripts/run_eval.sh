#!/bin/bash
# usage: run_eval.sh MAIN_CAL OUTDIR LENGTHS [ABL_NAME=ABL_DIR]
cd /work/main
abl=()
[ -n "$4" ] && abl=(--ablation "$4")
date -u
time HF_HUB_OFFLINE=1 nice -n 10 .venv/bin/python -m dynamo_kvtc.cli.main eval --model gemma3-270m --calibration "$1" --preset long --tasks ppl passkey --lengths "$3" --ratios 16 --no-baselines --no-ablations "${abl[@]}" --out "$2"
date -u

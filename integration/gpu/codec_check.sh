#!/usr/bin/env bash
# GPU check of the codec, run on an H200 through the device tool (see docs/benchmarks.md):
#   ../shared/tools/gpu-wheels.sh            # once, fills .whl/ with nvCOMP + NIXL wheels
#   device run, carry [".whl"], command: bash integration/gpu/codec_check.sh
# Runs the GPU tests (CPU<->GPU parity, nvCOMP<->zlib, tiers on CUDA) and codec and tier benchmarks; results land in
# $OUT. SKIP_CODEC=1 skips the codec benchmarks, CODEC_TAGS picks their entropy codecs.
# The shipped calibrations (34 MB) plus the wheels exceed the 64 MiB a device call carries: untrack them for the call
#   git rm -r -q --cached calibrations && echo /calibrations/ >> .git/info/exclude   (then git reset -q; remove the line)
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch; from nvidia import nvcomp; print('torch', torch.__version__, 'nvcomp', nvcomp.__version__)"
python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_codec.py tests/test_container.py tests/test_tiers.py -rs 2>&1 \
  | tee "$OUT/pytest-gpu.log" | tail -15
kvtc() { python3 -m dynamo_kvtc.cli.main "$@"; }
if [ -z "${SKIP_CODEC:-}" ]; then
for tag in ${CODEC_TAGS:-deflate gdeflate ans}; do
  kvtc bench codec --device cuda --synthetic smollm2-135m --tokens 8192 --tag "$tag" \
    --json "$OUT/bench-codec-cuda-smollm2-$tag.json" 2>&1 | tail -6
done
kvtc bench codec --device cuda --synthetic mistral-nemo-12b --tokens 8192 --ratios 16 --tag ans \
  --json "$OUT/bench-codec-cuda-nemo-ans.json" 2>&1 | tail -4
kvtc bench codec --device cpu --synthetic smollm2-135m --tokens 8192 --ratios 16 --repeat 1 \
  --json "$OUT/bench-codec-h200host-cpu-smollm2.json" 2>&1 | tail -3
fi
for shape in smollm2-135m mistral-nemo-12b; do
  kvtc bench tiers --device cuda --synthetic "$shape" --tokens 8192 --ratios 16 --repeat 2 --disk-dir /tmp \
    --json "$OUT/bench-tiers-cuda-$shape.json" 2>&1 | grep -v NIXL | tail -3
done

#!/usr/bin/env bash
# H200 check of the GPU-speed work (issue #6): fused kernels + batched nvCOMP, the GPU tests, `dynamo-kvtc bench gpu`.
# Run through the device tool from the repository root:
#   carry [".whl"], command: bash integration/gpu/perf_check.sh
# The wheels (.whl/: nvCOMP, NIXL, pytest-asyncio) plus the shipped calibrations exceed the 64 MiB a call carries:
# untrack the calibrations for the call as codec_check.sh says (nothing here needs them):
#   git rm -r -q --cached calibrations && echo /calibrations/ >> .git/info/exclude   (afterwards: git reset -q; drop the line)
# Budget: about 8 minutes (install ~20 s, GPU tests ~2 min, benchmark the rest; the benchmark skips optional parts
# rather than run over). Writes at most 5 files to $OUT: pytest-gpu.log, bench-gpu.json, bench-gpu.png,
# bench-gpu.log, env.txt. Exit status: 0 all good, 1 setup/import failure (stops at once), 2 tests failed,
# 3 benchmark failed.
set -uo pipefail
T0=$(date +%s)
OUT=${OUT:-out/perf}
TOTAL_S=${TOTAL_S:-500}
mkdir -p "$OUT"
el() { echo $(($(date +%s) - T0)); }
step() { echo "== [$(el)s] $*"; }
die() { echo "!! FATAL: $*"; exit 1; }

step "install wheels from .whl/"
ls .whl/*.whl >/dev/null 2>&1 || die "no wheels in .whl/ (run with carry [\".whl\"])"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || die "wheel install failed"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

step "environment"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.sm --format=csv,noheader
  nproc
  python3 -c "import sys; print(sys.version)"
} 2>&1 | tee "$OUT/env.txt"
python3 - <<'EOF' 2>&1 | tee -a "$OUT/env.txt"
import torch, triton
from nvidia import nvcomp
import dynamo_kvtc
from dynamo_kvtc.codec.gpu import triton_kernels  # noqa: F401  (the kernels' module: Triton decorates them here)
from dynamo_kvtc import settings
from dynamo_kvtc.codec.gpu import fused_status
from dynamo_kvtc.bench import gpu  # noqa: F401
assert torch.cuda.is_available(), "torch sees no CUDA device"
print("IMPORTS OK: torch", torch.__version__, "cuda", torch.version.cuda, "| triton", triton.__version__,
      "| nvcomp", nvcomp.__version__, "| gpu", torch.cuda.get_device_name(0), "| fused", fused_status("cuda"),
      "| GPU entropy default", settings.env_value("gpu_entropy"))
EOF
grep -q "IMPORTS OK" "$OUT/env.txt" || die "import check failed (output above)"

step "fused smoke: one GPU round trip with the Triton kernels (stops here if they do not compile or disagree)"
python3 - <<'EOF' || die "fused smoke failed (traceback above)"
import time, torch
from dynamo_kvtc import KvtcCodec
from dynamo_kvtc.codec import CodecOptions
from dynamo_kvtc.calibration.synthetic import synthetic_calibration, synthetic_kv
t0 = time.time()
cal = synthetic_calibration(8, 4, 64, theta=1e4, ratios=(16,), rank=512, dp_rows=1024, device="cuda")
k, v, pos = synthetic_kv(cal, 1000, device="cuda")
ref = KvtcCodec(cal, ratio=16, device="cuda", tag="deflate", fused=False)
fus = KvtcCodec(cal, ratio=16, device="cuda", tag="ans", fused=True, options=CodecOptions(fused_strict=True))
b = fus.encode(k, v, pos)
kf, vf = fus.decode(b)
kr, vr = ref.decode(ref.encode(k, v, pos))
e = lambda a, x: float((a.float() - x.float())[:, 4:-128].norm() / x.float()[:, 4:-128].norm())
print(f"smoke ok in {time.time() - t0:.1f} s: ops={fus.fused.ops.name}, rel err K fused {e(kf, k):.4f} vs reference "
      f"{e(kr, k):.4f}, V {e(vf, v):.4f} vs {e(vr, v):.4f}, nvCOMP decode mode {fus.fused.entropy.decode_mode!r}")
assert fus.fused.ops.name == "triton" and not fus.fused.kernel_errors
assert abs(e(kf, k) - e(kr, k)) < 0.05 * e(kr, k) + 1e-3
EOF

step "GPU tests (tests/test_gpu*.py)"
TEST_STATUS=0
timeout 300 python3 -m pytest -q -p no:cacheprovider -rs --continue-on-collection-errors tests/test_gpu*.py >"$OUT/pytest-gpu.log" 2>&1 || TEST_STATUS=2
grep -E "^(FAILED|ERROR)" "$OUT/pytest-gpu.log" | head -20
TEST_SUMMARY=$(tail -1 "$OUT/pytest-gpu.log")
echo "   tests: $TEST_SUMMARY"

BUDGET=$((TOTAL_S - $(el) - 30))
[ "$BUDGET" -lt 150 ] && BUDGET=150
HARD=$((575 - $(el)))
[ "$HARD" -lt $((BUDGET + 30)) ] && BUDGET=$((HARD - 60))
step "dynamo-kvtc bench gpu (optional parts stop after ${BUDGET}s, hard stop ${HARD}s)"
BENCH_STATUS=0
timeout "$HARD" python3 -m dynamo_kvtc.cli.main bench gpu --budget-s "$BUDGET" \
  --json "$OUT/bench-gpu.json" --plot "$OUT/bench-gpu.png" >"$OUT/bench-gpu.log" 2>&1 || BENCH_STATUS=3
grep -E "^(bench gpu|ceilings)" "$OUT/bench-gpu.log"
if grep -q "^=== summary" "$OUT/bench-gpu.log"; then
  sed -n '/^=== summary/,$p' "$OUT/bench-gpu.log"
else
  echo "!! bench gpu did not finish (status $BENCH_STATUS); last lines of its log:"
  tail -40 "$OUT/bench-gpu.log"
fi

step "done: tests=${TEST_STATUS} bench=${BENCH_STATUS}; files in $OUT: $(ls "$OUT" | tr '\n' ' ')"
echo "   GPU tests: $TEST_SUMMARY"
[ "$TEST_STATUS" -ne 0 ] && exit 2
[ "$BENCH_STATUS" -ne 0 ] && exit 3
exit 0

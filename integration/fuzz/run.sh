#!/usr/bin/env bash
# Long fuzzing runs with atheris (libFuzzer for Python). Usage:
#   integration/fuzz/run.sh [SECONDS_PER_TARGET] [TARGET...]      (default 600 s; targets: blob disk_index control)
# atheris goes into a throwaway venv ($FUZZ_VENV, default /tmp/kvtc-fuzz-venv) that borrows the project's .venv
# packages through a .pth file, so the project's environment is never modified. Findings (crash-*, leak-*, timeout-*
# files) land in $FUZZ_OUT (default out/fuzz); the corpora grow in $FUZZ_OUT/corpus-<target>.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
secs="${1:-600}"; shift || true
targets=("$@"); [ ${#targets[@]} -gt 0 ] || targets=(blob disk_index control)
venv="${FUZZ_VENV:-/tmp/kvtc-fuzz-venv}"
out="${FUZZ_OUT:-$repo/out/fuzz}"
project_site="$("$repo/.venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if [ ! -x "$venv/bin/python" ]; then
  "$repo/.venv/bin/python" -m venv "$venv"
  "$venv/bin/pip" install -q atheris
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$project_site" > "$site/kvtc-project.pth"
fi
mkdir -p "$out"
export PYTHONPATH="$repo:$here${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
for t in "${targets[@]}"; do
  corpus="$out/corpus-$t"
  mkdir -p "$corpus"
  "$venv/bin/python" "$here/fuzz_$t.py" --write-seeds "$corpus"
  echo "== fuzz_$t for ${secs}s (corpus $corpus)"
  (cd "$out" && "$venv/bin/python" "$here/fuzz_$t.py" "$corpus" -max_total_time="$secs" -rss_limit_mb=4096 \
     -timeout=30 -print_final_stats=1 -artifact_prefix="$out/$t-" 2>&1 | tail -25)
done

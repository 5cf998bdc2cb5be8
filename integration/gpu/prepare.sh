#!/usr/bin/env bash
# Get a checkout ready for a device call of integration/gpu/run.sh (run HERE, on the machine without a GPU, from the
# repository root; integration/gpu/README.md says why each step is needed):
#
#   bash integration/gpu/prepare.sh [--old REV] [--keep-calibrations] [--pool]   # before the call(s)
#   bash integration/gpu/prepare.sh --undo                               # after them
#
# 1. .whl/: the nvCOMP, NIXL and pytest-asyncio wheels (../shared/tools/gpu-wheels.sh fills it when it is empty) and
#    pyzmq (0.8 MB, for the hand-off's control channel), nvCOMP's slimmed in place (its command-line tool, C headers and the extension modules of other Pythons dropped:
#    34 -> 24 MB) so that wheels and tree fit the 64 MiB one call carries; .whl/COMMIT = this tree's commit.
# 2. calibrations/ (35 MB, which no GPU check reads) is untracked for the call and ignored (--undo tracks it again;
#    commit nothing in between). --keep-calibrations leaves it.
# 3. --old REV: .old/ = the package of commit REV (git archive: dynamo_kvtc/, pyproject.toml; ~1 MB) and
#    .old/COMMIT, ignored, for `run.sh compare .old` and `run.sh grants`.
# 4. --pool: .whl-pool/, the wheels of `run.sh pool` (bench pool on a real mooncake_master): Mooncake's client and
#    master (its benchmark tool, its C++ client and one of its two copies of the etcd wrapper dropped: 46 -> 21 MB;
#    run.sh links the dropped name), cryptography (sealing), nvCOMP as in .whl, and of NIXL only the libraries the
#    pool loads Mooncake over (libibverbs, libnl); carry [".whl-pool"] and run with WHEEL_DIR=.whl-pool.
# It ends by printing what would travel and the carry list for the call.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
EXCLUDE=$(git rev-parse --git-path info/exclude)
LIMIT=$((64 << 20))
exclude() { grep -qxF "$1" "$EXCLUDE" 2>/dev/null || printf '%s\n' "$1" >>"$EXCLUDE"; }
unexclude() { [ -f "$EXCLUDE" ] && sed -i "\\|^$1\$|d" "$EXCLUDE"; }

OLD="" KEEP_CAL=0 UNDO=0 POOL=0
while [ $# -gt 0 ]; do
  case $1 in
    --old) OLD=$2; shift ;;
    --keep-calibrations) KEEP_CAL=1 ;;
    --pool) POOL=1 ;;
    --undo) UNDO=1 ;;
    *) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 1 ;;
  esac
  shift
done

if [ "$UNDO" = 1 ]; then
  git reset -q -- calibrations && unexclude /calibrations/ && echo "calibrations/ tracked again"
  rm -rf .old .whl-pool && echo ".old/ and .whl-pool/ removed"
  git status --short | head -5
  exit 0
fi

exclude /.whl/
if ! ls .whl/*.whl >/dev/null 2>&1; then
  [ -x ../shared/tools/gpu-wheels.sh ] || { echo "no wheels in .whl/ and no ../shared/tools/gpu-wheels.sh"; exit 1; }
  ../shared/tools/gpu-wheels.sh
fi
# the hand-off's control channel needs zmq, which the H200 image lacks (the issue-17 runs carried pyzmq 27.1)
if ! ls .whl/pyzmq-*.whl >/dev/null 2>&1; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
    -d .whl "pyzmq==27.1.0" || echo "!! no pyzmq wheel: the hand-off tests and run.sh handoff will miss zmq"
fi
python3 - <<'EOF'
import pathlib, re, shutil, tempfile, zipfile
drop = re.compile(r"^(nvidia/libnvcomp/bin/|nvidia/libnvcomp/include/|nvidia/nvcomp/nvcomp_impl\.cpython-(?!312-)[^/]+\.so$)").match
for w in pathlib.Path(".whl").glob("nvidia_*nvcomp*.whl"):
    with zipfile.ZipFile(w) as zi:
        if not any(drop(i.filename) for i in zi.infolist()):
            continue
        tmp = pathlib.Path(tempfile.mkdtemp()) / w.name
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zo:
            for info in zi.infolist():
                if drop(info.filename):
                    continue
                data = zi.read(info)
                if info.filename.endswith(".dist-info/RECORD"):
                    data = b"".join(l for l in data.splitlines(True) if not drop(l.decode()))
                zo.writestr(info, data)
    before = w.stat().st_size
    shutil.move(tmp, w)
    print(f"slimmed {w.name}: {before / 1e6:.1f} -> {w.stat().st_size / 1e6:.1f} MB")
EOF
git describe --always --dirty --abbrev=12 >.whl/COMMIT

if [ "$POOL" = 1 ]; then
  exclude /.whl-pool/
  rm -rf .whl-pool && mkdir .whl-pool
  cp .whl/nvidia_*nvcomp*.whl .whl/COMMIT .whl-pool/
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl-pool \
    "mooncake-transfer-engine-non-cuda==0.3.13.post1" "cryptography>=42" cffi pycparser
  python3 - <<'EOF'
import pathlib, re, shutil, tempfile, zipfile
# what the pool does not load: Mooncake's benchmark and C++ client, the store's copy of the etcd wrapper (run.sh
# links that name to the master's copy); of NIXL all but its Python package's files and libibverbs/libnl
drops = {
    "mooncake_transfer_engine_non_cuda-": re.compile(r"^mooncake/(transfer_engine_bench|mooncake_client|libetcd_wrapper\.so)$").match,
    "nixl_cu13-": lambda f: not re.match(r"^(nixl_cu13/[^/]+\.py|nixl_cu13\.libs/lib(ibverbs|nl-3|nl-route-3)-[^/]+|nixl_cu13-[^/]+\.dist-info/.*)$", f),
}
for src in [*pathlib.Path(".whl-pool").glob("mooncake*.whl"), *pathlib.Path(".whl").glob("nixl_cu13-*.whl")]:
    drop = next(d for k, d in drops.items() if src.name.startswith(k))
    before = src.stat().st_size
    tmp = pathlib.Path(tempfile.mkdtemp()) / src.name
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zo:
        for info in zi.infolist():
            if drop(info.filename):
                continue
            data = zi.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                data = b"".join(l for l in data.splitlines(True) if not drop(l.decode().split(",")[0]))
            zo.writestr(info, data)
    out = pathlib.Path(".whl-pool") / src.name
    shutil.move(tmp, out)
    print(f"slimmed {src.name}: {before / 1e6:.1f} -> {out.stat().st_size / 1e6:.1f} MB")
EOF
fi

if [ "$KEEP_CAL" = 0 ] && git ls-files --error-unmatch calibrations >/dev/null 2>&1; then
  git rm -r -q --cached calibrations && exclude /calibrations/
  echo "calibrations/ untracked for the call (undo: bash integration/gpu/prepare.sh --undo)"
fi

CARRY='".whl"'
if [ -n "$OLD" ]; then
  rm -rf .old && mkdir .old
  git archive "$OLD" dynamo_kvtc pyproject.toml | tar -x -C .old
  git rev-parse --short=12 "$OLD" >.old/COMMIT
  exclude /.old/
  CARRY="$CARRY, \".old\""
  echo ".old/ = $OLD ($(cat .old/COMMIT))"
fi

size() { xargs -0 -r du -cb 2>/dev/null | awk 'END {print $1 + 0}'; }
t=$(git ls-files -z --cached | size)
u=$(git ls-files -z --others --exclude-standard | size)
w=$(du -cb .whl | tail -1 | cut -f1)
[ "$POOL" = 1 ] && { w=$(du -cb .whl-pool | tail -1 | cut -f1); CARRY=${CARRY/.whl/.whl-pool}; }
o=0
[ -d .old ] && [ -n "$OLD" ] && o=$(du -cb .old | tail -1 | cut -f1)
total=$((t + u + w + o))
echo "travels: tracked $((t >> 20)) MiB + untracked $((u >> 20)) MiB + wheels $((w >> 20)) MiB + .old $((o >> 20)) MiB" \
  "= $((total >> 20)) MiB of 64"
[ "$total" -gt "$LIMIT" ] && echo "!! over the 64 MiB a call carries: untrack more, or carry fewer wheels"
echo "carry: [$CARRY]"

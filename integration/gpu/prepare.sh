#!/usr/bin/env bash
# Get a checkout ready for a device call of integration/gpu/run.sh (run HERE, on the machine without a GPU, from the
# repository root; integration/gpu/README.md says why each step is needed):
#
#   bash integration/gpu/prepare.sh [--old REV] [--keep-calibrations]   # before the call(s)
#   bash integration/gpu/prepare.sh --undo                               # after them
#
# 1. .whl/: the nvCOMP, NIXL and pytest-asyncio wheels (../shared/tools/gpu-wheels.sh fills it when it is empty) and
#    pyzmq (0.8 MB, for the hand-off's control channel), nvCOMP's slimmed in place (its command-line tool, C headers and the extension modules of other Pythons dropped:
#    34 -> 24 MB) so that wheels and tree fit the 64 MiB one call carries; .whl/COMMIT = this tree's commit.
# 2. calibrations/ (35 MB, which no GPU check reads) is untracked for the call and ignored (--undo tracks it again;
#    commit nothing in between). --keep-calibrations leaves it.
# 3. --old REV: .old/ = the package of commit REV (git archive: dynamo_kvtc/, pyproject.toml; ~1 MB) and
#    .old/COMMIT, ignored, for `run.sh compare .old`.
# It ends by printing what would travel and the carry list for the call.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
EXCLUDE=$(git rev-parse --git-path info/exclude)
LIMIT=$((64 << 20))
exclude() { grep -qxF "$1" "$EXCLUDE" 2>/dev/null || printf '%s\n' "$1" >>"$EXCLUDE"; }
unexclude() { [ -f "$EXCLUDE" ] && sed -i "\\|^$1\$|d" "$EXCLUDE"; }

OLD="" KEEP_CAL=0 UNDO=0
while [ $# -gt 0 ]; do
  case $1 in
    --old) OLD=$2; shift ;;
    --keep-calibrations) KEEP_CAL=1 ;;
    --undo) UNDO=1 ;;
    *) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 1 ;;
  esac
  shift
done

if [ "$UNDO" = 1 ]; then
  git reset -q -- calibrations && unexclude /calibrations/ && echo "calibrations/ tracked again"
  rm -rf .old && echo ".old/ removed"
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
o=0
[ -d .old ] && [ -n "$OLD" ] && o=$(du -cb .old | tail -1 | cut -f1)
total=$((t + u + w + o))
echo "travels: tracked $((t >> 20)) MiB + untracked $((u >> 20)) MiB + .whl $((w >> 20)) MiB + .old $((o >> 20)) MiB" \
  "= $((total >> 20)) MiB of 64"
[ "$total" -gt "$LIMIT" ] && echo "!! over the 64 MiB a call carries: untrack more, or carry fewer wheels"
echo "carry: [$CARRY]"

"""Mooncake Store's client and NIXL's UCX agents in one process: a transfer through each, correct bytes, exit 0.

The mooncake wheel's ``store.so`` needs ``libibverbs.so.1``; Debian's package for it (and the libnl it pulls) put a
second libnl beside the copy bundled in the nixl wheel, and processes died with SIGSEGV at exit in libnl's
destructors. tiers/mooncake_lib.py loads ``mooncake.store`` over NIXL's one copy instead: the child process below
must see exactly NIXL's libnl and libibverbs (plus the ``libibverbs.so.1`` copy of it), both transfers exact, and
exit cleanly, in either order of first use."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mooncake")
pytest.importorskip("nixl_cu13")

from dynamo_kvtc.tiers import mooncake_lib  # noqa: E402
from tests.mooncake_fixture import mooncake_master  # noqa: E402,F401  (the fixture)

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("order", ["nixl-first", "pool-first"])
def test_nixl_and_mooncake_in_one_process_exit_cleanly(mooncake_master, order):  # noqa: F811
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "pool_native.py"), mooncake_master.master,
         mooncake_master.metadata_server, order],
        capture_output=True, text=True, timeout=240, env=env,
    )  # fmt: skip
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["nixl"] and got["pool"], got
    nixl = {p.name for p in mooncake_lib.nixl_libs().iterdir()}
    libnl = [n for n in got["libs"] if n.startswith("libnl")]
    assert len(libnl) == 2 and set(libnl) <= nixl, got["libs"]  # one libnl-3 and one libnl-route-3: NIXL's
    assert set(got["libs"]) - set(libnl) <= nixl | {"libibverbs.so.1"}, got["libs"]

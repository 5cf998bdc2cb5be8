"""LMCache's multi-process server with the ``kvtc`` serde registered:

    python -m dynamo_kvtc.connector.lmcache.server [lmcache.v1.multiprocess.server arguments ...]

LMCache 0.5 discovers serdes only through ``register_serde_factory`` calls made in its own process (it has no entry
point for them, and ``--server-module`` factories load after the storage manager is built), so this launcher imports
:mod:`dynamo_kvtc.connector.lmcache.serde` and then runs LMCache's server module as ``__main__`` with the same
arguments.
"""

from __future__ import annotations

import runpy

from . import serde as lmcache_serde


def main() -> None:
    if not lmcache_serde.register():
        raise SystemExit("dynamo_kvtc.connector.lmcache.server: LMCache is not installed (pip install lmcache)")
    runpy.run_module("lmcache.v1.multiprocess.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

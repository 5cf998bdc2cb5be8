"""The pool tier's settings rows (``tier`` scope, tiers/pool.py): a part of :data:`dynamo_kvtc.settings.SETTINGS`."""

from __future__ import annotations

from typing import Any

from .row import Setting


def _s(key: str, type: str, default: Any, doc: str, scope: str, **kw: Any) -> Setting:
    return Setting(key, type, default, doc, scope, **kw)


POOL_ROWS: tuple[Setting, ...] = (
    _s("pool_master", "str", None, "the cluster-wide pool tier (tiers/pool.py, on Mooncake Store): `host:port` of "
       "`mooncake_master`'s RPC port. Set, every saved blob is also written through to the pool (sealed with the "
       "cluster secret `transfer_secret_file`/`transfer_secret`) and any worker restores from it", "tier",
       default_doc="unset: no pool tier", ways=("vllm_tier",)),
    _s("pool_metadata_server", "str", None, "the pool's metadata server URL", "tier",
       default_doc="`http://<pool_master host>:8080/metadata`", ways=("vllm_tier",)),
    _s("pool_segment_gb", "float", 1.0, "memory this worker contributes to the pool (0: a client that contributes "
       "none)", "tier", lo=0, ways=("vllm_tier",)),
    _s("pool_replicas", "int", 1, "copies of each pool object (on different workers' segments)", "tier", lo=1,
       ways=("vllm_tier",)),
    _s("pool_protocol", "str", "tcp", "the pool's transport: `tcp`, or `rdma` where the cluster has it", "tier",
       choices=("tcp", "rdma"), ways=("vllm_tier",)),
    _s("pool_device", "str", None, "RDMA device names of the pool (rdma only)", "tier", default_doc="none",
       ways=("vllm_tier",)),
    _s("pool_timeout_s", "float", 2.0, "a pool read's deadline; past it the read is a miss (the engine recomputes)",
       "tier", lo=0, lo_open=True, ways=("vllm_tier",)),
    _s("pool_queue_mb", "int", 256, "the pool's write-through queue budget; a put over it is skipped and counted "
       "(`pool_put_skipped`)", "tier", lo=1, ways=("vllm_tier",)),
    _s("pool_insecure", "bool", False, "run the pool unsealed. WARNING: anyone who reaches the master then reads "
       "every prompt's KV (a KV cache reveals its prompt) and can plant blocks; without it and without a secret the "
       "pool tier refuses to start", "tier", ways=("vllm_tier",)),
)

"""The four systems ``bench cluster`` compares, at equal memory per worker, and the caches each one builds.

Every worker has ``gpu_kv_gb`` of HBM for KV (raw, LRU) and ``host_gb`` of host memory. A per-node system keeps its
host memory as that worker's own tier; a pool system contributes it to one pool that every worker reads (pool
memory = the sum of the contributed segments). kvtc holds the measured effective ratio more tokens in the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cache import BlockLRU
from .costs import Costs

__all__ = ["SYSTEMS", "Memory", "System", "Layout"]


@dataclass(frozen=True)
class System:
    name: str
    pooled: bool  # host memory is one shared pool (else: one tier per worker)
    kvtc: bool  # compressed blobs (else: raw KV)
    doc: str


SYSTEMS = {
    s.name: s
    for s in (
        System("node-raw", False, False, "per-node raw host tier (vLLM-style CPU offloading)"),
        System("node-kvtc", False, True, "per-node kvtc host tier (measured effective ratio x more tokens)"),
        System("pool-raw", True, False, "cluster pool of raw blocks (sum of host segments, shared)"),
        System("pool-kvtc", True, True, "cluster pool of sealed kvtc blobs (sum of host segments, shared)"),
    )
}


@dataclass(frozen=True)
class Memory:
    """Memory per worker, and the simulator's block size."""

    gpu_kv_gb: float = 16.0
    host_gb: float = 32.0
    block_tokens: int = 256


class Layout:
    """The caches of one system on ``workers`` workers: ``hbm[w]``, ``local[w]`` (per-node) or ``pool``; and the
    restore time per token from each place (HBM: free, the prefix is already on the GPU)."""

    def __init__(self, system: System, memory: Memory, costs: Costs, workers: int):
        b = memory.block_tokens
        kind = "kvtc" if system.kvtc else "raw"
        self.system, self.memory, self.workers, self.kind = system, memory, workers, kind
        self.hbm = [BlockLRU(int(memory.gpu_kv_gb * 1e9 / (costs.raw_bytes * b))) for _ in range(workers)]
        decode_s = costs.kvtc_restore_s if system.kvtc else costs.raw_restore_s
        self.local: list[BlockLRU] | None = None
        self.pool: BlockLRU | None = None
        if system.pooled:
            self.block_bytes = costs.pool_bytes[kind] * b  # stored in the pool and moved over the network
            self.pool = BlockLRU(int(workers * memory.host_gb * 1e9 / self.block_bytes))
            self.local_s = 0.0
            self.pool_s = costs.pool_bytes[kind] / (costs.pool_get_gbps[kind] * 1e9) + decode_s
        else:
            self.block_bytes = costs.raw_bytes * b / (costs.kvtc_ratio if system.kvtc else 1.0)
            self.local = [BlockLRU(int(memory.host_gb * 1e9 / self.block_bytes)) for _ in range(workers)]
            self.local_s = decode_s
            self.pool_s = 0.0

    def tier_capacity_blocks(self) -> int:
        """Blocks the host memory holds in all (every worker's tier, or the pool)."""
        if self.pool is not None:
            return self.pool.capacity
        return sum(t.capacity for t in self.local or [])

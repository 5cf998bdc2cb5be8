"""The systems ``bench serve`` compares, on the same requests and the same host budget.

- ``none``: no offload tier; every history is recomputed.
- ``raw``: a raw offload tier as KVBM, vLLM's OffloadingConnector and LMCache's CPU backend build it
  (:class:`~.rawtier.RawDmaTier`): a block-granular pinned host pool, offload and restore by DMA only (one copy per
  layer, K/V and run of slots; no codec, no CRC, no framing), LRU per block. The fair baseline: its bytes cost only
  the link.
- ``raw_blob``: the product's own raw mode, the same :class:`~dynamo_kvtc.tiers.KvtcStore` with the codec off
  (``ratio_policy=raw``): blobs cut into the same spans, every one stored uncompressed with its header and section
  CRCs. Slower than ``raw`` per byte (the encode path's framing and host copies); kept to show that cost.
- ``kvtc16`` / ``kvtc32``: the kvtc tier at 16x / 32x (each saved sequence's last ``window`` tokens raw).
- ``vllm_tier``: vLLM's tiered OffloadingConnector with the ``kvtc`` secondary tier (:mod:`.cascade`): a raw
  primary of a quarter of the budget, every chunk cascaded to a kvtc 16x tier holding the other three quarters; a
  chunk only in the kvtc tier is promoted into the primary before it loads (no layer-by-layer restore).
- ``policy``: kvtc 16x under ``ratio_policy=raw_first``: stored raw while the host tier has room, compressed once it
  has not.

Host budgets are fractions of the workload's raw working set (:func:`host_budget`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...tiers import TierConfig
from ...tiers.config import process_settings

__all__ = ["SYSTEMS", "System", "host_budget", "tier_config"]


@dataclass(frozen=True)
class System:
    """What one system stores: nothing (``offload`` False), raw blocks in a DMA pool (``dma``), raw blobs, or kvtc
    blobs at ``ratio`` under ``ratio_policy``."""

    name: str
    doc: str
    offload: bool = True
    dma: bool = False  # the raw DMA pool (RawDmaTier) instead of the KvtcStore
    ratio: float = 16.0
    ratio_policy: str = "fixed"
    primary_share: float = 0.0  # > 0: a raw DMA primary of this share of the budget in front of the kvtc tier


SYSTEMS = {
    s.name: s
    for s in (
        System("none", "no offload: every history is recomputed", offload=False),
        System("raw", "raw DMA tier: block-granular pinned pool, DMA only, LRU (what KVBM/vLLM offloading do)",
               dma=True),
        System("raw_blob", "the kvtc store with the codec off (every blob raw, framed, CRC'd): the product's raw mode",
               ratio_policy="raw"),
        System("kvtc16", "kvtc at 16x", ratio=16.0),
        System("kvtc32", "kvtc at 32x", ratio=32.0),
        System("vllm_tier", "vLLM's tiered offloading: raw primary (1/4 of the budget) + kvtc 16x secondary (3/4)",
               primary_share=0.25),
        System("policy", "kvtc 16x, stored raw while the host tier has room (ratio_policy=raw_first)",
               ratio_policy="raw_first"),
    )
}  # fmt: skip


def tier_config(
    system: System,
    host_bytes: int,
    *,
    window: int = 128,
    disk_bytes: int = 0,
    disk_dir: str | Path | None = None,
    page_bytes: int = 16384,
) -> TierConfig:
    """The tier settings of ``system`` at a host budget (every offload admitted, every eviction to disk if any)."""
    return TierConfig(
        host_bytes=int(host_bytes),
        disk_bytes=int(disk_bytes),
        disk_dir=disk_dir if disk_bytes else None,
        ratio=system.ratio,
        min_tokens=0,
        min_frequency=1,
        disk_min_uses=1,
        page_bytes=page_bytes,
        window=window,
        ratio_policy=system.ratio_policy,
        **process_settings(),  # the codec's DYN_KVTC_* knobs of this process
    )


def host_budget(fraction: float, working_set_blocks: int, block_size: int, bytes_per_token: int) -> int:
    """Host bytes at ``fraction`` of the raw working set (1.0: raw holds every block the workload reuses)."""
    return int(fraction * working_set_blocks * block_size * bytes_per_token)

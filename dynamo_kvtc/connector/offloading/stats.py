"""The ``kvtc`` tier's statistics on the engine's ``/metrics``, through vLLM's offloading metrics: the ``vllm:kvtc_*``
families KvtcConnector reports (defined once in :mod:`dynamo_kvtc.connector.metrics`; KvtcConnector's reporter is
:mod:`dynamo_kvtc.connector.vllm.stats`), read from the tier's :class:`~dynamo_kvtc.tiers.store.KvtcStore`'s
StoreStats by :func:`~dynamo_kvtc.connector.metrics.connector_counters`, with the same names and labels.

vLLM asks each secondary tier class for its metric definitions (``build_metric_definitions``) when it builds its
Prometheus metrics, and each tier for an ``OffloadingConnectorStats`` every step (``get_stats``): counter deltas since
the last call, the latest gauges. Lookups and hits are the scheduler's (vLLM's own ``vllm:kv_offload_*``), so the
tier carries only the families its store feeds: blocks and bytes offloaded, blocks restored by source, faults, the
policy's ratio and the host tier's fill; and ``vllm:kvtc_tier_enabled{reason}`` (0 with the reason when the tier serves
without its store, the start-up rule's runtime limitations)."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata, OffloadingMetricMetadata

from ..metrics import COUNTERS, GAUGES, connector_counters, policy_ratio

__all__ = ["FAMILIES", "TierStats", "metric_definitions"]

PREFIX = "vllm:kvtc_"
FAMILIES = ("offload_blocks", "onboard_blocks", "offload_bytes", "fallbacks")  # the counters a store feeds
GAUGE_FAMILIES = ("policy_ratio", "host_fill", "effective_ratio")
ENABLED = PREFIX + "tier_enabled"  # not KvtcConnector's vllm:kvtc_enabled (no label there): both may share an engine


def label_of(name: str) -> str | None:
    """A family's label on the engine's ``/metrics``: COUNTERS', except ``offload_blocks`` (host only there, as
    KvtcConnector's: demotions to disk are counted on the ``kvtc_`` endpoint)."""
    return None if name == "offload_blocks" else COUNTERS[name][1]


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    out: dict[str, OffloadingMetricMetadata] = {}
    for name in FAMILIES:
        label = label_of(name)
        out[PREFIX + name] = OffloadingCounterMetadata(COUNTERS[name][0], (label,) if label else ())
    for name in GAUGE_FAMILIES:
        out[PREFIX + name] = OffloadingGaugeMetadata(GAUGES[name])
    out[ENABLED] = OffloadingGaugeMetadata("1 when the kvtc tier serves, 0 when it serves without its store (the "
                                           "reason as a label)", ("reason",))  # fmt: skip
    return out


class TierStats:
    """Turns a store's cumulative counters into per-call deltas. Owns the last reported values; never changes the
    store."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self._last: dict[tuple[str, tuple[str, ...]], float] = {}

    def counters(self) -> dict[tuple[str, tuple[str, ...]], float]:
        """(family, label values) -> the store's cumulative count."""
        c = connector_counters(store=self.store)
        out = {
            ("offload_blocks", ()): c.offload_blocks,
            ("offload_bytes", ("raw",)): c.offload_raw_bytes,
            ("offload_bytes", ("stored",)): c.offload_stored_bytes,
        }
        out.update({("onboard_blocks", (t,)): n for t, n in c.onboard_blocks.items()})
        out.update({("fallbacks", (why,)): n for why, n in c.fallbacks.items()})
        return out

    def take(self, reason: str = "none") -> OffloadingConnectorStats:
        """The deltas and gauges, and ``vllm:kvtc_tier_enabled{reason}`` (1 with ``none``; 0 with the reason the tier
        serves without its store: the start-up rule's limitations)."""
        stats = OffloadingConnectorStats()
        stats.set_gauge(ENABLED, float(reason == "none"), (reason,))
        if self.store is None:
            return stats
        try:
            now = self.counters()
        except RuntimeError:  # a Counter grew while being read (a job thread): the deltas come next call
            now = self._last
        for (name, labels), v in now.items():
            delta = v - self._last.get((name, labels), 0.0)
            if delta > 0:
                stats.increase_counter(PREFIX + name, delta, labels)
        self._last = now
        stats.set_gauge(PREFIX + "policy_ratio", policy_ratio(self.store))
        stats.set_gauge(PREFIX + "host_fill", float(self.store.host.fill))
        stats.set_gauge(PREFIX + "effective_ratio", float(self.store.stats.effective_ratio))
        return stats

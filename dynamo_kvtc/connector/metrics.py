"""Prometheus metrics for the compressed tiers (``kvtc_*``), served over HTTP on ``DYN_KVTC_METRICS_PORT``.

Counters and gauges are read from ``KvtcStore.snapshot()`` at scrape time (a custom collector, so nothing is double
counted); encode, restore and time-to-first-layer histograms are fed from the store's timing queue. A disabled
connector (no store) still serves ``kvtc_enabled 0`` with its reason, its fallbacks and its lookups.
:func:`connector_counters` is the one flat view of the counters that vLLM's KV-connector stats also carry.
"""

from __future__ import annotations

from typing import Any

from .. import settings
from ..errors import ConfigError

TIERS = ("host", "disk")
SOURCES = ("host", "disk", "peer")  # where restored blocks come from


def connector_counters(worker: Any) -> dict[str, float]:
    """The connector's monotonic counters, flat: its own (lookups, hits, fallbacks) and the store's (offloads,
    restores per source, evictions). What :class:`KvtcMetrics` and the vLLM stats report are read from here."""
    out: dict[str, float] = {k: float(v) for k, v in worker.stats.items()}
    if worker.store is not None:
        for k, v in list(worker.store.stats.items()):
            out[f"store_{k}"] = float(v)
    return out


def enabled_reason(worker: Any) -> str:
    """``none`` for a working connector, else why it is disabled (``kv_cache_dtype``, ``layout``, ``calibration``,
    ``store``, ``error``)."""
    if worker is None or getattr(worker, "disabled", None) is None:
        return "none"
    return getattr(worker, "disabled_reason", None) or "error"


def policy_ratio(store: Any) -> float:
    """The ratio the store's policy would pick for an offload now (it moves up under host-tier pressure)."""
    return float(store.policy.choose(store.host.fill))


class KvtcMetrics:
    def __init__(self, store: Any, registry: Any = None, connector: Any = None) -> None:
        try:
            from prometheus_client import CollectorRegistry, Histogram
        except ImportError as e:
            raise ConfigError("metrics need prometheus-client: pip install prometheus-client") from e
        self.store = store
        self.connector = connector  # a KvtcWorker: lookups, hits and fallbacks of the engine connector
        self.registry = registry or CollectorRegistry()
        self.registry.register(_SnapshotCollector(self))  # first: each scrape drains the timings before histograms
        buckets = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
        self.hist = {
            "encode": Histogram(
                "kvtc_encode_seconds", "Time to gather and encode one offload", buckets=buckets, registry=self.registry
            ),
            "restore": Histogram(
                "kvtc_restore_seconds",
                "Time to restore all layers of one onboard",
                buckets=buckets,
                registry=self.registry,
            ),
            "first_layer": Histogram(
                "kvtc_time_to_first_layer_seconds",
                "Time until layer 0 of an onboard is in place",
                buckets=buckets,
                registry=self.registry,
            ),
        }

    def drain(self) -> None:
        if not hasattr(self, "hist") or self.store is None:
            return
        q = self.store.timings
        while q:
            kind, seconds = q.popleft()
            if kind in self.hist:
                self.hist[kind].observe(seconds)

    def serve(self, port: int | None = None, addr: str = "127.0.0.1") -> int:
        from prometheus_client import start_http_server

        if port is None:
            port = settings.env_value("metrics_port")
            if port is None:
                raise ConfigError("no metrics port: pass one or set DYN_KVTC_METRICS_PORT")
        if not 0 <= port < 65536:
            raise ConfigError(f"metrics port {port} out of range")
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return server.server_port


class _SnapshotCollector:
    def __init__(self, m: KvtcMetrics) -> None:
        self.m = m

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        self.m.drain()
        c = dict(self.m.connector.stats) if self.m.connector is not None else {}
        reason = enabled_reason(self.m.connector)
        en = GaugeMetricFamily(
            "kvtc_enabled", "1 when the connector runs, 0 when disabled (see reason)", labels=["reason"]
        )
        en.add_metric([reason], 1.0 if reason == "none" else 0.0)
        yield en
        s = self.m.store.snapshot() if self.m.store is not None else {}
        if self.m.store is not None:
            yield from self._store(s)
        yield from self._fallbacks(s, c)
        if self.m.connector is not None:
            yield from self._lookups(s, c)
        link = getattr(getattr(self.m.connector, "peer", None), "link", None)
        if link is not None:  # a decode worker with the compressed hand-off
            yield from handoff_families(link.snapshot())

    def _store(self, s: dict[str, Any]):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        blocks = GaugeMetricFamily("kvtc_tier_blocks", "Blocks held per tier", labels=["tier"])
        raw = GaugeMetricFamily("kvtc_tier_raw_bytes", "16-bit bytes of the KV held per tier", labels=["tier"])
        stored = GaugeMetricFamily("kvtc_tier_stored_bytes", "Compressed bytes held per tier", labels=["tier"])
        ratio = GaugeMetricFamily("kvtc_tier_ratio", "Raw / stored bytes held per tier", labels=["tier"])
        for t in TIERS:
            blocks.add_metric([t], s.get(f"{t}_blocks", 0))
            raw.add_metric([t], s.get(f"{t}_raw_bytes", 0))
            stored.add_metric([t], s.get(f"{t}_stored_bytes", 0))
            st = s.get(f"{t}_stored_bytes", 0)
            ratio.add_metric([t], s.get(f"{t}_raw_bytes", 0) / st if st else 0.0)
        yield from (blocks, raw, stored, ratio)
        total_raw = sum(s.get(f"{t}_raw_bytes", 0) for t in TIERS)
        total_stored = sum(s.get(f"{t}_stored_bytes", 0) for t in TIERS)
        yield GaugeMetricFamily(
            "kvtc_effective_ratio",
            "Raw / stored bytes over both tiers",
            value=total_raw / total_stored if total_stored else 0.0,
        )
        yield GaugeMetricFamily(
            "kvtc_policy_ratio",
            "Ratio the policy picks for an offload now (the default, higher under host-tier pressure); "
            "disk blobs keep the ratio they were encoded at",
            value=policy_ratio(self.m.store),
        )
        yield GaugeMetricFamily("kvtc_host_fill", "Share of host-tier pages in use", value=s.get("host_fill", 0.0))
        off = CounterMetricFamily(
            "kvtc_offload_blocks", "Blocks offloaded: encoded into host memory, demoted to disk", labels=["tier"]
        )
        off.add_metric(["host"], s.get("offload_blocks", 0))
        off.add_metric(["disk"], s.get("disk_demoted_blocks", 0))
        yield off
        on = CounterMetricFamily(
            "kvtc_onboard_blocks", "Blocks restored into the engine, by where they came from", labels=["tier"]
        )
        for t in SOURCES:
            on.add_metric([t], s.get(f"onboard_{t}_blocks", 0))
        yield on
        hits = CounterMetricFamily("kvtc_onboard_blob_hits", "Blobs read for restores, by tier", labels=["tier"])
        for t in TIERS:
            hits.add_metric([t], s.get(f"onboard_{t}_hits", 0))
        yield hits
        ev = CounterMetricFamily("kvtc_evictions", "Blobs evicted, by tier", labels=["tier"])
        for t in TIERS:
            ev.add_metric([t], s.get(f"{t}_evictions", 0))
        yield ev
        ob = CounterMetricFamily("kvtc_offload_bytes", "Bytes offloaded: raw (16-bit KV) and stored", labels=["kind"])
        ob.add_metric(["raw"], s.get("offload_raw_bytes", 0))
        ob.add_metric(["stored"], s.get("offload_stored_bytes", 0))
        yield ob

    def _fallbacks(self, s: dict[str, Any], c: dict[str, Any]):
        from prometheus_client.core import CounterMetricFamily

        fb = CounterMetricFamily(
            "kvtc_fallbacks", "Failed offloads/restores (the engine recomputes), by reason", labels=["reason"]
        )
        for k, v in s.items():
            if k.startswith(("onboard_error_", "offload_error_", "disk_write_error_")) or k == "blobs_dropped":
                fb.add_metric([k], v)
        for k, v in c.items():
            if k.startswith("fallback_"):
                fb.add_metric([k[len("fallback_") :]], v)
        yield fb

    def _lookups(self, s: dict[str, Any], c: dict[str, Any]):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        looked, hit = c.get("lookup_tokens", 0), c.get("hit_tokens", 0)
        lt = CounterMetricFamily("kvtc_lookup_tokens", "Prompt tokens looked up in the compressed tiers")
        lt.add_metric([], looked)
        yield lt
        ht = CounterMetricFamily("kvtc_matched_tokens", "Prompt tokens restored from the compressed tiers")
        ht.add_metric([], hit)
        yield ht
        yield GaugeMetricFamily(
            "kvtc_hit_rate", "Matched / looked-up prompt tokens", value=hit / looked if looked else 0.0
        )
        bs = getattr(self.m.connector, "block_size", 0)
        tier = GaugeMetricFamily(
            "kvtc_tier_hit_rate", "Tokens restored from each source / prompt tokens looked up", labels=["tier"]
        )
        for t in SOURCES:
            tier.add_metric([t], s.get(f"onboard_{t}_blocks", 0) * bs / looked if looked else 0.0)
        yield tier


def handoff_families(snap: dict[str, Any]):
    """The hand-off's link estimates and raw-vs-compressed choices per prefill peer (``LinkPolicy.snapshot()``)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    bw = GaugeMetricFamily(
        "kvtc_handoff_link_gbps", "Link rate to a prefill peer, Gbit/s (set or learned)", labels=["peer"]
    )
    est = GaugeMetricFamily(
        "kvtc_handoff_estimate_seconds",
        "Estimated hand-off time of the last prompt from a peer, raw KV vs compressed (transfer + restore)",
        labels=["peer", "path"],
    )
    ch = CounterMetricFamily(
        "kvtc_handoff_choices", "Raw-vs-compressed choices of the link policy per peer", labels=["peer", "choice"]
    )
    for peer, p in snap.items():
        bw.add_metric([peer], p["link_gbps"])
        last = p["last"]
        if last is not None:
            for path, key in (("raw", "raw_s"), ("compressed", "compressed_s")):
                v = last[key]
                est.add_metric([peer, path], v if v != float("inf") else float("nan"))
        for choice, n in p["choices"].items():
            ch.add_metric([peer, choice], n)
    yield from (bw, est, ch)

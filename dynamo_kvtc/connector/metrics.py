"""Prometheus metrics for the compressed tiers (``kvtc_*``), served over HTTP on ``DYN_KVTC_METRICS_PORT``.

Counters and gauges are read at scrape time (a custom collector, so nothing is double counted): the tiers' contents
from ``KvtcStore.snapshot()``, the counters from the store's typed :class:`~dynamo_kvtc.tiers.stats.StoreStats` and
the worker's own counters; encode, restore and time-to-first-layer histograms are fed from the stats' timing queue. A
disabled connector (no store) still serves ``kvtc_enabled 0`` with its reason, its fallbacks and its lookups.

The families both exporters carry (this endpoint as ``kvtc_<name>``, the engine's ``/metrics`` through
:mod:`.vllm.stats` as ``vllm:kvtc_<name>``) are defined once, in :data:`COUNTERS` and :data:`GAUGES`, and both read
their values from one :class:`ConnectorCounters` (:func:`connector_counters`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..tiers.stats import BUILT_IN, PEER

SOURCES = (*BUILT_IN, PEER)  # the ``tier`` labels without a store; a store reports its own (StoreStats.sources)

# name -> (help, label): the counter families of both exporters (``_total`` is added by Prometheus)
COUNTERS: dict[str, tuple[str, str | None]] = {
    "lookup_tokens": ("Prompt tokens looked up in the kvtc compressed tiers", None),
    "matched_tokens": ("Prompt tokens restored from the kvtc compressed tiers", None),
    "offload_blocks": ("Blocks offloaded by kvtc: encoded into host memory (and, kvtc_ only, demoted to disk)", "tier"),
    "onboard_blocks": ("Blocks restored from kvtc into the engine, by source (host, disk, peer)", "tier"),
    "offload_bytes": ("Bytes offloaded by kvtc: raw (uncompressed KV) and stored (compressed)", "kind"),
    "fallbacks": ("kvtc faults that cost a recompute or a lost cache entry, by reason", "reason"),
}
# name -> help: the gauges of both exporters
GAUGES: dict[str, str] = {
    "enabled": "1 when the kvtc connector runs, 0 when disabled (kvtc_: with the reason as a label)",
    "policy_ratio": "Compression ratio the kvtc policy picks for an offload now (the default, higher under host-tier "
    "pressure); disk blobs keep the ratio they were encoded at",
    "host_fill": "Share of the kvtc host tier's pages in use",
    "effective_ratio": "Raw / stored bytes of the KV the kvtc tiers hold now, each blob once (raw windows, sinks and "
    "headers included): the ratio stored conversations get",
}


@dataclass
class ConnectorCounters:
    """The monotonic counters both exporters report: the worker's (lookups, hits, fallbacks) and its store's."""

    lookup_tokens: float = 0.0
    matched_tokens: float = 0.0
    offload_blocks: float = 0.0  # encoded into the host tier
    offload_raw_bytes: float = 0.0
    offload_stored_bytes: float = 0.0
    onboard_blocks: dict[str, float] = field(default_factory=dict)  # source -> blocks restored
    fallbacks: dict[str, float] = field(default_factory=dict)  # reason -> faults


def connector_counters(worker: Any = None, store: Any = None) -> ConnectorCounters:
    """The one reading of a worker's counters and its store's :class:`~dynamo_kvtc.tiers.stats.StoreStats` (by
    attribute) that :class:`KvtcMetrics` and the vLLM stats report (``store``: the worker's unless given; either may
    be None). Fallback reasons: the worker's ``fallback_<why>`` as ``<why>``, the store's faults under their own names
    (``onboard_error_<Error>``, ``offload_error_<Error>``, ``disk_write_error_<Error>``, ``blobs_dropped``)."""
    c = dict(worker.stats) if worker is not None else {}
    out = ConnectorCounters(
        lookup_tokens=float(c.get("lookup_tokens", 0)),
        matched_tokens=float(c.get("hit_tokens", 0)),
        onboard_blocks={t: 0.0 for t in SOURCES},
        fallbacks={k[len("fallback_") :]: float(v) for k, v in c.items() if k.startswith("fallback_")},
    )
    if store is None:
        store = getattr(worker, "store", None)
    if store is not None:
        st = store.stats
        out.offload_blocks = float(st.offload_blocks)
        out.offload_raw_bytes = float(st.offload_raw_bytes)
        out.offload_stored_bytes = float(st.offload_stored_bytes)
        out.onboard_blocks = {t: float(st.onboard_from(t)) for t in st.sources}
        faults = {**st.faults(), "blobs_dropped": st.blobs_dropped}
        out.fallbacks.update({k: float(v) for k, v in faults.items() if v})
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
            kind: Histogram(name, doc, buckets=buckets, registry=self.registry)
            for kind, name, doc in (
                ("encode", "kvtc_encode_seconds", "Time to gather and encode one offload"),
                ("restore", "kvtc_restore_seconds", "Time to restore all layers of one onboard"),
                ("first_layer", "kvtc_time_to_first_layer_seconds", "Time until layer 0 of an onboard is in place"),
            )
        }

    def drain(self) -> None:
        if not hasattr(self, "hist") or self.store is None:
            return
        q = self.store.stats.timings
        while q:
            kind, seconds = q.popleft()
            if kind in self.hist:
                self.hist[kind].observe(seconds)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve the registry on ``port`` (the configuration's ``metrics_port``; 0: any free port); the port bound."""
        from prometheus_client import start_http_server

        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
            raise ConfigError(f"metrics port {port} out of range")
        server, _ = start_http_server(port, addr=addr, registry=self.registry)
        return server.server_port


def _counter(name: str, labels: list[str] | None = None, doc: str | None = None):
    from prometheus_client.core import CounterMetricFamily

    if doc is None:
        doc, label = COUNTERS[name]
        labels = [label] if label else []
    return CounterMetricFamily(f"kvtc_{name}", doc, labels=labels or [])


def _gauge(name: str, value: float | None = None, labels: list[str] | None = None, doc: str | None = None):
    from prometheus_client.core import GaugeMetricFamily

    return GaugeMetricFamily(f"kvtc_{name}", doc or GAUGES[name], value=value, labels=labels)


class _SnapshotCollector:
    def __init__(self, m: KvtcMetrics) -> None:
        self.m = m

    def collect(self):
        self.m.drain()
        reason = enabled_reason(self.m.connector)
        en = _gauge("enabled", labels=["reason"])
        en.add_metric([reason], 1.0 if reason == "none" else 0.0)
        yield en
        c = connector_counters(self.m.connector, self.m.store)
        if self.m.store is not None:
            yield from self._store(self.m.store.snapshot(), c)
        fb = _counter("fallbacks")
        for why, n in c.fallbacks.items():
            fb.add_metric([why], n)
        yield fb
        if self.m.connector is not None:
            yield from self._lookups(c)
        link = getattr(getattr(self.m.connector, "peer", None), "link", None)
        if link is not None:  # a decode worker with the compressed hand-off
            yield from handoff_families(link.snapshot())

    def _store(self, s: dict[str, Any], c: ConnectorCounters):
        st = self.m.store.stats
        blocks = _gauge("tier_blocks", labels=["tier"], doc="Blocks held per tier")
        raw = _gauge("tier_raw_bytes", labels=["tier"], doc="Uncompressed bytes of the KV held per tier")
        stored = _gauge("tier_stored_bytes", labels=["tier"], doc="Compressed bytes held per tier")
        ratio = _gauge("tier_ratio", labels=["tier"], doc="Raw / stored bytes held per tier")
        tiers = tuple(st.tiers)  # every registered tier, by name (counters keyed by it), the first tier first
        for t in tiers:
            blocks.add_metric([t], s.get(f"{t}_blocks", 0))
            raw.add_metric([t], s.get(f"{t}_raw_bytes", 0))
            stored.add_metric([t], s.get(f"{t}_stored_bytes", 0))
            st_bytes = s.get(f"{t}_stored_bytes", 0)
            ratio.add_metric([t], s.get(f"{t}_raw_bytes", 0) / st_bytes if st_bytes else 0.0)
        yield from (blocks, raw, stored, ratio)
        yield _gauge("effective_ratio", st.effective_ratio)
        yield _gauge("policy_ratio", policy_ratio(self.m.store))
        yield _gauge("host_fill", s.get("host_fill", 0.0))
        off = _counter("offload_blocks")
        for t in tiers:  # the first tier: the encoded blocks; a lower one: those demoted into it
            off.add_metric([t], c.offload_blocks if t == tiers[0] else st.tier(t).demoted_blocks)
        yield off
        on = _counter("onboard_blocks")
        for t, n in c.onboard_blocks.items():
            on.add_metric([t], n)
        yield on
        hits = _counter("onboard_blob_hits", ["tier"], "Blobs read for restores, by tier")
        ev = _counter("evictions", ["tier"], "Blobs evicted, by tier")
        for t in tiers:
            hits.add_metric([t], st.tier(t).hits)
            ev.add_metric([t], st.tier(t).evictions)
        yield hits
        yield ev
        ob = _counter("offload_bytes")
        ob.add_metric(["raw"], c.offload_raw_bytes)
        ob.add_metric(["stored"], c.offload_stored_bytes)
        yield ob

    def _lookups(self, c: ConnectorCounters):
        looked, hit = c.lookup_tokens, c.matched_tokens
        lt = _counter("lookup_tokens")
        lt.add_metric([], looked)
        yield lt
        ht = _counter("matched_tokens")
        ht.add_metric([], hit)
        yield ht
        yield _gauge("hit_rate", hit / looked if looked else 0.0, doc="Matched / looked-up prompt tokens")
        bs = getattr(self.m.connector, "block_size", 0)
        tier = _gauge(
            "tier_hit_rate", labels=["tier"], doc="Tokens restored from each source / prompt tokens looked up"
        )
        for t, n in c.onboard_blocks.items():
            tier.add_metric([t], n * bs / looked if looked else 0.0)
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

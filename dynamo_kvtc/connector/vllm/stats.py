"""The connector's statistics through vLLM's own KV-connector stats, so they appear on the engine's ``/metrics``.

vLLM (0.31 API) asks each worker's connector for a :class:`KVConnectorStats` after every step
(``get_kv_connector_stats``), aggregates the workers' objects, ships ``to_dict()`` to the front-end process, rebuilds
it there with the connector class's ``build_kv_connector_stats`` (MultiConnector does it by class name) and hands it
to the ``KVConnectorPromMetrics`` the class built (``build_prom_metrics``) and to the periodic log line.

:class:`KvtcConnectorStats` carries counter deltas since the last report (summed on aggregation) and the latest
gauges; :class:`StatsReporter` makes them from the worker's counters (:func:`~.metrics.connector_counters`; the
families are defined once, in :mod:`.metrics`), on TP rank 0 only (one rank's view, like the ``kvtc_*`` endpoint);
:class:`KvtcPromMetrics` turns them into ``vllm:kvtc_*`` series with the engine's labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ..metrics import COUNTERS, GAUGES, connector_counters, enabled_reason, policy_ratio

# the families carried here: every shared counter; offload_blocks without its tier label (host only: demotions to
# disk stay on the kvtc_ endpoint)
LABELS = {name: label for name, (_, label) in COUNTERS.items() if label and name != "offload_blocks"}


def flat_counters(worker: Any) -> dict[str, float]:
    """The worker's counters under the keys :class:`KvtcConnectorStats` carries (``family`` or ``family:label``)."""
    c = connector_counters(worker)
    out = {
        "lookup_tokens": c.lookup_tokens,
        "matched_tokens": c.matched_tokens,
        "offload_blocks": c.offload_blocks,
        "offload_bytes:raw": c.offload_raw_bytes,
        "offload_bytes:stored": c.offload_stored_bytes,
    }
    for t, n in c.onboard_blocks.items():
        out[f"onboard_blocks:{t}"] = n
    for why, n in c.fallbacks.items():
        out[f"fallbacks:{why}"] = n
    return out


def gauges(worker: Any) -> dict[str, float]:
    g = {"enabled": 1.0 if enabled_reason(worker) == "none" else 0.0}
    if worker.store is not None:
        g["policy_ratio"] = policy_ratio(worker.store)
        g["host_fill"] = float(worker.store.host.fill)
        g["effective_ratio"] = float(worker.store.stats.effective_ratio)
    return g


@dataclass
class KvtcConnectorStats(KVConnectorStats):
    """``data = {"counters": {key: delta}, "gauges": {name: value}}``: plain numbers, so it survives vLLM's
    serialisation between processes. Owns aggregation (counters add, the latest gauge wins); never reads a worker."""

    def __post_init__(self) -> None:
        if not self.data:
            self.reset()
        self.data.setdefault("counters", {})
        self.data.setdefault("gauges", {})

    def reset(self) -> None:
        self.data = {"counters": {}, "gauges": {}}

    def is_empty(self) -> bool:
        return not any(self.data["counters"].values()) and not self.data["gauges"]

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        counters = self.data["counters"]
        for k, v in other.data.get("counters", {}).items():
            counters[k] = counters.get(k, 0) + v
        self.data["gauges"].update(other.data.get("gauges", {}))
        return self

    def reduce(self) -> dict[str, int | float]:
        """The log line's view: counter sums over the interval, hit rate, latest gauges."""
        c = self.data["counters"]
        out: dict[str, int | float] = {k.replace(":", "_"): v for k, v in sorted(c.items()) if v}
        looked = c.get("lookup_tokens", 0)
        if looked:
            out["hit_rate"] = round(c.get("matched_tokens", 0) / looked, 4)
        out.update(self.data["gauges"])
        return out


class StatsReporter:
    """Turns a worker's cumulative counters into :class:`KvtcConnectorStats` deltas, one per step with news.

    Owns the last reported values; never changes the worker. Returns None when nothing changed (vLLM then sends no
    connector output for the step)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self._last: dict[str, float] = {}
        self._last_gauges: dict[str, float] = {}

    def take(self) -> KvtcConnectorStats | None:
        try:
            now, g = flat_counters(self.worker), gauges(self.worker)
        except RuntimeError:  # a counter grew while being read (offload thread): report next step
            return None
        delta = {k: v - self._last.get(k, 0.0) for k, v in now.items() if v != self._last.get(k, 0.0)}
        changed = {k: v for k, v in g.items() if self._last_gauges.get(k) != v}
        if not delta and not changed:
            return None
        self._last, self._last_gauges = now, g
        return KvtcConnectorStats(data={"counters": delta, "gauges": g})


class KvtcPromMetrics(KVConnectorPromMetrics):
    """``vllm:kvtc_*`` series on the engine's own ``/metrics``, fed from :class:`KvtcConnectorStats` payloads.

    Owns the metric objects vLLM's metric classes create (with its per-engine labels); never reads the store."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str], per_engine_labelvalues: dict):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            name: self._counter_cls(
                name=f"vllm:kvtc_{name}",
                documentation=doc,
                labelnames=labelnames + ([LABELS[name]] if name in LABELS else []),
            )
            for name, (doc, _) in COUNTERS.items()
        }
        self._gauges = {
            name: self._gauge_cls(
                name=f"vllm:kvtc_{name}", documentation=doc, labelnames=labelnames, multiprocess_mode="mostrecent"
            )
            for name, doc in GAUGES.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        if not transfer_stats_data:
            return
        labels = list(self.per_engine_labelvalues[engine_idx])
        for key, v in transfer_stats_data.get("counters", {}).items():
            family, _, value = key.partition(":")
            metric = self._counters.get(family)
            if metric is None or v <= 0:
                continue
            metric.labels(*labels, *([value] if family in LABELS else [])).inc(v)
        for name, v in transfer_stats_data.get("gauges", {}).items():
            if name in self._gauges:
                self._gauges[name].labels(*labels).set(v)

"""The store's counters and timings, as one typed object the parts bump and the exporters read by attribute.

One :class:`StoreStats` per store, handed to the block index, the placement, the offloader and the restorer; each part
bumps only its own fields (listed below by part). Plain attribute increments and deque appends, unlocked, as the
:class:`collections.Counter` before it: readers (metrics at scrape time, vLLM's per-step stats) see a value at most
one increment old. :meth:`StoreStats.as_dict` is the flat view under the historical key names (``store.snapshot()``,
the benchmarks' JSON).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field, fields

SOURCES = ("host", "disk", "peer")  # where restored blocks come from
TIMED = ("encode", "restore", "first_layer", "warm_up")  # the kinds of :attr:`StoreStats.timings`


@dataclass
class StoreStats:
    # offloader
    offload_blocks: int = 0  # blocks encoded into the host tier
    offload_raw_bytes: int = 0  # uncompressed bytes of those blocks (the engine's dtype)
    offload_stored_bytes: int = 0  # their blobs' bytes
    offload_raw: int = 0  # offloads stored uncompressed (``raw``/``raw_first`` ratio policies)
    offload_filtered: int = 0  # offloads the admission filter refused
    offload_tp_disagreed: int = 0  # saves skipped on every TP rank: the ranks' votes differed (joint codec)
    offload_queue_full: int = 0  # saves skipped, nothing copied: the offload queue held its byte budget already
    offload_fused_batches: int = 0  # encodes that went through the fused CUDA path
    encode_seconds_x1e6: int = 0  # encode time, microseconds
    offload_errors: Counter[str] = field(default_factory=Counter)  # error class (or "unexpected") -> offloads lost
    # restorer
    onboards: int = 0  # restores that finished
    onboard_blocks: int = 0  # blocks they restored ...
    onboard_host_blocks: int = 0  # ... from the host tier,
    onboard_disk_blocks: int = 0  # ... from disk,
    onboard_peer_blocks: int = 0  # ... from a peer (the compressed hand-off)
    onboard_fused_batches: int = 0  # restores that went through the fused CUDA path
    onboard_errors: Counter[str] = field(default_factory=Counter)  # error class -> restores failed (recomputed)
    onboard_cancelled: int = 0  # restores stopped by their caller (timed out) before all layers were written
    # placement
    onboard_host_hits: int = 0  # blobs read from the host tier
    onboard_disk_hits: int = 0  # blobs read from disk
    host_evictions: int = 0  # host LRU victims (demoted or dropped)
    disk_evictions: int = 0  # disk LRU victims (dropped)
    disk_demotions: int = 0  # blobs written to disk
    disk_demoted_blocks: int = 0  # their blocks
    disk_admission_dropped: int = 0  # victims not admitted to disk (used too few times)
    disk_recovered_blobs: int = 0  # blobs of this calibration found on disk at start
    disk_foreign_blobs: int = 0  # blobs of another calibration or block size found on disk at start (left alone)
    disk_bad_records: int = 0  # disk files whose blob metadata had a missing or wrong-typed field (deleted at start)
    blobs_dropped: int = 0  # unusable blobs removed from every tier
    disk_write_errors: Counter[str] = field(default_factory=Counter)  # error class -> demotions that failed
    # index
    listener_errors: int = 0  # store listeners (KV events) that raised
    # store
    warm_up_errors: int = 0
    timings: deque[tuple[str, float]] = field(default_factory=lambda: deque(maxlen=4096))  # (kind, s), drained

    def time(self, kind: str, seconds: float) -> None:
        """Record one duration of ``kind`` (one of :data:`TIMED`) for the metrics' histograms."""
        self.timings.append((kind, seconds))

    def onboard_from(self, source: str) -> int:
        """Blocks restored from ``source`` (one of :data:`SOURCES`)."""
        return getattr(self, f"onboard_{source}_blocks")

    def faults(self) -> dict[str, int]:
        """Failures that cost a recompute or a lost cache entry, by reason: ``offload_error_<Error>``,
        ``onboard_error_<Error>``, ``disk_write_error_<Error>``, ``offload_queue_full``, ``offload_tp_disagreed``,
        ``onboard_cancelled`` (``blobs_dropped`` is a field of its own)."""
        named = ("offload_queue_full", "offload_tp_disagreed", "onboard_cancelled")
        out = {k: getattr(self, k) for k in named if getattr(self, k)}
        for prefix, errors in (
            ("offload_error_", self.offload_errors),
            ("onboard_error_", self.onboard_errors),
            ("disk_write_error_", self.disk_write_errors),
        ):
            for name, n in list(errors.items()):
                out[prefix + name] = n
        return out

    def as_dict(self) -> dict[str, int]:
        """Every counter, flat, under its historical key (errors as ``<kind>_error_<Error>``); no timings."""
        out = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("offload_errors", "onboard_errors", "disk_write_errors", "timings")
        }
        out.update(self.faults())
        return out

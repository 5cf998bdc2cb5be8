"""The store's counters and timings, as one typed object the parts bump and the exporters read by attribute.

One :class:`StoreStats` per store, handed to the block index, the placement, the offloader and the restorer; each part
bumps only its own fields (listed below by part). Plain attribute increments and deque appends, unlocked, as the
:class:`collections.Counter` before it: readers (metrics at scrape time, vLLM's per-step stats) see a value at most
one increment old. Each tier's counters are a :class:`TierCounters` in :attr:`StoreStats.tiers`, keyed by the tier's
name (``stats.tier("disk").demotions``). :meth:`StoreStats.as_dict` is the flat view under the historical key names
(``store.snapshot()``, the benchmarks' JSON, the metrics): a tier's counters become ``onboard_<tier>_hits``,
``onboard_<tier>_blocks``, ``<tier>_evictions``, ``<tier>_demotions``, ... (:data:`FLAT`).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field, fields

BUILT_IN = ("host", "disk")  # tiers whose counters every store reports (zeros when it has no such tier)
PEER = "peer"  # restored blocks that came from another engine (the hand-off), not from a tier
TIMED = ("encode", "restore", "first_layer", "warm_up")  # the kinds of :attr:`StoreStats.timings`


@dataclass
class TierCounters:
    """What one tier of the chain counts (the placement and the restorer bump these)."""

    hits: int = 0  # blobs read from the tier
    blocks: int = 0  # blocks restored from it
    evictions: int = 0  # its LRU victims (handed to the next tier or dropped)
    demotions: int = 0  # blobs written into it from the tier above
    demoted_blocks: int = 0  # their blocks
    admission_dropped: int = 0  # victims of the tier above not admitted into it (used too few times)
    recovered_blobs: int = 0  # blobs of this calibration found in it at start
    foreign_blobs: int = 0  # blobs of another calibration or block size found in it at start (left alone)
    bad_records: int = 0  # blobs whose metadata had a missing or wrong-typed field (deleted at start)
    write_errors: Counter[str] = field(default_factory=Counter)  # error class -> demotions into it that failed
    skipped: int = 0  # write-through puts it could not take then (the pool's queue over budget, or disconnected)
    raw_held: int = 0  # gauge, refreshed by ``KvtcStore.snapshot()``: the KV it holds, uncompressed ...
    stored_held: int = 0  # ... and as stored (its blobs' bytes)

    @property
    def effective_ratio(self) -> float:
        """Raw / stored bytes this tier holds (0 when empty), as of the last snapshot."""
        return self.raw_held / self.stored_held if self.stored_held else 0.0


# TierCounters field -> its flat key in :meth:`StoreStats.as_dict` (``{t}``: the tier's name)
FLAT = {
    "hits": "onboard_{t}_hits",
    "blocks": "onboard_{t}_blocks",
    "evictions": "{t}_evictions",
    "demotions": "{t}_demotions",
    "demoted_blocks": "{t}_demoted_blocks",
    "admission_dropped": "{t}_admission_dropped",
    "recovered_blobs": "{t}_recovered_blobs",
    "foreign_blobs": "{t}_foreign_blobs",
    "bad_records": "{t}_bad_records",
    "raw_held": "{t}_raw_bytes",
    "stored_held": "{t}_stored_bytes",
    "skipped": "{t}_skipped",
}


@dataclass
class StoreStats:
    # offloader
    offload_blocks: int = 0  # blocks encoded into the host tier
    offload_raw_bytes: int = 0  # uncompressed bytes of those blocks (the engine's dtype)
    offload_stored_bytes: int = 0  # their blobs' bytes (less a replaced raw window's: the bytes each offload added)
    offload_raw: int = 0  # offloads stored uncompressed (``raw``/``raw_first`` ratio policies)
    offload_filtered: int = 0  # offloads the admission filter refused
    offload_tp_disagreed: int = 0  # saves skipped on every TP rank: the ranks' votes differed (joint codec)
    offload_queue_full: int = 0  # saves skipped, nothing copied: the offload queue held its byte budget already
    offload_fused_batches: int = 0  # encodes that went through the fused CUDA path
    offload_window_recoded: int = 0  # stored raw windows coded by the offload that extended their prefix
    offload_window_blocks: int = 0  # their blocks (encoded again, on top of ``offload_blocks``)
    encode_seconds_x1e6: int = 0  # encode time, microseconds
    offload_errors: Counter[str] = field(default_factory=Counter)  # error class (or "unexpected") -> offloads lost
    # restorer
    onboards: int = 0  # restores that finished
    onboard_blocks: int = 0  # blocks they restored (by tier: ``tiers[name].blocks``) ...
    onboard_peer_blocks: int = 0  # ... of those from a peer (the compressed hand-off)
    onboard_fused_batches: int = 0  # restores that went through the fused CUDA path
    onboard_errors: Counter[str] = field(default_factory=Counter)  # error class -> restores failed (recomputed)
    onboard_cancelled: int = 0  # restores stopped by their caller (timed out) before all layers were written
    # placement (and the restorer's blocks per tier)
    tiers: dict[str, TierCounters] = field(default_factory=lambda: {t: TierCounters() for t in BUILT_IN})
    blobs_dropped: int = 0  # unusable blobs removed from every tier
    blobs_retired: int = 0  # superseded blobs removed from every tier (replaced raw windows)
    # index
    listener_errors: int = 0  # store listeners (KV events) that raised
    held_raw_bytes: int = 0  # gauge: the KV of every indexed blob (each blob once, whichever tiers hold it), raw ...
    held_stored_bytes: int = 0  # ... and as stored: their ratio is :attr:`effective_ratio`
    # store
    warm_up_errors: int = 0
    timings: deque[tuple[str, float]] = field(default_factory=lambda: deque(maxlen=4096))  # (kind, s), drained

    @property
    def effective_ratio(self) -> float:
        """Raw / stored bytes of what the tiers hold now, each blob once (0 when empty): the ratio the stored
        conversations get, raw windows, sinks and headers included, where the codec's own ratio counts none."""
        return self.held_raw_bytes / self.held_stored_bytes if self.held_stored_bytes else 0.0

    def time(self, kind: str, seconds: float) -> None:
        """Record one duration of ``kind`` (one of :data:`TIMED`) for the metrics' histograms."""
        self.timings.append((kind, seconds))

    def tier(self, name: str) -> TierCounters:
        """The counters of tier ``name`` (made on first use: a registered tier of any name)."""
        got = self.tiers.get(name)
        if got is None:
            got = self.tiers[name] = TierCounters()
        return got

    @property
    def sources(self) -> tuple[str, ...]:
        """Where restored blocks come from: every tier counted here, then ``peer``."""
        return (*self.tiers, PEER)

    def onboard_from(self, source: str) -> int:
        """Blocks restored from ``source`` (one of :attr:`sources`)."""
        return self.onboard_peer_blocks if source == PEER else self.tier(source).blocks

    def faults(self) -> dict[str, int]:
        """Failures that cost a recompute or a lost cache entry, by reason: ``offload_error_<Error>``,
        ``onboard_error_<Error>``, ``<tier>_write_error_<Error>``, ``offload_queue_full``, ``offload_tp_disagreed``,
        ``onboard_cancelled`` (``blobs_dropped`` is a field of its own)."""
        named = ("offload_queue_full", "offload_tp_disagreed", "onboard_cancelled")
        out = {k: getattr(self, k) for k in named if getattr(self, k)}
        for prefix, errors in (
            ("offload_error_", self.offload_errors),
            ("onboard_error_", self.onboard_errors),
            *((f"{t}_write_error_", c.write_errors) for t, c in list(self.tiers.items())),
        ):
            for name, n in list(errors.items()):
                out[prefix + name] = n
        return out

    def as_dict(self) -> dict[str, float]:
        """Every counter, flat, under its historical key (a tier's as :data:`FLAT` names them; errors as
        ``<kind>_error_<Error>``); no timings."""
        out = {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name not in ("offload_errors", "onboard_errors", "tiers", "timings")
        }
        for t, c in list(self.tiers.items()):
            out.update({key.format(t=t): getattr(c, name) for name, key in FLAT.items()})
        out.update(self.faults())
        out["effective_ratio"] = self.effective_ratio
        return out

"""The block index: which blob holds each stored block, the metadata of every indexed blob, and the listeners told
when blocks become available or go away (the connector's KV events), and in which tier
(:meth:`BlockIndex.announce_tier`: a tier every worker of a cluster reads, such as the ``pool``, is published to the
router apart from this worker's own)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from ..errors import TierError
from .blobs import BlobMeta, BlobRun
from .stats import StoreStats

log = logging.getLogger(__name__)


class BlockIndex:
    """Sequence hash -> (blob id, block in blob), and blob id -> :class:`BlobMeta`, under its own lock.

    Owns the mapping and the listener list (objects with ``stored(hashes, token_ids, parent)`` and
    ``removed(hashes)``, and optionally ``stored_in(tier, hashes)`` / ``removed_from(tier, hashes)``: a blob's blocks
    entered or left the named tier); a failing listener is logged and counted (``listener_errors``), never raised. It
    never reads or writes blob bytes and never knows which tier holds a blob: callers ask the tiers, and whoever moves
    a blob into or out of a tier (the placement, a write-through tier) says so through :meth:`announce_tier`."""

    def __init__(self, stats: StoreStats) -> None:
        self._lock = threading.RLock()
        self._index: dict[int, tuple[str, int]] = {}
        self._blobs: dict[str, BlobMeta] = {}
        self._stats = stats
        self.listeners: list[Any] = []

    # ------------------------------------------------------------------ changes
    def add(self, meta: BlobMeta) -> None:
        with self._lock:
            self._held(self._blobs.get(meta.id), -1)
            self._blobs[meta.id] = meta
            self._held(meta, 1)
            for i, h in enumerate(meta.hashes):
                self._index[h] = (meta.id, i)

    def remove(self, blob_id: str) -> None:
        """Forget a blob; its blocks that no newer blob re-indexed are announced as removed."""
        with self._lock:
            meta = self._blobs.pop(blob_id, None)
            if meta is None:
                return
            self._held(meta, -1)
            gone = [h for h in meta.hashes if self._index.get(h, (None,))[0] == blob_id]
            for h in gone:
                del self._index[h]
        self._notify("removed", gone)

    def _held(self, meta: BlobMeta | None, sign: int) -> None:
        """Keep the stats' held-bytes gauges in step with the indexed blobs (under the lock)."""
        if meta is not None:
            self._stats.held_raw_bytes += sign * meta.raw_bytes
            self._stats.held_stored_bytes += sign * meta.stored_bytes

    def announce_stored(self, hashes: Sequence[int], token_ids: Sequence[int], parent: int | None) -> None:
        self._notify("stored", list(hashes), list(token_ids), parent)

    def announce_tier(self, what: str, tier: str, hashes: Sequence[int]) -> None:
        """Blocks ``hashes`` (one blob's) were ``"stored"`` in or ``"removed"`` from the tier named ``tier``; told to
        the listeners that have ``stored_in`` / ``removed_from`` (others do not hear of tiers)."""
        if what not in ("stored", "removed"):
            raise ValueError(f"announce_tier: {what!r} is neither 'stored' nor 'removed'")
        self._notify("stored_in" if what == "stored" else "removed_from", tier, list(hashes), optional=True)

    def _notify(self, what: str, *args: Any, optional: bool = False) -> None:
        for listener in list(self.listeners):
            if optional and not hasattr(listener, what):
                continue
            try:
                getattr(listener, what)(*args)
            except Exception as e:  # a listener never breaks the data path
                log.warning("kvtc listener %s.%s failed: %s", type(listener).__name__, what, e)
                self._stats.listener_errors += 1

    # ------------------------------------------------------------------ reads
    def __contains__(self, h: int) -> bool:
        """Whether block (sequence hash) ``h`` is indexed."""
        with self._lock:
            return h in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def locate(self, h: int) -> tuple[str, int] | None:
        """(blob id, block in blob) of block ``h``, or None."""
        with self._lock:
            return self._index.get(h)

    def has_blob(self, blob_id: str) -> bool:
        with self._lock:
            return blob_id in self._blobs

    def meta(self, blob_id: str) -> BlobMeta | None:
        with self._lock:
            return self._blobs.get(blob_id)

    def blob_ids(self) -> set[str]:
        """A snapshot of the indexed blob ids."""
        with self._lock:
            return set(self._blobs)

    def metas(self) -> list[BlobMeta]:
        """A snapshot of the indexed blobs' metadata."""
        with self._lock:
            return list(self._blobs.values())

    def entries(self) -> dict[int, tuple[str, int]]:
        """A snapshot of the whole index: sequence hash -> (blob id, block in blob)."""
        with self._lock:
            return dict(self._index)

    def missing(self, hashes: Sequence[int]) -> list[int]:
        """Indices of ``hashes`` not indexed."""
        with self._lock:
            return [i for i, h in enumerate(hashes) if h not in self._index]

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` are indexed."""
        n = 0
        with self._lock:
            for h in hashes:
                if h not in self._index:
                    break
                n += 1
        return n

    def match_tiers(self, hashes: Sequence[int], in_host: Callable[[str], bool]) -> tuple[int, int]:
        """(leading blocks indexed, leading blocks whose blob ``in_host``)."""
        n = n_host = 0
        with self._lock:
            for h in hashes:
                e = self._index.get(h)
                if e is None:
                    break
                n += 1
                if n_host == n - 1 and in_host(e[0]):
                    n_host = n
        return n, n_host

    def plan(self, hashes: Sequence[int]) -> list[BlobRun]:
        """The runs of blobs covering ``hashes`` in order (planned: ``blob_id`` set, no bytes yet); TierError if a
        block is in no blob."""
        runs: list[BlobRun] = []
        with self._lock:
            for j, h in enumerate(hashes):
                e = self._index.get(h)
                if e is None:
                    raise TierError(f"block {j} ({h:016x}) is in no tier")
                blob_id, i = e
                last = runs[-1] if runs else None
                if last is not None and last.blob_id == blob_id and last.first + last.count == i:
                    runs[-1] = replace(last, count=last.count + 1)
                else:
                    runs.append(BlobRun(None, i, 1, j, blob_id=blob_id))
        return runs

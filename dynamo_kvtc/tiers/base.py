"""The one face every blob tier shows the store: :class:`BlobTier`, and the one record of a blob it evicts.

:class:`~dynamo_kvtc.tiers.host.HostTier` (pinned arena, G2c) and :class:`~dynamo_kvtc.tiers.disk.DiskTier` (NIXL
files, G3c) implement it exactly; :class:`~dynamo_kvtc.tiers.placement.Placement` chains tiers by it (first =
fastest) and never asks which tier it talks to. A new kind of tier (a remote pool) implements this contract and
registers in :mod:`dynamo_kvtc.tiers.registry`.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, NamedTuple

from ..codec.blob import BlobView


class Evicted(NamedTuple):
    """A blob a tier let go of to make room: its id, its bytes (a BlobView or bytes-like the next tier's ``put``
    takes; empty when the caller said it keeps no victims) and its meta as stored."""

    blob_id: str
    blob: Any
    meta: Any


class BlobTier:
    """Blobs by id, least recently used first.

    A tier implements:

    - ``name``: the tier's name (the settings, the stats and the metrics key its counters by it: ``host``, ``disk``);
    - ``put(blob_id, blob, meta, *, keep_evicted=True) -> list[Evicted]``: store the blob (a BlobView or bytes-like;
      ``meta`` is a plain msgpack-able map), evicting least-recently-used blobs to make room, and return them (their
      bytes only with ``keep_evicted``: without a next tier nothing is copied out). A blob already held is only
      marked most recently used. Raises :class:`~dynamo_kvtc.errors.TierFullError` when it cannot fit (the tier is
      unchanged) or another :class:`~dynamo_kvtc.errors.TierError` when the write failed (nothing of it is kept);
    - ``read(blob_id) -> BlobView | None``: the blob (marks it most recently used), ``None`` when the tier does not
      hold it (a remote tier: also on a miss or an unreachable peer). The caller calls the view's ``release()``
      once it no longer reads the bytes (a host tier's lease gives its pages back; elsewhere it does nothing). A
      held entry found damaged is forgotten (deleted) and raises :class:`~dynamo_kvtc.errors.TierError`; a read
      that failed but left the entry intact raises :class:`~dynamo_kvtc.errors.TransferError` (a TierError);
    - ``discard(blob_id)``: forget a blob if held;
    - ``capacity`` / ``used_bytes``: bytes it may hold / holds; ``close()``: let go of what it holds open.

    Membership, ``len``, :meth:`ids`, :meth:`meta` and :meth:`copy` are implemented here over ``_entries`` (an
    OrderedDict id -> entry with a ``meta`` attribute, LRU order) under the re-entrant ``_lock``. A tier
    never knows about block hashes, calibrations or other tiers: the store's index and placement do.
    """

    name: str = ""
    capacity: int
    used_bytes: int
    _entries: OrderedDict[str, Any]
    _lock: threading.RLock

    def __contains__(self, blob_id: str) -> bool:
        with self._lock:
            return blob_id in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def ids(self) -> list[str]:
        """Ids held, least recently used first."""
        with self._lock:
            return list(self._entries)

    def meta(self, blob_id: str) -> Any:
        """The metadata stored with a blob, or None if it is not held."""
        with self._lock:
            e = self._entries.get(blob_id)
            return None if e is None else e.meta

    def copy(self, blob_id: str) -> bytes | None:
        """A copy of a held blob's bytes (read, copied, released), or None."""
        view = self.read(blob_id)
        if view is None:
            return None
        try:
            return view.tobytes()
        finally:
            view.release()

    def put(self, blob_id: str, blob: Any, meta: Any, *, keep_evicted: bool = True) -> list[Evicted]:
        raise NotImplementedError

    def read(self, blob_id: str) -> BlobView | None:
        raise NotImplementedError

    def discard(self, blob_id: str) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Let go of what the tier holds open (a directory lock, a connection); the default holds nothing."""

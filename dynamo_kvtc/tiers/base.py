"""The one face every blob tier shows the store: put / get / discard / membership / ids / meta / capacity.

:class:`~dynamo_kvtc.tiers.host.HostTier` (pinned arena, G2c) and :class:`~dynamo_kvtc.tiers.disk.DiskTier` (NIXL
files, G3c) both derive from :class:`BlobTier`; the read-only accessors live here once.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any


class BlobTier:
    """Blobs by id, least recently used first.

    A subclass owns ``_entries`` (an OrderedDict id -> entry with a ``meta`` attribute, LRU order) under the re-entrant
    ``_lock``, and ``capacity`` / ``used_bytes``. It implements:

    - ``put(blob_id, blob, meta) -> list``: store the blob, evicting least-recently-used blobs to make room, and return
      what it evicted (the host tier hands back ``(id, bytes, meta)`` for demotion, the disk tier the ids);
    - ``get(blob_id) -> (bytes, meta)``: read a blob (marks it most recently used); absent: ``None`` (host) or
      :class:`~dynamo_kvtc.errors.TierError` (disk, which also raises it for a damaged file);
    - ``discard(blob_id)``: forget a blob if held.

    A tier never knows about block hashes, calibrations or other tiers: the store's index and placement do.
    """

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

    def put(self, blob_id: str, blob: bytes, meta: Any) -> list:
        raise NotImplementedError

    def get(self, blob_id: str) -> tuple[bytes, Any] | None:
        raise NotImplementedError

    def discard(self, blob_id: str) -> None:
        raise NotImplementedError

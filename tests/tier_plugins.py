"""A storage tier that exists only in the tests: blobs in a dict with a byte capacity, LRU. It plugs into the store's
chain with the one registration line at the bottom (chained when ``TierConfig(tiers=("mem",))`` names it) and runs
through the same store tests as the host and disk tiers (tests/test_tiers.py)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, NamedTuple

from dynamo_kvtc.codec.blob import BlobView
from dynamo_kvtc.errors import TierFullError
from dynamo_kvtc.tiers.base import BlobTier, Evicted
from dynamo_kvtc.tiers.registry import TierKind, register

MEM_BYTES = 1 << 20  # the tier's capacity in the tests


class _Entry(NamedTuple):
    data: bytearray
    meta: Any


class MemTier(BlobTier):
    """The ``mem`` tier: copies of blobs in a dict, least recently used first, at most ``capacity`` bytes."""

    name = "mem"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used_bytes = 0
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._lock = threading.RLock()

    def put(self, blob_id: str, blob: Any, meta: Any, *, keep_evicted: bool = True) -> list[Evicted]:
        data = bytearray(BlobView.of(blob).host())
        if len(data) > self.capacity:
            raise TierFullError(f"blob of {len(data)} bytes exceeds the mem tier ({self.capacity} bytes)")
        evicted = []
        with self._lock:
            if blob_id in self._entries:
                self._entries.move_to_end(blob_id)
                return evicted
            while self.used_bytes + len(data) > self.capacity:
                old_id, old = self._entries.popitem(last=False)
                self.used_bytes -= len(old.data)
                evicted.append(Evicted(old_id, bytes(old.data) if keep_evicted else None, old.meta))
            self._entries[blob_id] = _Entry(data, meta)
            self.used_bytes += len(data)
        return evicted

    def read(self, blob_id: str) -> BlobView | None:
        with self._lock:
            e = self._entries.get(blob_id)
            if e is None:
                return None
            self._entries.move_to_end(blob_id)
            return BlobView(bytes(e.data))

    def discard(self, blob_id: str) -> None:
        with self._lock:
            e = self._entries.pop(blob_id, None)
            if e is not None:
                self.used_bytes -= len(e.data)

    def damage(self, blob_id: str) -> None:
        """Flip a byte in the middle of a held blob (the tests' stand-in for a corrupted store)."""
        with self._lock:
            data = self._entries[blob_id].data
            data[len(data) // 2] ^= 0xFF


register(TierKind("mem", MemTier, lambda cfg: MemTier(MEM_BYTES) if "mem" in cfg.tiers else None))

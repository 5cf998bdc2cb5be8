"""Host tier (G2c): compressed blobs in one pinned arena, LRU, eviction hands blobs to the caller (for demotion).

The arena is cut into fixed pages (``page_bytes``, default 16 KiB); a blob takes ``ceil(size / page)`` pages that need
not be contiguous. There is no external fragmentation, so the tier never "collapses" into unusable holes, and at most
one partial page is wasted per blob. Pages are pinned when CUDA is present (fast H2D), plain memory otherwise.

Memory: the arena is allocated once, up front; an arena that cannot be allocated (or pinned) is a
:class:`~dynamo_kvtc.errors.TierError` at start (pinning falls back to plain memory first), never an engine crash. A
``put`` is all-or-nothing: if copying the blob in, or reading an eviction victim out, fails for lack of memory the
tier is left exactly as it was and :class:`~dynamo_kvtc.errors.TierFullError` is raised.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError, TierError, TierFullError
from .base import BlobTier

log = logging.getLogger(__name__)


@dataclass
class HostEntry:
    pages: list[int]
    nbytes: int
    meta: Any


class HostTier(BlobTier):
    """Compressed blobs in one page arena, LRU. Owns the arena, its free pages and the entries; it never decides what
    happens to an evicted blob (``put`` hands victims back) and never interprets a blob's bytes."""

    def __init__(self, capacity_bytes: int, page_bytes: int = 16384, pinned: bool | None = None) -> None:
        for name, v in (("capacity_bytes", capacity_bytes), ("page_bytes", page_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (name == "page_bytes"):
                raise ConfigError(f"host tier {name} must be a non-negative integer, got {v!r}")
        self.page = page_bytes
        self.num_pages = capacity_bytes // page_bytes
        if pinned is None:
            pinned = torch.cuda.is_available()
        self.arena = self._allocate(self.num_pages * page_bytes, bool(pinned))
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._entries: OrderedDict[str, HostEntry] = OrderedDict()
        self._lock = threading.RLock()
        self.used_bytes = 0  # payload bytes (not page-rounded)

    def _allocate(self, nbytes: int, pinned: bool) -> torch.Tensor:
        if pinned:
            try:
                arena = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                self.pinned = True
                return arena
            except (RuntimeError, MemoryError) as e:  # page-locking limits: plain memory still works, slower H2D
                log.warning("host tier: cannot pin %d bytes (%s); using pageable memory", nbytes, e)
        self.pinned = False
        try:
            return torch.empty(nbytes, dtype=torch.uint8)
        except (RuntimeError, MemoryError) as e:
            raise TierError(
                f"cannot allocate the {nbytes / (1 << 30):.2f} GiB host tier ({type(e).__name__}: {e}); "
                "lower DYN_KVTC_CPU_CACHE_GB / cpu_cache_gb"
            ) from None

    # ------------------------------------------------------------------ capacity
    @property
    def capacity(self) -> int:
        return self.num_pages * self.page

    @property
    def fill(self) -> float:
        with self._lock:
            return 1.0 - len(self._free) / self.num_pages if self.num_pages else 1.0

    def pages_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.page))

    # ------------------------------------------------------------------ operations
    def put(self, blob_id: str, data: bytes | bytearray | memoryview, meta: Any = None) -> list[tuple[str, bytes, Any]]:
        """Store a blob; evict least-recently-used blobs to make room and return them (id, bytes, meta)."""
        data = memoryview(data).cast("B")
        need = self.pages_for(len(data))
        if need > self.num_pages:
            raise TierFullError(f"blob of {len(data)} bytes exceeds the host tier ({self.capacity} bytes)")
        try:  # every allocation happens before the tier changes: a failure leaves it as it was
            src = (
                torch.frombuffer(bytearray(data), dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)
            )
        except MemoryError as e:
            raise TierFullError(f"no memory to copy a blob of {len(data)} bytes into the host tier") from e
        evicted: list[tuple[str, bytes, Any]] = []
        with self._lock:
            if blob_id in self._entries:
                self._entries.move_to_end(blob_id)
                return evicted
            victims, free = [], len(self._free)
            for old_id, old in self._entries.items():
                if free >= need:
                    break
                victims.append(old_id)
                free += len(old.pages)
            try:
                evicted = [(v, self._read(self._entries[v]), self._entries[v].meta) for v in victims]
            except MemoryError as e:
                raise TierFullError("no memory to hand eviction victims on; host tier unchanged") from e
            for v in victims:
                self._release(self._entries.pop(v))
            pages = [self._free.pop() for _ in range(need)]
            for i, p in enumerate(pages):
                chunk = src[i * self.page : (i + 1) * self.page]
                self.arena[p * self.page : p * self.page + chunk.numel()].copy_(chunk)
            self._entries[blob_id] = HostEntry(pages, len(data), meta)
            self.used_bytes += len(data)
        return evicted

    def _read(self, e: HostEntry) -> bytes:
        parts = []
        left = e.nbytes
        for p in e.pages:
            n = min(self.page, left)
            parts.append(self.arena[p * self.page : p * self.page + n].numpy().tobytes())
            left -= n
        return b"".join(parts)

    def _release(self, e: HostEntry) -> None:
        self._free.extend(e.pages)
        self.used_bytes -= e.nbytes

    def get(self, blob_id: str) -> tuple[bytes, Any] | None:
        """The blob's bytes and meta (marks it most recently used), or None."""
        with self._lock:
            e = self._entries.get(blob_id)
            if e is None:
                return None
            self._entries.move_to_end(blob_id)
            return self._read(e), e.meta

    def pop(self, blob_id: str) -> tuple[bytes, Any] | None:
        with self._lock:
            e = self._entries.pop(blob_id, None)
            if e is None:
                return None
            data = self._read(e)
            self._release(e)
            return data, e.meta

    def discard(self, blob_id: str) -> None:
        self.pop(blob_id)

    def extents(self, blob_id: str) -> list[tuple[int, int]]:
        """(byte offset in ``arena``, length) of each piece of a held blob, in order (for zero-copy reads, e.g. NIXL
        descriptors of a staging arena); empty if the blob is not held."""
        with self._lock:
            e = self._entries.get(blob_id)
            if e is None:
                return []
            out, left = [], e.nbytes
            for p in e.pages:
                n = min(self.page, left)
                out.append((p * self.page, n))
                left -= n
            return out

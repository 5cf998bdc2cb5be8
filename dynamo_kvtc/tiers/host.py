"""Host tier (G2c): compressed blobs in one pinned arena, LRU, eviction hands blobs to the caller (for demotion).

The arena is cut into fixed pages (``page_bytes``, default 16 KiB); a blob takes ``ceil(size / page)`` pages, in one
contiguous run when one is free (first fit over the merged free runs) and otherwise in a few pieces, so the tier never
"collapses" into unusable holes and at most one partial page is wasted per blob. Pages are pinned when CUDA is present
(fast H2D), plain memory otherwise. A restore reads a blob in place through a :class:`HostLease` (one asynchronous
device copy of a contiguous blob, no host copy); a leased blob is never evicted and its pages are not reused before the
lease is released.

Memory: the arena is allocated once, up front; an arena that cannot be allocated (or pinned) is a
:class:`~dynamo_kvtc.errors.TierError` at start (pinning falls back to plain memory first), never an engine crash. A
``put`` is all-or-nothing: if reading an eviction victim out fails for lack of memory, or the pages it needs are being
read, the tier is left exactly as it was and :class:`~dynamo_kvtc.errors.TierFullError` is raised.
"""

from __future__ import annotations

import bisect
import logging
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..codec.blob import BlobView
from ..errors import ConfigError, TierError, TierFullError
from .base import BlobTier, Evicted

log = logging.getLogger(__name__)


@dataclass
class HostEntry:
    runs: list[tuple[int, int]]  # (first page, page count), in blob order
    nbytes: int
    meta: Any
    leases: int = 0  # readers holding the pages (zero-copy restores); eviction skips a leased entry
    dead: bool = False  # dropped while leased: the pages go back when the last lease is released

    @property
    def pages(self) -> int:
        return sum(n for _, n in self.runs)


class FreeRuns:
    """The arena's free pages as sorted, merged runs ``(first page, count)``. :meth:`take` gives one contiguous run
    where one is long enough (first fit), else pieces of several; :meth:`give` merges runs back. Owns nothing but the
    page numbers; never touches the arena."""

    def __init__(self, num_pages: int) -> None:
        self.starts: list[int] = [0] if num_pages else []
        self.lengths: list[int] = [num_pages] if num_pages else []
        self.free = num_pages

    def take(self, need: int) -> list[tuple[int, int]]:
        if need > self.free:
            raise TierFullError(f"{need} pages asked, {self.free} free")
        for i, n in enumerate(self.lengths):
            if n >= need:  # first fit: one contiguous run
                a = self.starts[i]
                if n == need:
                    del self.starts[i], self.lengths[i]
                else:
                    self.starts[i], self.lengths[i] = a + need, n - need
                self.free -= need
                return [(a, need)]
        out, left = [], need  # fragmented: the largest runs first, so a blob has few pieces
        while left:
            i = max(range(len(self.lengths)), key=self.lengths.__getitem__)
            a, n = self.starts[i], self.lengths[i]
            k = min(n, left)
            out.append((a, k))
            if k == n:
                del self.starts[i], self.lengths[i]
            else:
                self.starts[i], self.lengths[i] = a + k, n - k
            left -= k
        self.free -= need
        return out

    def give(self, runs: list[tuple[int, int]]) -> None:
        for a, n in runs:
            i = bisect.bisect_left(self.starts, a)
            if i > 0 and self.starts[i - 1] + self.lengths[i - 1] == a:  # merge with the run before
                i -= 1
                self.lengths[i] += n
            else:
                self.starts.insert(i, a)
                self.lengths.insert(i, n)
            if i + 1 < len(self.starts) and self.starts[i] + self.lengths[i] == self.starts[i + 1]:  # and after
                self.lengths[i] += self.lengths.pop(i + 1)
                self.starts.pop(i + 1)
            self.free += n


class HostLease:
    """A zero-copy read of one held blob: while the lease is held its pages are neither evicted nor reused, so a
    device copy may read them asynchronously. :attr:`extents` are ``(arena offset, length)`` pieces in order;
    :meth:`view` is ``(arena, offset, length)`` when the blob is contiguous. Release exactly once (idempotent)."""

    def __init__(self, tier: HostTier, entry: HostEntry, extents: list[tuple[int, int]]) -> None:
        self.tier, self.entry, self.extents = tier, entry, extents
        self.nbytes = entry.nbytes
        self.meta = entry.meta
        self._released = False

    def view(self) -> tuple[torch.Tensor, int, int] | None:
        if len(self.extents) == 1:
            off, n = self.extents[0]
            return self.tier.arena, off, n
        return None

    def tobytes(self) -> bytes:
        return self.tier.read_extents(self.extents)

    def blob(self) -> BlobView:
        """The blob as a :class:`~dynamo_kvtc.codec.blob.BlobView`: read in place when contiguous, else a copy; its
        ``release()`` releases this lease."""
        got = self.view()
        return BlobView(*(got or (self.tobytes(),)), on_release=self.release)

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.tier.release(self.entry)


GIL_FREE_COPY = 1 << 20  # copies at least this large go through torch: it releases the GIL (and may use threads)


def _copy_into(dst: torch.Tensor, src: np.ndarray) -> None:
    """``dst[:] = src`` (uint8). A raw blob is ~1 GB: copied by numpy it would hold the GIL for ~0.1-0.3 s and stall
    the engine's Python loop; torch's copy runs without it."""
    if src.nbytes < GIL_FREE_COPY:
        dst.numpy()[:] = src
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # a read-only source (bytes) is only read
        dst.copy_(torch.from_numpy(src))


class HostTier(BlobTier):
    """The ``host`` tier: compressed blobs in one page arena, LRU. Owns the arena, its free page runs and the
    entries; it never decides what happens to an evicted blob (``put`` hands victims back) and never interprets a
    blob's bytes. A blob is kept in one contiguous run of pages when one is free (so restores copy it to the device
    in one piece, zero-copy through :meth:`lease` / :meth:`read`), else in a few pieces."""

    name = "host"

    def __init__(self, capacity_bytes: int, page_bytes: int = 16384, pinned: bool | None = None) -> None:
        for name, v in (("capacity_bytes", capacity_bytes), ("page_bytes", page_bytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < (name == "page_bytes"):
                raise ConfigError(f"host tier {name} must be a non-negative integer, got {v!r}")
        self.page = page_bytes
        self.num_pages = capacity_bytes // page_bytes
        if pinned is None:
            pinned = torch.cuda.is_available()
        self.arena = self._allocate(self.num_pages * page_bytes, bool(pinned))
        self._free = FreeRuns(self.num_pages)
        self._entries: OrderedDict[str, HostEntry] = OrderedDict()
        self._lock = threading.RLock()
        self.used_bytes = 0  # payload bytes (not page-rounded), leased-but-dropped blobs included until released

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
            return 1.0 - self._free.free / self.num_pages if self.num_pages else 1.0

    def pages_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.page))

    # ------------------------------------------------------------------ operations
    def put(self, blob_id: str, blob: Any, meta: Any = None, *, keep_evicted: bool = True) -> list[Evicted]:
        """Store a blob (a BlobView or bytes-like); evict least-recently-used blobs (never a leased one) to make room
        and return them (their bytes are empty unless ``keep_evicted``: a caller with nowhere to put them saves the
        copy). All-or-nothing: TierFullError leaves the tier as it was."""
        data = BlobView.of(blob).host()
        src = np.frombuffer(data, dtype=np.uint8)  # a view: the one copy is into the arena
        need = self.pages_for(len(data))
        if need > self.num_pages:
            raise TierFullError(f"blob of {len(data)} bytes exceeds the host tier ({self.capacity} bytes)")
        evicted: list[Evicted] = []
        with self._lock:
            if blob_id in self._entries:
                self._entries.move_to_end(blob_id)
                return evicted
            victims, free = [], self._free.free
            for old_id, old in self._entries.items():
                if free >= need:
                    break
                if old.leases:
                    continue  # being read right now
                victims.append(old_id)
                free += old.pages
            if free < need:
                raise TierFullError(f"host tier: {need} pages needed, {free} can be freed (the rest is being read)")
            try:
                evicted = [
                    Evicted(v, self._read(self._entries[v]) if keep_evicted else b"", self._entries[v].meta)
                    for v in victims
                ]
            except MemoryError as e:
                raise TierFullError("no memory to hand eviction victims on; host tier unchanged") from e
            for v in victims:
                self._release(self._entries.pop(v))
            runs = self._free.take(need)
            at = 0
            for p, n in runs:
                k = min(n * self.page, len(src) - at)
                _copy_into(self.arena[p * self.page : p * self.page + k], src[at : at + k])
                at += k
            self._entries[blob_id] = HostEntry(runs, len(data), meta)
            self.used_bytes += len(data)
        return evicted

    def _extents(self, e: HostEntry) -> list[tuple[int, int]]:
        out, left = [], e.nbytes
        for p, n in e.runs:
            k = min(n * self.page, left)
            if k:
                out.append((p * self.page, k))
            left -= k
        return out

    def read_extents(self, extents: list[tuple[int, int]]) -> bytes:
        arena = self.arena.numpy()
        if len(extents) == 1:
            off, n = extents[0]
            return arena[off : off + n].tobytes()
        return b"".join(arena[off : off + n].tobytes() for off, n in extents)

    def _read(self, e: HostEntry) -> bytes:
        return self.read_extents(self._extents(e))

    def _release(self, e: HostEntry) -> None:
        if e.leases:  # a reader still copies from these pages: free them when it is done
            e.dead = True
            return
        self._free.give(e.runs)
        e.runs = []
        self.used_bytes -= e.nbytes

    def release(self, e: HostEntry) -> None:
        """End one lease of ``e`` (see :class:`HostLease`)."""
        with self._lock:
            e.leases -= 1
            if e.dead and not e.leases:
                e.dead = False
                self._release(e)

    def lease(self, blob_id: str) -> HostLease | None:
        """A zero-copy read of a held blob (marks it most recently used), or None. Release it when done."""
        with self._lock:
            e = self._entries.get(blob_id)
            if e is None:
                return None
            self._entries.move_to_end(blob_id)
            e.leases += 1
            return HostLease(self, e, self._extents(e))

    def read(self, blob_id: str) -> BlobView | None:
        """A held blob read in place under a lease (marks it most recently used; see :meth:`HostLease.blob`), or
        None. The view's ``release()`` gives the pages back."""
        lease = self.lease(blob_id)
        return None if lease is None else lease.blob()

    def pop(self, blob_id: str) -> Evicted | None:
        """Take a blob out of the tier (its bytes copied out), or None if it is not held."""
        with self._lock:
            e = self._entries.pop(blob_id, None)
            if e is None:
                return None
            data = self._read(e)
            self._release(e)
            return Evicted(blob_id, data, e.meta)

    def discard(self, blob_id: str) -> None:
        with self._lock:
            e = self._entries.pop(blob_id, None)
            if e is not None:
                self._release(e)

    def extents(self, blob_id: str) -> list[tuple[int, int]]:
        """(byte offset in ``arena``, length) of each piece of a held blob, in order (for zero-copy reads, e.g. NIXL
        descriptors of a staging arena); empty if the blob is not held."""
        with self._lock:
            e = self._entries.get(blob_id)
            return [] if e is None else self._extents(e)

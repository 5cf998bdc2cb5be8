"""Where blobs live: into the host tier, host -> disk on eviction, disk -> host on a read, and out of every tier."""

from __future__ import annotations

import logging
import threading

from ..errors import BadRecordError, TierError, TierFullError
from .blobs import BlobMeta
from .disk import DiskTier
from .host import HostLease, HostTier
from .index import BlockIndex
from .stats import StoreStats

log = logging.getLogger(__name__)


class Placement:
    """Moves blobs between the host tier and the (optional) disk tier, keeping the block index in step.

    A new or promoted blob goes into the host tier; the host's least-recently-used victims are demoted to disk, or
    dropped (unindexed) without one. Disk admission: a victim is written to disk only once it was used ``min_uses``
    times (its offload counts once, every read for a restore or a peer once; a blob that was on disk before is
    admitted again), so one-off prompts do not spend SSD writes (``disk_admission_dropped``). A blob that cannot be
    used is dropped from every tier. The transit lock covers a put and the demotions it causes, so a reader that
    misses a blob in both tiers waits for the move and looks once more. Owns that lock and the use counts: ``host``
    and ``disk`` are the store's tiers (``host`` may be replaced). It never encodes or decodes, and never decides
    what to store."""

    def __init__(
        self, index: BlockIndex, host: HostTier, disk: DiskTier | None, stats: StoreStats, min_uses: int = 1
    ) -> None:
        self.index = index
        self.min_uses = min_uses
        self._uses: dict[str, int] = {}  # blob id -> uses, for disk admission
        self.host = host
        self.disk = disk
        self.stats = stats
        self._transit = threading.RLock()

    def adopt_disk(self, cal_id: str, block_size: int) -> None:
        """Index blobs that survived a restart (only those of this calibration and block size)."""
        n = 0
        for blob_id in self.disk.ids():
            try:
                meta = BlobMeta.from_dict(self.disk.meta(blob_id))
                if meta.id != blob_id:
                    raise BadRecordError(f"metadata names blob {meta.id!r}")
            except BadRecordError as e:  # a record of the wrong shape or types: dropped, counted, never raised
                log.warning("kvtc disk tier: dropping blob %s at start-up: %s", blob_id, e)
                self.stats.disk_bad_records += 1
                self.disk.delete(blob_id)
                continue
            if meta.cal != cal_id or meta.block_size != block_size:
                self.stats.disk_foreign_blobs += 1
                continue
            self.index.add(meta)
            self._uses[blob_id] = self.min_uses  # it was admitted to disk before the restart
            n += 1
        self.stats.disk_recovered_blobs += n

    def where(self, blob_id: str) -> str | None:
        if blob_id in self.host:
            return "host"
        return "disk" if self.disk is not None and blob_id in self.disk else None

    # ------------------------------------------------------------------ writes
    def put(self, meta: BlobMeta, blob: bytes) -> None:
        """Index a blob and keep it in the host tier (straight to disk if larger than the whole host tier). Raises
        TierFullError when it fits nowhere (then it is not indexed)."""
        with self._transit:  # LRU victims leave the host tier before they reach disk: a reader waits for both
            self.index.add(meta)
            self._uses[meta.id] = self._uses.get(meta.id, 0) + 1
            try:
                evicted = self.host.put(meta.id, blob, meta, keep_evicted=self.disk is not None)
            except TierFullError:
                if self.disk is None:
                    self.index.remove(meta.id)
                    raise
                self._evict(meta.id, blob, meta)  # larger than the whole host tier: straight to disk
                return
            for old_id, data, old_meta in evicted:
                self.stats.host_evictions += 1
                self._evict(old_id, data, old_meta)

    def _evict(self, blob_id: str, data: bytes, meta: BlobMeta) -> None:
        """A blob leaving the host tier: to disk if admitted, else out of the tiers."""
        if self.disk is not None and self._uses.get(blob_id, 0) < self.min_uses:
            self.stats.disk_admission_dropped += 1
            self._uses.pop(blob_id, None)
            self.index.remove(blob_id)
            return
        self._demote(blob_id, data, meta)

    def demote(self, blob_id: str) -> bool:
        """Move one blob out of the host tier to disk now (dropped without a disk tier, as an LRU victim is);
        False if the host tier does not hold it."""
        with self._transit:
            got = self.host.pop(blob_id)
            if got is None:
                return False
            self._demote(blob_id, got[0], got[1])
            return True

    def _demote(self, blob_id: str, data: bytes, meta: BlobMeta) -> None:
        if self.disk is None:
            self._uses.pop(blob_id, None)
            self.index.remove(blob_id)
            return
        try:
            for gone in self.disk.put(blob_id, data, meta.to_dict()):
                self.stats.disk_evictions += 1
                self._uses.pop(gone, None)
                self.index.remove(gone)
            self._uses[blob_id] = max(self._uses.get(blob_id, 0), self.min_uses)  # on disk once: admitted again
            self.stats.disk_demotions += 1
            self.stats.disk_demoted_blocks += len(meta.hashes)
        except TierError as e:
            log.warning("kvtc: demotion of %s to disk failed (%s); dropping it", blob_id, e)
            self.stats.disk_write_errors[type(e).__name__] += 1
            self._uses.pop(blob_id, None)
            self.index.remove(blob_id)

    def drop(self, blob_id: str, why: BaseException) -> None:
        """Forget an unusable blob everywhere (host, disk file, index)."""
        log.warning("kvtc: dropping unusable blob %s: %s", blob_id, why)
        self.stats.blobs_dropped += 1
        self.host.discard(blob_id)
        if self.disk is not None and blob_id in self.disk:
            self.disk.discard(blob_id)
        self._uses.pop(blob_id, None)
        self.index.remove(blob_id)

    # ------------------------------------------------------------------ reads
    def read(self, blob_id: str) -> HostLease | memoryview | bytes:
        """Like :meth:`fetch`, but without copies: a host-resident blob comes back as a :class:`HostLease` (read in
        place; the caller releases it once its device copy is done) — also right after a disk hit promoted it — and
        a disk hit that could not be promoted as a view of the buffer it was read into."""
        lease = self.host.lease(blob_id)
        if lease is not None:
            self._count_host_hit(blob_id)
            return lease
        blob = self._from_disk(blob_id)
        if blob is None:
            return self.fetch(blob_id)  # between tiers right now: fetch waits for the move and looks again
        lease = self.host.lease(blob_id)  # promoted (or, without room in memory, only the bytes)
        return blob if lease is None else lease

    def fetch(self, blob_id: str, _retry: bool = False) -> bytes:
        """A blob's bytes from the host tier, else from disk (then promoted to the host tier). TierError if no tier
        holds it; TransferError (a TierError) when a disk read failed but the file is kept."""
        got = self.host.get(blob_id)
        if got is not None:
            self._count_host_hit(blob_id)
            return got[0]
        blob = self._from_disk(blob_id)
        if blob is not None:
            return bytes(blob)
        if not _retry:
            with self._transit:  # it may be between host and disk right now: look once more after the move
                pass
            return self.fetch(blob_id, _retry=True)
        raise TierError(f"blob {blob_id} vanished from every tier")

    def _count_host_hit(self, blob_id: str) -> None:
        self.stats.onboard_host_hits += 1
        self._uses[blob_id] = self._uses.get(blob_id, 0) + 1

    def _from_disk(self, blob_id: str) -> memoryview | None:
        """Read a blob from disk and promote it into the host tier (the next turn finds it in memory); None when the
        disk tier does not hold it."""
        if self.disk is None or blob_id not in self.disk:
            return None
        blob, meta = self.disk.get(blob_id)
        self.stats.onboard_disk_hits += 1
        try:
            self.put(BlobMeta.from_dict(meta), blob)
        except TierError:
            pass
        return blob

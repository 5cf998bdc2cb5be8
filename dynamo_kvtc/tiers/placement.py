"""Where blobs live: an ordered chain of tiers (first = fastest): into the first, a tier's victims down the chain, a
hit further down promoted back into the first, and out of every tier."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..codec.blob import BlobView
from ..errors import BadRecordError, TierError, TierFullError
from .base import BlobTier
from .blobs import BlobMeta
from .index import BlockIndex
from .stats import StoreStats

log = logging.getLogger(__name__)


class Placement:
    """Moves blobs along a chain of :class:`~dynamo_kvtc.tiers.base.BlobTier` s (fastest first), keeping the block
    index in step.

    A new or promoted blob goes into the first tier; a tier's least-recently-used victims go to the next tier, or are
    dropped (unindexed) off the end of the chain. Admission (``min_uses``, by tier name): a victim is written into a
    tier only once it was used that many times (its offload counts once, every read for a restore or a peer once; a
    blob that was in that tier before is admitted again), so one-off prompts do not spend SSD writes
    (``<tier>_admission_dropped``). A read walks the chain and promotes a hit into the first tier. A blob that cannot
    be used is dropped from every tier. The transit lock covers a put and the moves it causes, so a reader that misses
    a blob in every tier waits for the move and looks once more. Owns that lock and the use counts; a blob leaving the
    chain is reported through one hook, ``on_gone(blob_id)`` (the index's ``remove``); a blob entering or leaving a
    tier through the placement is told to the index's tier listeners (:meth:`BlockIndex.announce_tier`). Tiers keep
    a blob's meta as the plain map :meth:`BlobMeta.to_dict` gives. It never encodes or decodes, and never decides
    what to store."""

    def __init__(
        self,
        index: BlockIndex,
        tiers: Sequence[BlobTier],
        stats: StoreStats,
        min_uses: Mapping[str, int] | None = None,
        on_gone: Callable[[str], None] | None = None,
    ) -> None:
        if not tiers:
            raise TierError("a placement needs at least one tier")
        self.index = index
        self.tiers = list(tiers)
        self.min_uses = dict(min_uses or {})
        self.on_gone = on_gone or index.remove
        self._uses: dict[str, int] = {}  # blob id -> uses, for admission
        self.stats = stats
        for t in self.tiers:
            stats.tier(t.name)
        self._transit = threading.RLock()

    @property
    def first(self) -> BlobTier:
        """The fastest tier (new and promoted blobs go here)."""
        return self.tiers[0]

    @first.setter
    def first(self, tier: BlobTier) -> None:  # tests replace the first tier with an empty one
        self.tiers[0] = tier

    def tier(self, name: str) -> BlobTier | None:
        """The chain's tier of that name, or None."""
        return next((t for t in self.tiers if t.name == name), None)

    def _admits(self, i: int) -> int:
        return self.min_uses.get(self.tiers[i].name, 1)

    def _gone(self, blob_id: str) -> None:
        self._uses.pop(blob_id, None)
        self.on_gone(blob_id)

    def adopt(self, cal_id: str, block_size: int) -> None:
        """Index blobs the tiers held at start (a restart's disk files; only this calibration and block size)."""
        for i, tier in enumerate(self.tiers):
            st = self.stats.tier(tier.name)
            bind = getattr(tier, "bind", None)  # a shared tier names its objects by calibration (the pool)
            if bind is not None:
                bind(cal_id, block_size)
            for blob_id in tier.ids():
                try:
                    meta = BlobMeta.from_dict(tier.meta(blob_id))
                    if meta.id != blob_id:
                        raise BadRecordError(f"metadata names blob {meta.id!r}")
                except BadRecordError as e:  # a record of the wrong shape or types: dropped, counted, never raised
                    log.warning("kvtc %s tier: dropping blob %s at start-up: %s", tier.name, blob_id, e)
                    st.bad_records += 1
                    tier.discard(blob_id)
                    continue
                if meta.cal != cal_id or meta.block_size != block_size:
                    st.foreign_blobs += 1
                    continue
                self.index.add(meta)
                self._uses[blob_id] = self._admits(i)  # it was admitted to this tier before the restart
                st.recovered_blobs += 1
                self.index.announce_tier("stored", tier.name, meta.hashes)

    def where(self, blob_id: str) -> str | None:
        """The name of the fastest tier holding the blob, or None."""
        return next((t.name for t in self.tiers if blob_id in t), None)

    # ------------------------------------------------------------------ writes
    def put(self, meta: BlobMeta, blob: Any) -> None:
        """Index a blob (a BlobView or bytes-like) and keep it in the first tier (further down if larger than the
        whole first tier). Raises TierFullError when it fits nowhere (then it is not indexed)."""
        with self._transit:  # victims leave a tier before they reach the next: a reader waits for both
            self.index.add(meta)
            self._uses[meta.id] = self._uses.get(meta.id, 0) + 1
            rec = meta.to_dict()
            try:
                self._store(0, meta.id, blob, rec)
            except TierFullError:
                if len(self.tiers) == 1:
                    self._gone(meta.id)
                    raise
                self._spill(1, meta.id, blob, rec)  # larger than the whole first tier: straight down
            self._write_through(meta.id, blob, rec)

    def _write_through(self, blob_id: str, blob: Any, rec: dict) -> None:
        """A tier below the first that asks for every saved blob (``write_through``: the shared pool, which another
        worker reads on the next turn) gets it now too; one that cannot take it now skips it, counted."""
        for tier in self.tiers[1:]:
            if not getattr(tier, "write_through", False) or blob_id in tier:
                continue
            st = self.stats.tier(tier.name)
            try:
                evicted = tier.put(blob_id, blob, rec, keep_evicted=False)
            except TierFullError:
                st.skipped += 1
                continue
            except TierError as e:
                st.write_errors[type(e).__name__] += 1
                continue
            self.index.announce_tier("stored", tier.name, _hashes(rec))  # the router counts it for every worker
            for ev in evicted:  # a tier that forgets what it wrote through (the pool's bounded list of its blobs)
                st.evictions += 1
                self.index.announce_tier("removed", tier.name, _hashes(ev.meta))
                if not any(ev.blob_id in t for t in self.tiers):
                    self._gone(ev.blob_id)

    def _store(self, i: int, blob_id: str, blob: Any, rec: dict) -> None:
        """Put into tier i; its victims go down the chain."""
        tier = self.tiers[i]
        evicted = tier.put(blob_id, blob, rec, keep_evicted=i + 1 < len(self.tiers))
        self.index.announce_tier("stored", tier.name, _hashes(rec))
        st = self.stats.tier(tier.name)
        for ev in evicted:
            st.evictions += 1
            self.index.announce_tier("removed", tier.name, _hashes(ev.meta))
            self._spill(i + 1, ev.blob_id, ev.blob, ev.meta)

    def _spill(self, i: int, blob_id: str, blob: Any, rec: Any, admit: bool = True) -> None:
        """A blob leaving tier i - 1: into tier i if admitted, else out of the chain."""
        if i >= len(self.tiers) or blob is None:
            self._gone(blob_id)
            return
        tier = self.tiers[i]
        st = self.stats.tier(tier.name)
        if admit and self._uses.get(blob_id, 0) < self._admits(i):
            st.admission_dropped += 1
            self._gone(blob_id)
            return
        try:
            self._store(i, blob_id, blob, rec)
        except TierError as e:
            log.warning("kvtc: demotion of %s to the %s tier failed (%s); dropping it", blob_id, tier.name, e)
            st.write_errors[type(e).__name__] += 1
            self._gone(blob_id)
            return
        self._uses[blob_id] = max(self._uses.get(blob_id, 0), self._admits(i))  # in this tier once: admitted again
        st.demotions += 1
        st.demoted_blocks += len(rec["hashes"])

    def demote(self, blob_id: str) -> bool:
        """Move one blob out of the first tier to the next now (dropped at the end of the chain, as a victim is);
        False if the first tier does not hold it."""
        with self._transit:
            first = self.first
            rec = first.meta(blob_id)
            view = first.read(blob_id)
            if view is None:
                return False
            try:
                data = view.tobytes()
            finally:
                view.release()
            first.discard(blob_id)
            self.index.announce_tier("removed", first.name, _hashes(rec))
            self._spill(1, blob_id, data, rec, admit=False)
            return True

    def drop(self, blob_id: str, why: BaseException) -> None:
        """Forget an unusable blob everywhere (every tier, the index); one already gone (dropped by whoever saw the
        failure first: a pool read's listener, then the restore it failed) is not dropped again."""
        if self.index.meta(blob_id) is None and not any(blob_id in t for t in self.tiers):
            return
        log.warning("kvtc: dropping unusable blob %s: %s", blob_id, why)
        self.stats.blobs_dropped += 1
        for tier in self.tiers:
            rec = tier.meta(blob_id)
            tier.discard(blob_id)
            if rec is not None:
                self.index.announce_tier("removed", tier.name, _hashes(rec))
        self._gone(blob_id)

    def retire(self, blob_id: str) -> None:
        """Forget a superseded blob everywhere (every tier through its ``discard``, the index): its blocks are held
        by newer blobs already (the moving raw window's replacement). A reader holding a host-tier lease on it keeps
        its pages until it releases them; one that reads it after this misses."""
        with self._transit:
            held = [(tier, tier.meta(blob_id)) for tier in self.tiers]
            for tier, _ in held:
                tier.discard(blob_id)
            self._gone(blob_id)
            for tier, rec in held:  # the router hears only of blocks no newer blob holds
                gone = [h for h in _hashes(rec) if h not in self.index]
                if gone:
                    self.index.announce_tier("removed", tier.name, gone)
        self.stats.blobs_retired += 1

    # ------------------------------------------------------------------ reads
    def peek(self, blob_id: str) -> bytes | None:
        """A copy of a blob's bytes from the fastest tier holding it, or None: no promotion, no use or hit counted
        (the offload reading back a raw window it replaces)."""
        for tier in self.tiers:
            try:
                view = tier.read(blob_id)
            except TierError:
                continue
            if view is None:
                continue
            try:
                return view.tobytes()
            except TierError:  # a blob still landing whose read failed (the pool's): that tier lost it
                continue
            finally:
                view.release()
        return None

    def read(self, blob_id: str, _retry: bool = False) -> BlobView:
        """The blob as a view, without copies: walks the chain; a hit below the first tier is promoted into it and
        then read from there (a host-tier lease: read in place, the caller calls ``release()`` once its device copy
        is done), or, without room, returned as the lower tier read it. TierError if no tier holds it;
        TransferError (a TierError) when a read failed but the entry is kept."""
        for i, tier in enumerate(self.tiers):
            view = tier.read(blob_id)
            if view is None:
                continue
            self.stats.tier(tier.name).hits += 1
            if i == 0:
                self._uses[blob_id] = self._uses.get(blob_id, 0) + 1
                return view
            return self._promote(tier, blob_id, view)
        if not _retry:
            with self._transit:  # it may be between two tiers right now: look once more after the move
                pass
            return self.read(blob_id, _retry=True)
        raise TierError(f"blob {blob_id} vanished from every tier")

    def _promote(self, tier: BlobTier, blob_id: str, view: BlobView) -> BlobView:
        """A hit in a lower tier: into the first tier (the next turn finds it there), read back from there. A blob
        still landing (the pool's, part by part) is returned as it is, so the restore starts on its first layer group
        at once; it is promoted once every byte landed, on the landing thread (:meth:`_landed`)."""
        if view.arriving:
            view.when_landed(lambda err: self._landed(blob_id, view, err))
            return view
        try:
            rec = tier.meta(blob_id)
            meta = BlobMeta.from_dict(rec) if rec is not None else self.index.meta(blob_id)
            if meta is not None:
                self.put(meta, view)
        except TierError:
            pass
        got = self.first.read(blob_id)
        if got is None:
            return view
        view.release()
        return got

    def _landed(self, blob_id: str, view: BlobView, err: BaseException | None) -> None:
        """A lower tier's blob finished landing: into the first tier if every byte came and opened and it is still
        indexed; a blob whose read failed (missing, late, refused) is never promoted, and is dropped everywhere."""
        meta = self.index.meta(blob_id)
        if err is not None:
            if meta is not None or any(blob_id in t for t in self.tiers):
                self.drop(blob_id, err)
            return
        if meta is None or blob_id in self.first:  # dropped or retired meanwhile, or promoted by another read
            return
        data = view.host_view()
        try:
            self.put(meta, data if data is not None else view.tobytes())
        except TierError as e:
            log.info("kvtc: not promoting blob %s into the %s tier: %s", blob_id, self.first.name, e)

    def fetch(self, blob_id: str) -> bytes:
        """A copy of a blob's bytes (as :meth:`read`, then copied and released)."""
        view = self.read(blob_id)
        try:
            return view.tobytes()
        finally:
            view.release()


def _hashes(rec: Any) -> list[int]:
    """The block hashes a tier's record of a blob names (none when the record is not a map)."""
    return list(rec.get("hashes", ())) if isinstance(rec, Mapping) else []

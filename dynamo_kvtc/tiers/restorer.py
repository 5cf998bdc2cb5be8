"""Onboard: blobs (from the tiers or a peer) -> verified -> restored layer by layer into engine blocks or a sink, on two
lanes (a worker thread and CUDA stream each: hits in the first tier (host) on one, restores from lower tiers and peers
on the other, so a slow blob never queues a host hit behind it); each layer signalled on its own, so attention on layer
0 can start early, and every layer's writes gated by the handle's cancel flag, so a restore its caller gave up on writes
nothing more."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import Any

import torch

from ..codec.base import Codec, PagedView, RestoreRun
from ..codec.blob import BlobView
from ..errors import DecodeError, KvtcError, TierError, TransferError
from .blobs import BlobRun, Sink
from .index import BlockIndex
from .keys import check_blob_keys
from .layout import PagedKV
from .placement import Placement
from .stats import PEER, StoreStats
from .streams import codec_stream

log = logging.getLogger(__name__)

Source = Callable[[], list[BlobRun]]
SLOW = "slow"  # the lane of restores from lower tiers (and prefetches); the first is the first tier's
# PEER ("peer", the stats' source name) is also the lane of restores from a peer: a dead peer a request names delays
# other peer fetches only


class OnboardHandle:
    """Per-layer readiness of one restore. ``wait_layer(i)`` returns once layer i is in place (on CUDA the current
    stream is also made to wait on the layer's event), or raises TierError if the restore failed.

    The producer (the onboard worker) makes each layer's writes inside :meth:`writing` and calls
    :meth:`mark_layer_ready` there, per layer in order, then :meth:`finish`, or :meth:`fail` at any point; consumers
    read ``ok`` / ``error`` / ``finished`` / ``ready_times`` / ``bytes_read`` / ``raw_bytes`` and wait. A consumer
    that gives up calls :meth:`cancel`: once it returns True no write of this restore is running or will start, and
    the device has finished those already queued. ``finished`` turns true only after the worker let go of the
    destination (its last write done on the device), so the blocks may be reused then. A handle never restores
    anything itself."""

    def __init__(self, num_layers: int, hashes: Sequence[int], device: torch.device) -> None:
        self.num_layers = num_layers
        self.hashes = list(hashes)
        self.device = device
        self._ready = [threading.Event() for _ in range(num_layers)]
        self._cuda: list[Any] = [None] * num_layers
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.ready_times: list[float | None] = [None] * num_layers
        self.started = time.perf_counter()
        self.future: Future | None = None
        self.bytes_read = 0  # compressed bytes fetched from the tiers for this restore
        self.raw_bytes = 0  # uncompressed bytes of the KV it restores (the engine's dtype)
        self.leases: list[BlobView] = []  # blobs this restore read from the tiers (released by the restorer)
        self.lane = "host"  # the restorer's lane it runs on
        self.stream: Any = None  # the lane's CUDA stream its writes are queued on (None on the CPU)
        self._gate = threading.Lock()  # held by the producer around each layer's writes, by cancel() to stop them
        self._cancelled = False

    # ------------------------------------------------------------------ cancellation
    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @contextmanager
    def writing(self):
        """Producer: one layer's writes into the destination. Raises TierError (nothing written) once cancelled."""
        with self._gate:
            if self._cancelled:
                raise TierError("restore cancelled by its caller before this layer was written")
            yield

    def cancel(self, timeout: float | None = None) -> bool:
        """Stop the restore's writes: no layer starts after this returns True, and the writes already queued on the
        device are done. False: a layer's writes were still running after ``timeout`` seconds (they stop after it).
        ``timeout=0``: only raise the flag, never wait (``finished`` says when the worker let go)."""
        self._cancelled = True
        if timeout is not None and timeout <= 0:
            return self.finished
        if not self._gate.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return False
        try:
            if self.stream is not None:
                self.stream.synchronize()  # the writes queued before the flag was seen
        finally:
            self._gate.release()
        return True

    # ------------------------------------------------------------------ producer side
    def mark_layer_ready(self, i: int) -> None:
        """Layer i's writes are queued on the current stream: record an event (CUDA) and release its waiters."""
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._cuda[i] = ev
        self.ready_times[i] = time.perf_counter() - self.started
        self._ready[i].set()

    def fail(self, e: BaseException) -> None:
        """The restore failed: every waiter is released and sees the error."""
        self.error = e
        for ev in self._ready:
            ev.set()
        self._done.set()

    def finish(self) -> None:
        self._done.set()

    # ------------------------------------------------------------------ consumer side
    @property
    def finished(self) -> bool:
        """Whether the restore ended (successfully or not); does not wait."""
        return self._done.is_set()

    def wait_layer(self, i: int, timeout: float | None = None) -> None:
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer {i} outside [0, {self.num_layers})")
        if not self._ready[i].wait(timeout):
            raise TierError(f"layer {i} not restored within {timeout} s")
        if self.ready_times[i] is None:
            raise TierError(f"restore failed before layer {i}: {self.error}")
        if self._cuda[i] is not None:
            torch.cuda.current_stream().wait_event(self._cuda[i])

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the whole restore finished; True if every layer is in place."""
        self._done.wait(timeout)
        return self.ok

    @property
    def ok(self) -> bool:
        return self._done.is_set() and self.error is None

    async def done(self) -> bool:
        await asyncio.get_running_loop().run_in_executor(None, self._done.wait)
        return self.ok


class Restorer:
    """Restores requested blocks from blob runs, layer by layer, and reads blobs out for peers. Owns the onboard
    lanes (:attr:`lanes`: a thread and a CUDA stream each; a restore whose blobs are all in the first tier runs on that
    tier's lane, ``host``; one from a ``source`` (a peer) on ``peer``; any other and prefetches on ``slow``). Blobs
    come from the tiers (through :class:`Placement`, which promotes hits in lower tiers) or from a ``source`` (a
    peer's runs, whose blobs of this calibration are then kept here too). Decoding goes through
    :meth:`Codec.restore`: every blob is fully verified before the first layer is written, a blob found corrupt is
    dropped from the tiers, and any failure is a miss reported on the handle, never raised into the engine. It never
    writes outside the given destination blocks or sink, and never encodes."""

    def __init__(
        self,
        *,
        cal: Any,
        kv: PagedKV | None,
        index: BlockIndex,
        placement: Placement,
        decoder: Callable[[], Codec],
        block_size: int,
        device: torch.device,
        stats: StoreStats,
        codec_sms: int = 0,
    ) -> None:
        self.cal, self.kv, self.index, self.placement, self.decoder = cal, kv, index, placement, decoder
        self.block_size, self.device = block_size, device
        self.num_layers = cal.fingerprint.num_layers
        self.stats = stats
        self.lanes = (placement.first.name, SLOW, PEER)
        self._pools = {lane: ThreadPoolExecutor(1, thread_name_prefix=f"kvtc-onboard-{lane}") for lane in self.lanes}
        self._streams = {lane: codec_stream(device, codec_sms) for lane in self.lanes}  # codec_sms: green context's SMs

    @property
    def stream(self) -> Any:
        """The first tier's lane's CUDA stream (None on the CPU)."""
        return self._streams[self.lanes[0]]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown(wait=True)

    def lane_of(self, hashes: Sequence[int], source: Source | None) -> str:
        """``peer`` for a source; the first tier's lane (``host``) when every blob covering ``hashes`` is in that
        tier now, else ``slow`` (a lower tier, unknown)."""
        if source is not None:
            return PEER
        first = self.placement.first
        try:
            return first.name if all(r.blob_id in first for r in self.index.plan(hashes)) else SLOW
        except KvtcError:
            return SLOW  # the restore itself reports why

    def start(
        self,
        hashes: Sequence[int],
        dst_blocks: Sequence[int] | None = None,
        *,
        sink: Sink | None = None,
        source: Source | None = None,
    ) -> OnboardHandle:
        """See :meth:`KvtcStore.start_onboard <dynamo_kvtc.tiers.store.KvtcStore.start_onboard>`."""
        if sink is None and (dst_blocks is None or self.kv is None):
            raise TierError("onboard needs dst_blocks with a registered paged KV cache, or a sink")
        if dst_blocks is not None and len(dst_blocks) != len(hashes):
            raise TierError(f"{len(dst_blocks)} destination blocks for {len(hashes)} hashes")
        handle = OnboardHandle(self.num_layers, hashes, self.device)
        handle.lane = self.lane_of(hashes, source)
        handle.stream = self._streams[handle.lane]
        dst = None if dst_blocks is None else list(dst_blocks)
        handle.future = self._pools[handle.lane].submit(self._restore, handle, list(hashes), dst, sink, source)
        return handle

    def submit(self, fn: Callable[[], Any], lane: str = SLOW) -> Future:
        """Run ``fn`` on an onboard lane (after the restores queued there before it)."""
        return self._pools[lane].submit(fn)

    # ------------------------------------------------------------------ reads for others
    def export(self, hashes: Sequence[int], lease: bool = False) -> tuple[list[BlobRun], list[BlobView]]:
        """The runs of blobs covering ``hashes``, each with its meta (for a peer), and the views they hold.

        ``lease=False``: every blob is a copy, nothing held. ``lease=True``: no copies: the blobs are the tiers' views
        (host-resident ones the host tier's (pinned) pages under a lease, so a peer's staging is one DMA per blob);
        the caller calls ``release()`` on each held view once done."""
        runs: list[BlobRun] = []
        held: list[BlobView] = []
        try:
            for r in self.index.plan(hashes):
                meta = self.index.meta(r.blob_id)
                if meta is None:
                    raise TierError(f"blob {r.blob_id} left the tiers while being exported")
                if lease:
                    got = self.placement.read(r.blob_id)
                    held.append(got)
                else:
                    got = BlobView(self.placement.fetch(r.blob_id))
                runs.append(replace(r, blob=got, meta=meta))
                check_blob_keys(got, r.first, hashes[r.at : r.at + r.count])  # a peer gets only what it asked for
        except BaseException:
            for h in held:
                h.release()
            raise
        return runs, held

    def prefetch(self, hashes: Sequence[int]) -> int:
        """Promote blobs of the matched prefix of ``hashes`` held in lower tiers into the first tier; returns blobs
        moved."""
        moved = 0
        place = self.placement
        for r in self.index.plan(hashes[: self.index.match(hashes)]):
            if place.where(r.blob_id) not in (None, place.first.name):
                try:
                    place.read(r.blob_id).release()
                    moved += 1
                except TransferError:
                    pass  # transient: the blob stays on disk
                except TierError as e:
                    place.drop(r.blob_id, e)
        return moved

    # ------------------------------------------------------------------ the worker
    def _restore(self, handle: OnboardHandle, hashes: list[int], dst_blocks, sink, source: Source | None) -> None:
        try:
            if handle.cancelled:  # given up on while queued: no fetch, no read, no write
                raise TierError("restore cancelled by its caller before it started")
            decoder = self.decoder()
            if source is not None:
                runs, ids = self._from_source(handle, hashes, source), None
                tiers: Counter[str] = Counter({PEER: len(hashes)})
            else:
                runs, tiers = self._from_tiers(handle, hashes)
                ids = [r.blob_id for r in runs]
            ctx = torch.cuda.stream(handle.stream) if handle.stream is not None else nullcontext()
            try:
                with ctx:
                    self._write_layers(decoder, handle, runs, ids, dst_blocks, sink)
            finally:
                self._release(handle)
            dtype = self.kv.dtype if self.kv is not None else None  # None: the calibrated model's dtype
            handle.raw_bytes = len(hashes) * self.block_size * self.cal.fingerprint.raw_bytes_per_token(dtype)
            st = self.stats
            st.onboard_blocks += len(hashes)
            for name, n in tiers.items():
                if name == PEER:
                    st.onboard_peer_blocks += n
                else:
                    st.tier(name).blocks += n
            st.onboards += 1
            if source is not None:
                self._adopt(runs)
            st.time("restore", time.perf_counter() - handle.started)
            st.time("first_layer", handle.ready_times[0] or 0.0)
            handle.finish()
        except BaseException as e:  # any failure is a miss: the engine recomputes
            self._release(handle)
            if handle.cancelled:
                self.stats.onboard_cancelled += 1
                log.info("kvtc onboard of %d blocks cancelled by its caller: %s", len(hashes), e)
            else:
                self.stats.onboard_errors[type(e).__name__] += 1
                log.warning("kvtc onboard failed (%d blocks): %s", len(hashes), e)
            handle.fail(e if isinstance(e, KvtcError) else TierError(f"{type(e).__name__}: {e}"))

    def _release(self, handle: OnboardHandle) -> None:
        """Let go of the destination and the sources: wait for the device to finish this restore's writes (so the
        handle reads finished only once the blocks are free to reuse), then give the leased host pages back."""
        if handle.stream is not None:
            handle.stream.synchronize()  # every write and every host->device copy of the leased pages is done
        if not handle.leases:
            return
        for lease in handle.leases:
            lease.release()
        handle.leases.clear()

    def _from_source(self, handle: OnboardHandle, hashes: list[int], source: Source) -> list[BlobRun]:
        runs = [replace(r, blob=BlobView.of(r.blob)) for r in source()]
        covered = sum(r.count for r in runs)
        if covered != len(hashes):
            raise TierError(f"the source delivered {covered} of {len(hashes)} blocks")
        for r in runs:  # a peer's blob must answer for the keys asked for (its header, the first range to land)
            check_blob_keys(r.blob, r.first, hashes[r.at : r.at + r.count])
        handle.bytes_read += sum(len(r.blob) for r in runs)  # a peer's blob may still be landing: read where it is
        return runs

    def _from_tiers(self, handle: OnboardHandle, hashes: list[int]) -> tuple[list[BlobRun], Counter[str]]:
        """The runs covering ``hashes``, read (host-resident blobs under a lease, read in place) and recorded in
        ``handle.leases`` for the caller to release once the device has copied them; blocks by tier read from."""
        runs = []
        tiers: Counter[str] = Counter()
        place = self.placement
        for r in self.index.plan(hashes):
            tiers[place.where(r.blob_id) or place.tiers[-1].name] += r.count
            try:
                blob = place.read(r.blob_id)
            except TransferError:
                raise  # a failed read of an intact file: a miss now, the blob stays for the next try
            except TierError as e:
                self.placement.drop(r.blob_id, e)
                raise
            handle.leases.append(blob)
            handle.bytes_read += len(blob)
            runs.append(replace(r, blob=blob))
            try:  # the blob must answer for exactly the keys asked for: else a counted miss, never served
                check_blob_keys(blob, r.first, hashes[r.at : r.at + r.count])
            except KvtcError as e:
                self.placement.drop(r.blob_id, e)
                raise
        return runs, tiers

    def _write_layers(
        self, decoder: Codec, handle: OnboardHandle, runs: list[BlobRun], ids: list[str] | None, dst_blocks, sink
    ) -> None:
        """Decode every run (all verified first) and write each layer, in order (call on the onboard stream)."""
        bs = self.block_size
        paged = None
        if sink is None and self.kv.addressable and self.kv.device.type == "cuda":
            paged = PagedView(self.kv.layer_views, self.num_layers, bs)

        def bad(i: int, e: DecodeError) -> None:
            if ids is not None:
                self.placement.drop(ids[i], e)

        specs = [
            RestoreRun(
                r.blob, r.first * bs, r.count * bs, None if sink is not None else dst_blocks[r.at : r.at + r.count]
            )
            for r in runs
        ]
        restore = decoder.restore(specs, paged=paged, bad=bad)
        layers = iter(restore)
        while True:
            # the fused path writes into the engine's blocks while it yields: then the gate covers the step too
            with handle.writing() if paged is not None else nullcontext():
                step = next(layers, None)
            if step is None:
                break
            layer, parts = step
            with handle.writing():
                for r, (k, v) in zip(runs, parts or ()):
                    if sink is not None:
                        sink(layer, r.at * bs, k, v)
                    else:
                        self.kv.scatter_layer(layer, dst_blocks[r.at : r.at + r.count], k, v)
                handle.mark_layer_ready(layer)
        if restore.fused:
            self.stats.onboard_fused_batches += 1

    def _adopt(self, runs: list[BlobRun]) -> None:
        """A peer's blobs of this calibration: keep them in the tiers for the next turn on this side."""
        for r in runs:
            m = r.meta
            if m is None:
                continue
            try:
                if m.cal == self.cal.id and m.block_size == self.block_size and not self.index.has_blob(m.id):
                    self.placement.put(m, r.blob.host())  # one copy into the host tier
            except (TypeError, KeyError, TierError) as e:
                log.info("kvtc: not keeping a transferred blob: %s", e)

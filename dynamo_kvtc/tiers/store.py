"""KvtcStore: compressed host (G2c) and disk (G3c) tiers of KVTC blobs, keyed by Dynamo-compatible block hashes.

- **Offload** (GPU -> host): a sequence's full blocks not yet stored are gathered (from the engine's paged cache or
  given tensors), encoded on a dedicated worker with its own CUDA stream (ordered after the producer by an event), and
  only the compressed bytes land in host memory. Spans are cut into blobs of at most ``span_tokens``; the raw window
  is kept only on the sequence's last blob. The host tier's LRU victims are demoted to disk (or dropped).
- **Onboard** (host/disk -> GPU): the blobs covering the requested blocks are read (NIXL for disk) and decoded layer
  by layer *in order*, each layer scattered into the engine's blocks (or handed to a sink) and marked ready with one
  event per layer, so attention on layer 0 can start while later layers are still being restored.
- Anything that fails (unknown calibration, corrupt blob, NIXL error, ENOSPC) is logged, counted, removed from the
  index, and surfaces as a miss: :meth:`OnboardHandle.wait_layer` raises :class:`~dynamo_kvtc.errors.TierError` and
  the engine recomputes. Nothing wrong is ever scattered: every blob is fully verified before its first layer.

The public methods are asyncio coroutines and the store is thread-safe (an engine may call from other threads).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..codec.entropy import nvcomp_available
from ..codec.kvtc import KvtcCodec
from ..errors import DecodeError, KvtcError, TierError, TierFullError, TransferError
from .config import TierConfig
from .disk import DiskTier
from .host import HostTier
from .keys import sequence_hashes
from .layout import PagedKV
from .policy import OffloadFilter, RatioPolicy

log = logging.getLogger(__name__)

Sink = Callable[[int, int, torch.Tensor, torch.Tensor], None]  # (layer, first token index, k, v)


@dataclass
class BlobMeta:
    id: str
    hashes: list[int]
    block_size: int
    first_position: int
    ratio: float | None
    cal: str
    raw_bytes: int
    stored_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BlobMeta:
        return cls(**d)


@dataclass
class OffloadResult:
    stored_blocks: int = 0
    skipped: str | None = None  # why nothing (more) was stored: "short", "filtered", "present", "error: ..."
    blobs: list[str] = field(default_factory=list)
    ratio: float | None = None
    raw_bytes: int = 0
    stored_bytes: int = 0
    seconds: float = 0.0


class OnboardHandle:
    """Per-layer readiness of one restore. ``wait_layer(i)`` returns once layer i is in place (on CUDA the current
    stream is also made to wait on the layer's event), or raises TierError if the restore failed."""

    def __init__(self, num_layers: int, hashes: Sequence[int], device: torch.device) -> None:
        self.num_layers = num_layers
        self.hashes = list(hashes)
        self.device = device
        self._ready = [threading.Event() for _ in range(num_layers)]
        self._cuda = [None] * num_layers
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.ready_times: list[float | None] = [None] * num_layers
        self.started = time.perf_counter()
        self.future: Future | None = None
        self.bytes_read = 0  # compressed bytes fetched from the tiers for this restore
        self.raw_bytes = 0  # 16-bit bytes of the KV it restores

    def _layer_ready(self, i: int) -> None:
        if self.device.type == "cuda":
            ev = torch.cuda.Event()
            ev.record()
            self._cuda[i] = ev
        self.ready_times[i] = time.perf_counter() - self.started
        self._ready[i].set()

    def _fail(self, e: BaseException) -> None:
        self.error = e
        for ev in self._ready:
            ev.set()
        self._done.set()

    def _finish(self) -> None:
        self._done.set()

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


class KvtcStore:
    def __init__(
        self,
        calibration: Any,
        config: TierConfig | None = None,
        *,
        device: str | torch.device = "cpu",
        block_size: int = 16,
        span_tokens: int = 1024,
        kv: PagedKV | None = None,
        disk: DiskTier | None = None,
    ) -> None:
        self.cfg = config or TierConfig.from_env()
        self.cal = calibration
        self.device = torch.device(device)
        self.block_size = block_size
        self.span_blocks = max(1, span_tokens // block_size)
        self.kv = kv
        self.num_layers = calibration.fingerprint.num_layers
        self.policy = RatioPolicy(calibration.ratios, self.cfg.ratio, self.cfg.max_ratio, self.cfg.pressure_high)
        self.filter = OffloadFilter(self.cfg.min_frequency)
        self.host = HostTier(self.cfg.host_bytes, self.cfg.page_bytes)
        if disk is None and self.cfg.disk_bytes:
            disk = DiskTier(
                self.cfg.disk_dir, self.cfg.disk_bytes, fsync=self.cfg.fsync, timeout_s=self.cfg.nixl_timeout_s
            )
        self.disk = disk
        self._codecs: dict[float, KvtcCodec] = {}
        self._lock = threading.RLock()
        self._transit = threading.RLock()
        self._index: dict[int, tuple[str, int]] = {}  # sequence hash -> (blob id, block index in blob)
        self._blobs: dict[str, BlobMeta] = {}
        self.stats: Counter[str] = Counter()
        self.listeners: list[Any] = []  # objects with stored(hashes, token_ids, parent) / removed(hashes)
        self.timings: deque[tuple[str, float]] = deque(maxlen=4096)  # (kind, seconds), drained by metrics
        self._offload_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtc-offload")
        self._onboard_pool = ThreadPoolExecutor(1, thread_name_prefix="kvtc-onboard")
        cuda = self.device.type == "cuda"
        self._offload_stream = torch.cuda.Stream(self.device) if cuda else None
        self._onboard_stream = torch.cuda.Stream(self.device) if cuda else None
        if self.disk is not None:
            self._adopt_disk()

    # ------------------------------------------------------------------ plumbing
    def codec(self, ratio: float) -> KvtcCodec:
        with self._lock:
            if ratio not in self._codecs:
                self._codecs[ratio] = KvtcCodec(
                    self.cal,
                    ratio=ratio,
                    device=self.device,
                    sinks=self.cfg.sinks,
                    window=self.cfg.window,
                    tag=self._tag(),
                )
            return self._codecs[ratio]

    def _tag(self) -> str:
        """Entropy codec of new blobs: the measured GPU default where nvCOMP runs, Deflate (CPU-readable) elsewhere."""
        if self.device.type == "cuda" and nvcomp_available():
            from ..codec.gpu import default_gpu_tag

            return default_gpu_tag()
        return "deflate"

    def _adopt_disk(self) -> None:
        """Index blobs that survived a restart (only those of this calibration)."""
        for blob_id in self.disk.ids():
            try:
                meta = BlobMeta.from_dict(self.disk.meta(blob_id))
            except (TypeError, KeyError):
                self.disk.delete(blob_id)
                continue
            if meta.cal != self.cal.id or meta.block_size != self.block_size:
                self.stats["disk_foreign_blobs"] += 1
                continue
            self._index_blob(meta)
        self.stats["disk_recovered_blobs"] += len(self._blobs)

    def _index_blob(self, meta: BlobMeta) -> None:
        with self._lock:
            self._blobs[meta.id] = meta
            for i, h in enumerate(meta.hashes):
                self._index[h] = (meta.id, i)

    def _unindex_blob(self, blob_id: str) -> None:
        with self._lock:
            meta = self._blobs.pop(blob_id, None)
            if meta is None:
                return
            gone = [h for h in meta.hashes if self._index.get(h, (None,))[0] == blob_id]
            for h in gone:
                del self._index[h]
        self._notify("removed", gone)

    def _notify(self, what: str, *args: Any) -> None:
        for listener in list(self.listeners):
            try:
                getattr(listener, what)(*args)
            except Exception as e:  # a listener never breaks the data path
                log.warning("kvtc listener %s.%s failed: %s", type(listener).__name__, what, e)
                self.stats["listener_errors"] += 1

    async def _run(self, pool: ThreadPoolExecutor, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def close(self) -> None:
        self._offload_pool.shutdown(wait=True)
        self._onboard_pool.shutdown(wait=True)
        if self.disk is not None and hasattr(self.disk, "close"):
            self.disk.close()  # releases the directory for the next process

    # ------------------------------------------------------------------ lookup
    def hashes(self, token_ids: Sequence[int]) -> list[int]:
        return sequence_hashes(token_ids, self.block_size)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` either tier holds."""
        n = 0
        with self._lock:
            for h in hashes:
                if h not in self._index:
                    break
                n += 1
        return n

    def match_tiers(self, hashes: Sequence[int]) -> tuple[int, int]:
        """(leading blocks held by either tier, leading blocks held in host memory)."""
        n = n_host = 0
        with self._lock:
            for h in hashes:
                e = self._index.get(h)
                if e is None:
                    break
                n += 1
                if n_host == n - 1 and e[0] in self.host:
                    n_host = n
        return n, n_host

    def lookup(self, token_ids: Sequence[int]) -> int:
        return self.match(self.hashes(token_ids))

    def where(self, h: int) -> str | None:
        with self._lock:
            e = self._index.get(h)
        if e is None:
            return None
        return "host" if e[0] in self.host else ("disk" if self.disk is not None and e[0] in self.disk else None)

    # ------------------------------------------------------------------ offload
    async def offload(
        self,
        token_ids: Sequence[int],
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        *,
        block_ids: Sequence[int] | None = None,
        ready_event: Any = None,
        tail: bool = True,
    ) -> OffloadResult:
        """Store the sequence's full blocks that no tier holds yet. Give either ``keys``/``values``
        [L, >= n_full*block_size, H, D] for ``token_ids`` from position 0, or the engine ``block_ids`` (one per full
        block) of the registered paged cache. ``ready_event`` (a CUDA event) orders the encode after the producer."""
        bs = self.block_size
        n_full = len(token_ids) // bs
        if len(token_ids) < self.cfg.min_tokens or n_full == 0:
            self.stats["offload_bypass_short"] += 1
            return OffloadResult(skipped="short")
        if keys is None and (block_ids is None or self.kv is None):
            raise TierError("offload needs keys/values or block_ids with a registered paged KV cache")
        if block_ids is not None and len(block_ids) < n_full:
            raise TierError(f"offload got {len(block_ids)} block ids for {n_full} full blocks")
        hashes = self.hashes(token_ids[: n_full * bs])
        fut = self.submit_offload(
            hashes,
            list(token_ids[: n_full * bs]),
            keys=keys,
            values=values,
            block_ids=block_ids,
            ready_event=ready_event,
            tail=tail,
        )
        return await asyncio.wrap_future(fut)

    def submit_offload(
        self,
        hashes: Sequence[int],
        token_ids: Sequence[int],
        *,
        first_block: int = 0,
        parent: int | None = None,
        keys: torch.Tensor | None = None,
        values: torch.Tensor | None = None,
        block_ids: Sequence[int] | None = None,
        ready_event: Any = None,
        tail: bool = True,
    ) -> Future:
        """Queue the encode of blocks ``first_block .. first_block + len(hashes)`` of a sequence on the offload worker
        and return a Future of the :class:`OffloadResult` (errors are caught and reported in it, never raised).

        ``hashes``/``token_ids`` cover just these blocks; ``parent`` is the sequence hash of the block before them.
        K/V come from ``keys``/``values`` [L, len(hashes)*block_size, H, D] (already copied out of the engine's
        blocks) or are gathered from the registered paged cache at ``block_ids`` (one per hash) on the worker."""
        bs = self.block_size
        n = len(hashes)
        res = OffloadResult()
        done: Future = Future()
        if len(token_ids) != n * bs:
            raise TierError(f"{len(token_ids)} token ids for {n} blocks of {bs}")
        if keys is not None and (values is None or keys.shape[1] != n * bs or values.shape != keys.shape):
            raise TierError(f"keys/values must be [L, {n * bs}, H, D], got {tuple(keys.shape)}")
        if keys is None and (block_ids is None or self.kv is None or len(block_ids) != n):
            raise TierError("offload needs keys/values, or one engine block id per hash with a registered KV cache")
        admitted = self.filter.admit(hashes)
        with self._lock:
            missing = [i for i, h in enumerate(hashes) if h not in self._index]
        if not missing:
            res.skipped = "present"
            done.set_result(res)
            return done
        start = missing[0]
        end = start
        while end < n and admitted[end]:
            end += 1
        if end == start:
            res.skipped = "filtered"
            self.stats["offload_filtered"] += 1
            done.set_result(res)
            return done
        ratio = self.policy.choose(self.host.fill)
        args = (hashes, token_ids, first_block, parent, start, end, n, keys, values, block_ids, ready_event, tail)
        return self._offload_pool.submit(self._offload_guarded, args, ratio, res)

    def _offload_guarded(self, args, ratio: float, res: OffloadResult) -> OffloadResult:
        try:
            self._offload_sync(*args, ratio, res)
        except KvtcError as e:
            log.warning("kvtc offload failed: %s", e)
            self.stats[f"offload_error_{type(e).__name__}"] += 1
            res.skipped = f"error: {e}"
        except Exception as e:  # an offload never takes the engine down; it only loses a cache entry
            log.warning("kvtc offload failed unexpectedly: %s: %s", type(e).__name__, e)
            self.stats["offload_error_unexpected"] += 1
            res.skipped = f"error: {type(e).__name__}: {e}"
        return res

    def _offload_sync(
        self,
        hashes,
        token_ids,
        first_block,
        parent,
        start,
        end,
        n,
        keys,
        values,
        block_ids,
        ready_event,
        tail,
        ratio,
        res,
    ):
        t0 = time.perf_counter()
        bs = self.block_size
        codec = self.codec(ratio)
        ctx = torch.cuda.stream(self._offload_stream) if self._offload_stream is not None else nullcontext()
        with ctx:
            if ready_event is not None and self._offload_stream is not None:
                self._offload_stream.wait_event(ready_event)
            cuts = []  # (first block, end block, raw window) of each blob
            a = start
            while a < end:
                b = min(end, a + self.span_blocks)
                if tail and end == n and (end - b) * bs <= self.cfg.window:
                    b = end  # the last blob holds the whole raw window of the sequence
                cuts.append((a, b, self.cfg.window if (tail and b == n) else 0))
                a = b
            fused = self._encode_fused(codec, cuts, first_block, keys, values, block_ids)
            for i, (a, b, window) in enumerate(cuts):
                if fused is not None:
                    blob = fused[i]
                    L = self.num_layers
                    fp = self.cal.fingerprint
                    raw = L * (b - a) * bs * fp.num_kv_heads * fp.head_dim * self._kv_itemsize(keys) * 2
                else:
                    if keys is not None:
                        k, v = keys[:, a * bs : b * bs], values[:, a * bs : b * bs]
                    else:
                        k, v = self.kv.gather(block_ids[a:b])
                    pos = torch.arange((first_block + a) * bs, (first_block + b) * bs)
                    blob = codec.encode(k, v, pos, window=window)
                    raw = k.numel() * k.element_size() * 2
                meta = BlobMeta(
                    f"{hashes[a]:016x}{hashes[b - 1]:016x}",
                    list(hashes[a:b]),
                    bs,
                    (first_block + a) * bs,
                    ratio,
                    self.cal.id,
                    raw,
                    len(blob),
                )
                self._put_host(meta, blob)
                if meta.id in self._blobs:
                    prev = hashes[a - 1] if a else parent
                    self._notify("stored", meta.hashes, list(token_ids[a * bs : b * bs]), prev)
                res.blobs.append(meta.id)
                res.stored_blocks += b - a
                res.raw_bytes += raw
                res.stored_bytes += len(blob)
        res.ratio = ratio
        res.seconds = time.perf_counter() - t0
        self.stats["offload_blocks"] += res.stored_blocks
        self.stats["offload_raw_bytes"] += res.raw_bytes
        self.stats["offload_stored_bytes"] += res.stored_bytes
        self.stats["encode_seconds_x1e6"] += int(res.seconds * 1e6)
        self.timings.append(("encode", res.seconds))

    def _kv_itemsize(self, keys: torch.Tensor | None) -> int:
        return keys.element_size() if keys is not None else self.kv.dtype.itemsize

    def _encode_fused(self, codec: KvtcCodec, cuts, first_block, keys, values, block_ids) -> list[bytes] | None:
        """All blobs of one offload in one fused batch (one projection GEMM per K/V, one nvCOMP call, device CRCs),
        read straight from the engine's paged blocks where the layout allows; None where the fused path is off."""
        fc = codec.fused
        if fc is None:
            return None
        from ..codec.gpu import DenseKV, PagedBlocks, Span

        bs = self.block_size
        try:
            off = 0
            if keys is not None:
                src = DenseKV(keys.to(self.device), values.to(self.device))
            elif self.kv.layout != "cpu" and self.kv.device.type == self.device.type == "cuda":
                src = PagedBlocks(self.kv._kv, self.num_layers, [list(block_ids)])
            else:
                lo, hi = cuts[0][0], cuts[-1][1]
                src = DenseKV(*[t.to(self.device) for t in self.kv.gather(block_ids[lo:hi])])
                off = lo
            spans = [
                Span(0, (a - off) * bs, torch.arange((first_block + a) * bs, (first_block + b) * bs), w)
                for a, b, w in cuts
            ]
            blobs = fc.encode_batch(src, spans)
            self.stats["offload_fused_batches"] += 1
            return blobs
        except KvtcError:
            raise
        except Exception as e:  # noqa: BLE001 - the reference path is always there
            codec._fused_failed("batch encode", e)
            return None

    def _put_host(self, meta: BlobMeta, blob: bytes) -> None:
        with self._transit:  # LRU victims leave the host tier before they reach disk: a reader waits for both
            self._put_host_locked(meta, blob)

    def _put_host_locked(self, meta: BlobMeta, blob: bytes) -> None:
        self._index_blob(meta)
        try:
            evicted = self.host.put(meta.id, blob, meta)
        except TierFullError:
            if self.disk is None:
                self._unindex_blob(meta.id)
                raise
            self._demote(meta.id, blob, meta)  # larger than the whole host tier: straight to disk
            return
        for old_id, data, old_meta in evicted:
            self.stats["host_evictions"] += 1
            self._demote(old_id, data, old_meta)

    def _demote(self, blob_id: str, data: bytes, meta: BlobMeta) -> None:
        if self.disk is None:
            self._unindex_blob(blob_id)
            return
        try:
            for gone in self.disk.put(blob_id, data, meta.to_dict()):
                self.stats["disk_evictions"] += 1
                self._unindex_blob(gone)
            self.stats["disk_demotions"] += 1
            self.stats["disk_demoted_blocks"] += len(meta.hashes)
        except TierError as e:
            log.warning("kvtc: demotion of %s to disk failed (%s); dropping it", blob_id, e)
            self.stats[f"disk_write_error_{type(e).__name__}"] += 1
            self._unindex_blob(blob_id)

    # ------------------------------------------------------------------ onboard
    def _plan(self, hashes: Sequence[int]) -> list[tuple[str, int, int, int]]:
        """(blob id, first block in blob, number of blocks, first requested block) runs covering ``hashes``."""
        runs: list[tuple[str, int, int, int]] = []
        with self._lock:
            for j, h in enumerate(hashes):
                e = self._index.get(h)
                if e is None:
                    raise TierError(f"block {j} ({h:016x}) is in no tier")
                blob_id, i = e
                if runs and runs[-1][0] == blob_id and runs[-1][1] + runs[-1][2] == i:
                    r = runs[-1]
                    runs[-1] = (r[0], r[1], r[2] + 1, r[3])
                else:
                    runs.append((blob_id, i, 1, j))
        return runs

    async def onboard(
        self, hashes: Sequence[int], dst_blocks: Sequence[int] | None = None, *, sink: Sink | None = None
    ) -> OnboardHandle:
        """Start restoring ``hashes`` (a matched prefix) into engine blocks ``dst_blocks`` (or a ``sink``); returns
        at once with a handle whose ``wait_layer(i)`` returns when layer i is in place."""
        return self.start_onboard(hashes, dst_blocks, sink=sink)

    def start_onboard(
        self,
        hashes: Sequence[int],
        dst_blocks: Sequence[int] | None = None,
        *,
        sink: Sink | None = None,
        source: Callable[[], list[tuple[bytes, int, int, int, dict | None]]] | None = None,
    ) -> OnboardHandle:
        """Synchronous form of :meth:`onboard` (for engine hooks): queues the restore and returns its handle.

        ``source`` replaces the tiers as where the blobs come from (a peer, for prefill->decode transfer): called on
        the onboard worker, it returns (blob, first block in blob, blocks, first requested block, meta) runs covering
        ``hashes``; blobs that decode and carry a meta of this calibration are kept in the host tier too."""
        if sink is None and (dst_blocks is None or self.kv is None):
            raise TierError("onboard needs dst_blocks with a registered paged KV cache, or a sink")
        if dst_blocks is not None and len(dst_blocks) != len(hashes):
            raise TierError(f"{len(dst_blocks)} destination blocks for {len(hashes)} hashes")
        handle = OnboardHandle(self.num_layers, hashes, self.device)
        handle.future = self._onboard_pool.submit(
            self._onboard_sync, handle, list(hashes), None if dst_blocks is None else list(dst_blocks), sink, source
        )
        return handle

    def _fetch(self, blob_id: str, _retry: bool = False) -> bytes:
        got = self.host.get(blob_id)
        if got is not None:
            self.stats["onboard_host_hits"] += 1
            return got[0]
        if self.disk is not None and blob_id in self.disk:
            blob, meta = self.disk.get(blob_id)
            self.stats["onboard_disk_hits"] += 1
            try:  # promote: the next turn finds it in memory
                self._put_host(BlobMeta.from_dict(meta), blob)
            except TierError:
                pass
            return blob
        if not _retry:
            with self._transit:  # it may be between host and disk right now: look once more after the move
                pass
            return self._fetch(blob_id, _retry=True)
        raise TierError(f"blob {blob_id} vanished from every tier")

    def _onboard_sync(self, handle: OnboardHandle, hashes, dst_blocks, sink, source=None) -> None:
        bs = self.block_size
        try:
            decoder = self.codec(self.policy.default)
            items = []  # (blob, first block in blob, blocks, first requested block, blob id or None)
            adopt = []
            if source is not None:
                runs = source()
                covered = sum(count for _, _, count, _, _ in runs)
                if covered != len(hashes):
                    raise TierError(f"the source delivered {covered} of {len(hashes)} blocks")
                for blob, first, count, j, meta in runs:
                    handle.bytes_read += len(blob)
                    items.append((blob, first, count, j, None))
                    if meta is not None:
                        adopt.append((meta, blob))
            tiers: Counter[str] = Counter({"peer": len(hashes)} if source is not None else {})
            for blob_id, first, count, j in self._plan(hashes) if source is None else ():
                tiers["host" if blob_id in self.host else "disk"] += count
                try:
                    blob = self._fetch(blob_id)
                except TransferError:
                    raise  # a failed read of an intact file: a miss now, the blob stays for the next try
                except TierError as e:
                    self._drop(blob_id, e)
                    raise
                handle.bytes_read += len(blob)
                items.append((blob, first, count, j, blob_id))
            ctx = torch.cuda.stream(self._onboard_stream) if self._onboard_stream is not None else nullcontext()
            with ctx:
                if not self._restore_fused(decoder, handle, items, dst_blocks, sink):
                    gens = []
                    for blob, first, count, j, blob_id in items:
                        try:
                            gens.append((decoder.decode_layers(blob), first, count, j))  # validates the whole blob
                        except DecodeError as e:
                            if blob_id is not None:
                                self._drop(blob_id, e)
                            raise
                    for layer in range(self.num_layers):
                        for gen, first, count, j in gens:
                            got_layer, k, v = next(gen)
                            if got_layer != layer:
                                raise TierError(f"decoder produced layer {got_layer}, expected {layer}")
                            k = k[first * bs : (first + count) * bs]
                            v = v[first * bs : (first + count) * bs]
                            if sink is not None:
                                sink(layer, j * bs, k, v)
                            else:
                                self.kv.scatter_layer(layer, dst_blocks[j : j + count], k, v)
                        handle._layer_ready(layer)
            fp = self.cal.fingerprint
            handle.raw_bytes = len(hashes) * bs * self.num_layers * fp.num_kv_heads * fp.head_dim * 2 * 2  # K+V, 16-bit
            self.stats["onboard_blocks"] += len(hashes)
            for tier, n in tiers.items():
                self.stats[f"onboard_{tier}_blocks"] += n
            self.stats["onboards"] += 1
            for meta, blob in adopt:  # a peer's blobs: keep them for the next turn on this side
                try:
                    m = BlobMeta.from_dict(meta)
                    if m.cal == self.cal.id and m.block_size == bs and m.id not in self._blobs:
                        self._put_host(m, blob)
                except (TypeError, KeyError, TierError) as e:
                    log.info("kvtc: not keeping a transferred blob: %s", e)
            self.timings.append(("restore", time.perf_counter() - handle.started))
            self.timings.append(("first_layer", handle.ready_times[0] or 0.0))
            handle._finish()
        except BaseException as e:  # any failure is a miss: the engine recomputes
            self.stats[f"onboard_error_{type(e).__name__}"] += 1
            log.warning("kvtc onboard failed (%d blocks): %s", len(hashes), e)
            handle._fail(e if isinstance(e, KvtcError) else TierError(f"{type(e).__name__}: {e}"))

    def _restore_fused(self, decoder: KvtcCodec, handle: OnboardHandle, items, dst_blocks, sink) -> bool:
        """Restore every blob in one fused batch (called on the onboard stream): all blobs verified (CRCs on the
        device) before the first layer, then per layer one projection GEMM per K/V for all blobs, scattered straight
        into the engine's blocks (GPU layouts) or handed to the sink. False when the fused path is off."""
        fc = decoder.fused
        if fc is None or not items:
            return False
        bs = self.block_size
        try:
            job = fc.open([it[0] for it in items])
        except DecodeError:
            for blob, _, _, _, blob_id in items:  # find the bad blob(s) to drop them, as the reference path does
                try:
                    fc.open([blob])
                except DecodeError as e:
                    if blob_id is not None:
                        self._drop(blob_id, e)
            raise
        except KvtcError:
            raise
        except Exception as e:  # noqa: BLE001 - the reference path is always there
            decoder._fused_failed("batch restore", e)
            return False
        if sink is None and self.kv.layout != "cpu" and self.kv.device.type == "cuda":
            from ..codec.gpu import PagedBlocks

            seqs, keep = [], []
            for i, (_, first, count, j, _) in enumerate(items):
                nblk = -(-job.tokens[i] // bs)
                seqs.append([dst_blocks[j + b - first] if first <= b < first + count else 0 for b in range(nblk)])
                keep.append((first * bs, (first + count) * bs))
            dest = PagedBlocks(self.kv._kv, self.num_layers, seqs)
            for layer in job.layers(dest=dest, targets=[(i, 0) for i in range(len(items))], keep=keep):
                handle._layer_ready(layer)
        else:
            for layer, kbuf, vbuf in job.layers():
                for i, (_, first, count, j, _) in enumerate(items):
                    a = job.bases[i] + first * bs
                    k, v = kbuf[a : a + count * bs], vbuf[a : a + count * bs]
                    if sink is not None:
                        sink(layer, j * bs, k, v)
                    else:
                        self.kv.scatter_layer(layer, dst_blocks[j : j + count], k, v)
                handle._layer_ready(layer)
        job.finish()
        self.stats["onboard_fused_batches"] += 1
        return True

    def export(self, hashes: Sequence[int]) -> list[tuple[bytes, int, int, int, dict]]:
        """Blobs covering ``hashes``, for a peer: (blob, first block in blob, blocks, first requested block, meta)."""
        out = []
        for blob_id, first, count, j in self._plan(hashes):
            blob = self._fetch(blob_id)
            with self._lock:
                meta = self._blobs.get(blob_id)
            if meta is None:
                raise TierError(f"blob {blob_id} left the tiers while being exported")
            out.append((blob, first, count, j, meta.to_dict()))
        return out

    def _drop(self, blob_id: str, why: BaseException) -> None:
        log.warning("kvtc: dropping unusable blob %s: %s", blob_id, why)
        self.stats["blobs_dropped"] += 1
        self.host.pop(blob_id)
        if self.disk is not None and blob_id in self.disk:
            self.disk.delete(blob_id)
        self._unindex_blob(blob_id)

    async def prefetch(self, hashes: Sequence[int]) -> int:
        """Promote disk-resident blobs of ``hashes`` into the host tier ahead of an onboard; returns blobs moved."""

        def work() -> int:
            moved = 0
            for blob_id, *_ in self._plan(hashes[: self.match(hashes)]):
                if blob_id not in self.host and self.disk is not None and blob_id in self.disk:
                    try:
                        self._fetch(blob_id)
                        moved += 1
                    except TransferError:
                        pass  # transient: the blob stays on disk
                    except TierError as e:
                        self._drop(blob_id, e)
            return moved

        return await self._run(self._onboard_pool, work)

    # ------------------------------------------------------------------ stats
    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            host_blobs = [m for m in self._blobs.values() if m.id in self.host]
            disk_blobs = [m for m in self._blobs.values() if self.disk is not None and m.id in self.disk]
        out: dict[str, Any] = dict(self.stats)
        for name, blobs in (("host", host_blobs), ("disk", disk_blobs)):
            out[f"{name}_blobs"] = len(blobs)
            out[f"{name}_blocks"] = sum(len(m.hashes) for m in blobs)
            out[f"{name}_raw_bytes"] = sum(m.raw_bytes for m in blobs)
            out[f"{name}_stored_bytes"] = sum(m.stored_bytes for m in blobs)
        out["host_capacity_bytes"] = self.host.capacity
        out["host_fill"] = self.host.fill
        if self.disk is not None:
            out["disk_capacity_bytes"] = self.disk.capacity
            out["disk_used_bytes"] = self.disk.used_bytes
        return out

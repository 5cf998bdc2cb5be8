"""Offload: a sequence's new full blocks -> spans -> KVTC blobs -> host tier, on one worker with its own CUDA stream."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import nullcontext
from typing import Any

import torch

from ..codec.base import Codec, EncodeSpan, PagedView
from ..errors import KvtcError, TierError
from .admission import OffloadFilter, RatioPolicy
from .blobs import BlobMeta, OffloadRequest, OffloadResult
from .config import TierConfig
from .index import BlockIndex
from .keys import keyed_blob
from .layout import PagedKV
from .placement import Placement
from .stats import StoreStats
from .streams import codec_stream
from .window import RawTails, absorb, retire

log = logging.getLogger(__name__)


class QueueBudget:
    """Bytes of K/V the offload queue holds (the copies waiting for their encode), bounded: :meth:`take` refuses what
    would go over ``limit`` unless the queue is empty (one save larger than the whole budget still goes through, alone:
    the queue never holds more than ``max(limit, the largest save)``), :meth:`give` returns a finished job's bytes.
    ``peak`` is the most ever held."""

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self.held = 0
        self.peak = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> bool:
        with self._lock:
            if self.held and self.held + nbytes > self.limit:
                return False
            self.held += nbytes
            self.peak = max(self.peak, self.held)
            return True

    def give(self, nbytes: int) -> None:
        with self._lock:
            self.held -= nbytes


class Offloader:
    """Turns offload requests into blobs in the host tier.

    Owns the offload worker (one thread) and its CUDA stream (ordered after the producer by the request's event), the
    queue's byte budget (``offload_queue_bytes``: over it a save is skipped before anything is copied, counted as
    ``offload_queue_full``), the admission checks (present / filtered) and the cutting of a request into spans of at
    most ``span_blocks`` blocks, the sequence's last blob holding the whole raw window, and the ``raw_first`` policy's
    choice (store a request uncompressed while the host tier has room for it; ``raw``: always, the codec off). Encoding
    goes through :class:`Codec`; placing the blobs (and demoting the host's victims) through :class:`Placement`. It
    never raises from the worker (errors end up in the :class:`OffloadResult`), never restores, and reads the engine's
    cache only through :class:`PagedKV`'s public methods."""

    def __init__(
        self,
        *,
        cal: Any,
        cfg: TierConfig,
        kv: PagedKV | None,
        index: BlockIndex,
        placement: Placement,
        codec: Callable[[float], Codec],
        policy: RatioPolicy,
        admit: OffloadFilter,
        block_size: int,
        span_blocks: int,
        device: torch.device,
        stats: StoreStats,
    ) -> None:
        self.cal, self.cfg, self.kv = cal, cfg, kv
        self.index, self.placement, self.codec = index, placement, codec
        self.policy, self.admit = policy, admit
        self.block_size, self.span_blocks, self.device = block_size, span_blocks, device
        self.stats = stats
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtc-offload")
        self._stream = codec_stream(device, cfg.codec_sms)
        self.budget = QueueBudget(cfg.offload_queue_bytes)
        # Tensor parallel with the joint codec (set by the connector): ``agree(vote)`` runs on the offload worker,
        # first in every job, and returns (ratio, raw) when every rank votes to encode the same blocks, else None.
        # Every save then queues a job on every rank, skipped ones too, so the ranks' collectives stay in step.
        self.agree: Callable[[tuple[int, ...]], tuple[float, bool] | None] | None = None
        self._votes = 0
        # The raw-window blobs of stored prefixes, by their last block: the next offload that extends one codes it
        # (see :mod:`~dynamo_kvtc.tiers.window`). Off for sliding-window calibrations (their groups hold only a blob's
        # last tokens) and tensor parallel with the joint codec (every rank must encode the same spans).
        self.tails = RawTails()
        self.moving_window = cfg.window > 0 and not any(g.tokens for g in cal.groups)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every encode queued so far finished; False if that took longer than ``timeout`` seconds."""
        try:
            self._pool.submit(lambda: None).result(timeout)
        except FutureTimeout:
            return False
        return True

    # ------------------------------------------------------------------ queueing
    def submit(
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
        copy: Callable[[], tuple[torch.Tensor, torch.Tensor, Any]] | None = None,
    ) -> Future:
        """See :meth:`KvtcStore.submit_offload <dynamo_kvtc.tiers.store.KvtcStore.submit_offload>`."""
        bs = self.block_size
        n = len(hashes)
        res = OffloadResult()
        done: Future = Future()
        if len(token_ids) != n * bs:
            raise TierError(f"{len(token_ids)} token ids for {n} blocks of {bs}")
        if keys is not None and (values is None or keys.shape[1] != n * bs or values.shape != keys.shape):
            raise TierError(f"keys/values must be [L, {n * bs}, H, D], got {tuple(keys.shape)}")
        if keys is None and copy is None and (block_ids is None or self.kv is None or len(block_ids) != n):
            raise TierError("offload needs keys/values, or one engine block id per hash with a registered KV cache")
        if copy is not None and self.kv is None:
            raise TierError("offload by copy needs a registered KV cache")
        admitted = self.admit.admit(hashes)
        missing = self.index.missing(hashes)
        start = end = missing[0] if missing else n
        while end < n and admitted[end]:
            end += 1
        held = self._raw_bytes(n, keys)  # what the queued job keeps alive until its encode ends
        if not missing:
            res.skipped = "present"
        elif end == start:
            res.skipped = "filtered"
            self.stats.offload_filtered += 1
        elif not self.budget.take(held):
            res.skipped = "queue_full"
            self.stats.offload_queue_full += 1
        vote = None if self.agree is None else self._vote(hashes, start, end, res.skipped is None, keys)
        if res.skipped is not None:
            if vote is not None:  # the other ranks' encode of this save is collective: vote "no" in turn
                return self._pool.submit(self._guarded, None, res, vote=vote)
            done.set_result(res)
            return done
        try:
            if copy is not None:  # the caller's copy out of the engine's blocks, made only once admitted
                keys, values, ready_event = copy()
                if keys.shape[1] != n * bs or values.shape != keys.shape:
                    raise TierError(f"copied keys/values must be [L, {n * bs}, H, D], got {tuple(keys.shape)}")
            ratio, raw = self._choice(start, end, keys)
            req = OffloadRequest(
                hashes,
                token_ids,
                start,
                end,
                ratio,
                first_block=first_block,
                parent=parent,
                keys=keys,
                values=values,
                block_ids=block_ids,
                ready_event=ready_event,
                tail=tail,
            )
            return self._pool.submit(self._guarded, req, res, raw, held, vote)
        except BaseException:
            self.budget.give(held)
            if vote is not None:  # the other ranks still vote on this save: this rank's vote turns into "no"
                self._pool.submit(self._guarded, None, res, vote=(*vote[:3], 0, *vote[4:]))
            raise

    def _raw_bytes(self, blocks: int, keys: torch.Tensor | None) -> int:
        """Bytes of ``blocks`` blocks of K and V as the engine holds them (what a raw blob of them holds)."""
        fp8_cache = self.kv is not None and self.kv.dtype.itemsize == 1  # keys gathered from it are dequantized
        dtype = keys.dtype if keys is not None and not fp8_cache else self.kv.dtype
        return blocks * self.block_size * self.cal.fingerprint.raw_bytes_per_token(dtype)

    def _choice(self, start: int, end: int, keys: Any) -> tuple[float, bool]:
        """(ratio, raw) for blocks ``start:end`` of a save: the policy's ratio at the host tier's fill, and whether
        ``ratio_policy`` stores them raw."""
        host = self.placement.first  # the host tier (a chain always starts with it)
        raw = self.cfg.ratio_policy == "raw" or (
            self.cfg.ratio_policy == "raw_first"
            and self.policy.room_for_raw(host.fill, self._raw_bytes(end - start, keys) / max(1, host.capacity))
        )
        return self.policy.choose(host.fill), raw

    def _vote(self, hashes: Sequence[int], start: int, end: int, want: bool, keys: Any) -> tuple[int, ...]:
        """This rank's vote on a save (see :attr:`agree`): (job number, blocks, first hash, want, start, end, ratio in
        thousandths, raw)."""
        self._votes += 1
        ratio, raw = self._choice(start, end, keys)
        return (self._votes, len(hashes), hashes[0] & ((1 << 62) - 1), int(want), start, end, round(ratio * 1000), raw)

    def _guarded(
        self, req: OffloadRequest | None, res: OffloadResult, raw: bool = False, held: int = 0, vote: Any = None
    ) -> OffloadResult:
        try:
            if vote is not None:  # tensor parallel, joint codec: every rank encodes this save, or none does
                agreed = self.agree(vote)
                if req is None:
                    return res
                if agreed is None:
                    res.skipped = "tp_disagreed"
                    self.stats.offload_tp_disagreed += 1
                    return res
                req.ratio, raw = agreed
            self._run(req, res, raw)
        except KvtcError as e:
            log.warning("kvtc offload failed: %s", e)
            self.stats.offload_errors[type(e).__name__] += 1
            res.skipped = f"error: {e}"
        except Exception as e:  # an offload never takes the engine down; it only loses a cache entry
            log.warning("kvtc offload failed unexpectedly: %s: %s", type(e).__name__, e)
            self.stats.offload_errors["unexpected"] += 1
            res.skipped = f"error: {type(e).__name__}: {e}"
        finally:
            if req is not None:
                req.keys = req.values = None  # the copies go now, not when the caller drops its Future
            self.budget.give(held)
        return res

    # ------------------------------------------------------------------ the worker
    def cuts(self, req: OffloadRequest, raw: bool = False) -> list[tuple[int, int, int]]:
        """(first block, end block, raw window) of each blob of the request. A request that ends the sequence
        (``tail``) keeps its last ``window`` tokens raw: with the moving window (:attr:`moving_window`) in a blob of
        their own (whole blocks, all raw), every block before them coded in blobs of at most ``span_blocks`` (a short
        remainder joins the blob before it), so the next offload that extends the sequence codes that blob's tokens and
        replaces it (:mod:`~dynamo_kvtc.tiers.window`); without it the sequence's last blob holds the whole raw window
        (it grows past ``span_blocks`` rather than leave part of the window in a compressed blob). ``raw``: every
        blob's window is the whole blob (stored uncompressed)."""
        bs, window = self.block_size, self.cfg.window
        tail = req.tail and req.end == req.n
        if tail and not raw and self._moving():
            k = -(-window // bs)  # blocks of the raw window
            coded_end = max(req.start, req.end - k)
            if (coded_end - req.start) * bs < self.codec(req.ratio).config.min_tokens:
                coded_end = req.start  # too few to code: they wait raw in the tail for the next offload
            out = []
            a = req.start
            while a < coded_end:
                b = min(coded_end, a + self.span_blocks)
                if coded_end - b < max(1, self.span_blocks // 4):
                    b = coded_end
                out.append((a, b, 0))
                a = b
            if coded_end < req.end:
                out.append((coded_end, req.end, (req.end - coded_end) * bs))
            return out
        out = []
        a = req.start
        while a < req.end:
            b = min(req.end, a + self.span_blocks)
            if tail and (req.end - b) * bs <= window:
                b = req.end
            out.append((a, b, (b - a) * bs if raw else window if (tail and b == req.n) else 0))
            a = b
        return out

    def _moving(self) -> bool:
        return self.moving_window and self.agree is None

    def _run(self, req: OffloadRequest, res: OffloadResult, raw: bool = False) -> None:
        t0 = time.perf_counter()
        codec = self.codec(req.ratio)
        ctx = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
        with ctx:
            if req.ready_event is not None and self._stream is not None:
                self._stream.wait_event(req.ready_event)
            old = None
            if not raw and self._moving():  # it extends a prefix whose raw window is still stored: code that too
                got = absorb(self, req, res)
                if got is not None:
                    req, old = got
            cuts = self.cuts(req, raw)
            if raw:
                self.stats.offload_raw += 1
            encoded = self._encode(codec, req, cuts)
            if encoded.fused:
                self.stats.offload_fused_batches += 1
            for (a, b, w), blob in zip(cuts, encoded.blobs):
                self._keep(req, a, b, blob, self._raw_bytes(b - a, req.keys), res)
                if w and w == (b - a) * self.block_size and not raw and self._moving() and res.blobs:
                    self.tails.remember(req.hashes[b - 1], res.blobs[-1])
            if old is not None:  # the new blobs are indexed: the superseded raw window goes from every tier
                gone = retire(self, old, res.blobs)
                if gone is not None:  # count what this offload added: its new blocks, the bytes held beyond the old
                    res.raw_bytes -= gone.raw_bytes
                    res.stored_bytes = max(0, res.stored_bytes - gone.stored_bytes)
        res.ratio = req.ratio
        res.seconds = time.perf_counter() - t0
        st = self.stats
        st.offload_blocks += res.stored_blocks
        st.offload_raw_bytes += res.raw_bytes
        st.offload_stored_bytes += res.stored_bytes
        st.encode_seconds_x1e6 += int(res.seconds * 1e6)
        st.time("encode", res.seconds)

    def _encode(self, codec: Codec, req: OffloadRequest, cuts: list[tuple[int, int, int]]):
        bs = self.block_size
        spans = [
            EncodeSpan(a * bs, torch.arange((req.first_block + a) * bs, (req.first_block + b) * bs), w)
            for a, b, w in cuts
        ]
        if req.keys is not None:
            keys, values = req.keys, req.values

            def read(t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
                return keys[:, t0:t1], values[:, t0:t1]

            return codec.encode_spans(spans, read, views=True)  # one worker: each blob is kept before the next
        kv, block_ids = self.kv, req.block_ids

        def gather(t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
            return kv.gather(block_ids[t0 // bs : t1 // bs])

        paged = None
        if kv.addressable and kv.device.type == self.device.type == "cuda":
            paged = PagedView(kv.layer_views, self.cal.fingerprint.num_layers, bs)
        return codec.encode_spans(spans, gather, paged=paged, block_ids=block_ids, views=True)

    def _keep(self, req: OffloadRequest, a: int, b: int, blob: bytes, raw: int, res: OffloadResult) -> None:
        """Put blocks a..b's blob into the tiers, tell the listeners, account it in ``res``."""
        bs, hashes = self.block_size, req.hashes
        blob = keyed_blob(blob, hashes[a:b])  # the blob carries its block keys; a restore checks them
        meta = BlobMeta(
            f"{hashes[a]:016x}{hashes[b - 1]:016x}",
            list(hashes[a:b]),
            bs,
            (req.first_block + a) * bs,
            req.ratio,
            self.cal.id,
            raw,
            len(blob),
        )
        self.placement.put(meta, blob)
        x = max(a, req.announce_from)  # blocks before it were announced when first stored (a replaced raw window)
        if self.index.has_blob(meta.id) and x < b:
            prev = hashes[x - 1] if x else req.parent
            tokens = req.token_ids[(x - req.announce_from) * bs : (b - req.announce_from) * bs]
            self.index.announce_stored(hashes[x:b], list(tokens), prev)
        res.blobs.append(meta.id)
        res.stored_blocks += max(0, b - x)
        res.raw_bytes += raw
        res.stored_bytes += len(blob)

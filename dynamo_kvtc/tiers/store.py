"""KvtcStore: compressed host (G2c) and disk (G3c) tiers of KVTC blobs, keyed by Dynamo-compatible block hashes.

- **Offload** (GPU -> host): a sequence's full blocks not yet stored are gathered (from the engine's paged cache or
  given tensors), encoded on a dedicated worker with its own CUDA stream (ordered after the producer by an event), and
  only the compressed bytes land in host memory. The queue of copies waiting for their encode is bounded
  (``offload_queue_bytes``): over it a save is skipped before anything is copied, and counted. Spans are cut into blobs
  of at most ``span_tokens``; the raw window is kept only on the sequence's last blob. The host tier's LRU victims are
  demoted to disk (or dropped).
- **Onboard** (host/disk -> GPU): the blobs covering the requested blocks are read (NIXL for disk) and decoded layer
  by layer *in order*, each layer scattered into the engine's blocks (or handed to a sink) and marked ready with one
  event per layer, so attention on layer 0 can start while later layers are still being restored. Host hits have
  a lane of their own (thread and stream), apart from disk and peer restores; a restore its caller cancels (timed
  out) writes no layer after :meth:`OnboardHandle.cancel` returns.
- Anything that fails (unknown calibration, corrupt blob, NIXL error, ENOSPC) is logged, counted, removed from the
  index, and surfaces as a miss: :meth:`OnboardHandle.wait_layer` raises :class:`~dynamo_kvtc.errors.TierError` and
  the engine recomputes. Nothing wrong is ever scattered: every blob is verified (CRC of every section) before its
  bytes are used — on the fused path the writes are gated on the device by that verdict, which the restore reports
  when it ends, so a restore counts only once it finished.

The parts: :class:`~.index.BlockIndex` (hash -> blob), a chain of :class:`~.base.BlobTier` s built from the registry
(:mod:`.registry`: :class:`~.host.HostTier`, then :class:`~.disk.DiskTier` when configured, then any other registered
kind the config names), :class:`~.placement.Placement` (moves along the chain), :class:`~.offloader.Offloader` and
:class:`~.restorer.Restorer` (the two workers), :class:`~dynamo_kvtc.codec.base.Codec` (fused or reference codec path,
chosen once by :func:`~dynamo_kvtc.codec.factory.make_codec`). The public methods are thread-safe calls keyed by block
hashes (:meth:`KvtcStore.hashes` gives a sequence's); an engine may call from other threads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import nullcontext
from typing import Any

import torch

from ..codec import fp8
from ..codec.base import Codec, EncodeSpan, RestoreRun
from ..codec.blob import BlobView
from ..codec.factory import Shard, entropy_tag, make_codec
from ..errors import TierError, TierFullError
from .admission import OffloadFilter, RatioPolicy
from .base import BlobTier
from .blobs import BlobMeta, BlobRun, OffloadRequest, OffloadResult, Sink
from .config import TierConfig
from .disk import DiskTier
from .host import HostTier
from .index import BlockIndex
from .keys import keyed_blob, sequence_hashes
from .layout import PagedKV
from .offloader import Offloader
from .placement import Placement
from .registry import admission, build_chain, names
from .restorer import OnboardHandle, Restorer, Source
from .stats import StoreStats

log = logging.getLogger(__name__)

__all__ = ["BlobMeta", "BlobRun", "KvtcStore", "OffloadRequest", "OffloadResult", "OnboardHandle", "Sink"]


class KvtcStore:
    """The compressed tiers of one engine (one calibration, one block size), as one object.

    Owns the parts listed in the module docstring, the codecs per ratio, the parts' :class:`StoreStats` (``stats``),
    and wires them together; the work itself happens in the parts. It never hands out a part's private state:
    readers use :attr:`index` (a :class:`BlockIndex`), :attr:`tiers` (the chain, fastest first; :attr:`host` the
    first, :attr:`disk` the disk tier or None) and the methods below."""

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
        shard: Shard | None = None,
    ) -> None:
        """``shard``: one tensor-parallel rank of a JOINT calibration (its codecs are the row-sharded ones, whose
        encodes are collective: see :mod:`dynamo_kvtc.connector.vllm.tensor_parallel`)."""
        self.cfg = config or TierConfig.from_env()
        self.shard = shard
        self.cal = calibration
        self.device = torch.device(device)
        self.block_size = block_size
        self.span_blocks = max(1, span_tokens // block_size)
        self.num_layers = calibration.fingerprint.num_layers
        self.policy = RatioPolicy(calibration.ratios, self.cfg.ratio, self.cfg.max_ratio, self.cfg.pressure_high)
        self.filter = OffloadFilter(self.cfg.min_frequency)
        chain = build_chain(self.cfg, {} if disk is None else {"disk": disk})
        self._codecs: dict[float, Codec] = {}
        self._codecs_lock = threading.Lock()
        self.stats = StoreStats()  # the parts' counters and timings, read by the metrics
        for name in names():  # every registered tier reports its counters (zeros when not in this chain)
            self.stats.tier(name)
        self.index = BlockIndex(self.stats)
        self.placement = Placement(self.index, chain, self.stats, admission(self.cfg), on_gone=self.index.remove)
        common = dict(cal=calibration, kv=kv, index=self.index, placement=self.placement, block_size=block_size)
        common.update(device=self.device, stats=self.stats)
        self.offloader = Offloader(
            cfg=self.cfg,
            codec=self.codec,
            policy=self.policy,
            admit=self.filter,
            span_blocks=self.span_blocks,
            **common,
        )
        self.restorer = Restorer(decoder=self.default_codec, codec_sms=self.cfg.codec_sms, **common)
        self.placement.adopt(calibration.id, block_size)  # what the tiers held at start (a restart's disk files)

    # ------------------------------------------------------------------ parts
    @property
    def tiers(self) -> list[BlobTier]:
        """The chain of tiers, fastest first."""
        return self.placement.tiers

    @property
    def host(self) -> HostTier:
        return self.placement.first

    @host.setter
    def host(self, tier: HostTier) -> None:  # tests replace the host tier with an empty one
        self.placement.first = tier

    @property
    def disk(self) -> DiskTier | None:
        return self.placement.tier("disk")

    @property
    def kv(self) -> PagedKV | None:
        """The engine's registered paged KV cache (None: offloads and restores go through tensors and sinks)."""
        return self.offloader.kv

    @property
    def listeners(self) -> list[Any]:
        """Objects with ``stored(hashes, token_ids, parent)`` / ``removed(hashes)``; append to subscribe."""
        return self.index.listeners

    def codec(self, ratio: float) -> Codec:
        with self._codecs_lock:
            if ratio not in self._codecs:
                self._codecs[ratio] = make_codec(
                    self.cal,
                    ratio=ratio,
                    device=self.device,
                    sinks=self.cfg.sinks,
                    window=self.cfg.window,
                    tag=self._tag(),
                    options=self.cfg.codec,
                    shard=self.shard,
                )
                if self.kv is not None:
                    fp8.mark_kv_source(self._codecs[ratio], fp8.source_name(self.kv.dtype))
            return self._codecs[ratio]

    def default_codec(self) -> Codec:
        """The codec restores decode with (any ratio of the calibration reads with it)."""
        return self.codec(self.policy.default)

    def _tag(self) -> str:
        """Entropy codec of new blobs (:func:`~dynamo_kvtc.codec.factory.entropy_tag`): a store with a disk tier
        writes blobs readable anywhere unless the codec options name a GPU codec."""
        return entropy_tag(self.device, self.cfg.codec, portable=len(self.tiers) > 1)

    def warm_up(self) -> float:
        """Pay first-use costs now, at start-up, not on the first offload or restore: build the codec of every ratio
        the policy may pick and run one small encode and restore through each on this device (kernel compilation,
        device tables, entropy coder, staging buffers). Nothing is stored. Returns the seconds it took; a failure is
        logged and left to the first real call (which then falls back or reports a miss as it would anyway)."""
        t0 = time.perf_counter()
        ratios = [r for r in self.policy.available if self.policy.default <= r <= self.policy.max_ratio]
        try:
            for ratio in ratios:
                self._warm(self.codec(ratio))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - a warm-up never takes the engine down
            self.stats.warm_up_errors += 1
            log.warning("kvtc: warm-up failed (%s: %s); first calls pay their set-up", type(e).__name__, e)
        took = time.perf_counter() - t0
        self.stats.time("warm_up", took)
        return took

    def _warm(self, codec: Codec) -> None:
        """One small encode and restore through ``codec`` (random K/V: only the code paths matter)."""
        fp, cfg = self.cal.fingerprint, codec.config
        window = 16  # not the configured window (a lossless setting keeps ~everything raw): the coded path is the point
        n = -(-(cfg.sinks + cfg.min_tokens + window + 16) // self.block_size) * self.block_size
        gen = torch.Generator().manual_seed(0)
        heads = fp.num_kv_heads if self.shard is None else codec.heads.stop - codec.heads.start  # a rank's own heads
        shape = (fp.num_layers, n, heads, fp.head_dim)
        dtype = self.kv.value_dtype if self.kv is not None else torch.bfloat16
        k = torch.randn(shape, generator=gen).to(self.device, dtype)
        v = torch.randn(shape, generator=gen).to(self.device, dtype)
        spans = [EncodeSpan(0, torch.arange(n), window=window)]
        blobs = list(codec.encode_spans(spans, lambda a, b: (k[:, a:b], v[:, a:b])).blobs)
        stream = self.restorer.stream
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            for _ in codec.restore([RestoreRun(blobs[0], 0, n)]):
                pass

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every offload queued so far finished; False if that took longer than ``timeout`` seconds."""
        return self.offloader.wait_idle(timeout)

    def close(self) -> None:
        self.offloader.close()
        self.restorer.close()
        for tier in self.tiers:
            tier.close()  # the disk tier releases its directory for the next process

    # ------------------------------------------------------------------ lookup
    def hashes(self, token_ids: Sequence[int]) -> list[int]:
        return sequence_hashes(token_ids, self.block_size)

    def match(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of ``hashes`` the tiers hold (a shared tier is asked for those this store's index
        lacks)."""
        self.discover(hashes)
        return self.index.match(hashes)

    def discover(self, hashes: Sequence[int]) -> None:
        """Index the blobs a shared tier (the pool: another worker wrote them) holds for the blocks of ``hashes``
        past those this store's index holds; a tier without ``discover`` is not asked."""
        for tier in self.placement.tiers:
            find = getattr(tier, "discover", None)
            if find is None:
                continue
            n = self.index.match(hashes)
            if n >= len(hashes):
                return
            for meta in find(list(hashes[n:]), self.block_size):
                self.index.add(meta)

    def match_tiers(self, hashes: Sequence[int]) -> tuple[int, int]:
        """(leading blocks the tiers can restore, leading blocks of those held in the first tier, host memory)."""
        host = self.host
        self.discover(hashes)
        n, n_host = self.index.match_tiers(hashes, host.__contains__)
        held = min((g.tokens for g in self.cal.groups if g.tokens), default=0)
        if held:
            n = self._restorable(hashes, n, held)
        return n, min(n_host, n)

    def _restorable(self, hashes: Sequence[int], n: int, held: int) -> int:
        """The leading blocks of ``hashes[:n]`` a restore can serve when sliding-window layers hold only a blob's last
        ``held`` tokens: a run (the index's plan) that stops before its blob's end must start inside what every layer
        holds (codec/base.py refuses it otherwise); the promise ends where the first run that does not begins."""
        try:
            runs = self.index.plan(hashes[:n])
        except TierError:
            return n  # evicted since the match: the restore finds the miss and counts it
        done = 0
        for r in runs:
            meta = self.index.meta(r.blob_id)
            if meta is None:
                return n  # likewise
            tokens = len(meta.hashes) * meta.block_size
            if r.first + r.count < len(meta.hashes) and r.first * meta.block_size < tokens - held:
                return done
            done += r.count
        return done

    def where(self, h: int) -> str | None:
        """The name of the fastest tier holding block ``h`` ("host", "disk", ...) or None."""
        e = self.index.locate(h)
        return None if e is None else self.placement.where(e[0])

    def blob_of(self, h: int) -> str | None:
        """The id of the blob holding block ``h``, or None."""
        e = self.index.locate(h)
        return None if e is None else e[0]

    # ------------------------------------------------------------------ offload
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
        copy: Any = None,
    ) -> Future:
        """Queue the encode of blocks ``first_block .. first_block + len(hashes)`` of a sequence on the offload worker
        and return a Future of the :class:`OffloadResult` (errors are caught and reported in it, never raised).

        ``hashes``/``token_ids`` cover just these blocks; ``parent`` is the sequence hash of the block before them.
        K/V come from ``keys``/``values`` [L, len(hashes)*block_size, H, D] (already copied out of the engine's
        blocks), or from ``copy()`` -> ``(keys, values, ready_event)``, called here, on the caller's thread, only once
        the offload is admitted (not present, not filtered, within ``offload_queue_bytes``), or are gathered from the
        registered paged cache at ``block_ids`` (one per hash) on the worker. Over the queue's byte budget nothing is
        copied or queued: the result says ``skipped="queue_full"`` and ``stats.offload_queue_full`` counts it."""
        return self.offloader.submit(
            hashes,
            token_ids,
            first_block=first_block,
            parent=parent,
            keys=keys,
            values=values,
            block_ids=block_ids,
            ready_event=ready_event,
            tail=tail,
            copy=copy,
        )

    def put_blob(
        self,
        hashes: Sequence[int],
        blob: bytes,
        *,
        first_position: int,
        ratio: float | None,
        raw_bytes: int,
        seconds: float = 0.0,
    ) -> str | None:
        """Keep a blob encoded by the caller (the vLLM ``kvtc`` tier encodes its chunks itself) as an offload keeps
        its blobs: ``hashes`` are its blocks' keys (one per ``block_size`` tokens, in order) and go into its header,
        it is indexed and placed (host tier, LRU victims to disk: :meth:`Placement.put`), the listeners are told its
        blocks are stored (without token ids) and :attr:`stats` counts it as an offload (``offload_blocks``,
        ``offload_raw_bytes``, ``offload_stored_bytes``, ``offload_raw`` when ``ratio`` is None; ``seconds``: its
        encode time). ``first_position`` is the absolute position of its first token, ``raw_bytes`` the KV's size
        uncompressed. The blob must be of this store's calibration; restores check its keys and CRCs as any other.
        Returns its blob id, or None when it fits in no tier (nothing is indexed then); KvtcError for a blob that
        does not parse or bad keys."""
        hashes = list(hashes)
        blob = keyed_blob(blob, hashes)
        meta = BlobMeta(
            f"{hashes[0]:016x}{hashes[-1]:016x}",  # the offloader's naming
            hashes,
            self.block_size,
            first_position,
            ratio,
            self.cal.id,
            raw_bytes,
            len(blob),
        )
        try:
            self.placement.put(meta, blob)
        except TierFullError:
            return None
        if not self.index.has_blob(meta.id):
            return None  # dropped on the way (its own demotion to a full disk)
        self.index.announce_stored(hashes, [], None)
        st = self.stats
        st.offload_blocks += len(hashes)
        st.offload_raw_bytes += raw_bytes
        st.offload_stored_bytes += len(blob)
        st.offload_raw += ratio is None
        st.encode_seconds_x1e6 += int(seconds * 1e6)
        st.time("encode", seconds)
        return meta.id

    # ------------------------------------------------------------------ onboard
    def start_onboard(
        self,
        hashes: Sequence[int],
        dst_blocks: Sequence[int] | None = None,
        *,
        sink: Sink | None = None,
        source: Source | None = None,
    ) -> OnboardHandle:
        """Start restoring ``hashes`` (a matched prefix) into engine blocks ``dst_blocks`` (or a ``sink``): queues the
        restore on an onboard lane (``host`` when every blob is in host memory, else ``slow``) and returns at once with
        a handle whose ``wait_layer(i)`` returns when layer i is in place.

        ``source`` replaces the tiers as where the blobs come from (a peer, for prefill->decode transfer): called on
        the slow onboard lane, it returns the :class:`BlobRun` s covering ``hashes`` in order; blobs that decode and
        carry a meta of this calibration are kept in the host tier too."""
        return self.restorer.start(hashes, dst_blocks, sink=sink, source=source)

    def export(self, hashes: Sequence[int], *, lease: bool = False) -> tuple[list[BlobRun], list[BlobView]]:
        """Blobs covering ``hashes``, for a peer: (:class:`BlobRun` s with their ``meta`` set, views held). Without
        ``lease`` every blob is a copy and nothing is held; with it the blobs are the tiers' views (host-resident ones
        their pinned pages under a lease), which the caller releases once it has copied them (the hand-off server's
        staging)."""
        return self.restorer.export(hashes, lease)

    def prefetch(self, hashes: Sequence[int]) -> Future:
        """Promote blobs of ``hashes`` held in lower tiers (disk) into the host tier ahead of an onboard, on the slow
        onboard lane; a Future of the number of blobs moved."""
        return self.restorer.submit(lambda: self.restorer.prefetch(hashes))

    # ------------------------------------------------------------------ stats
    def snapshot(self) -> dict[str, Any]:
        metas = self.index.metas()
        host = self.host
        out: dict[str, Any] = self.stats.as_dict()
        chain = {t.name: t for t in self.tiers}
        for name in self.stats.tiers:  # every registered tier, as the stats (zeros for one not in the chain)
            tier = chain.get(name)
            blobs = [m for m in metas if tier is not None and m.id in tier]
            out[f"{name}_blobs"] = len(blobs)
            out[f"{name}_blocks"] = sum(len(m.hashes) for m in blobs)
            c = self.stats.tier(name)
            c.raw_held, c.stored_held = sum(m.raw_bytes for m in blobs), sum(m.stored_bytes for m in blobs)
            out[f"{name}_raw_bytes"], out[f"{name}_stored_bytes"] = c.raw_held, c.stored_held
            out[f"{name}_effective_ratio"] = c.effective_ratio
        out["host_capacity_bytes"] = host.capacity
        budget = self.offloader.budget
        out["offload_queue_bytes"], out["offload_queue_peak_bytes"] = budget.held, budget.peak
        out["host_fill"] = host.fill
        for tier in self.tiers[1:]:
            out[f"{tier.name}_capacity_bytes"] = tier.capacity
            out[f"{tier.name}_used_bytes"] = tier.used_bytes
        return out

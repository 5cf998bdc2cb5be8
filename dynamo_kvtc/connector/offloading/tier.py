"""``kvtc``: a compressed secondary tier for vLLM's OffloadingConnector (``TieringOffloadingSpec``).

vLLM's tiered offloading keeps a raw CPU *primary* tier (the only tier the GPU copies to and from) and cascades every
chunk it stores there to its *secondary* tiers; a chunk found only in a secondary tier is promoted back into a
primary slot before the GPU loads it. This tier holds those chunks as KVTC blobs: a small raw hot tier in front of a
large compressed warm tier, in the ``kv_connector_extra_config`` users already write for OffloadingConnector::

    {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 4000000000,
     "secondary_tiers": [{"type": "kvtc", "cpu_cache_gb": 64, "ratio": 16,
                          "disk_cache_gb": 500, "disk_cache_dir": "/nvme/kvtc"}]}

``type: kvtc`` is registered by :mod:`dynamo_kvtc.connector.offloading.register` (vLLM loads it through the
``vllm.general_plugins`` entry point of the installed package); without the entry point the out-of-tree form works
too: ``{"type": "KvtcSecondaryTier", "module_path": "dynamo_kvtc.connector.offloading.tier", ...}``.

Everything here runs in the scheduler process, as vLLM requires of secondary tiers: ``submit_store`` and
``submit_load`` queue a job and return; a small thread pool reads the chunk out of the primary tier's memory view,
encodes it with the codec of :func:`~dynamo_kvtc.codec.factory.make_codec` (on the GPU when one is present, else on
the CPU) and puts the
blob into a :class:`~dynamo_kvtc.tiers.store.KvtcStore` (:mod:`.storage`: KvtcConnector's store, one chunk one blob:
its host tier, whose LRU victims move to its optional disk tier, its StoreStats); a promotion restores the blob through
the store and writes the chunk back into the primary slot vLLM allocated. Positions (for the keys' RoPE) come from
vLLM's per-request record of each chunk's end token; a chunk without one is stored raw. A failed or missing blob is a
failed promotion: vLLM recomputes those tokens.

The job contract (vLLM's ``SecondaryTierManager``): every submitted job is reported exactly once by
``get_finished_jobs``, whatever fails (a chunk's error of any type is that chunk's failure, the report is made in a
``finally``; a job that cannot be queued is reported failed at once); a store job succeeds only if every chunk is
stored (or was already held); a load job reports the chunks restored before the first failure. ``transfer_bytes`` are
the chunks' raw bytes, as vLLM's own tiers report them (vLLM's backpressure reads latency per byte).

Tier options: :mod:`.options` (the settings table's ``vllm_tier`` rows; an error names the key); the start-up
checks (calibration, the served model's family and fingerprint, ``ratio: auto``, the plan, the codec) are the three
ways in's one start-up, :func:`~dynamo_kvtc.connector.startup.open_tier`; chunk layouts: :mod:`.layout`; the store:
:mod:`.storage`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from ...calibration.models import EMBEDDED, cache_dir
from ...errors import KvtcError, TierError, TierFullError
from ...logs import operator_logging
from ..startup import CodecSpec, Opened, StoreSpec, WhyNot, open_tier
from .layout import ChunkLayout, cpu_offsets, layer_index, resolve_page_layout, torch_dtype
from .options import WAY, KvtcTierOptions, option_error
from .stats import TierStats, metric_definitions
from .storage import KeyBook, make_store, offload_hash

log = logging.getLogger(__name__)

__all__ = ["KvtcSecondaryTier", "open_calibration"]


def served_config(model: str) -> Any | None:
    """The served model's Hugging Face config through vLLM's own reader, from the name the engine was given (a
    directory, an embedded name already converted, or a hub id in the local cache); None, logged, when it cannot be
    read here (the calibration is then checked against the engine's chunk size only)."""
    from vllm.transformers_utils.config import get_config

    where = model
    if model in EMBEDDED and (cache_dir() / "models" / model / "config.json").is_file():
        where = str(cache_dir() / "models" / model)
    try:
        return get_config(where, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - any failure: the fingerprint check is skipped, with this warning
        log.warning("kvtc tier: cannot read model %r's config (%s); its calibration is not checked against it", model,
                    e)  # fmt: skip
        return None


def open_calibration(opts: KvtcTierOptions, cfg: Any, device: torch.device) -> Opened:
    """The tier's start-up (:func:`~dynamo_kvtc.connector.startup.open_tier`) for vLLM's ``OffloadingConfig``
    ``cfg``: the served model (its config read from ``cfg.model.name``) checked against the calibration, MLA refused
    (the tier reads K/V pages), the codec built on ``device``; the start-up rule applied (invalid configuration
    raises its one-line ConfigError naming the option; a limitation is warned about and returned in ``why_not``)."""
    return open_tier(
        WAY,
        calibration=opts.calibration,
        model=cfg.model.name,
        ratio=opts.ratio,
        policy=opts.ratio_policy,
        hf_config=served_config(cfg.model.name),
        serves_mla=False,
        codec=CodecSpec(device, window=opts.chunk_window, tag="deflate"),
        store=StoreSpec(opts.host_bytes, opts.disk_bytes, opts.disk_dir),
        device=opts.device,
    ).settle(WAY)


# --------------------------------------------------------------------------------------------------------- the tier
@dataclass
class _Job:
    job_id: int
    keys: list[OffloadKey]
    chunk_ids: list[int]
    positions: list[int | None] = field(default_factory=list)


class KvtcSecondaryTier(SecondaryTierManager):
    """vLLM secondary tier ``kvtc``: primary-tier chunks kept as KVTC blobs (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.CPU

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **options: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        operator_logging()  # the ready line and warnings in vLLM's log at its level
        self.opts = KvtcTierOptions.from_config(options)
        self.locality = Locality(self.opts.locality.upper()) if self.opts.locality else None
        cfg = offloading_spec.config
        self._flat = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 else primary_kv_view[:]
        self._primary: torch.Tensor | None = None
        self._pool = ThreadPoolExecutor(self.opts.threads, thread_name_prefix="kvtc_tier")
        self._lock = threading.Lock()
        self._done: list[JobResult] = []
        self._futures: set[Future] = set()
        self._stored_keys: list[OffloadKey] = []
        self._events = bool(getattr(offloading_spec.kv_events_config, "enable_kv_cache_events", False))
        self.keys = KeyBook()  # vLLM's keys of the blobs this tier put, and of those that left the store since
        self.store: Any = None
        self.disabled: WhyNot | None = None  # a runtime limitation: the tier serves nothing (every lookup a miss)
        self._stats = TierStats(None)
        self.device = self.opts.torch_device
        if len(cfg.groups) != 1:
            return self._serve_without("model", f"the kvtc tier needs one KV cache group (got {len(cfg.groups)}: "
                                       "hybrid models)")  # fmt: skip
        if cfg.parallel.world_size != 1:
            return self._serve_without("layout", f"the kvtc tier encodes one worker's KV per chunk; this engine has "
                                       f"{cfg.parallel.world_size} workers (tensor/pipeline parallel): use "
                                       "KvtcConnector for TP")  # fmt: skip
        opened = open_calibration(self.opts, cfg, self.device)  # invalid configuration: ConfigError, one line
        if opened.why_not is not None:  # a limitation, already warned about
            self.disabled = opened.why_not
            return
        self.cal, self.codec, self.ratio = opened.calibration, opened.codec, opened.ratio
        fp = self.cal.fingerprint
        dtype = torch_dtype(cfg.model.dtype) if cfg.model.dtype not in ("auto", "") else torch_dtype(fp.dtype)
        if dtype.is_floating_point is False or dtype.itemsize == 1:
            return self._serve_without("kv_cache_dtype", f"the kvtc tier encodes 16/32-bit float KV caches, not "
                                       f"{dtype}")  # fmt: skip
        group = cfg.groups[0]
        layers = [layer_index(n) for n in group.layer_names]
        kind = resolve_page_layout(self.opts.page_layout, getattr(cfg, "kv_cache_layout", None))
        offsets = (None, None)
        if kind == "cpu":
            offsets = cpu_offsets(fp.num_kv_heads, group.tokens_per_block, fp.head_dim, dtype) or (None, None)
        self.layout = ChunkLayout(
            layers=layers,
            block_size=group.tokens_per_block,
            blocks_per_chunk=offloading_spec.blocks_per_chunk,
            num_heads=fp.num_kv_heads,
            head_dim=fp.head_dim,
            dtype=dtype,
            kind=kind,
            k_offsets=offsets[0],
            v_offsets=offsets[1],
        )
        if len(layers) != fp.num_layers:
            raise option_error("calibration", f"the engine has {len(layers)} KV layers, calibration "
                               f"{self.cal.id[:12]} {fp.num_layers}")  # fmt: skip
        if not 0 <= self.block_size_bytes - self.layout.bytes < 4096:  # rows are padded to a page, no more
            raise option_error(
                "calibration",
                f"a primary chunk is {self.block_size_bytes} bytes but {len(layers)} layers x {self.layout.bpc} "
                f"blocks x {group.tokens_per_block} tokens x {fp.num_kv_heads} heads x {fp.head_dim} x K,V x "
                f"{self.layout.elem} bytes make {self.layout.bytes}: calibration {self.cal.id[:12]} is not for "
                "this model"
            )
        self.store = make_store(self.cal, self.opts, self.device, self.layout.tokens, float(self.codec.ratio))
        # the primary tier's rows as one uint8 tensor (no copy): [num_chunks, chunk bytes]
        self._primary = torch.frombuffer(self._flat, dtype=torch.uint8).view(-1, self.block_size_bytes)
        self.store.listeners.append(self.keys)
        self._stats = TierStats(self.store)
        log.info(
            "kvtc secondary tier ready: %d layers, page layout %s, %d tokens per chunk, calibration %s, %s, "
            "device %s, host %.2f GiB, disk %.2f GiB",
            len(layers),
            kind,
            self.layout.tokens,
            self.cal.id[:12],
            "raw (lossless)" if self.opts.ratio_policy == "raw" else f"ratio {self.ratio:g}",
            self.device,
            self.opts.host_bytes / (1 << 30),
            self.opts.disk_bytes / (1 << 30),
        )

    def _serve_without(self, reason: str, message: str) -> None:
        """A runtime limitation found here (the start-up rule: one WARNING line, every lookup a miss, every job
        reported failed, ``vllm:kvtc_tier_enabled{reason}`` 0)."""
        self.disabled = Opened(why_not=WhyNot(reason, "", message)).settle(WAY).why_not

    # ------------------------------------------------------------------ scheduler-facing hooks (non-blocking)
    def holds(self, key: OffloadKey) -> bool:
        """Whether the tier holds chunk ``key`` (host or disk)."""
        return self.store is not None and self.store.match([offload_hash(key)]) == 1

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if self.holds(key) else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def touch(self, keys, req_context: ReqContext) -> None:
        """Mark held chunks most recently used in the host tier (a zero-copy lease taken and given back)."""
        for key in keys if self.store is not None else ():
            blob_id = self.store.blob_of(offload_hash(key))
            lease = self.store.host.lease(blob_id) if blob_id is not None else None
            if lease is not None:
                lease.release()

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(self._store, job_metadata, positions=True)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(self._load, job_metadata, positions=False)

    def _submit(self, fn, meta: TransferJob, positions: bool) -> None:
        """Queue a job; a job that cannot even be queued (bad metadata, the tier shut down) is reported failed at
        once: every job vLLM submits is reported exactly once by :meth:`get_finished_jobs`."""
        try:
            if self.disabled is not None:
                raise TierError(f"the kvtc tier serves without its store ({self.disabled.reason})")
            keys = list(meta.keys)
            job = _Job(meta.job_id, keys, [int(c) for c in meta.chunk_ids])
            if positions:
                job.positions = [meta.req_context.get_offload_key_position(k) for k in keys]
            fut = self._pool.submit(fn, job)
        except Exception as e:  # noqa: BLE001 - reported as the job's failure
            log.warning("kvtc tier: job %s not started (%s: %s); reported failed", meta.job_id, type(e).__name__, e)
            self._finish(JobResult(meta.job_id, success=False, transfer_time=0.0, transfer_bytes=0))
            return
        with self._lock:
            self._futures.add(fut)
        fut.add_done_callback(self._retire)

    def _retire(self, fut: Future) -> None:
        with self._lock:
            self._futures.discard(fut)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            out, self._done = self._done, []
        return out

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._futures)

    def drain_jobs(self) -> None:
        while True:
            with self._lock:
                futs = list(self._futures)
            if not futs:
                return
            for f in futs:
                f.exception()

    def take_events(self) -> Iterable[OffloadingEvent]:
        removed = self.keys.take_removed()
        with self._lock:
            stored, self._stored_keys = self._stored_keys, []
        if not self._events:
            return ()
        out = []
        if stored:
            out.append(OffloadingEvent(stored, self.medium, False, self.locality, ownership=self.tier_type))
        if removed:
            out.append(OffloadingEvent(removed, self.medium, True, self.locality, ownership=self.tier_type))
        return out

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)  # every queued job still runs and reports
        if self.store is not None:
            self.store.close()
        self._primary = None  # drop the tensor over the primary's memory, then the view, so vLLM can unmap it
        import gc

        gc.collect()
        try:
            self._flat.release()
        except BufferError:
            log.warning("kvtc tier: the primary tier's memory is still referenced at shutdown")

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        """The ``vllm:kvtc_*`` families KvtcConnector reports that the tier's store feeds (:mod:`.stats`)."""
        return metric_definitions()

    def get_stats(self) -> OffloadingConnectorStats | None:
        """The store's counter deltas since the last call and its gauges (:class:`.stats.TierStats`)."""
        return self._stats.take(self.disabled.reason if self.disabled is not None else "none")

    def snapshot(self) -> dict[str, Any]:
        """The store's snapshot (:meth:`KvtcStore.snapshot`: the :class:`~dynamo_kvtc.tiers.stats.StoreStats`
        counters and the tiers' contents; one chunk is one block) and ``ratio``, raw / stored bytes offloaded."""
        if self.store is None:  # serving without its store (a runtime limitation)
            return {"enabled": False, "reason": self.disabled.reason if self.disabled else "none"}
        s = self.store.snapshot()
        s["ratio"] = s["offload_raw_bytes"] / s["offload_stored_bytes"] if s["offload_stored_bytes"] else None
        return s

    # ------------------------------------------------------------------ the work (pool threads)
    def _row(self, chunk_id: int) -> torch.Tensor:
        if self._primary is None:
            raise TierError("the kvtc tier was shut down")
        if not 0 <= chunk_id < self._primary.shape[0]:
            raise TierError(f"chunk id {chunk_id} outside the primary tier's {self._primary.shape[0]} chunks")
        return self._primary[chunk_id, : self.layout.bytes]

    def _finish(self, result: JobResult) -> None:
        with self._lock:
            self._done.append(result)

    def _store(self, job: _Job) -> None:
        """Encode and keep each chunk of a store job. A chunk that fails (any exception) is not stored, counted in
        ``StoreStats.offload_errors`` and fails the job; the job is reported once, whatever happens."""
        t0 = time.perf_counter()
        done, stored = 0, []
        try:
            for i, key in enumerate(job.keys):
                try:
                    if self._store_chunk(key, job.chunk_ids[i], job.positions[i]):
                        stored.append(key)
                    done += 1
                except Exception as e:  # noqa: BLE001 - any error is a chunk not stored, never a lost job
                    self.store.stats.offload_errors[type(e).__name__] += 1
                    log.warning(
                        "kvtc tier: storing a chunk failed (%s: %s); it is not stored",
                        type(e).__name__,
                        e,
                        exc_info=not isinstance(e, KvtcError),
                    )
        finally:
            with self._lock:
                self._stored_keys.extend(stored)
            self._finish(self._result(job, done == len(job.keys), done, t0))

    def _store_chunk(self, key: OffloadKey, chunk_id: int, end: int | None) -> bool:
        """Encode one chunk and put its blob in the store; False if the store holds it already."""
        h = offload_hash(key)
        if self.store.match([h]):
            return False
        t0 = time.perf_counter()
        k, v = self.layout.unpack(self._row(chunk_id).to(self.device))
        T = self.layout.tokens
        raw = self.opts.ratio_policy == "raw" or end is None
        start = 0 if end is None else int(end) - T
        blob = self.codec.encode(k, v, torch.arange(start, start + T), window=T if raw else None)
        self.keys.add(h, key)  # before the put: an eviction it causes may already name it
        blob_id = self.store.put_blob(
            [h],
            blob,
            first_position=max(start, 0),
            ratio=None if raw else float(self.codec.ratio),
            raw_bytes=self.layout.bytes,
            seconds=time.perf_counter() - t0,
        )
        if blob_id is None:
            raise TierFullError(f"a blob of {len(blob)} bytes fits in no tier")
        return True

    def _load(self, job: _Job) -> None:
        """Restore each chunk of a load job into its primary slot, in order, up to the first that fails (any
        exception: a miss, vLLM recomputes from there); the job is reported once, whatever happens."""
        t0 = time.perf_counter()
        ok: list[OffloadKey] = []
        try:
            for i, key in enumerate(job.keys):
                try:
                    self._load_chunk(key, job.chunk_ids[i])
                except Exception as e:  # noqa: BLE001 - any error is a failed promotion, never a lost job
                    log.warning(
                        "kvtc tier: restoring a chunk failed (%s: %s); vLLM recomputes it",
                        type(e).__name__,
                        e,
                        exc_info=not isinstance(e, KvtcError),
                    )
                    break
                ok.append(key)
        finally:
            success = len(ok) == len(job.keys)
            result = self._result(job, success, len(ok), t0)
            result.successful_keys = None if success else (tuple(ok) or None)
            self._finish(result)

    def _load_chunk(self, key: OffloadKey, chunk_id: int) -> None:
        """Restore one chunk through the store (its restorer: keys and CRCs checked, a corrupt blob dropped from
        every tier, counted in StoreStats) into a [L, T, H, D] pair, then write it into primary slot ``chunk_id``."""
        row = self._row(chunk_id)
        fp, lay = self.cal.fingerprint, self.layout
        shape = (fp.num_layers, lay.tokens, fp.num_kv_heads, fp.head_dim)
        k = torch.empty(shape, dtype=lay.dtype, device=self.device)
        v = torch.empty_like(k)
        layers: set[int] = set()

        def sink(layer: int, at: int, kl: torch.Tensor, vl: torch.Tensor) -> None:
            if at != 0 or kl.shape[0] != lay.tokens:
                raise TierError(f"blob holds {kl.shape[0]} tokens at {at}, a chunk {lay.tokens}")
            k[layer].copy_(kl)
            v[layer].copy_(vl)
            layers.add(layer)

        handle = self.store.start_onboard([offload_hash(key)], sink=sink)
        if not handle.wait():
            raise handle.error or TierError("restore failed")
        if len(layers) != fp.num_layers:
            raise TierError(f"the restore wrote {len(layers)} of {fp.num_layers} layers")
        row.copy_(lay.pack(k, v).cpu())

    def _result(self, job: _Job, success: bool, chunks: int, t0: float) -> JobResult:
        """A job's report. ``transfer_bytes`` are the raw (primary-tier) bytes of the chunks it moved, as vLLM's own
        tiers report them: vLLM's backpressure detector divides a store's latency by them, so the compressed size
        (~1/16) would read as a tier ~16x slower than a raw one at the same latency. The compressed bytes are in
        StoreStats (``offload_stored_bytes``)."""
        return JobResult(
            job.job_id,
            success=success,
            transfer_time=time.perf_counter() - t0,
            transfer_bytes=chunks * self.block_size_bytes,
        )

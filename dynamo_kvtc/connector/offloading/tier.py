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
the CPU) and keeps the blob in a byte-budgeted LRU host tier whose victims move to an optional disk tier; a promotion
decodes the blob and writes the chunk back into the primary slot vLLM allocated. Positions (for the keys' RoPE) come
from vLLM's per-request record of each chunk's end token; a chunk without one is stored raw. A failed or missing blob
is a failed promotion: vLLM recomputes those tokens.

Tier options: :mod:`.options` (the settings table's ``vllm_tier`` rows; an error names the key); the start-up
checks (calibration, the served model's family and fingerprint, ``ratio: auto``, the plan, the codec) are the three
ways in's one start-up, :func:`~dynamo_kvtc.connector.startup.open_tier`; chunk layouts: :mod:`.layout`; the blob
store: :mod:`.store`.
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
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from ...calibration.models import EMBEDDED, cache_dir
from ...errors import ConfigError, KvtcError
from ..startup import CodecSpec, Opened, open_tier
from .layout import ChunkLayout, cpu_offsets, layer_index, resolve_page_layout, torch_dtype
from .options import WAY, KvtcTierOptions
from .store import BlobCache

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
    (the tier reads K/V pages), the codec built on ``device``; a refusal stops the engine naming the option."""
    return open_tier(
        WAY,
        calibration=opts.calibration,
        model=cfg.model.name,
        ratio=opts.ratio,
        policy=opts.ratio_policy,
        hf_config=served_config(cfg.model.name),
        serves_mla=False,
        codec=CodecSpec(device, window=opts.chunk_window, tag="deflate"),
    ).raise_for(WAY)


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
        self.opts = KvtcTierOptions.from_config(options)
        self.locality = Locality(self.opts.locality.upper()) if self.opts.locality else None
        cfg = offloading_spec.config
        if len(cfg.groups) != 1:
            raise ConfigError(f"the kvtc tier needs one KV cache group (got {len(cfg.groups)}: hybrid models)")
        if cfg.parallel.world_size != 1:
            raise ConfigError(
                f"the kvtc tier encodes one worker's KV per chunk; this engine has {cfg.parallel.world_size} "
                "workers (tensor/pipeline parallel): use KvtcConnector for TP"
            )
        self.device = self.opts.torch_device
        opened = open_calibration(self.opts, cfg, self.device)
        self.cal, self.codec, self.ratio = opened.calibration, opened.codec, opened.ratio
        fp = self.cal.fingerprint
        dtype = torch_dtype(cfg.model.dtype) if cfg.model.dtype not in ("auto", "") else torch_dtype(fp.dtype)
        if dtype.is_floating_point is False or dtype.itemsize == 1:
            raise ConfigError(f"the kvtc tier encodes 16/32-bit float KV caches, not {dtype}")
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
            raise ConfigError(f"engine has {len(layers)} KV layers, calibration {self.cal.id[:12]} {fp.num_layers}")
        if not 0 <= self.block_size_bytes - self.layout.bytes < 4096:  # rows are padded to a page, no more
            raise ConfigError(
                f"a primary chunk is {self.block_size_bytes} bytes but {len(layers)} layers x {self.layout.bpc} "
                f"blocks x {group.tokens_per_block} tokens x {fp.num_kv_heads} heads x {fp.head_dim} x K,V x "
                f"{self.layout.elem} bytes make {self.layout.bytes}: calibration {self.cal.id[:12]} is not for "
                "this model"
            )
        disk_dir = str(self.opts.disk_dir) if self.opts.disk_dir is not None else None
        self.cache = BlobCache(self.opts.host_bytes, self.opts.disk_bytes, disk_dir)
        self._flat = primary_kv_view.cast("B") if primary_kv_view.ndim != 1 else primary_kv_view[:]
        # the primary tier's rows as one uint8 tensor (no copy): [num_chunks, chunk bytes]
        self._primary: torch.Tensor | None = torch.frombuffer(self._flat, dtype=torch.uint8).view(
            -1, self.block_size_bytes
        )
        self._pool = ThreadPoolExecutor(self.opts.threads, thread_name_prefix="kvtc_tier")
        self._lock = threading.Lock()
        self._done: list[JobResult] = []
        self._futures: set[Future] = set()
        self._stored_keys: list[OffloadKey] = []
        self._events = bool(getattr(offloading_spec.kv_events_config, "enable_kv_cache_events", False))
        self.stats: dict[str, float] = {
            "stored_chunks": 0,
            "stored_raw_chunks": 0,
            "raw_bytes": 0,
            "blob_bytes": 0,
            "store_failures": 0,
            "loaded_chunks": 0,
            "load_failures": 0,
            "encode_seconds": 0.0,
            "decode_seconds": 0.0,
        }
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

    # ------------------------------------------------------------------ scheduler-facing hooks (non-blocking)
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return LookupResult.HIT if key in self.cache else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def touch(self, keys, req_context: ReqContext) -> None:
        self.cache.touch(keys)

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        job = _Job(job_metadata.job_id, keys, [int(c) for c in job_metadata.chunk_ids])
        job.positions = [job_metadata.req_context.get_offload_key_position(k) for k in keys]
        self._submit(self._store, job)

    def submit_load(self, job_metadata: TransferJob) -> None:
        job = _Job(job_metadata.job_id, list(job_metadata.keys), [int(c) for c in job_metadata.chunk_ids])
        self._submit(self._load, job)

    def _submit(self, fn, job: _Job) -> None:
        fut = self._pool.submit(fn, job)
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
        removed = self.cache.take_removed()
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
        self._pool.shutdown(wait=True)
        self._primary = None  # drop the tensor over the primary's memory, then the view, so vLLM can unmap it
        import gc

        gc.collect()
        try:
            self._flat.release()
        except BufferError:
            log.warning("kvtc tier: the primary tier's memory is still referenced at shutdown")

    def snapshot(self) -> dict[str, Any]:
        """Counters, sizes and fills (for tests, logs and benchmarks)."""
        with self._lock:
            s = dict(self.stats)
        with self.cache.lock:
            s.update(
                host_blobs=len(self.cache.host),
                host_bytes=self.cache.host_used,
                disk_blobs=len(self.cache.disk),
                disk_bytes=self.cache.disk_used,
                **self.cache.stats,
            )
        s["ratio"] = s["raw_bytes"] / s["blob_bytes"] if s["blob_bytes"] else None
        return s

    # ------------------------------------------------------------------ the work (pool threads)
    def _row(self, chunk_id: int) -> torch.Tensor:
        assert self._primary is not None, "the kvtc tier was shut down"
        return self._primary[chunk_id, : self.layout.bytes]

    def _finish(self, result: JobResult, **counts: float) -> None:
        with self._lock:
            for k, v in counts.items():
                self.stats[k] += v
            self._done.append(result)

    def _store(self, job: _Job) -> None:
        t0 = time.perf_counter()
        raw_bytes = blob_bytes = raw_chunks = stored = failed = 0
        done_keys = []
        for key, cid, end in zip(job.keys, job.chunk_ids, job.positions):
            if key in self.cache:
                continue
            try:
                k, v = self.layout.unpack(self._row(cid).to(self.device))
                T = self.layout.tokens
                raw = self.opts.ratio_policy == "raw" or end is None
                start = 0 if end is None else int(end) - T
                positions = torch.arange(start, start + T)
                blob = self.codec.encode(k, v, positions, window=T if raw else None)
            except (KvtcError, RuntimeError, ValueError) as e:
                log.warning("kvtc tier: encoding a chunk failed (%s); it is not stored", e)
                failed += 1
                continue
            if self.cache.put(key, blob):
                done_keys.append(key)
            stored += 1
            raw_chunks += raw
            raw_bytes += self.layout.bytes
            blob_bytes += len(blob)
        with self._lock:
            self._stored_keys.extend(done_keys)
        self._finish(
            JobResult(job.job_id, success=True, transfer_time=time.perf_counter() - t0, transfer_bytes=blob_bytes),
            stored_chunks=stored,
            stored_raw_chunks=raw_chunks,
            raw_bytes=raw_bytes,
            blob_bytes=blob_bytes,
            store_failures=failed,
            encode_seconds=time.perf_counter() - t0,
        )

    def _load(self, job: _Job) -> None:
        t0 = time.perf_counter()
        ok: list[OffloadKey] = []
        nbytes = 0
        for key, cid in zip(job.keys, job.chunk_ids):
            blob = self.cache.get(key)
            if blob is None:
                break
            try:
                k, v = self.codec.decode(blob)
                if k.shape[1] != self.layout.tokens:
                    raise KvtcError(f"blob holds {k.shape[1]} tokens, a chunk {self.layout.tokens}")
                data = self.layout.pack(k, v).cpu()
            except (KvtcError, RuntimeError, ValueError) as e:
                log.warning("kvtc tier: restoring a chunk failed (%s); vLLM recomputes it", e)
                self.cache.forget(key)
                break
            self._row(cid).copy_(data)
            ok.append(key)
            nbytes += len(blob)
        success = len(ok) == len(job.keys)
        self._finish(
            JobResult(
                job.job_id,
                success=success,
                successful_keys=None if success else (tuple(ok) or None),
                transfer_time=time.perf_counter() - t0,
                transfer_bytes=nbytes,
            ),
            loaded_chunks=len(ok),
            load_failures=0 if success else 1,
            decode_seconds=time.perf_counter() - t0,
        )

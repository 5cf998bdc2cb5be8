"""The worker half of the connector: owns the compressed tiers and moves KV between them and the engine's blocks.

- **Restore, layer by layer.** ``start_load`` launches one restore per request on the store's onboard worker (its own
  CUDA stream); ``wait_layer(i)`` returns as soon as layer i of every restore of this step is in place, so attention on
  layer 0 runs while later layers are still being decoded. A restore that fails at any point (blob evicted, corrupt,
  wrong calibration, timeout) marks its blocks invalid: vLLM recomputes them; nothing wrong is served because vLLM
  discards what the step computed from those blocks. A restore given up on (``load_timeout_s``) is cancelled: no layer
  is written into its blocks after the cancel returns (a request waiting on it asynchronously is reported done only
  once its restore let go of the blocks).
- **Save without stalling.** After the forward pass, the blocks that just became full are copied out of the paged
  cache on the current stream (a small device copy, ordered before any later reuse of the blocks), and the encode runs
  on the store's offload worker behind an event; while the queued copies hold ``offload_queue_bytes`` a save is
  skipped, nothing copied (counted as ``offload_queue_full``: a later miss).
- **Never crash the engine.** A missing or mismatched calibration, an unknown layout or an unsupported KV cache dtype
  (FP8) disables the connector with one error line and a reason (every lookup then misses; ``kvtc_enabled 0``); every
  other fault is logged once per occurrence, counted, and becomes a recompute.
- **Sizes are totals across the TP group** (what vLLM's ``--kv-offloading-size`` means): each rank allocates
  ``cpu_cache_gb / tp_size`` of host memory and ``disk_cache_gb / tp_size`` of disk (:func:`rank_tiers`); rank 0
  warns at start-up when the host memory asked for exceeds the pod's or machine's (:func:`host_memory_warning`).
  With a joint calibration (``tp.json``) each rank codes its own heads, the ranks' encodes collective
  (:mod:`.tensor_parallel`: its group, start-up vote and per-save agreement).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import Counter
from contextlib import suppress
from dataclasses import replace
from typing import Any

import torch

from ...calibration.mla import is_mla
from ...codec.fp8 import kv_format
from ...errors import ConfigError, KvtcError, TierError
from ...tiers.layout import PagedKV
from ...tiers.layouts import detect_layout
from ...tiers.store import KvtcStore, OnboardHandle
from ..config import ConnectorConfig
from ..host_memory import host_memory_limit, host_memory_warning
from ..startup import Refusal, StoreSpec, open_tier
from .services import WorkerServices
from .step_plan import LoadOp, SaveOp, StepPlan
from .tensor_parallel import agree_start, open_group, rank_tiers

log = logging.getLogger(__name__)

# KV cache dtypes the codec encodes from and restores into as they are (FP8 caches go through their scales)
SUPPORTED_KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_kv_dtype(t: torch.Tensor, cache_dtype: str = "auto") -> None:
    """Refuse KV caches the codec cannot read: anything but 16/32-bit float, or an FP8 cache (``fp8``, ``fp8_e4m3``,
    ``fp8_e5m2``; uint8 or float8 tensors, encoded through its per-layer scales). Other quantized caches are refused."""
    fmt = kv_format(cache_dtype)
    if fmt is not None and t.dtype in (torch.uint8, fmt):
        return
    if str(cache_dtype) not in ("auto", "bfloat16", "float16", "float32", "half", "float") or (
        t.dtype not in SUPPORTED_KV_DTYPES
    ):
        raise TierError(
            f"KV cache dtype {cache_dtype} ({t.dtype}) is not supported: kvtc encodes bfloat16/float16/float32 and "
            "fp8/fp8_e4m3/fp8_e5m2 caches only"
        )


def layer_index(name: str) -> int:
    m = re.search(r"(?:^|\.)(\d+)(?:\.|$)", name)
    if m is None:
        raise TierError(f"cannot tell the layer index of KV cache {name!r}")
    return int(m.group(1))




class KvtcWorker:
    """The worker half: one object per TP rank, answering every worker-side vLLM hook.

    Owns the store (compressed tiers) of this rank and the services rank 0 offers (:class:`~.services.WorkerServices`:
    lookup channel, metrics, the hand-off server on a prefill engine). Its blob sources are given at construction: its
    own tiers always, and ``peer`` (a :class:`~dynamo_kvtc.connector.handoff.client.HandoffClient`) on a decode engine.
    It never decides what to load or save (the scheduler's plan does), never writes a block it has not verified, and
    never raises into the engine: every fault is a miss (recompute) or a lost cache entry."""

    def __init__(
        self,
        config: ConnectorConfig,
        *,
        engine_id: str,
        model: str,
        hf_config: Any,
        block_size: int,
        num_blocks: int | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        peer: Any = None,
        listeners: tuple = (),
        kv_cache_dtype: str = "auto",
        refusal: str | None = None,
        from_env: frozenset[str] = frozenset(),
    ) -> None:
        self.cfg = config
        self.engine_id = engine_id
        self.model = model
        self.hf_config = hf_config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.store: KvtcStore | None = None
        self.kv_cache_dtype = str(kv_cache_dtype)  # vLLM's --kv-cache-dtype
        self.disabled: str | None = None  # why the connector passes everything through
        self.disabled_reason: str | None = None  # the same, as a metric label: kv_cache_dtype, layout, calibration, ...
        self.layers: dict[str, int] = {}
        self.stats: Counter[str] = Counter()
        self._sync: list[tuple[LoadOp, OnboardHandle]] = []
        self._async: dict[str, tuple[LoadOp, OnboardHandle]] = {}
        self._failed: set[str] = set()
        self._load_errors: set[int] = set()
        self._done_sending: set[str] = set()
        self._lock = threading.Lock()
        self.restores: list[dict[str, Any]] = []  # recent restores (tokens, first layer / all layers seconds)
        self.peer = peer  # HandoffClient on a decode engine with compressed hand-off
        self.services = WorkerServices(config, engine_id, self.stats)  # rank 0: lookup, hand-off server, metrics
        self.listeners = tuple(listeners)  # store listeners (vLLM KV events)
        self.refusal = refusal  # why the engine cannot be trusted to recompute a failed restore (None: it can)
        self.from_env = from_env  # the settings a DYN_KVTC_* variable set (start-up errors name the variable)

    @property
    def lookup_server(self) -> Any:
        return self.services.lookup

    @property
    def handoff_server(self) -> Any:
        """The HandoffServer on a prefill engine (rank 0), or None."""
        return self.services.handoff

    @property
    def metrics(self) -> Any:
        return self.services.metrics

    @property
    def metrics_port(self) -> int | None:
        return self.services.metrics_port

    # ------------------------------------------------------------------ setup
    def _disable(self, why: str, reason: str = "error", logged: bool = False) -> None:
        """Serve without the tier (a runtime limitation): every lookup a miss; one WARNING line (``logged``: the
        start-up rule, :meth:`~dynamo_kvtc.connector.startup.Opened.settle`, wrote it)."""
        self.disabled = why
        self.disabled_reason = reason
        self.stats["fallback_disabled"] += 1
        if not logged:
            log.warning("KvtcConnector disabled (%s), every request recomputes: %s", reason, why)
        if self.tp_rank == 0:  # lookups still answered (always a miss); kvtc_enabled 0 and the reason scrapeable
            self.services.start(self, None)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], offsets: Any = None, scales: Any = None) -> None:
        """``offsets``: (k, v) element orders inside a CPU-layout block (see :class:`PagedKV`); ``scales``: an FP8
        cache's ``{layer name: (k_scale, v_scale)}`` (None: 1.0, vLLM's default). The start-up checks are
        :func:`~dynamo_kvtc.connector.startup.open_tier`'s (this worker's KV cache checks run inside it, after the
        model's family is decided and before the calibration is opened). The start-up rule: invalid configuration
        raises its one-line ConfigError (the engine stops), a runtime limitation disables the connector."""
        tp = open_group(self.tp_rank, self.tp_size)  # every rank, now: the joint codec's collectives run on it
        found: dict[str, Any] = {}
        stage, voted, settled = "failure_policy", False, False
        stop: ConfigError | None = None
        try:
            if self.refusal is not None:  # the engine would fail a request on a failed restore (connector.py)
                raise TierError(self.refusal)
            opened = open_tier(
                "extra",
                calibration=self.cfg.calibration,
                model=self.model,
                ratio=self.cfg.tiers.ratio,
                policy=self.cfg.tiers.ratio_policy,
                hf_config=self.hf_config,
                tp_rank=self.tp_rank,
                tp_size=self.tp_size,
                tp=tp,
                engine=lambda fp: self._engine_kv(kv_caches, offsets, scales, fp, found),
                store=StoreSpec(self.cfg.tiers.host_bytes, self.cfg.tiers.disk_bytes, self.cfg.tiers.disk_dir),
            )
            if opened.why_not is not None:
                stage = opened.why_not.reason
                try:
                    opened.settle("extra", self.from_env)  # invalid configuration raises; a limitation warns
                    settled = True
                except ConfigError as e:
                    stop = e
                raise TierError(opened.why_not.message)
            kv, names, cal = found["kv"], found["names"], opened.calibration
            self.cfg = replace(self.cfg, tiers=self.cfg.tiers.with_(ratio=opened.ratio))  # `auto` resolved
            stage = "store"
            tiers = rank_tiers(self.cfg.tiers, self.tp_rank, self.tp_size)
            if self.tp_rank == 0:
                self._warn_host_memory()
            store = KvtcStore(cal, tiers, device=kv.device, block_size=self.block_size, kv=kv, shard=opened.shard)
            stage, voted = "tensor_parallel", True
            try:
                agree_start(tp, store)  # the ranks serve a joint calibration together or not at all
            except KvtcError:
                store.close()
                raise
            stage = "warm_up"
            log.info("kvtc: codec warm-up took %.2f s", store.warm_up())  # collective with the joint codec
        except (KvtcError, OSError, ValueError) as e:
            if not voted:
                with suppress(KvtcError):
                    agree_start(tp, None)  # the other ranks wait for this rank's vote
            if stop is not None:
                raise stop from None  # invalid configuration: the engine stops with the one line
            self._disable(str(e), stage, logged=settled)
            return
        self.layers = {n: i for i, n in enumerate(names)}
        self.store = store
        store.listeners.extend(self.listeners)
        log.info(
            "KvtcConnector ready: %d layers, layout %s, calibration %s (%s), ratio %g, host tier %.2f GiB (this rank), "
            "disk %s",
            kv.num_layers,
            kv.layout,
            cal.id[:12],
            cal.fingerprint.model_name or cal.fingerprint.architecture,
            tiers.ratio,
            tiers.host_bytes / (1 << 30),
            tiers.disk_dir if tiers.disk_bytes else "off",
        )
        if self.tp_rank == 0:
            self.services.start(self, store)

    def _engine_kv(
        self, kv_caches: dict[str, torch.Tensor], offsets: Any, scales: Any, fp: Any, found: dict[str, Any]
    ) -> Any:
        """The engine's paged KV (into ``found``: ``kv``, ``names``) after the dtype and layout checks, and the model
        fingerprint ``fp`` as this rank serves it (its KV heads), checked against the cache's shape."""
        names = sorted(kv_caches, key=layer_index)
        tensors = [kv_caches[n] for n in names]
        try:
            check_kv_dtype(tensors[0], self.kv_cache_dtype)
        except TierError as e:
            raise Refusal("kv_cache_dtype", "", str(e)) from None
        layout = detect_layout(tensors[0], self.num_blocks, mla=is_mla(self.hf_config))
        if isinstance(offsets, Exception) and layout == "cpu":  # read as the plain layout, keys come out scrambled
            raise TierError(f"cannot learn the element order of this CPU KV cache: {offsets}")
        ko, vo = offsets if offsets is not None and layout == "cpu" else (None, None)
        ks = vs = None
        if kv_format(self.kv_cache_dtype) is not None:
            if layout == "cpu" and offsets is None:
                raise TierError("the element order of this CPU FP8 KV cache is unknown (no cache kernel to probe)")
            if scales is not None:
                if set(names) - set(scales):
                    raise TierError(f"no k/v scale for FP8 KV cache {sorted(set(names) - set(scales))[0]!r}")
                ks, vs = [scales[n][0] for n in names], [scales[n][1] for n in names]
        kv = PagedKV(tensors, layout, self.block_size, k_offsets=ko, v_offsets=vo, cache_dtype=self.kv_cache_dtype,
                     k_scales=ks, v_scales=vs)  # fmt: skip
        found.update(kv=kv, names=names)
        if fp is None:
            return None
        if self.tp_size == 1 and kv.num_heads != fp.total_kv_heads:
            raise Refusal("layout", "", f"engine KV cache has {kv.num_heads} heads, the model config "
                          f"{fp.total_kv_heads}")  # fmt: skip
        if kv.head_dim != fp.head_dim or kv.num_layers != fp.num_layers:
            raise Refusal("layout", "", f"engine KV cache is {kv.num_layers} layers x head_dim {kv.head_dim}, "
                          f"the model config {fp.num_layers} x {fp.head_dim}")  # fmt: skip
        return replace(fp, num_kv_heads=kv.num_heads)

    def _warn_host_memory(self) -> None:
        """Rank 0, at start-up: warn when ``cpu_cache_gb`` (all ranks of this engine, on this machine) exceeds the
        pod's or machine's memory."""
        msg = host_memory_warning(self.cfg.tiers.host_bytes, host_memory_limit())
        if msg is not None:
            self.stats["host_memory_overcommit"] += 1
            log.warning(msg)

    # ------------------------------------------------------------------ lookup
    def match(self, hashes: list[int]) -> tuple[int, int]:
        if self.store is None:
            return 0, 0
        return self.store.match_tiers(hashes)

    def handoff_port(self) -> int | None:
        return self.services.handoff_port

    def _source(self, op: LoadOp) -> tuple[Any, list[OnboardHandle]]:
        """Where a load's blobs come from: the tiers (None), or the prefill peer named in the op; and the cell the
        caller puts the restore's handle in, so that a restore cancelled before its turn never fetches."""
        cell: list[OnboardHandle] = []
        if op.remote is None:
            return None, cell
        if self.peer is None:
            raise TierError("a remote load reached a worker without compressed hand-off")
        host, port = op.remote

        def fetch() -> list:
            if cell and cell[0].cancelled:  # given up on while it waited for its lane: nothing asked of the peer
                raise TierError("restore cancelled by its caller before its peer fetch")
            return self.peer.fetch(host, port, list(op.hashes))

        return fetch, cell

    # ------------------------------------------------------------------ per step
    def start_load(self, plan: StepPlan | None) -> None:
        if plan is None:
            return
        self.stats["lookup_tokens"] += plan.lookup_tokens
        self.stats["hit_tokens"] += plan.hit_tokens
        self.stats["fallback_bypass_unkeyable"] += plan.bypassed
        for op in plan.loads:
            if self.store is None:
                self._fail_load(op, f"connector disabled: {self.disabled}")
                continue
            try:
                source, cell = self._source(op)
                handle = self.store.start_onboard(op.hashes, op.block_ids, source=source)
                cell.append(handle)  # before any cancel: the caller cancels only through the handle it got here
            except KvtcError as e:
                self._fail_load(op, str(e))
                continue
            if op.asynchronous:
                self._async[op.req_id] = (op, handle)
            else:
                self._sync.append((op, handle))

    def _fail_load(self, op: LoadOp, why: str, reason: str = "load_error") -> None:
        log.warning("kvtc restore of %d blocks for %s failed, recomputing: %s", len(op.hashes), op.req_id, why)
        self.stats[f"fallback_{reason}"] += 1
        with self._lock:
            if op.asynchronous:
                self._failed.add(op.req_id)  # vLLM recomputes the whole request
            else:
                self._load_errors.update(op.block_ids)  # vLLM recomputes from the first of these blocks

    def wait_layer(self, layer_name: str) -> None:
        if not self._sync:
            return
        i = self.layers.get(layer_name)
        if i is None:
            return
        keep = []
        for op, handle in self._sync:
            try:
                handle.wait_layer(i, timeout=self.cfg.load_timeout_s)
                keep.append((op, handle))
            except TierError as e:
                self._cancel(handle)
                self._fail_load(op, str(e), "timeout" if "within" in str(e) else "load_error")
        self._sync = keep

    def save(self, plan: StepPlan | None) -> None:
        """After the forward pass: finish this step's restores, copy out newly full blocks, queue their encode."""
        for op, handle in self._sync:
            if handle.wait(self.cfg.load_timeout_s):
                self._record_restore(op, handle)
            else:
                self._cancel(handle)
                self._fail_load(op, str(handle.error or "restore did not finish"))
        self._sync = []
        if plan is None:
            return
        with self._lock:
            self._done_sending.update(plan.releases)
        for op in plan.saves:
            self._save_one(op)

    def _save_one(self, op: SaveOp) -> None:
        try:
            if self.store is None:
                return
            if len(op.token_ids) < self.cfg.tiers.min_tokens and op.first_block == 0 and op.final:
                self.stats["offload_bypass_short"] += 1
                return
            kv, ids = self.store.kv, op.block_ids

            def copy() -> tuple[torch.Tensor, torch.Tensor, Any]:  # called only once the save is admitted
                k, v = kv.gather(ids)  # a copy on the current stream: blocks may be reused after
                ev = None
                if k.is_cuda:
                    ev = torch.cuda.Event()
                    ev.record()
                return k, v, ev

            self.store.submit_offload(
                op.hashes,
                op.token_ids,
                first_block=op.first_block,
                parent=op.parent,
                copy=copy,
                tail=op.tail,
            )
        except Exception as e:  # losing a cache entry is fine; taking the engine down is not
            log.warning("kvtc save of %d blocks for %s failed: %s", len(op.hashes), op.req_id, e)
            self.stats["fallback_save_error"] += 1
        finally:
            if op.final:
                with self._lock:
                    self._done_sending.add(op.req_id)

    def _record_restore(self, op: LoadOp, handle: OnboardHandle) -> None:
        times = [t for t in handle.ready_times if t is not None]
        self.restores.append(
            {
                "req_id": op.req_id,
                "blocks": len(op.hashes),
                "tokens": len(op.hashes) * self.block_size,
                "first_layer_s": times[0] if times else None,
                "all_layers_s": times[-1] if times else None,
                "layer_ready_s": list(handle.ready_times),
                "block_ids": list(op.block_ids),
                "hashes": list(op.hashes),
                "raw_bytes": handle.raw_bytes,
                "stored_bytes": handle.bytes_read,
                "asynchronous": op.asynchronous,
            }
        )
        del self.restores[:-256]

    def _cancel(self, handle: OnboardHandle) -> None:
        """Stop a restore given up on: its blocks get no write after this returns. A layer still being written after
        ``load_timeout_s`` is waited for (the blocks go back to vLLM, which reuses them, only once it stopped): a
        slower step, never a block written after vLLM recomputed it."""
        if handle.finished or handle.cancel(self.cfg.load_timeout_s):
            return
        log.error("kvtc: a cancelled restore still writing after %s s; waiting for it to stop", self.cfg.load_timeout_s)
        handle.cancel(None)

    def finished(self) -> tuple[set[str], set[str], set[str]]:
        """(done sending, done receiving, failed receiving) since the last call. A restore running past
        ``load_timeout_s`` is cancelled; its request is reported only once the restore let go of its blocks."""
        recv, failed = set(), set()
        for req_id, (op, handle) in list(self._async.items()):
            if not handle.finished and time.perf_counter() - handle.started > self.cfg.load_timeout_s:
                handle.cancel(0)  # never blocks the engine: the worker sees the flag before its next layer
            if handle.finished:
                del self._async[req_id]
                recv.add(req_id)
                if handle.ok:
                    self._record_restore(op, handle)
                else:
                    self._fail_load(op, str(handle.error), "timeout" if handle.cancelled else "load_error")
        with self._lock:
            sending, self._done_sending = self._done_sending, set()
            failed, self._failed = self._failed, set()
        return sending, recv | failed, failed

    def load_errors(self) -> set[int]:
        with self._lock:
            out, self._load_errors = self._load_errors, set()
        return out

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Block until every queued encode finished (tests, shutdown); False if some did not within ``timeout``."""
        return self.store is None or self.store.wait_idle(timeout)

    def shutdown(self) -> None:
        self.services.stop()
        if self.peer is not None:
            self.peer.close()
        if self.store is not None:
            self.store.close()

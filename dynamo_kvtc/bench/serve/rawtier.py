"""The raw baseline of ``bench serve``: a block-granular pinned host pool moved by DMA, with no blob framing.

This is what a raw offload tier does (vLLM's OffloadingConnector, Dynamo KVBM's host pool, LMCache's local CPU
backend): every offloaded block gets a slot in a pinned host pool; an offload is one device->host copy per layer, K/V
and run of contiguous slots on its own stream; a restore one host->device copy per layer, K/V and run, issued in layer
order so attention on layer i waits for layer i only; eviction is least-recently-used per block (a sequence's later
blocks leave before its earlier ones). No codec, no CRC, no blob headers, no host-side copies: the bytes cost only
the link. It stands in for those systems in the benchmark; it is not a tier of the product (the product's raw mode is
the ``raw_blob`` system: the real store with the codec off).

Pool layout ``[layers, 2, slots, block, kv heads, head dim]`` (layer-major, so a layer's blocks are one copy per run).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch

from ...errors import TierError
from ...tiers.layout import PagedKV
from ...tiers.restorer import OnboardHandle

log = logging.getLogger(__name__)

__all__ = ["RawDmaConfig", "RawDmaTier", "runs_of"]


def runs_of(slots: Sequence[int], blocks: Sequence[int] | None = None) -> list[tuple[int, int, int]]:
    """(first slot, first block, length) of each run where both the slots and the blocks they go with are consecutive;
    ``blocks`` defaults to the indices into ``slots`` (runs of adjacent slots, in ``slots``' order)."""
    out: list[tuple[int, int, int]] = []
    for s, b in zip(slots, range(len(slots)) if blocks is None else blocks):
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == b:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, b, 1))
    return out


@dataclass(frozen=True)
class RawDmaConfig:
    """Pool size in bytes and the KV geometry of one block."""

    host_bytes: int
    layers: int
    kv_heads: int
    head_dim: int
    block_size: int = 16
    dtype: torch.dtype = torch.bfloat16
    pinned: bool = True

    @property
    def block_bytes(self) -> int:
        """K and V of one block over every layer."""
        return 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def slots(self) -> int:
        return self.host_bytes // self.block_bytes


class RawDmaTier:
    """A raw host tier: owns the pinned pool, the block index (hash -> slot, LRU order), the free slots, one offload
    worker with its own CUDA stream and one restore stream. The same ``match`` / ``start_onboard`` /
    ``submit_offload`` / ``snapshot`` / ``close`` surface as :class:`~dynamo_kvtc.tiers.KvtcStore` for the engine
    loop. A slot being read by a restore is never overwritten before that read finished (the offload stream waits on
    the restore's event before it writes)."""

    def __init__(self, cfg: RawDmaConfig, device: str | torch.device, *, kv: PagedKV | None = None) -> None:
        self.cfg, self.dev = cfg, torch.device(device)
        if kv is not None and (kv.layout != "flash" or len(kv.caches) != cfg.layers):
            raise TierError(f"the raw DMA tier restores into a flash-layout cache of {cfg.layers} layers")
        self.kv = kv  # the engine's paged cache, restored into in place (None: restores go to a sink)
        n = cfg.slots
        if n < 1:
            raise TierError(f"host budget {cfg.host_bytes} B holds no block of {cfg.block_bytes} B")
        cuda = self.dev.type == "cuda"
        self.pool = torch.empty(cfg.layers, 2, n, cfg.block_size, cfg.kv_heads, cfg.head_dim, dtype=cfg.dtype,
                                pin_memory=cfg.pinned and cuda)  # fmt: skip
        self._index: OrderedDict[int, int] = OrderedDict()  # hash -> slot, least recently used first
        self._free = list(range(n - 1, -1, -1))  # a stack: low slots first
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rawdma-offload")
        self._off_stream = torch.cuda.Stream(self.dev) if cuda else None
        self._on_stream = torch.cuda.Stream(self.dev) if cuda else None
        self._last_read: Any = None  # the event after the latest restore's copies
        self.stats: Counter[str] = Counter()

    # ------------------------------------------------------------------ the store surface
    def match(self, hashes: Sequence[int]) -> int:
        """How many of ``hashes``' leading blocks the pool holds."""
        with self._lock:
            n = 0
            for h in hashes:
                if h not in self._index:
                    break
                n += 1
            return n

    def start_onboard(
        self,
        hashes: Sequence[int],
        dst_blocks: Sequence[int] | None = None,
        *,
        sink: Callable[[int, int, torch.Tensor, torch.Tensor], None] | None = None,
    ) -> OnboardHandle:
        """Copy the blocks of ``hashes`` (all held: ``match`` said so) layer by layer, on the restore stream, straight
        into the registered cache's ``dst_blocks`` (one copy per layer, K/V and run of slots and blocks that are both
        consecutive), or into ``sink(layer, first token, k, v)``; the handle's layer events gate the engine's
        attention."""
        if sink is None and (dst_blocks is None or self.kv is None or len(dst_blocks) != len(hashes)):
            raise TierError("a restore needs one destination block per hash with a registered cache, or a sink")
        handle = OnboardHandle(self.cfg.layers, hashes, self.dev)
        with self._lock:
            try:
                slots = [self._index[h] for h in hashes]
            except KeyError as e:
                handle.fail(TierError(f"block {e.args[0]:016x} is no longer held"))
                return handle
            for h in reversed(hashes):  # the first block is the most recently used: tails leave first
                self._index.move_to_end(h)
            ctx = torch.cuda.stream(self._on_stream) if self._on_stream is not None else nullcontext()
            with ctx:
                if self._on_stream is not None:
                    self._on_stream.wait_stream(torch.cuda.current_stream(self.dev))
                if sink is None:
                    copies = self._into_pages(slots, list(dst_blocks), handle)
                else:
                    copies = self._into_sink(slots, sink, handle)
                if self._on_stream is not None:
                    ev = torch.cuda.Event()
                    ev.record()
                    self._last_read = ev
            handle.raw_bytes = handle.bytes_read = len(slots) * self.cfg.block_bytes
        self.stats["restores"] += 1
        self.stats["restore_copies"] += copies
        self.stats["restore_bytes"] += handle.raw_bytes
        handle.finish()
        return handle

    def _into_pages(self, slots: list[int], dst: list[int], handle: OnboardHandle) -> int:
        copies = 0
        runs = runs_of(slots, dst)
        for layer in range(self.cfg.layers):
            page = self.kv.caches[layer]  # [2, blocks, block, H, D]
            for s0, d0, n in runs:
                for j in (0, 1):
                    page[j, d0 : d0 + n].copy_(self.pool[layer, j, s0 : s0 + n], non_blocking=True)
                    copies += 1
            handle.mark_layer_ready(layer)
        return copies

    def _into_sink(self, slots: list[int], sink: Callable, handle: OnboardHandle) -> int:
        bs, copies = self.cfg.block_size, 0
        runs = runs_of(slots)
        T = len(slots) * bs
        for layer in range(self.cfg.layers):
            kv = torch.empty(2, T, self.cfg.kv_heads, self.cfg.head_dim, dtype=self.cfg.dtype, device=self.dev)
            for s0, i0, n in runs:  # K and V apart: each copy contiguous on both sides (a strided host
                for j in (0, 1):  # source would be staged through pageable memory, synchronously)
                    src = self.pool[layer, j, s0 : s0 + n].flatten(0, 1)
                    kv[j, i0 * bs : (i0 + n) * bs].copy_(src, non_blocking=True)
                    copies += 1
            sink(layer, 0, kv[0], kv[1])
            handle.mark_layer_ready(layer)
        return copies

    def submit_offload(self, hashes: Sequence[int], token_ids: Sequence[int], *, keys: torch.Tensor,
                       values: torch.Tensor, ready_event: Any = None) -> Future:  # fmt: skip
        """Store the blocks of ``hashes`` not held yet (``keys``/``values`` ``[L, len(hashes) * block, H, D]``), as
        many leading ones as the pool has room for; the future resolves once the bytes are in the pool."""
        bs = self.cfg.block_size
        if keys.shape[1] != len(hashes) * bs or values.shape != keys.shape:
            raise TierError(f"keys/values must be [L, {len(hashes) * bs}, H, D], got {tuple(keys.shape)}")
        return self._pool.submit(self._offload, list(hashes), keys, values, ready_event)

    def _offload(self, hashes: list[int], keys: torch.Tensor, values: torch.Tensor, ready: Any) -> int:
        t0 = time.perf_counter()
        bs = self.cfg.block_size
        with self._lock:
            for h in reversed(hashes):
                if h in self._index:
                    self._index.move_to_end(h)
            new = [i for i, h in enumerate(hashes) if h not in self._index]
            keep = set(hashes)
            while len(self._free) < len(new) and self._index:
                victim = next((h for h in self._index if h not in keep), None)
                if victim is None:
                    break
                self._free.append(self._index.pop(victim))
                self.stats["evicted_blocks"] += 1
            new = new[: len(self._free)]
            self._free.sort(reverse=True)
            slots = [self._free.pop() for _ in new]
            last_read = self._last_read
        if not new:
            return 0
        ctx = torch.cuda.stream(self._off_stream) if self._off_stream is not None else nullcontext()
        with ctx:
            if self._off_stream is not None:
                if ready is not None:
                    self._off_stream.wait_event(ready)
                if last_read is not None:  # an evicted slot may still be read by a restore in flight
                    self._off_stream.wait_event(last_read)
            copies = 0
            for s0, b0, n in runs_of(slots, new):
                for layer in range(self.cfg.layers):
                    self.pool[layer, 0, s0 : s0 + n].copy_(keys[layer, b0 * bs : (b0 + n) * bs].unflatten(0, (n, bs)),
                                                           non_blocking=True)  # fmt: skip
                    self.pool[layer, 1, s0 : s0 + n].copy_(
                        values[layer, b0 * bs : (b0 + n) * bs].unflatten(0, (n, bs)), non_blocking=True
                    )
                    copies += 2
            if self._off_stream is not None:
                self._off_stream.synchronize()
        with self._lock:
            for i, s in zip(new, slots):
                self._index[hashes[i]] = s
        self.stats["offloads"] += 1
        self.stats["offload_blocks"] += len(new)
        self.stats["offload_copies"] += copies
        self.stats["offload_seconds_x1e6"] += int((time.perf_counter() - t0) * 1e6)
        return len(new)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            held = len(self._index)
        return {**self.stats, "held_blocks": held, "slots": self.cfg.slots, "host_bytes": self.cfg.host_bytes,
                "host_stored_bytes": held * self.cfg.block_bytes}  # fmt: skip

    def close(self) -> None:
        self._pool.shutdown(wait=True)

"""The ``vllm_tier`` system of ``bench serve``: vLLM's tiered OffloadingConnector with the ``kvtc`` secondary tier.

vLLM's tiered offloading (what :mod:`dynamo_kvtc.connector.offloading.tier` plugs into) keeps a raw CPU *primary*
tier, the only one the GPU copies to and from, and cascades every chunk it stores there to its secondary tiers. A
chunk found only in a secondary tier is first promoted into a primary slot, then loaded from the primary like any
other. :class:`CascadeTier` replays that data path on the benchmark's engine, at a share of the same host budget:

- offload: the blocks go to the raw primary (a :class:`~.rawtier.RawDmaTier`, DMA only) and to the kvtc store
  (encoded on the same device as the engine's other systems). The engine's slot is reused once both finished.
- restore, every block in the primary: the primary's layer-by-layer DMA restore (the ``raw`` system's path).
- restore, some block only in the kvtc tier: decode all of them (the kvtc store's restore, into the engine's pages),
  copy them into primary slots (device to host: the promotion), then load them from the primary (host to device).
  The engine's first layer waits for the whole promotion: vLLM loads a chunk only once it is in the primary.

Not modelled: vLLM's tier reads the chunk to encode from the primary's host memory (one host-to-device copy of the
raw bytes per offload, off the request path); here it encodes the engine's device copy, as the other kvtc systems do.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any

import torch

from ...errors import TierError
from ...tiers.layout import PagedKV
from .rawtier import RawDmaTier

__all__ = ["CascadeTier"]


class _PromotedHandle:
    """A restore that waits for the promotion into the primary, then for the primary's layer-by-layer copy."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.started = time.perf_counter()
        self.ready_times: list[float | None] = [None] * num_layers
        self.error: BaseException | None = None
        self._promoted = threading.Event()
        self._load: Any = None  # the primary's OnboardHandle, once the promotion finished

    def _done(self, load: Any = None, error: BaseException | None = None) -> None:
        self._load, self.error = load, error
        self._promoted.set()

    def wait_layer(self, i: int, timeout: float | None = None) -> None:
        if not self._promoted.wait(timeout):
            raise TierError(f"layer {i} not promoted within {timeout} s")
        if self.error is not None:
            raise TierError(f"promotion from the kvtc tier failed: {self.error}")
        self._load.wait_layer(i, timeout)
        if self.ready_times[i] is None:
            self.ready_times[i] = time.perf_counter() - self.started

    def wait(self, timeout: float | None = None) -> bool:
        return self._promoted.wait(timeout) and self.error is None and self._load.wait(timeout)


class CascadeTier:
    """A raw primary tier in front of a kvtc store, both on the same host budget (the engine's store surface:
    ``match`` / ``start_onboard`` / ``submit_offload`` / ``snapshot`` / ``close``, restoring into ``kv`` in place)."""

    def __init__(self, primary: RawDmaTier, secondary: Any, kv: PagedKV) -> None:
        if kv is None:
            raise TierError("the cascade restores into the engine's paged cache; pass kv")
        self.primary, self.secondary, self.kv = primary, secondary, kv
        self.cfg = secondary.cfg  # the kvtc store's settings (its disk folder, for the run's clean-up)
        self.dev = primary.dev
        self._promote = ThreadPoolExecutor(1, thread_name_prefix="cascade-promote")
        self._stream = torch.cuda.Stream(self.dev) if self.dev.type == "cuda" else None
        self.stats: Counter[str] = Counter()

    def match(self, hashes: Sequence[int]) -> int:
        """Leading blocks held by either tier (the primary keeps a prefix, the secondary every cascaded chunk)."""
        return max(self.primary.match(hashes), self.secondary.match(hashes))

    def start_onboard(
        self, hashes: Sequence[int], dst_blocks: Sequence[int] | None = None, *, sink: Callable | None = None
    ) -> Any:
        if sink is not None or dst_blocks is None or len(dst_blocks) != len(hashes):
            raise TierError("the cascade restores into the engine's paged cache: one destination block per hash")
        if self.primary.match(hashes) >= len(hashes):
            self.stats["primary_hits"] += 1
            return self.primary.start_onboard(hashes, dst_blocks)
        self.stats["promotions"] += 1
        handle = _PromotedHandle(self.primary.cfg.layers)
        self._promote.submit(self._promotion, list(hashes), list(dst_blocks), handle)
        return handle

    def _promotion(self, hashes: list[int], dst: list[int], handle: _PromotedHandle) -> None:
        try:
            dec = self.secondary.start_onboard(hashes, dst)
            ctx = torch.cuda.stream(self._stream) if self._stream is not None else nullcontext()
            with ctx:
                for i in range(handle.num_layers):
                    dec.wait_layer(i)  # this stream now waits on the decode of layer i
                bs = self.primary.cfg.block_size
                idx = torch.tensor(dst, device=self.dev)
                k = torch.stack([page[0].index_select(0, idx).flatten(0, 1) for page in self.kv.caches])
                v = torch.stack([page[1].index_select(0, idx).flatten(0, 1) for page in self.kv.caches])
                ev = None
                if self._stream is not None:
                    ev = torch.cuda.Event()
                    ev.record()
            stored = self.primary.submit_offload(hashes, [0] * len(hashes) * bs, keys=k, values=v, ready_event=ev)
            stored.result()
            if self.primary.match(hashes) < len(hashes):  # the primary could not take the chunk: serve the decode
                self.stats["promotions_unplaced"] += 1
                handle._done(dec)
                return
            handle._done(self.primary.start_onboard(hashes, dst))
        except Exception as e:  # a failed promotion is a miss: the engine recomputes
            self.stats["promotion_failures"] += 1
            handle._done(error=e)

    def submit_offload(self, hashes: Sequence[int], token_ids: Sequence[int], *, keys: torch.Tensor,
                       values: torch.Tensor, ready_event: Any = None) -> Future:  # fmt: skip
        """Both tiers store the blocks; the future resolves once both have (the engine then reuses the memory)."""
        a = self.primary.submit_offload(hashes, token_ids, keys=keys, values=values, ready_event=ready_event)
        b = self.secondary.submit_offload(hashes, token_ids, keys=keys, values=values, ready_event=ready_event)
        both: Future = Future()
        lock = threading.Lock()

        def settle(_f: Future) -> None:
            with lock:
                if not (a.done() and b.done()) or both.done():
                    return
                err = a.exception() or b.exception()
                both.set_exception(err) if err else both.set_result(a.result())

        a.add_done_callback(settle)
        b.add_done_callback(settle)
        return both

    def snapshot(self) -> dict[str, Any]:
        p, s = self.primary.snapshot(), self.secondary.snapshot()
        out = {**s, **{f"primary_{k}": v for k, v in p.items()}, **self.stats}
        out["host_stored_bytes"] = p.get("host_stored_bytes", 0) + s.get("host_stored_bytes", 0)
        return out

    def close(self) -> None:
        self._promote.shutdown(wait=True)
        self.primary.close()
        self.secondary.close()

"""The compressed tiers' blocks as vLLM KV cache events, the one path by which Dynamo's router hears of them.

- :class:`EventQueue` (worker) turns the store's stored/removed notifications into vLLM ``BlockStored`` /
  ``BlockRemoved`` events (medium ``CPU``), which vLLM's KV event stream carries to Dynamo's router;
  :class:`EventCollector` (scheduler) aggregates the TP workers' batches of one step and stamps the LoRA adapter of
  the blocks that belong to a LoRA request (the worker's store knows hashes only; the scheduler knows the adapter),
  so Dynamo's router hashes them with the adapter's name as vLLM's own events do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVConnectorKVEvents, KVEventAggregator

from ..tiers.keys import router_hash

MEDIUM = "CPU"  # the compressed tiers live in host memory (and on local disk behind it)


class KvtcKVEvents(KVConnectorKVEvents):
    """Compressed-tier BlockStored/BlockRemoved events, aggregated over TP workers (kept when all ranks report)."""

    def __init__(self, num_workers: int = 1) -> None:
        self._agg = KVEventAggregator(num_workers)

    def add_events(self, events: list) -> None:
        self._agg.add_events(events)

    def aggregate(self) -> KvtcKVEvents:
        common = self._agg.get_common_events()
        self._agg.clear_events()
        self._agg.add_events(common)
        self._agg.reset_workers()
        return self

    def increment_workers(self, count: int = 1) -> None:
        self._agg.increment_workers(count)

    def get_all_events(self) -> list:
        return self._agg.get_all_events()

    def get_number_of_workers(self) -> int:
        return self._agg.get_number_of_workers()

    def clear_events(self) -> None:
        self._agg.clear_events()
        self._agg.reset_workers()


class EventQueue:
    """Store listener turning committed/dropped blobs into vLLM KV cache events (relayed by dynamo.vllm).

    Owns the events of one worker between two steps; it never blocks or raises into the store. Events carry each
    block key's 64-bit :func:`~dynamo_kvtc.tiers.keys.router_hash` (the router's width)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.events: list = []

    def stored(self, hashes, token_ids, parent) -> None:
        self.events.append(
            BlockStored(
                block_hashes=[router_hash(h) for h in hashes],
                parent_block_hash=None if parent is None else router_hash(parent),
                token_ids=list(token_ids),
                block_size=self.block_size,
                lora_id=None,
                medium=MEDIUM,
                lora_name=None,
            )
        )

    def removed(self, hashes) -> None:
        self.events.append(BlockRemoved(block_hashes=[router_hash(h) for h in hashes], medium=MEDIUM))

    def take(self) -> KvtcKVEvents | None:
        """This step's events as vLLM's connector event batch (None when there are none)."""
        events, self.events = self.events, []
        if not events:
            return None
        out = KvtcKVEvents(num_workers=1)
        out.add_events(events)
        return out


class EventCollector:
    """Scheduler side: gathers the workers' event batches of one step (``update_connector_output``) and hands the
    events that every TP worker reported to vLLM's event stream (``take_events``).

    ``lora_of`` (the scheduler's :meth:`~dynamo_kvtc.connector.vllm.scheduler.KvtcScheduler.lora_of`) maps a block hash
    to its request's (lora id, lora name); stored events of such blocks carry both. It never drops or reorders
    events."""

    def __init__(self, lora_of: Callable[[int], tuple[int, str] | None] | None = None) -> None:
        self._batch: KvtcKVEvents | None = None
        self._lora_of = lora_of

    def add(self, connector_output: Any) -> None:
        ev = getattr(connector_output, "kv_cache_events", None)
        if not isinstance(ev, KvtcKVEvents):
            return
        if self._batch is None:
            self._batch = ev
        else:
            self._batch.add_events(ev.get_all_events())
            self._batch.increment_workers(ev.get_number_of_workers())

    def take(self):
        if self._batch is not None:
            batch, self._batch = self._batch, None  # this step's batch (all workers) is consumed here
            batch.aggregate()
            for event in batch.get_all_events():
                yield self._stamp(event)

    def _stamp(self, event: Any) -> Any:
        if self._lora_of is None or not isinstance(event, BlockStored) or not event.block_hashes:
            return event
        lora = self._lora_of(event.block_hashes[0])
        if lora is None:
            return event
        return msgspec.structs.replace(event, lora_id=lora[0], lora_name=lora[1])

"""The compressed tiers' blocks as vLLM KV cache events, the one path by which Dynamo's router hears of them.

- :class:`EventQueue` (worker) turns the store's stored/removed notifications into vLLM ``BlockStored`` /
  ``BlockRemoved`` events (medium ``CPU``), which vLLM's KV event stream carries to Dynamo's router; blocks that
  enter or leave a tier every worker of the cluster reads (:data:`SHARED_TIERS`: the ``pool``) are published once
  more, with medium ``EXTERNAL`` (Dynamo's ``External`` storage tier), so the router can tell "in this worker's host
  memory" from "in the cluster's pool" (docs/cluster.md: what Dynamo's router can and cannot do with them);
  :class:`EventCollector` (scheduler) aggregates the TP workers' batches of one step and stamps the LoRA adapter of
  the blocks that belong to a LoRA request (the worker's store knows hashes only; the scheduler knows the adapter),
  so Dynamo's router hashes them with the adapter's name as vLLM's own events do.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVConnectorKVEvents, KVEventAggregator

from ..tiers.keys import router_hash

MEDIUM = "CPU"  # the compressed tiers live in host memory (and on local disk behind it)
# Tiers whose blobs every worker of the cluster can restore, by the name they register under, and the medium their
# blocks are published with: "EXTERNAL" is the wire name of Dynamo's StorageTier::External (its router maps
# EXTERNAL / NETWORK / REMOTE / SHARED there, and drops an event whose medium it does not know). The events carry no
# ``locality``: Dynamo 1.6 drops events marked REMOTE (it has no shared index yet), so they stay this worker's.
SHARED_TIERS = frozenset({"pool"})
MEDIUM_SHARED = "EXTERNAL"
# Blocks whose tokens are kept for a later tier event (a write-through put lands shortly after the save), as 4-byte
# token ids: about 0.2 KB a block of 32 tokens with its entry, so a few MB at most.
REMEMBERED_BLOCKS = 1 << 15


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
        # block key -> (its tokens, its parent's key), for the blocks stored lately: a tier event names keys only
        self._tokens: OrderedDict[int, tuple[array, int | None]] = OrderedDict()
        self._shared: set[int] = set()  # block keys published as in a shared tier (not yet removed)
        self.unpublished = 0  # shared-tier blocks whose tokens were not known here (the router needs them)

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
        self._remember(hashes, token_ids, parent)

    def removed(self, hashes) -> None:
        self.events.append(BlockRemoved(block_hashes=[router_hash(h) for h in hashes], medium=MEDIUM))

    def stored_in(self, tier: str, hashes: Sequence[int]) -> None:
        """Blocks entered tier ``tier``: for a shared tier, BlockStored events (medium EXTERNAL), one per run of
        consecutive blocks whose tokens were stored here; blocks already published as in the tier are not again."""
        if tier not in SHARED_TIERS:
            return
        run: list[int] = []
        for h in hashes:
            known = self._tokens.get(h)
            if h in self._shared or known is None:
                self.unpublished += known is None and h not in self._shared
                self._publish_run(run)
                run = []
                continue
            if run and known[1] != run[-1]:
                self._publish_run(run)
                run = []
            run.append(h)
        self._publish_run(run)

    def removed_from(self, tier: str, hashes: Sequence[int]) -> None:
        """Blocks left tier ``tier``: for a shared tier, a BlockRemoved (medium EXTERNAL) of those published."""
        if tier not in SHARED_TIERS:
            return
        gone = [h for h in hashes if h in self._shared]
        if gone:
            self._shared.difference_update(gone)
            self.events.append(BlockRemoved(block_hashes=[router_hash(h) for h in gone], medium=MEDIUM_SHARED))

    def _publish_run(self, run: list[int]) -> None:
        if not run:
            return
        parent = self._tokens[run[0]][1]
        tokens = [t for h in run for t in self._tokens[h][0].tolist()]
        self._shared.update(run)
        self.events.append(
            BlockStored(
                block_hashes=[router_hash(h) for h in run],
                parent_block_hash=None if parent is None else router_hash(parent),
                token_ids=tokens,
                block_size=self.block_size,
                lora_id=None,
                medium=MEDIUM_SHARED,
                lora_name=None,
            )
        )

    def _remember(self, hashes, token_ids, parent) -> None:
        bs = self.block_size
        if len(token_ids) < bs * len(hashes):
            return  # stored without tokens (the vLLM kvtc tier's chunks): nothing to publish a tier event with
        prev = parent
        for i, h in enumerate(hashes):
            try:
                toks = array("I", token_ids[i * bs : (i + 1) * bs])
            except (OverflowError, TypeError):  # not token ids the router could hash either
                return
            self._tokens[h] = (toks, prev)
            self._tokens.move_to_end(h)
            prev = h
        while len(self._tokens) > REMEMBERED_BLOCKS:
            self._tokens.popitem(last=False)

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

"""Blocks in a tier every worker reads (a tier registered as ``pool``) reach Dynamo's router as ``EXTERNAL`` blocks.

A real store chains the host tier and a tier named ``pool`` (the tests' in-memory tier under that name: the event path
knows tiers by name only); the store's real offloads demote blobs into it and evict them out of it, and the connector's
:class:`EventQueue` turns those moves into vLLM ``BlockStored`` / ``BlockRemoved`` events, checked as vLLM's
``KVEventBatch`` wire bytes (what dynamo.vllm relays to the router) decode."""

from __future__ import annotations

import random

import msgspec
import pytest
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from dynamo_kvtc.connector.kv_events import MEDIUM, MEDIUM_SHARED, EventQueue
from dynamo_kvtc.tiers import KvtcStore
from dynamo_kvtc.tiers.config import TierConfig
from dynamo_kvtc.tiers.keys import block_hashes, chain, router_hash

from .conftest import offload_seq
from .tier_plugins import MemTier

BS = 16


class PoolMem(MemTier):
    """The tests' in-memory tier under the name the cluster pool registers with."""

    name = "pool"


def _store(cal, lower: type[MemTier], lower_bytes: int) -> tuple[KvtcStore, EventQueue]:
    cfg = TierConfig(host_bytes=48 * 1024, ratio=8, min_tokens=32, page_bytes=1024, window=32)
    store = KvtcStore(cal, cfg, block_size=BS, span_tokens=128)
    tier = lower(lower_bytes)
    store.placement.tiers.append(tier)  # host -> <lower>: the host tier's victims go there
    store.stats.tier(tier.name)
    q = EventQueue(BS)
    store.listeners.append(q)
    return store, q


def _wire(events: list) -> list:
    """The events as vLLM's KV event stream sends them (msgpack, array-like, tagged) and a subscriber decodes them."""
    payload = msgspec.msgpack.encode(KVEventBatch(ts=0.0, events=events))
    return msgspec.msgpack.Decoder(KVEventBatch).decode(payload).events


def _fill(store, synth, n_seqs: int) -> list[list[int]]:
    seqs = []
    for i in range(n_seqs):
        toks = [random.Random(i).randrange(1000) for _ in range(256)]
        k, v, _ = synth.sample(256)
        offload_seq(store, toks, k, v)
        seqs.append(toks)
    return seqs


def test_pool_blocks_are_published_external_with_their_tokens(synth, synth_cal):
    store, q = _store(synth_cal, PoolMem, 1 << 20)
    seqs = _fill(store, synth, 8)  # more than the host tier holds: its victims go to the pool
    pool = store.placement.tier("pool")
    assert len(pool) > 0 and len(store.host) > 0
    events = _wire(q.take().get_all_events())
    external = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM_SHARED]
    own = [e for e in events if isinstance(e, BlockStored) and e.medium == MEDIUM]
    assert own and external
    # every block of every blob the pool holds is published as in the pool, once, and nothing else is
    in_pool = {router_hash(h) for bid in pool.ids() for h in pool.meta(bid)["hashes"]}
    published = [h for e in external for h in e.block_hashes]
    assert sorted(published) == sorted(in_pool) and len(set(published)) == len(published)
    # none marks itself REMOTE (Dynamo 1.6 drops those) or names an owning tier it does not know
    assert all(e.locality is None and e.ownership is None for e in external)
    # each event's hashes are the router hashes of its own tokens' chained block keys, continuing its parent
    keys = {router_hash(k): k for toks in seqs for k in chain(block_hashes(toks, BS), None)}
    for e in external:
        assert len(e.token_ids) == BS * len(e.block_hashes) and e.block_size == BS
        parent = None if e.parent_block_hash is None else keys[e.parent_block_hash]
        assert [router_hash(k) for k in chain(block_hashes(e.token_ids, BS), parent)] == e.block_hashes


def test_pool_evictions_are_published_removed(synth, synth_cal):
    store, q = _store(synth_cal, PoolMem, 24 * 1024)  # a small pool: it evicts too
    _fill(store, synth, 10)
    pool = store.placement.tier("pool")
    assert store.stats.tier("pool").evictions > 0
    events = _wire(q.take().get_all_events())
    live: set[int] = set()
    for e in events:  # replayed in order, the pool's published blocks are exactly those it holds now
        if e.medium != MEDIUM_SHARED:
            continue
        if isinstance(e, BlockStored):
            assert not live & set(e.block_hashes)
            live |= set(e.block_hashes)
        else:
            assert isinstance(e, BlockRemoved) and set(e.block_hashes) <= live
            live -= set(e.block_hashes)
    assert live == {router_hash(h) for bid in pool.ids() for h in pool.meta(bid)["hashes"]}
    assert any(isinstance(e, BlockRemoved) and e.medium == MEDIUM_SHARED for e in events)


def test_a_tier_of_another_name_is_not_published_as_shared(synth, synth_cal):
    store, q = _store(synth_cal, MemTier, 1 << 20)
    _fill(store, synth, 8)
    assert len(store.placement.tier("mem")) > 0  # blobs did go down to it
    events = q.take().get_all_events()
    assert events and all(e.medium == MEDIUM for e in events)


def test_dropping_an_unusable_blob_unpublishes_its_pool_blocks(synth, synth_cal):
    store, q = _store(synth_cal, PoolMem, 1 << 20)
    _fill(store, synth, 8)
    pool = store.placement.tier("pool")
    victim = pool.ids()[0]
    hashes = pool.meta(victim)["hashes"]
    q.take()
    store.placement.drop(victim, ValueError("planted"))
    events = q.take().get_all_events()
    gone = [e for e in events if isinstance(e, BlockRemoved) and e.medium == MEDIUM_SHARED]
    assert [h for e in gone for h in e.block_hashes] == [router_hash(h) for h in hashes]


@pytest.mark.parametrize("tokens_known", [True, False])
def test_tier_events_need_the_blocks_tokens(tokens_known):
    """The router hashes a stored block's tokens; a pool block whose tokens this worker never saw is not published
    (counted) rather than published without them."""
    q = EventQueue(BS)
    toks = list(range(3 * BS))
    keys = chain(block_hashes(toks, BS), None)
    q.stored(keys, toks if tokens_known else [], None)
    q.take()
    q.stored_in("pool", keys)
    batch = q.take()
    if tokens_known:
        (e,) = batch.get_all_events()
        assert e.medium == MEDIUM_SHARED and e.token_ids == toks and e.parent_block_hash is None
        q.stored_in("pool", keys)  # already published: not again
        assert q.take() is None
    else:
        assert batch is None and q.unpublished == 3

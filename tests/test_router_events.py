"""Blocks in a tier every worker reads (a tier registered as ``pool``) reach Dynamo's router as ``EXTERNAL`` blocks.

A real store chains the host tier and a tier named ``pool`` (the tests' in-memory tier under that name: the event path
knows tiers by name only); the store's real offloads demote blobs into it and evict them out of it, and the connector's
:class:`EventQueue` turns those moves into vLLM ``BlockStored`` / ``BlockRemoved`` events, checked as vLLM's
``KVEventBatch`` wire bytes (what dynamo.vllm relays to the router) decode, and as Dynamo 1.6.1's own KV indexer
(``python -m dynamo.indexer``, subscribed to two workers' event streams) counts them."""

from __future__ import annotations

import importlib.util
import json
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable

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


# ------------------------------------------------------------------ what Dynamo 1.6.1's own indexer does with them
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Indexer:
    """Dynamo's standalone KV indexer (``python -m dynamo.indexer``, the router's indexer as a service) subscribed to
    the vLLM KV event streams of two workers, which this test publishes as vLLM's ZMQ publisher does."""

    def __init__(self, tmp_path) -> None:
        import zmq

        self.http = _free_port()
        self.ctx = zmq.Context()
        self.pubs, self.seq, workers = {}, {}, []
        for wid in (1, 2):
            port = _free_port()
            self.pubs[wid] = self.ctx.socket(zmq.PUB)
            self.pubs[wid].bind(f"tcp://127.0.0.1:{port}")
            self.seq[wid] = 0
            workers.append(f"{wid}=tcp://127.0.0.1:{port}")
        self.log = open(tmp_path / "indexer.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--block-size", str(BS), "--port", str(self.http),
             "--threads", "1", "--model-name", "m", "--workers", ",".join(workers)],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        end = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.http}/health", timeout=1)
                break
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < end, "dynamo.indexer did not start"
                time.sleep(0.2)
        time.sleep(1.0)  # the listeners' SUB sockets connect after the server is up

    def publish(self, wid: int, events: list) -> None:
        payload = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=events))
        self.pubs[wid].send_multipart([b"", self.seq[wid].to_bytes(8, "big"), payload])
        self.seq[wid] += 1

    def query(self, tokens: list[int]) -> dict:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.http}/query",
            data=json.dumps({"token_ids": tokens, "model_name": "m"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())["instances"]

    def settle(self, tokens: list[int], want: Callable[[dict], bool]) -> dict:
        end = time.monotonic() + 20
        while True:
            got = self.query(tokens)
            if want(got) or time.monotonic() > end:
                return got
            time.sleep(0.2)

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=20)
        self.log.close()
        for s in self.pubs.values():
            s.close(0)
        self.ctx.term()


@pytest.fixture
def indexer(tmp_path):
    if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.indexer") is None:
        pytest.skip("needs ai-dynamo 1.6.1 (its standalone KV indexer)")
    ix = _Indexer(tmp_path)
    yield ix
    ix.close()


def test_dynamo_indexer_counts_pool_blocks_for_the_worker_whose_stream_carries_them(indexer):
    """The router's own indexer (Dynamo 1.6.1): worker 1's host-tier blocks (CPU) count in its ``cpu`` column and its
    pool blocks (EXTERNAL) in its lower-tier column; the same pool events marked REMOTE on worker 2's stream are
    dropped; published on worker 2's stream as they are, they count for worker 2 too. So a block counts for exactly
    the workers whose event streams carry it (docs/cluster.md: what the router cannot express)."""
    toks = list(range(100, 100 + 6 * BS))
    keys = chain(block_hashes(toks, BS), None)
    q = EventQueue(BS)
    q.stored(keys[:4], toks[: 4 * BS], None)  # four blocks into this worker's host tier
    q.stored_in("pool", keys[:3])  # three of them reach the pool
    events = q.take().get_all_events()
    pooled = [e for e in events if e.medium == MEDIUM_SHARED]
    assert [h for e in pooled for h in e.block_hashes] == [router_hash(k) for k in keys[:3]]

    own = [e for e in events if e.medium == MEDIUM]
    # the indexer's per-worker summary: `cpu` = leading tokens in the host tier, `disk` = leading tokens in the host
    # tier or any tier below it (External included), `gpu` = on the device
    indexer.publish(1, pooled)
    indexer.publish(2, [msgspec.structs.replace(e, locality="REMOTE") for e in pooled])
    got = indexer.settle(toks, lambda g: g.get("1", {}).get("disk") == 3 * BS)
    assert got["1"]["disk"] == 3 * BS and got["1"]["cpu"] == 0 and got["1"]["gpu"] == 0  # EXTERNAL: a lower tier
    assert "2" not in got  # marked REMOTE: dropped by Dynamo 1.6.1

    indexer.publish(2, pooled)  # the pool's blocks on worker 2's own stream: they count for worker 2 too
    got = indexer.settle(toks, lambda g: g.get("2", {}).get("disk") == 3 * BS)
    assert got["2"]["disk"] == 3 * BS and got["2"]["cpu"] == 0

    indexer.publish(1, own)  # worker 1's host-tier blocks (CPU): its host tier column
    got = indexer.settle(toks, lambda g: g.get("1", {}).get("cpu") == 4 * BS)
    assert got["1"]["cpu"] == 4 * BS and got["2"]["cpu"] == 0

    indexer.publish(2, [BlockRemoved(block_hashes=[router_hash(keys[2])], medium=MEDIUM_SHARED)])
    got = indexer.settle(toks, lambda g: g.get("2", {}).get("disk") == 2 * BS)
    assert got["2"]["disk"] == 2 * BS  # a block leaving the pool leaves the worker's count


def test_pool_events_pass_the_scheduler_side_and_carry_the_adapter():
    """The scheduler's EventCollector hands the pool's events to vLLM's stream as it does the others: one event for
    the TP group when every worker reported it, stamped with the LoRA adapter of its request (the router hashes with
    the adapter's name)."""
    from dynamo_kvtc.connector.kv_events import EventCollector

    toks = list(range(7, 7 + 2 * BS))
    keys = chain(block_hashes(toks, BS), None)
    batches = []
    for _ in range(2):  # two TP workers, each with its own store and queue, saw the same blocks reach the pool
        q = EventQueue(BS)
        q.stored(keys, toks, None)
        q.stored_in("pool", keys)
        batches.append(q.take())
    col = EventCollector(lambda h: (3, "adapter-3") if h == router_hash(keys[0]) else None)
    col.add(type("Out", (), {"kv_cache_events": batches[0]})())
    col.add(type("Out", (), {"kv_cache_events": batches[1]})())
    events = list(col.take())
    pooled = [e for e in events if e.medium == MEDIUM_SHARED]
    assert len(pooled) == 1 and pooled[0].block_hashes == [router_hash(k) for k in keys]
    assert (pooled[0].lora_id, pooled[0].lora_name) == (3, "adapter-3")

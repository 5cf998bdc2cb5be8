"""The pool tier (tiers/pool.py) on a real Mooncake master (tests/mooncake_fixture.py) through real stores: any worker
restores any conversation, bit-exact; sealed (a store without the secret reads nothing and plants nothing; forged or
corrupted objects are refused); a master that stops mid-run costs misses, and the tier works again once it is back;
a write-through queue over its budget skips and counts."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from dynamo_kvtc.errors import ConfigError, TierError, TierFullError
from dynamo_kvtc.reliability.pool_faults import Ticker
from dynamo_kvtc.tiers import KvtcStore, TierConfig
from dynamo_kvtc.tiers.blobs import BlobMeta
from dynamo_kvtc.tiers.registry import build_chain

from .conftest import offload_seq
from .test_tiers import BS, Collect, _tokens

pytest.importorskip("mooncake")
from .mooncake_fixture import mooncake_master  # noqa: E402,F401  (the fixture)

SECRET = b"cluster secret for the pool tests"


def _cfg(m=None, **kw):
    kw.setdefault("pool_secret", SECRET)
    kw.setdefault("pool_timeout_s", 5.0)
    return TierConfig(host_bytes=1 << 20, ratio=8, min_tokens=32, page_bytes=1024, window=32,
                      pool_master=None if m is None else m.master, pool_metadata_server=None if m is None else
                      m.metadata_server, pool_segment_gb=0.0625, **kw)  # fmt: skip


def _store(cal, m, **kw) -> KvtcStore:
    store = KvtcStore(cal, _cfg(m, **kw), block_size=BS, span_tokens=128)
    assert [t.name for t in store.tiers] == ["host", "pool"]
    assert _pool(store).wait_idle(120), "the pool tier did not connect"
    return store


def _pool(store):
    return store.placement.tier("pool")


async def _restore(store, toks, k):
    n = len(toks) // BS
    sink = Collect(k.shape[0], n * BS, *k.shape[2:])
    h = store.start_onboard(store.hashes(toks)[:n], sink=sink)
    assert await h.done()
    return sink


def test_pool_without_a_secret_refuses_to_start():
    cfg = TierConfig(host_bytes=1 << 20, page_bytes=1024, pool_master="127.0.0.1:1")
    with pytest.raises(ConfigError, match="transfer_secret_file") as e:
        build_chain(cfg)
    assert "pool_insecure" in str(e.value)
    assert [t.name for t in build_chain(TierConfig(host_bytes=1 << 20, page_bytes=1024))] == ["host"]


async def test_any_worker_restores_any_conversation_sealed(mooncake_master, synth, synth_cal):  # noqa: F811
    a = _store(synth_cal, mooncake_master)
    toks = _tokens(400, 11)
    k, v, _ = synth.sample(400)
    res = offload_seq(a, toks, k, v)
    assert res.stored_blocks == 400 // BS
    assert _pool(a).wait_idle(60) and _pool(a).counts["put"] == len(res.blobs)
    mine = await _restore(a, toks, k)
    written = {b: a.placement.fetch(b) for b in a.index.blob_ids()}

    b = _store(synth_cal, mooncake_master)  # another worker: never saw the conversation
    hashes = b.hashes(toks)
    assert b.match(hashes) == 400 // BS and all(b.where(h) == "pool" for h in hashes[: 400 // BS])
    theirs = await _restore(b, toks, k)
    assert torch.equal(theirs.k, mine.k) and torch.equal(theirs.v, mine.v)  # the same blobs, restored
    assert b.snapshot()["onboard_pool_hits"] == len(written)
    deadline = time.monotonic() + 20  # promoted into the host tier once every part landed, off the restore's path
    while not all(b.where(h) == "host" for h in hashes[:3]) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert all(b.where(h) == "host" for h in hashes[:3])
    assert {x: b.placement.fetch(x) for x in written} == written  # bit-exact: the blobs A wrote

    # a worker without the secret (explicitly insecure) reads nothing, and what it plants is refused
    c = _store(synth_cal, mooncake_master, pool_secret=None, pool_insecure=True)
    assert c.match(hashes) == 0 and _pool(c).counts["refused"] >= 1
    toks2 = _tokens(256, 12)
    k2, v2, _ = synth.sample(256)
    offload_seq(c, toks2, k2, v2)
    assert _pool(c).wait_idle(60) and _pool(c).counts["put"] >= 1
    refused = _pool(b).counts["refused"]
    assert b.match(b.hashes(toks2)) == 0 and _pool(b).counts["refused"] == refused + 1
    for s in (a, b, c):
        s.close()


async def test_forged_and_corrupted_objects_are_misses(mooncake_master, synth, synth_cal):  # noqa: F811
    a = _store(synth_cal, mooncake_master)
    toks = _tokens(128, 21)
    k, v, _ = synth.sample(128)
    offload_seq(a, toks, k, v)
    assert _pool(a).wait_idle(60) and len(a.index.blob_ids()) == 2  # the coded span, then the raw window
    pool, (blob_id, _) = _pool(a), a.index.locate(a.hashes(toks)[0])  # the first: a restore's layer 0 needs it
    client = pool._client
    obj = client.get(pool.object_key(blob_id))
    bad = bytearray(obj)
    bad[len(bad) // 2] ^= 1
    assert client.remove(pool.object_key(blob_id), True) == 0 and client.put(pool.object_key(blob_id), bytes(bad)) == 0

    b = _store(synth_cal, mooncake_master)
    hashes = b.hashes(toks)
    assert b.match(hashes) == 128 // BS  # the locator opens; the blob itself does not
    h = b.start_onboard(hashes, sink=Collect(k.shape[0], 128, *k.shape[2:]))
    with pytest.raises(TierError):
        h.wait_layer(0, timeout=30)
    assert _pool(b).counts["refused"] == 1 and b.match(hashes) == 0  # dropped: the next turn recomputes

    # a forged locator (the right key, bytes not sealed with the secret) for another sequence: refused
    toks3 = _tokens(128, 22)
    h3 = b.hashes(toks3)
    assert client.put(pool._at(h3[0]), os.urandom(300)) == 0
    assert b.match(h3) == 0 and _pool(b).counts["refused"] == 2
    a.close()
    b.close()


async def test_master_stopped_mid_run_costs_misses_then_the_tier_reconnects(mooncake_master, synth, synth_cal):  # noqa: F811
    a = _store(synth_cal, mooncake_master)
    toks = _tokens(128, 31)
    k, v, _ = synth.sample(128)
    offload_seq(a, toks, k, v)
    assert _pool(a).wait_idle(60)
    mooncake_master.stop()
    b = KvtcStore(synth_cal, _cfg(mooncake_master), block_size=BS, span_tokens=128)  # starts with no master
    t = time.monotonic()
    assert b.match(b.hashes(toks)) == 0 and not _pool(b).connected  # a miss, at once
    assert time.monotonic() - t < 10
    toks2 = _tokens(128, 32)
    assert a.match(a.hashes(toks2)) == 0  # the connected client's lookup fails: a miss, no exception
    offload_seq(a, toks2, *synth.sample(128)[:2])  # saves still work (host); the pool put fails or is skipped
    assert a.match(a.hashes(toks2)) == 128 // BS
    mooncake_master.start()
    assert _pool(b).wait_idle(150), "the pool tier did not reconnect"
    deadline = time.monotonic() + 150
    while not _pool(a).connected and time.monotonic() < deadline:
        a.match(a.hashes(_tokens(128, 33)))  # lookups find the lost connection; the writer reconnects
        time.sleep(0.5)
    assert _pool(a).connected
    toks4 = _tokens(128, 34)
    k4, v4, _ = synth.sample(128)
    offload_seq(a, toks4, k4, v4)
    assert _pool(a).wait_idle(60)
    got = b.match(b.hashes(toks4))
    assert got == 128 // BS, (dict(_pool(a).counts), dict(_pool(b).counts))  # the restarted master has what came since
    sink = await _restore(b, toks4, k4)
    assert torch.equal(sink.k, (await _restore(a, toks4, k4)).k)
    a.close()
    b.close()


async def test_the_first_lookup_and_read_after_a_master_kill_keep_the_deadline(mooncake_master, synth, synth_cal):  # noqa: F811
    """Right after a SIGKILL of the master, the first lookup (discover: batch_is_exist) and the first read of a blob
    through a connected client each return within pool_timeout_s + 100 ms, and no thread of the process stops for
    longer meanwhile, nor in the seconds after (a ticking thread, which native code holding the GIL stops). Closing a
    Mooncake client holds the GIL while its destructor joins its ping thread and retries the unmount against the dead
    master (7-13 s measured): the tier lost 6.5 s on its first lookup after a kill while it closed the lost client.
    It keeps the client instead, and reuses it once Mooncake's own pings find the master again."""
    timeout = 1.0
    a = _store(synth_cal, mooncake_master, pool_timeout_s=timeout)
    toks = _tokens(128, 51)
    k, v, _ = synth.sample(128)
    offload_seq(a, toks, k, v)
    assert _pool(a).wait_idle(60)
    b = _store(synth_cal, mooncake_master, pool_timeout_s=timeout)
    hashes = b.hashes(toks)[: 128 // BS]
    assert b.match(hashes) == 128 // BS and b.where(hashes[0]) == "pool"  # discovered; no blob read yet
    client = _pool(b)._client
    with Ticker() as tick:
        mooncake_master.stop()  # SIGKILL
        t = time.monotonic()
        assert b.match(b.hashes(_tokens(128, 52))) == 0  # the first lookup: a miss
        lookup = time.monotonic() - t
        t = time.monotonic()
        h = b.start_onboard(hashes, sink=Collect(k.shape[0], 128, *k.shape[2:]))
        with pytest.raises(TierError):  # the first read: a miss, the engine recomputes
            h.wait_layer(0, timeout=30)
        read = time.monotonic() - t
        time.sleep(3 * timeout)  # a stall after the calls returned (a lost client torn down meanwhile) counts too
    bound = timeout + 0.1
    assert lookup < bound and read < bound and tick.worst < bound, (lookup, read, tick.worst, dict(_pool(b).counts))
    mooncake_master.start()  # the same client serves again once Mooncake's pings find the restarted master
    deadline = time.monotonic() + 60
    while not (_pool(a).connected and _pool(b).connected) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _pool(b)._client is client
    toks2 = _tokens(128, 53)
    k2, v2, _ = synth.sample(128)
    offload_seq(a, toks2, k2, v2)
    assert _pool(a).wait_idle(60) and b.match(b.hashes(toks2)) == 128 // BS, dict(_pool(a).counts)
    a.close()
    b.close()


def test_lookups_to_a_frozen_master_give_up_at_the_deadline_without_queueing(mooncake_master, synth_cal):  # noqa: F811
    """A frozen master (SIGSTOP) holds each call ~30 s: the tier's readers fill up with hung calls and every later
    lookup gives up within pool_timeout_s (counted ``busy``) instead of queueing behind them; the pool serves again
    once the master continues."""
    from dynamo_kvtc.tiers.pool import READERS

    timeout = 0.5
    store = _store(synth_cal, mooncake_master, pool_timeout_s=timeout)
    pool = _pool(store)
    pool.bind(synth_cal.id, BS)
    os.killpg(mooncake_master.proc.pid, signal.SIGSTOP)
    try:
        took = []
        for i in range(READERS + 2):
            t = time.monotonic()
            assert pool.discover([1000 + i], BS) == []
            took.append(time.monotonic() - t)
        assert max(took) < timeout + 0.1, took
        assert (pool.counts["timeout"], pool.counts["busy"]) == (READERS, 2), dict(pool.counts)
    finally:
        os.killpg(mooncake_master.proc.pid, signal.SIGCONT)

    def answered() -> bool:  # a lookup that neither timed out nor found the readers busy
        failed = sum(pool.counts[k] for k in ("timeout", "busy", "unreachable"))
        pool.discover([2000], BS)
        return sum(pool.counts[k] for k in ("timeout", "busy", "unreachable")) == failed

    deadline = time.monotonic() + 60
    while not answered() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert answered(), dict(pool.counts)
    store.close()


def test_write_through_over_budget_is_skipped_and_counted(mooncake_master, synth_cal):  # noqa: F811
    store = _store(synth_cal, mooncake_master, pool_queue_mb=1)
    pool = _pool(store)
    blobs = [os.urandom(600 << 10) for _ in range(3)]
    metas = [BlobMeta(f"{i:032x}", [i + 1], BS, 0, None, synth_cal.id, 1, len(b)) for i, b in enumerate(blobs)]
    with pool._lock:  # the writer cannot take anything off the queue meanwhile
        store.placement.put(metas[0], blobs[0])  # queued
        store.placement.put(metas[1], blobs[1])  # over 1 MB: skipped
        with pytest.raises(TierFullError):
            pool.put(metas[2].id, blobs[2], metas[2].to_dict())
    assert store.stats.tier("pool").skipped == 1 and pool.counts["skipped"] == 2
    assert store.snapshot()["pool_skipped"] == 1
    assert pool.wait_idle(60) and pool.counts["put"] == 1
    store.close()


class _TierEvents:
    """A router-events listener: what the index tells it about tiers (connector/kv_events.py has the same methods)."""

    def __init__(self):
        self.seen = []

    def stored_in(self, tier, hashes):
        self.seen.append(("stored", tier, list(hashes)))

    def removed_from(self, tier, hashes):
        self.seen.append(("removed", tier, list(hashes)))


def test_write_through_is_told_to_the_router_and_the_known_blobs_are_bounded(mooncake_master, synth, synth_cal):  # noqa: F811
    store = _store(synth_cal, mooncake_master)
    pool, events = _pool(store), _TierEvents()
    store.index.listeners.append(events)
    pool.entries_kept = 2
    for seed in (41, 42):
        toks = _tokens(128, seed)
        offload_seq(store, toks, *synth.sample(128)[:2])
    assert pool.wait_idle(60)
    first = store.hashes(_tokens(128, 41))[: 128 // BS]
    stored = [h for what, tier, hs in events.seen if what == "stored" and tier == "pool" for h in hs]
    removed = [h for what, tier, hs in events.seen if what == "removed" and tier == "pool" for h in hs]
    assert set(first) <= set(stored) and len(pool._entries) == 2  # 4 blobs written through, the 2 oldest forgotten
    assert set(removed) == set(first) and store.match(first) == 128 // BS  # still in the host tier: still a hit
    store.close()


def test_both_ways_in_configure_the_pool_by_settings_alone(tmp_path, monkeypatch):
    """KvtcConnector's extra config (and the environment) and the vLLM kvtc tier's options set the pool tier's rows;
    the cluster secret comes from the hand-off's rows and seals it."""
    from dynamo_kvtc.connector.config import ConnectorConfig
    from dynamo_kvtc.connector.offloading.options import KvtcTierOptions
    from dynamo_kvtc.connector.offloading.storage import pool_settings

    secret = tmp_path / "secret"
    secret.write_bytes(SECRET + b"\n")
    env = {"DYN_KVTC_TRANSFER_SECRET_FILE": str(secret)}
    cfg = ConnectorConfig.from_sources({"pool_master": "10.0.0.5:50051", "pool_replicas": 2}, env=env).tiers
    assert (cfg.pool_master, cfg.pool_replicas, cfg.pool_secret) == ("10.0.0.5:50051", 2, SECRET)
    assert ConnectorConfig.from_sources({}, env=env).tiers.pool_master is None
    opts = KvtcTierOptions.from_config({"pool_master": "10.0.0.5:50051", "pool_timeout_s": 0.5})
    monkeypatch.setenv("DYN_KVTC_TRANSFER_SECRET_FILE", str(secret))
    kw = pool_settings(opts)
    assert kw["pool_master"] == "10.0.0.5:50051" and kw["pool_timeout_s"] == 0.5 and kw["pool_secret"] == SECRET
    assert pool_settings(KvtcTierOptions.from_config({})) == {}

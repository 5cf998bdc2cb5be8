"""The pool tier restores layer group by layer group (tiers/pool.py, tiers/pool_parts.py), on a real Mooncake master
(tests/mooncake_fixture.py) with a four-group calibration of the synthetic model:

- a blob's groups are sealed as separate parts of one object; another worker's read is an ArrivingView with one
  range per group, landing in order, bit-exact, and
  its restore equals the writer's; the hit is promoted into the reader's host tier once it landed;
- a part tampered with (bytes written over the object with the raw client) fails the read after the parts before it
  landed, fails the restore (a miss), counts ``refused`` and is never promoted; swapped parts, a part cut short and a
  dropped last part are refused;
- a worker with a WRONG secret opens nothing another wrote (locators and parts), and what it plants is refused;
- sealing in parts binds each part's index and count and the blob's keys (swapped, dropped or moved parts fail);
- the readers take every blob's part 0 before any blob's part 1 (a restore of many blobs gets its first layer
  group first), every part waiting at the lowest index in one call, one call in flight at a time until it stalls;
  one call reads ranges of several objects on a real master (a missing one is NOT_FOUND alone).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from dynamo_kvtc import calibrate
from dynamo_kvtc.codec.container import group_ends
from dynamo_kvtc.errors import TierError, TransferError
from dynamo_kvtc.tiers import KvtcStore
from dynamo_kvtc.tiers.blobs import BlobMeta
from dynamo_kvtc.tiers.pool_parts import NOT_FOUND, Fetched, Landing, PartJob, PartQueue, Parts
from dynamo_kvtc.tiers.seal import Sealer, SealError, associated
from dynamo_kvtc.transport.arriving import ArrivingView

from .conftest import offload_seq
from .test_pool_tier import SECRET, _cfg, _pool, _restore
from .test_tiers import BS, Collect, _tokens

pytest.importorskip("mooncake")
from .mooncake_fixture import mooncake_master  # noqa: E402,F401  (the fixture)

GROUPS = 4


@pytest.fixture(scope="module")
def cal4(synth):
    samples = [synth.sample(512, start=i * 37) for i in range(6)]
    cal = calibrate(samples, synth.fp, ratios=(8, 16), layer_groups=GROUPS, dp_tokens=2048, progress=False, seed=0)
    assert cal.layer_groups == GROUPS
    return cal


def _store(cal, m, **kw) -> KvtcStore:
    store = KvtcStore(cal, _cfg(m, **kw), block_size=BS, span_tokens=128)
    assert _pool(store).wait_idle(120), "the pool tier did not connect"
    return store


def _written(a, synth, n=400, seed=51):
    """Store A saves a conversation (written through to the pool): tokens, K, its restore, its blobs' bytes."""
    toks = _tokens(n, seed)
    k, v, _ = synth.sample(n)
    offload_seq(a, toks, k, v)
    assert _pool(a).wait_idle(60)
    return toks, k, {b: a.placement.fetch(b) for b in a.index.blob_ids()}


def _first_blob(store, toks):
    return store.index.locate(store.hashes(toks)[0])[0]


def _wait(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def _rewrite(client, key, obj):
    assert client.remove(key, True) == 0 and client.put(key, bytes(obj)) == 0


async def test_a_blob_streams_group_by_group_in_order_and_restores_exactly(mooncake_master, synth, cal4):  # noqa: F811
    a = _store(cal4, mooncake_master)
    toks, k, blobs = _written(a, synth)
    mine = await _restore(a, toks, k)
    b = _store(cal4, mooncake_master)
    hashes = b.hashes(toks)
    n = len(toks) // BS
    assert b.match(hashes) == n and all(b.where(h) == "pool" for h in hashes[:n])
    pool = _pool(b)
    for blob_id, data in blobs.items():  # each blob: one sealed part per layer group, landing in order
        ends = group_ends(data)
        assert ends is not None and len(ends) == GROUPS
        assert list(pool.parts(blob_id).plain) == ends and _pool(a).parts(blob_id) == pool.parts(blob_id)
        view = pool.read(blob_id)
        assert isinstance(view, ArrivingView) and view.ends == tuple(ends) and len(view) == len(data)
        assert view.tobytes() == data  # bit-exact
        arrival = view.arrival
        assert arrival.finished.wait(10) and arrival.error is None
        landed = arrival.landed_s
        assert all(t is not None for t in landed) and landed == sorted(landed) and landed[0] < landed[-1]
    assert pool.counts["hit"] == len(blobs) and pool.counts["refused"] == 0

    views = [pool.read(x) for x in blobs]  # several blobs at once
    assert [x.tobytes() for x in views] == list(blobs.values())

    theirs = await _restore(b, toks, k)  # through the store: arriving views, promoted once landed
    assert torch.equal(theirs.k, mine.k) and torch.equal(theirs.v, mine.v)
    assert b.snapshot()["onboard_pool_hits"] == len(blobs)
    assert _wait(lambda: all(b.where(h) == "host" for h in hashes[:n])), "the pool hits were not promoted"
    assert {x: b.placement.first.copy(x) for x in blobs} == blobs  # the host tier holds exactly what A wrote
    a.close()
    b.close()


async def test_a_tampered_part_is_a_miss_counted_refused_and_never_promoted(mooncake_master, synth, cal4):  # noqa: F811
    a = _store(cal4, mooncake_master)
    toks, k, blobs = _written(a, synth, n=256, seed=52)
    blob_id, pa = _first_blob(a, toks), _pool(a)
    client, key, parts = pa._client, pa.object_key(_first_blob(a, toks)), pa.parts(blob_id)
    obj = bytearray(client.get(key))
    assert len(obj) == parts.sealed[-1] and len(parts.sealed) == GROUPS
    obj[parts.sealed[1] + 40] ^= 0x10  # a byte of part 2 (layer group 2)
    _rewrite(client, key, obj)

    c = _store(cal4, mooncake_master)  # a direct read: parts 0 and 1 land, part 2 fails the arrival
    hashes = c.hashes(toks)
    assert c.match(hashes) == len(toks) // BS
    view = _pool(c).read(blob_id)
    view.wait_for(parts.plain[1])
    assert bytes(view.host_view()[: parts.plain[1]]) == blobs[blob_id][: parts.plain[1]]
    with pytest.raises(TransferError):
        view.tobytes()
    assert view.arrival.landed_s[2] is None and view.arrival.landed_s[3] is None
    assert _pool(c).counts["refused"] == 1 and blob_id not in _pool(c)

    b = _store(cal4, mooncake_master)  # a restore through the store: a miss, dropped, not promoted
    assert b.match(hashes) == len(toks) // BS
    h = b.start_onboard(hashes, sink=Collect(k.shape[0], len(toks), *k.shape[2:]))
    with pytest.raises(TierError):
        h.wait_layer(0, timeout=30)
    assert _pool(b).counts["refused"] == 1 and b.match(hashes) == 0  # the next turn recomputes
    time.sleep(0.5)
    assert blob_id not in b.placement.first and not b.index.has_blob(blob_id) and b.where(hashes[0]) is None
    assert b.stats.blobs_dropped == 1  # once, though both the read's listener and the restore saw it fail
    for s in (a, b, c):
        s.close()


@pytest.mark.parametrize("how", ["swapped", "cut short", "last part dropped"])
async def test_swapped_or_truncated_parts_are_refused(mooncake_master, synth, cal4, how):  # noqa: F811
    a = _store(cal4, mooncake_master)
    toks, k, blobs = _written(a, synth, n=256, seed=53)
    blob_id, pa = _first_blob(a, toks), _pool(a)
    client, key, s = pa._client, pa.object_key(blob_id), pa.parts(blob_id).sealed
    obj = client.get(key)
    if how == "swapped":  # parts 0 and 1 traded places (each still a valid sealed message)
        bad = obj[s[0] : s[1]] + obj[: s[0]] + obj[s[1] :]
    elif how == "cut short":
        bad = obj[: s[-1] - 7]
    else:
        bad = obj[: s[-2]]
    _rewrite(client, key, bad)
    b = _store(cal4, mooncake_master)
    hashes = b.hashes(toks)
    assert b.match(hashes) == len(toks) // BS
    h = b.start_onboard(hashes, sink=Collect(k.shape[0], len(toks), *k.shape[2:]))
    with pytest.raises(TierError):
        h.wait_layer(0, timeout=30)
    assert _pool(b).counts["refused"] == 1 and b.match(hashes) == 0
    assert not b.index.has_blob(blob_id) and blob_id not in b.placement.first
    a.close()
    b.close()


async def test_a_wrong_secret_opens_nothing_and_plants_nothing(mooncake_master, synth, cal4):  # noqa: F811
    a = _store(cal4, mooncake_master)
    toks, k, blobs = _written(a, synth, n=256, seed=54)
    w = _store(cal4, mooncake_master, pool_secret=b"not the cluster's secret, but one")
    assert w.match(w.hashes(toks)) == 0 and _pool(w).counts["refused"] >= 1  # A's locators do not open
    blob_id = _first_blob(a, toks)  # nor do A's parts, were the locator known: the worker is handed it
    pw, parts = _pool(w), _pool(a).parts(blob_id)
    with pw._lock:
        pw._entries[blob_id] = a.index.meta(blob_id).to_dict()
        pw._parts[blob_id] = parts
    view = pw.read(blob_id)
    with pytest.raises(TransferError):
        view.wait_for(1)
    assert view.arrival.landed_s[0] is None and pw.counts["refused"] >= 2

    toks2 = _tokens(256, 55)  # what it plants (under the right keys) is refused by a worker with the secret
    offload_seq(w, toks2, *synth.sample(256)[:2])
    assert _pool(w).wait_idle(60) and _pool(w).counts["put"] >= 1
    b = _store(cal4, mooncake_master)
    assert b.match(b.hashes(toks2)) == 0 and _pool(b).counts["refused"] == 1
    assert b.match(b.hashes(toks)) == len(toks) // BS  # A's, for the right secret
    for s in (a, w, b):
        s.close()


def test_a_blob_on_the_write_through_queue_is_read_plain(mooncake_master, cal4):  # noqa: F811
    store = _store(cal4, mooncake_master)
    pool = _pool(store)
    meta = BlobMeta("ab" * 16, [7], BS, 0, None, cal4.id, 1, 1000)
    with pool._lock:  # the writer cannot take it off the queue meanwhile
        store.placement.put(meta, b"x" * 1000)
        view = pool.read(meta.id)
        assert view is not None and not view.arriving and view.tobytes() == b"x" * 1000
    store.close()


def test_one_call_reads_ranges_of_several_objects(mooncake_master, cal4):  # noqa: F811
    """Landing.read on a real master: ranges of several objects (one asked for twice, one missing) land back to back
    in ONE call; the missing one reads NOT_FOUND, every other its bytes."""
    store = _store(cal4, mooncake_master)
    client = _pool(store)._client
    objs = {f"test/landing/{i}": os.urandom(n) for i, n in enumerate((3000, 70000, 1 << 20))}
    for key, obj in objs.items():
        assert client.put(key, obj) == 0
    ranges = [("test/landing/0", 0, 3000), ("test/landing/2", 4096, 500000), ("test/landing/gone", 0, 100),
              ("test/landing/1", 10, 69990), ("test/landing/2", 0, 10)]  # fmt: skip
    landing = Landing(client, sum(n for _, _, n in ranges))
    assert landing.register(client) == 0
    got = landing.read(client, ranges)
    assert got == [3000, 500000, NOT_FOUND, 69990, 10]
    at = 0
    for (key, offset, n), g in zip(ranges, got):
        if g > 0:
            assert bytes(landing.view(at, n)) == objs[key][offset : offset + n]
        at += n
    landing.drop()
    store.close()


def test_parts_are_bound_to_their_index_count_and_blob():
    sealer = Sealer(SECRET)
    data = bytes(range(256)) * 40
    ends = [1000, 4000, 10240]
    aad = associated("blob", "cal", "-", [1, 2, 3])
    obj, sealed = sealer.seal_parts(data, ends, aad)
    assert len(obj) == sealed[-1] and [b - a for a, b in zip([0, *sealed], sealed)] == [
        b - a + sealer.overhead() for a, b in zip([0, *ends], ends)
    ]
    part = [obj[a:b] for a, b in zip([0, *sealed], sealed)]
    assert b"".join(sealer.open_part(p, aad, i, 3) for i, p in enumerate(part)) == data
    with pytest.raises(SealError):
        sealer.open_part(part[1], aad, 0, 3)  # moved to another index
    with pytest.raises(SealError):
        sealer.open_part(part[1], aad, 1, 2)  # a part dropped (the count changes)
    with pytest.raises(SealError):
        sealer.open_part(part[0], associated("blob", "cal", "-", [1, 2, 4]), 0, 3)  # another blob's keys
    with pytest.raises(SealError):
        Sealer(b"another secret").open_part(part[0], aad, 0, 3)
    with pytest.raises(ValueError):
        sealer.seal_parts(data, [1000, 900, 10240], aad)


def test_readers_take_every_first_part_before_any_second():
    """One reader, three blobs of three parts asked for while its first call is held: every part waiting at the lowest
    index goes in ONE call (several objects in flight together), part index first."""
    import threading

    calls, go, done = [], threading.Event(), threading.Event()

    def fetch(batch):
        go.wait(10)
        calls.append([(job.blob_id, k) for job, k in batch])
        return Fetched(None, [])

    def land(batch, fetched):
        if sum(map(len, calls)) == 9:
            done.set()
        return [True] * len(batch)

    readers = PartQueue(fetch, land, 1, "test-part")
    parts = Parts.whole([10, 20, 30], [2, 4, 6])
    for name in "abc":
        readers.submit(PartJob(name, name, b"", parts, None, None))
    go.set()
    assert done.wait(10)
    readers.close()
    assert calls[0][0] == ("a", 0) and sorted(p for c in calls[:-2] for p in c) == [("a", 0), ("b", 0), ("c", 0)]
    assert calls[-2:] == [[("a", 1), ("b", 1), ("c", 1)], [("a", 2), ("b", 2), ("c", 2)]]  # "a" 0 may go alone
    with pytest.raises(TierError):
        readers.submit(PartJob("d", "d", b"", parts, None, None))


def test_one_call_in_flight_until_it_stalls():
    """Four readers make one call at a time (the others wait for the lane, or land what the last call brought), until
    a call is still in flight after ``stall_s``: then the next starts beside it (one dead segment does not hold every
    read back for the whole deadline)."""
    import threading

    lock, flying, most, fetched = threading.Lock(), [0], [0], []
    release, stuck_in, both = threading.Event(), threading.Event(), threading.Event()

    def fetch(batch):
        with lock:
            flying[0] += 1
            most[0] = max(most[0], flying[0])
            fetched.extend((job.blob_id, k) for job, k in batch)
            if flying[0] == 2:
                both.set()
        if batch[0][0].blob_id == "stuck":
            stuck_in.set()
            release.wait(20)
        with lock:
            flying[0] -= 1
        return Fetched(None, [])

    parts = Parts.whole([10, 20, 30], [2, 4, 6])
    readers = PartQueue(fetch, lambda batch, f: [True] * len(batch), 4, "test-lane", stall_s=30.0)
    for i in range(40):
        readers.submit(PartJob(f"b{i}", f"b{i}", b"", parts, None, None))
    deadline = time.monotonic() + 20
    while len(fetched) < 120 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(fetched) == 120 and most[0] == 1  # 40 blobs x 3 parts, never two calls side by side
    readers.close()

    readers = PartQueue(fetch, lambda batch, f: [True] * len(batch), 4, "test-stall", stall_s=0.2)
    readers.submit(PartJob("stuck", "stuck", b"", parts, None, None))
    assert stuck_in.wait(10)
    readers.submit(PartJob("next", "next", b"", parts, None, None))
    assert both.wait(10) and not release.is_set() and ("next", 0) in fetched  # beside the stalled call
    release.set()
    readers.close()

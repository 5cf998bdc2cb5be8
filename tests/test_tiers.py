"""Compressed tiers: block keys, host allocator, disk through real NIXL (POSIX), the store's offload/onboard paths,
restart recovery, layer order, concurrency and faults."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess

import pytest
import torch

from dynamo_kvtc import KvtcCodec
from dynamo_kvtc.codec.blob import BlobView
from dynamo_kvtc.errors import ConfigError, TierError, TierFullError
from dynamo_kvtc.tiers import (
    DiskTier,
    HostTier,
    KvtcStore,
    OffloadFilter,
    PagedKV,
    RatioPolicy,
    TierConfig,
    block_hashes,
    sequence_hashes,
    to_signed,
)
from dynamo_kvtc.tiers.keys import router_hash
from dynamo_kvtc.transport.nixl_io import NixlFiles

from .conftest import offload_seq
from .tier_plugins import MemTier

BS = 16


# ---------------------------------------------------------------------------------------------- keys
def test_block_keys_are_128_bit_and_router_hashes_64():
    toks = [random.Random(0).randrange(50000) for _ in range(16 * 9 + 5)]
    ours = block_hashes(toks, 16)
    assert len(ours) == 9  # the partial tail block has no hash
    assert all(0 <= h < 1 << 128 for h in ours) and any(h >= 1 << 64 for h in ours)
    keys = sequence_hashes(toks, 16)
    assert all(0 <= router_hash(h) < 1 << 64 for h in keys) and len({router_hash(h) for h in keys}) == 9


def test_sequence_hashes_chain_the_prefix():
    a = sequence_hashes(list(range(64)), 16)
    b = sequence_hashes(list(range(48)) + [7] * 16, 16)
    c = sequence_hashes([9] + list(range(1, 64)), 16)
    assert a[:3] == b[:3] and a[3] != b[3]
    assert all(x != y for x, y in zip(a, c))  # a changed first block changes every later key
    assert to_signed(2**64 - 1) == -1 and to_signed(5) == 5


# ---------------------------------------------------------------------------------------------- host tier
def test_host_tier_lru_and_no_fragmentation_collapse():
    host = HostTier(64 * 1024, page_bytes=1024, pinned=False)
    rng = random.Random(1)
    stored: dict[str, bytes] = {}
    for i in range(2000):
        data = os.urandom(rng.randrange(1, 9000))
        for old_id, old, _ in host.put(f"b{i}", data):
            assert stored.pop(old_id) == old  # evicted bytes are intact, oldest first
        stored[f"b{i}"] = data
        assert host.used_bytes == sum(len(x) for x in stored.values()) <= host.capacity
    for k, v in stored.items():
        assert host.copy(k) == v
    with pytest.raises(TierFullError):
        host.put("huge", b"x" * (host.capacity + 1))


def test_host_tier_large_blobs_copied_without_the_gil_are_exact():
    """Blobs of >= GIL_FREE_COPY bytes are copied into the arena by torch (GIL released): read-only bytes, a
    memoryview of a larger buffer, and a blob split over two free runs all read back byte for byte."""
    from dynamo_kvtc.tiers.host import GIL_FREE_COPY

    page = 64 * 1024
    host = HostTier(8 * GIL_FREE_COPY, page_bytes=page, pinned=False)
    a = os.urandom(3 * GIL_FREE_COPY + 123)
    big = bytearray(os.urandom(4 * GIL_FREE_COPY))
    b = memoryview(big)[17 : 17 + 2 * GIL_FREE_COPY]
    host.put("a", a)
    host.put("b", b)
    assert host.copy("a") == a and host.copy("b") == bytes(b)
    host.discard("a")  # a hole of 3 MiB + 1 page before b, 3 MiB - 1 page after: the next blob takes both
    c = os.urandom(5 * GIL_FREE_COPY)
    host.put("c", c)
    assert len(host.extents("c")) == 2 and host.copy("c") == c and host.copy("b") == bytes(b)


def test_host_tier_keeps_blobs_contiguous_and_leases_pin_their_pages():
    host = HostTier(64 * 1024, page_bytes=1024, pinned=False)
    a, b = os.urandom(10_000), os.urandom(5_000)
    host.put("a", a)
    host.put("b", b)
    assert host.extents("a") == [(0, 10_000)] and host.extents("b") == [(10 * 1024, 5_000)]  # one piece each
    lease = host.lease("a")
    t, off, n = lease.view()
    assert bytes(t.numpy()[off : off + n]) == a and lease.tobytes() == a and lease.meta is None
    # a leased blob is never an eviction victim: filling the tier evicts b (LRU after the lease touched a)
    victims = host.put("c", os.urandom(52_000))
    assert [v[0] for v in victims] == ["b"] and "a" in host
    with pytest.raises(TierFullError):  # only a's pages could make room, and they are being read
        host.put("d", os.urandom(60_000))
    assert "a" in host and "c" in host  # all-or-nothing
    # dropped while leased: gone from the tier at once, its pages come back only when the reader is done
    host.discard("a")
    assert "a" not in host and host.lease("a") is None
    assert bytes(t.numpy()[off : off + n]) == a  # still intact for the reader
    full = host.fill
    lease.release()
    lease.release()  # idempotent
    assert host.fill < full and host.used_bytes == 52_000
    # freed runs merge: after churn a blob that fits a free run gets one piece
    host.discard("c")
    assert host.fill == 0.0
    host.put("e", os.urandom(64 * 1024))
    assert len(host.extents("e")) == 1


def test_host_tier_fragmented_arena_still_stores_and_reads_back():
    host = HostTier(16 * 1024, page_bytes=1024, pinned=False)
    for i in range(16):
        host.put(f"p{i}", bytes([i]) * 1024)
    for i in range(0, 16, 2):
        host.discard(f"p{i}")  # 8 free single pages, none adjacent
    data = os.urandom(4 * 1024)
    assert host.put("frag", data) == []
    assert len(host.extents("frag")) == 4 and host.copy("frag") == data
    lease = host.lease("frag")
    assert lease.view() is None and lease.tobytes() == data  # not contiguous: read as bytes
    lease.release()


# ---------------------------------------------------------------------------------------------- disk tier
@pytest.fixture(scope="module")
def nixl_files():
    return NixlFiles()


def test_disk_roundtrip_restart_and_damage(tmp_path, nixl_files):
    d = DiskTier(tmp_path / "g3", 1 << 20, io=nixl_files)
    blobs = {f"id{i}": os.urandom(1000 + 37 * i) for i in range(6)}
    for k, v in blobs.items():
        d.put(k, v, {"n": k})
    assert oct((tmp_path / "g3" / "id0.kvtc").stat().st_mode & 0o777) == "0o600"
    (tmp_path / "g3" / "leftover.tmp").write_bytes(b"torn")
    # restart: a new tier over the same directory finds every committed blob
    d2 = DiskTier(tmp_path / "g3", 1 << 20, io=nixl_files)
    assert sorted(d2.ids()) == sorted(blobs) and not (tmp_path / "g3" / "leftover.tmp").exists()
    for k, v in blobs.items():
        assert d2.copy(k) == v and d2.meta(k) == {"n": k}
    # a flipped byte is caught on read: never served, dropped
    f = tmp_path / "g3" / "id2.kvtc"
    raw = bytearray(f.read_bytes())
    raw[-10] ^= 0x40
    f.write_bytes(bytes(raw))
    with pytest.raises(TierError, match="corrupt"):
        d2.read("id2")
    assert "id2" not in d2 and not f.exists()
    # a truncated (torn) file is dropped at recovery
    g = tmp_path / "g3" / "id3.kvtc"
    g.write_bytes(g.read_bytes()[:-5])
    d3 = DiskTier(tmp_path / "g3", 1 << 20, io=nixl_files)
    assert "id3" not in d3 and d3.dropped == 1
    # a file deleted underneath is a miss, not a crash
    (tmp_path / "g3" / "id4.kvtc").unlink()
    with pytest.raises(TierError, match="missing"):
        d3.read("id4")


def test_disk_capacity_evicts_lru(tmp_path, nixl_files):
    d = DiskTier(tmp_path / "g3", 10_000, io=nixl_files)
    for i in range(10):
        d.put(f"b{i}", os.urandom(2000), {})
    assert d.used_bytes <= 10_000 and "b9" in d and "b0" not in d


def test_disk_dir_safety(tmp_path, nixl_files):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with pytest.raises(ConfigError, match="symlink"):
        DiskTier(tmp_path / "link", 1 << 20, io=nixl_files)
    (tmp_path / "open").mkdir(mode=0o777)
    os.chmod(tmp_path / "open", 0o777)
    with pytest.raises(ConfigError, match="world-writable"):
        DiskTier(tmp_path / "open", 1 << 20, io=nixl_files)


def test_disk_enospc_on_small_tmpfs(tmp_path, nixl_files):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        d = DiskTier(mnt / "g3", 1 << 30, io=nixl_files)  # the tier thinks it has 1 GiB; the device has 64 KiB
        d.put("fits", os.urandom(20_000), {})
        with pytest.raises(TierFullError, match="out of space"):
            d.put("too-big", os.urandom(200_000), {})
        assert d.copy("fits") and "too-big" not in d
        assert not list((mnt / "g3").glob("*.tmp"))
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


# ---------------------------------------------------------------------------------------------- policy
def test_ratio_policy_and_filter():
    p = RatioPolicy([8, 16, 32, 64], 16, max_ratio=32, pressure_high=0.8)
    assert p.choose(0.1) == 16 and p.choose(0.95) == 32 and p.choose(1.0) == 32
    with pytest.raises(ConfigError, match="no plan"):
        RatioPolicy([8, 16], 12)
    f = OffloadFilter(min_frequency=2)
    assert f.admit([1, 2]) == [False, False] and f.admit([1, 3]) == [True, False]
    with pytest.raises(ConfigError, match="DYN_KVTC_CPU_CACHE_GB"):
        TierConfig.from_env({"DYN_KVTC_CPU_CACHE_GB": "lots"})
    with pytest.raises(ConfigError, match="disk_cache_dir is not.*from DYN_KVTC_DISK_CACHE_GB"):
        TierConfig.from_env({"DYN_KVTC_DISK_CACHE_GB": "1"})
    assert TierConfig.from_env({"DYN_KVTC_CPU_CACHE_GB": "0.5"}).host_bytes == 1 << 29


# ---------------------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize("layout", ["flash", "flashinfer", "cpu", "trtllm"])
def test_paged_layouts_gather_scatter(layout):
    L, nb, H, D = 3, 10, 2, 8
    if layout == "flash":
        caches = [torch.zeros(2, nb, BS, H, D) for _ in range(L)]
    elif layout == "flashinfer":
        caches = [torch.zeros(nb, 2, BS, H, D) for _ in range(L)]
    elif layout == "cpu":
        caches = [torch.zeros(nb, H, BS, 2 * D) for _ in range(L)]
    else:
        caches = torch.zeros(nb, L, 2, H, BS, D)
    kv = PagedKV(caches, layout)
    k = torch.randn(L, 3 * BS, H, D)
    v = torch.randn(L, 3 * BS, H, D)
    for layer in range(L):
        kv.scatter_layer(layer, [7, 2, 5], k[layer], v[layer])
    k2, v2 = kv.gather([7, 2, 5])
    assert torch.equal(k2, k) and torch.equal(v2, v)
    if layout == "cpu":  # K rows of the block's tokens first, then V rows (vLLM CPU kernel's view)
        assert torch.equal(caches[0][7, 0].view(2 * BS, D)[:BS], k[0, :BS, 0])
        assert torch.equal(caches[0][7, 0].view(2 * BS, D)[BS:], v[0, :BS, 0])
    with pytest.raises(ConfigError, match="block ids"):
        kv.gather([nb])


# ---------------------------------------------------------------------------------------------- store
def _tokens(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


# the store tests run over these chains: the host tier alone, host + disk, host + the tests' own ``mem`` tier
# (tests/tier_plugins.py, registered with one line): the lower tier's name, or None
LOWER = [None, "disk", "mem"]


def _store(cal, tmp_path=None, host=1 << 20, disk=0, lower=None, **kw):
    """A store over host (+ ``lower``: "disk" in ``tmp_path``, or the registered test tier "mem")."""
    kw.setdefault("disk_min_uses", 1)  # these tests follow every eviction to disk; admission has its own test
    if lower == "mem":
        kw["tiers"] = ("mem",)
    elif lower == "disk" and not disk:
        disk = 1 << 20
    cfg = TierConfig(
        host_bytes=host, disk_bytes=disk, disk_dir=tmp_path, ratio=8, min_tokens=32, page_bytes=1024, window=32, **kw
    )
    return KvtcStore(cal, cfg, block_size=BS, span_tokens=128)


class Collect:
    """A sink recording the order layers arrive in, and the restored tensors."""

    def __init__(self, L, T, H, D):
        self.k = torch.zeros(L, T, H, D, dtype=torch.bfloat16)
        self.v = torch.zeros_like(self.k)
        self.order = []

    def __call__(self, layer, start, k, v):
        self.k[layer, start : start + k.shape[0]] = k
        self.v[layer, start : start + v.shape[0]] = v
        if not self.order or self.order[-1] != layer:
            self.order.append(layer)


@pytest.mark.parametrize("lower", LOWER)
async def test_offload_onboard_host_roundtrip_matches_codec(tmp_path, synth, synth_cal, lower):
    store = _store(synth_cal, tmp_path / "g3", lower=lower)
    assert [t.name for t in store.tiers] == ["host", *([lower] if lower else [])]
    toks = _tokens(400, 0)
    k, v, _ = synth.sample(400)
    res = offload_seq(store, toks, k, v)
    n_full = 400 // BS
    # three coded spans (8, 8, 7 blocks) and the raw window's own blob (2 blocks)
    assert res.stored_blocks == n_full and len(res.blobs) == 4 and res.ratio == 8.0
    assert res.raw_bytes / res.stored_bytes > 3
    hashes = store.hashes(toks)
    assert store.match(hashes) == n_full and store.match(store.hashes(toks + [1, 2, 3])) == n_full
    sink = Collect(*k.shape[:1], n_full * BS, *k.shape[2:])
    h = store.start_onboard(hashes, sink=sink)
    for layer in range(k.shape[0]):
        h.wait_layer(layer, timeout=30)
    assert await h.done() and sink.order == list(range(k.shape[0]))
    assert all(a < b for a, b in zip(h.ready_times, h.ready_times[1:]))  # layer 0 ready before the last
    # identical to decoding each span with the codec directly (same windows)
    codec = KvtcCodec(synth_cal, ratio=8)
    first = codec.decode(codec.encode(k[:, :128], v[:, :128], torch.arange(128), window=0))
    assert torch.equal(sink.k[:, :128], first[0]) and torch.equal(sink.v[:, :128], first[1])
    last = slice(n_full * BS - 32, n_full * BS)
    assert torch.equal(sink.k[:, last], k[:, last])  # the tail blob keeps its raw window
    again = offload_seq(store, toks, k, v)
    assert again.skipped == "present"
    snap = store.snapshot()
    assert snap["host_blocks"] == n_full and snap["onboard_host_hits"] == 4
    store.close()


@pytest.mark.parametrize("lower", ["disk", "mem"])
async def test_evict_demote_onboard_from_disk_and_restart(tmp_path, synth, synth_cal, lower):
    store = _store(synth_cal, tmp_path / "g3", host=48 * 1024, lower=lower)
    seqs = [(_tokens(256, s), *synth.sample(256)[:2]) for s in range(6)]
    for toks, k, v in seqs:
        offload_seq(store, toks, k, v)
    snap = store.snapshot()
    assert snap["host_evictions"] > 0 and snap[f"{lower}_demotions"] == snap["host_evictions"]
    assert snap["host_stored_bytes"] <= store.host.capacity and snap[f"{lower}_blobs"] > 0
    toks, k, v = seqs[0]
    hashes = store.hashes(toks)
    assert store.where(hashes[0]) == lower
    sink = Collect(k.shape[0], 256, *k.shape[2:])
    h = store.start_onboard(hashes, sink=sink)
    assert h.lane == "slow" and await h.done()
    snap = store.snapshot()
    assert snap[f"onboard_{lower}_hits"] >= 1 and store.where(hashes[0]) == "host"  # promoted
    assert snap[f"onboard_{lower}_blocks"] == 16 and snap["onboard_host_blocks"] == 0
    assert (sink.k[:, 4:128].float() - k[:, 4:128].float()).norm() / k[:, 4:128].float().norm() < 0.2
    store.close()
    if lower != "disk":
        return
    # restart: a fresh store over the same directory restores what reached the disk
    store2 = _store(synth_cal, tmp_path / "g3", host=48 * 1024, disk=1 << 20)
    on_disk = [s for s in seqs if store2.match(store2.hashes(s[0])) == 16]
    assert on_disk and store2.snapshot()["disk_recovered_blobs"] > 0
    toks, k, v = on_disk[0]
    sink2 = Collect(k.shape[0], 256, *k.shape[2:])
    assert await store2.start_onboard(store2.hashes(toks), sink=sink2).done()
    store2.close()


async def test_disk_admission_writes_only_blobs_used_twice(tmp_path, synth, synth_cal):
    """Default admission (disk_min_uses 2, as KVBM waits for a second use before spending SSD writes): a host
    eviction of a blob offloaded once and never restored is dropped; one restored once before its eviction reaches
    disk and restores from there. Files on disk are exactly the admitted blobs."""
    assert TierConfig().disk_min_uses == 2 and TierConfig().fsync is False
    store = _store(synth_cal, tmp_path / "g3", host=48 * 1024, disk=1 << 20, disk_min_uses=2)
    seqs = [(_tokens(256, 100 + s), *synth.sample(256)[:2]) for s in range(6)]
    toks0, k0, v0 = seqs[0]
    offload_seq(store, toks0, k0, v0)
    reused = store.hashes(toks0)
    assert await store.start_onboard(reused, sink=Collect(k0.shape[0], 256, *k0.shape[2:])).done()  # a 2nd use
    for toks, k, v in seqs[1:]:
        offload_seq(store, toks, k, v)
    snap = store.snapshot()
    assert snap["host_evictions"] > 0
    assert snap["disk_admission_dropped"] > 0 and snap["disk_demotions"] > 0
    assert snap["disk_demotions"] + snap["disk_admission_dropped"] == snap["host_evictions"]
    assert store.where(reused[0]) == "disk"  # used twice: admitted
    once = [t for t, _, _ in seqs[1:3] if store.match(store.hashes(t)) == 0]
    assert once, "blobs used once and evicted must be gone, not on disk"
    admitted = set(store.disk.ids())
    assert {m.id for m in store.index.metas() if store.where(m.hashes[0]) == "disk"} == admitted
    sink = Collect(k0.shape[0], 256, *k0.shape[2:])
    assert await store.start_onboard(reused, sink=sink).done()
    assert (sink.k[:, 4:128].float() - k0[:, 4:128].float()).norm() / k0[:, 4:128].float().norm() < 0.2
    store.close()


@pytest.mark.parametrize("lower", ["disk", "mem"])
async def test_corrupt_disk_blob_is_a_miss_not_wrong_kv(tmp_path, synth, synth_cal, lower):
    """A damaged blob in a lower tier: the disk tier's own CRC refuses it; the test tier serves the flipped bytes
    and the codec's section CRCs refuse them. Either way nothing is written and the blob leaves every tier."""
    store = _store(synth_cal, tmp_path / "g3", host=8 * 1024, lower=lower)
    toks, (k, v, _) = _tokens(256, 7), synth.sample(256)
    offload_seq(store, toks, k, v)
    for t in range(3):  # push it out of the host tier
        offload_seq(store, _tokens(256, 100 + t), *synth.sample(256)[:2])
    hashes = store.hashes(toks)
    assert store.where(hashes[0]) == lower
    blob_id = store.blob_of(hashes[0])
    if lower == "mem":
        store.placement.tier("mem").damage(blob_id)
    else:
        f = tmp_path / "g3" / f"{blob_id}.kvtc"
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        f.write_bytes(bytes(raw))
    sink = Collect(k.shape[0], 256, *k.shape[2:])
    h = store.start_onboard(hashes, sink=sink)
    assert not await h.done()
    with pytest.raises(TierError):
        h.wait_layer(0, timeout=10)
    assert sink.order == []  # nothing was written
    assert store.match(hashes) == 0  # the bad blob is forgotten: next time the engine recomputes
    assert store.snapshot()["blobs_dropped"] == 1 and store.where(hashes[0]) is None
    assert all(blob_id not in t for t in store.tiers)
    store.close()


async def test_foreign_calibration_blobs_are_not_served(tmp_path, synth, synth_cal):
    from dynamo_kvtc import calibrate

    store = _store(synth_cal, tmp_path / "g3", host=4 * 1024, disk=1 << 20)
    toks, (k, v, _) = _tokens(256, 3), synth.sample(256)
    offload_seq(store, toks, k, v)
    offload_seq(store, _tokens(256, 4), *synth.sample(256)[:2])
    store.close()
    other = calibrate(
        [synth.sample(256, start=i) for i in range(3)], synth.fp, ratios=(8,), dp_tokens=256, progress=False, seed=9
    )
    store2 = _store(other, tmp_path / "g3", host=4 * 1024, disk=1 << 20)
    assert store2.match(store2.hashes(toks)) == 0 and store2.snapshot()["disk_foreign_blobs"] > 0
    store2.close()


async def test_filter_bypass_and_paged_offload(synth, synth_cal):
    store = _store(synth_cal, min_frequency=2)
    toks, (k, v, _) = _tokens(320, 11), synth.sample(320)
    assert offload_seq(store, toks, k, v).skipped == "filtered"
    assert offload_seq(store, toks, k, v).stored_blocks == 20
    store.close()
    # from an engine's paged cache (vLLM flash layout) into other blocks of the same cache
    L, _, H, D = k.shape
    caches = [torch.zeros(2, 64, BS, H, D, dtype=torch.bfloat16) for _ in range(L)]
    kv = PagedKV(caches, "flash")
    src = list(range(20))
    for layer in range(L):
        kv.scatter_layer(layer, src, k[layer, :320], v[layer, :320])
    paged = KvtcStore(
        synth_cal,
        TierConfig(host_bytes=1 << 20, ratio=8, min_tokens=32, page_bytes=1024, window=64),
        block_size=BS,
        span_tokens=128,
        kv=kv,
    )
    assert offload_seq(paged, toks, block_ids=src).stored_blocks == 20
    dst = list(range(40, 60))
    h = paged.start_onboard(paged.hashes(toks), dst)
    assert await h.done()
    k2, _ = kv.gather(dst)
    assert (k2[:, 4:128].float() - k[:, 4:128].float()).norm() / k[:, 4:128].float().norm() < 0.2
    assert torch.equal(k2[:, 320 - 64 :], k[:, 320 - 64 :])  # raw window of the tail blob
    paged.close()


@pytest.mark.parametrize("lower", ["disk", "mem"])
async def test_many_concurrent_offloads_and_onboards_bounded(tmp_path, synth, synth_cal, lower):
    store = _store(synth_cal, tmp_path / "g3", host=48 * 1024, disk=256 * 1024 * (lower == "disk"), lower=lower)
    seqs = [(_tokens(192, 500 + i), *synth.sample(192)[:2]) for i in range(24)]
    refs = {}

    async def cycle(i):
        toks, k, v = seqs[i]
        offload_seq(store, toks, k, v)
        n = store.match(store.hashes(toks))
        if n:
            sink = Collect(k.shape[0], n * BS, *k.shape[2:])
            h = store.start_onboard(store.hashes(toks)[:n], sink=sink)
            if await h.done():
                refs[i] = (sink.k, k[:, : n * BS])

    await asyncio.gather(*(cycle(i) for i in range(len(seqs))))
    snap = store.snapshot()
    low = store.tiers[-1]
    assert snap["host_stored_bytes"] <= store.host.capacity and low.used_bytes <= low.capacity and low.name == lower
    assert len(refs) >= len(seqs) // 2
    for restored, ref in refs.values():
        assert (restored[:, 4:].float() - ref[:, 4:].float()).norm() / ref[:, 4:].float().norm() < 0.25
    store.close()


class ShortReadFiles(NixlFiles):
    """The real NIXL agent asked to read past the end of the file: NIXL itself fails the transfer."""

    def read(self, fd, nbytes, offset=0):
        return super().read(fd, nbytes + 4096, offset)


class ClosedFdFiles(NixlFiles):
    """The real NIXL agent handed a closed descriptor: the POSIX backend fails the write."""

    def write(self, fd, data, offset=0):
        bad = os.dup(fd)
        os.close(bad)
        return super().write(bad, data, offset)


def test_nixl_failures_become_tier_errors(tmp_path):
    good = DiskTier(tmp_path / "a", 1 << 20, io=NixlFiles())
    good.put("x", os.urandom(5000), {})
    reader = DiskTier(tmp_path / "a", 1 << 20, io=ShortReadFiles())
    with pytest.raises(TierError, match="NIXL READ failed"):
        reader.read("x")
    assert "x" in reader and good.copy("x")  # a failed transfer is a miss; the committed blob is kept
    writer = DiskTier(tmp_path / "b", 1 << 20, io=ClosedFdFiles())
    with pytest.raises(TierError, match="NIXL WRITE failed"):
        writer.put("y", os.urandom(5000), {})
    assert "y" not in writer and not list((tmp_path / "b").iterdir())  # nothing torn left behind


@pytest.mark.parametrize("lower", ["disk", "mem"])
async def test_export_to_a_peer_store_and_public_accessors(tmp_path, synth, synth_cal, lower):
    """export -> BlobRuns with metas; a second store restores them from that source (no tiers read) and keeps them;
    the index, host-tier extents, demotion and the idle wait through public names only."""
    from dynamo_kvtc.tiers import BlobRun

    a = _store(synth_cal, tmp_path / "a", lower=lower)
    toks, (k, v, _) = _tokens(320, 21), synth.sample(320)
    fut = a.submit_offload(a.hashes(toks), toks, keys=k[:, :320], values=v[:, :320])
    assert a.wait_idle(30) and fut.done() and fut.result().stored_blocks == 20
    hashes = a.hashes(toks)
    runs, _ = a.export(hashes[2:])
    assert all(isinstance(r, BlobRun) and r.meta is not None for r in runs)
    assert runs[0].at == 0 and sum(r.count for r in runs) == 18 and runs[0].first == 2
    assert a.index.blob_ids() == {r.meta.id for r in a.export(hashes)[0]}
    bid = a.blob_of(hashes[0])
    assert a.index.meta(bid).hashes[0] == hashes[0] and hashes[0] in a.index and a.index.locate(hashes[0]) == (bid, 0)
    assert sum(n for _, n in a.host.extents(bid)) == a.index.meta(bid).stored_bytes
    assert a.placement.demote(bid) and a.where(hashes[0]) == lower and not a.placement.demote(bid)

    b = _store(synth_cal)
    sink = Collect(k.shape[0], 18 * BS, *k.shape[2:])
    h = b.start_onboard(hashes[2:], sink=sink, source=lambda: runs)
    assert h.wait(30) and h.finished and h.bytes_read == sum(len(r.blob) for r in runs)
    ref = Collect(k.shape[0], 18 * BS, *k.shape[2:])
    assert await a.start_onboard(hashes[2:], sink=ref).done()
    assert torch.equal(sink.k, ref.k) and torch.equal(sink.v, ref.v)
    snap = b.snapshot()
    assert snap["onboard_peer_blocks"] == 18 and b.match(hashes) == 20  # the peer's whole blobs are kept here
    short = b.start_onboard(hashes, sink=Collect(k.shape[0], 20 * BS, *k.shape[2:]), source=lambda: runs)
    assert not short.wait(30) and short.finished and isinstance(short.error, TierError)
    a.close()
    b.close()


@pytest.mark.parametrize("fused", [False, True])
def test_span_coder_encodes_restores_and_names_bad_blobs(synth, synth_cal, fused):
    from dynamo_kvtc.codec import CodecOptions, EncodeSpan, RestoreRun
    from dynamo_kvtc.errors import DecodeError

    codec = KvtcCodec(synth_cal, ratio=8, window=32, fused=fused, options=CodecOptions(fused_strict=True))
    k, v, _ = synth.sample(256)
    spans = [EncodeSpan(0, torch.arange(0, 128), 0), EncodeSpan(128, torch.arange(128, 256), 32)]
    enc = codec.encode_spans(spans, lambda a, b: (k[:, a:b], v[:, a:b]))
    blobs = list(enc.blobs)
    assert enc.fused == fused and len(blobs) == 2
    restore = codec.restore([RestoreRun(blobs[0], 16, 32), RestoreRun(blobs[1], 0, 128)])
    got = list(restore)
    assert restore.fused == fused and [layer for layer, _ in got] == list(range(k.shape[0]))
    ref0, ref1 = KvtcCodec(synth_cal, ratio=8).decode(blobs[0]), KvtcCodec(synth_cal, ratio=8).decode(blobs[1])
    for layer, ((k0, v0), (k1, _)) in got:
        tol = 0.02 if fused else 0.0  # fp16 tensor-core projections vs the float32 reference
        assert (k0.float() - ref0[0][layer, 16:48].float()).norm() <= tol * ref0[0][layer, 16:48].float().norm()
        assert (k1.float() - ref1[0][layer].float()).norm() <= tol * ref1[0][layer].float().norm()
        assert v0.shape == (32, *k.shape[2:])
    bad_blob = bytearray(blobs[1])
    bad_blob[len(bad_blob) // 2] ^= 0xFF
    told = []
    runs = [RestoreRun(blobs[0], 0, 128), RestoreRun(bytes(bad_blob), 0, 128)]
    with pytest.raises(DecodeError):
        next(iter(codec.restore(runs, bad=lambda i, e: told.append(i))))
    assert told == [1]


def test_span_coder_falls_back_to_the_reference_path(monkeypatch, synth, synth_cal):
    """An unexpected failure of the fused path turns it off (KvtcCodec, the one fallback) and the reference path does
    the work: for an encode, and for a restore (before anything was written)."""
    from dynamo_kvtc.codec import EncodeSpan, RestoreRun

    k, v, _ = synth.sample(128)

    def boom(*a, **kw):
        raise RuntimeError("simulated fused failure")

    for what in ("encode_batch", "open"):
        codec = KvtcCodec(synth_cal, ratio=8, window=32, fused=True)
        monkeypatch.setattr(codec.fused, what, boom)
        enc = codec.encode_spans([EncodeSpan(0, torch.arange(128), 32)], lambda a, b: (k[:, a:b], v[:, a:b]))
        blob = next(iter(enc.blobs))
        restore = codec.restore([RestoreRun(blob, 0, 128)])
        got = list(restore)
        assert codec.fused is None and enc.fused == (what == "open") and not restore.fused and len(got) == k.shape[0]
        ref = KvtcCodec(synth_cal, ratio=8).decode(blob)
        assert torch.equal(got[-1][1][0][0], ref[0][-1])


def test_bench_tiers_puts_raw_host_and_raw_disk_tiers_beside_kvtc(tmp_path):
    """`dynamo-kvtc bench tiers` measures, in one run on the same KV, the kvtc host and disk tiers and the raw
    baselines (pinned copy; the same bytes through NIXL POSIX with the page cache dropped, read back bit-exact)."""
    import json

    from dynamo_kvtc.cli.main import main

    out = tmp_path / "tiers.json"
    argv = ["bench", "tiers", "--synthetic", "smollm2-135m", "--tokens", "512", "--repeat", "1"]
    assert main([*argv, "--disk-dir", str(tmp_path), "--json", str(out)]) == 0
    r = json.loads(out.read_text())["results"]
    assert r["raw_disk"]["onboard_all_layers_s"] > 0 and r["raw_disk"]["file_system"] != "unknown"
    assert r["raw_host"]["onboard_all_layers_s"] == r["raw_copy_from_host_s"] > 0
    for tier in ("host", "disk"):
        assert r["kvtc_vs_raw"][tier] > 0 and r[tier]["onboard_all_layers_s"] > 0
    assert r["kvtc_vs_raw"]["disk"] == r["disk"]["onboard_all_layers_s"] / r["raw_disk"]["onboard_all_layers_s"]
    # the tier path beside the codec's own restore of the same blobs, after a warm-up at start-up
    assert r["host"]["codec_restore_s"] > 0 and r["host"]["warm_up_s"] > 0
    assert r["host"]["tier_vs_codec"] == r["host"]["onboard_all_layers_s"] / r["host"]["codec_restore_s"]


async def test_warm_up_runs_the_codec_once_and_stores_nothing(synth, synth_cal):
    store = _store(synth_cal)
    took = store.warm_up()
    assert took > 0 and ("warm_up", took) in store.stats.timings
    assert store.stats.warm_up_errors == 0  # the encode and restore it ran succeeded
    assert len(store.host) == 0 and store.snapshot()["host_blocks"] == 0 and store.stats.onboards == 0
    toks = _tokens(192, 3)
    k, v, _ = synth.sample(192)
    res = offload_seq(store, toks, k, v)  # the store works as before after a warm-up
    assert res.stored_blocks == 192 // BS
    store.close()


def test_codec_streams_cpu_none_and_sms_setting_checked(monkeypatch):
    from dynamo_kvtc.errors import ConfigError
    from dynamo_kvtc.tiers.streams import codec_stream

    assert codec_stream(torch.device("cpu"), 32) is None
    monkeypatch.setenv("DYN_KVTC_CODEC_SMS", "-4")
    with pytest.raises(ConfigError, match="DYN_KVTC_CODEC_SMS='-4' is invalid"):  # parsed at start-up, with the tiers
        TierConfig.from_env()
    monkeypatch.setenv("DYN_KVTC_CODEC_SMS", "24")
    assert TierConfig.from_env().codec_sms == 24


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_codec_stream_in_a_green_context_runs_kernels():
    from dynamo_kvtc.tiers.streams import green_stream

    dev = torch.device("cuda")
    s = green_stream(dev, 16)  # not codec_stream: its fallback to a plain stream would pass this test too
    if s is None:
        pytest.skip("green contexts unavailable on this driver / torch build (the reason is logged)")
    with torch.cuda.stream(s):
        x = torch.randn(1024, 1024, device=dev)
        y = x @ x
    s.synchronize()
    assert torch.allclose(y, (x @ x), rtol=1e-3, atol=1e-3)


def test_store_stats_are_typed_and_flatten_under_the_historical_keys(synth_cal):
    """The parts bump fields of one StoreStats; snapshot()/as_dict() keep the flat keys (errors as
    ``<kind>_error_<Error>``); the bytes a token's KV takes come from the fingerprint only."""
    from dynamo_kvtc.tiers import StoreStats

    st = StoreStats()
    st.offload_blocks += 3
    st.tier("disk").write_errors["TierFullError"] += 2
    st.onboard_errors["DecodeError"] += 1
    st.time("encode", 0.5)
    flat = st.as_dict()
    assert flat["offload_blocks"] == 3 and flat["disk_write_error_TierFullError"] == 2
    assert st.faults() == {"onboard_error_DecodeError": 1, "disk_write_error_TierFullError": 2}
    assert "timings" not in flat and list(st.timings) == [("encode", 0.5)] and st.onboard_from("peer") == 0
    for key in ("onboard_host_blocks", "onboard_disk_hits", "host_evictions", "disk_demotions", "disk_demoted_blocks",
                "disk_admission_dropped", "disk_recovered_blobs", "disk_foreign_blobs", "disk_bad_records"):
        assert flat[key] == 0  # every store reports the built-in tiers' counters, under today's names
    st.tier("mem").hits += 1  # another tier's counters: keyed by its name, flattened the same way
    assert st.as_dict()["onboard_mem_hits"] == 1 and st.sources == ("host", "disk", "mem", "peer")
    fp = synth_cal.fingerprint
    per_token = 2 * fp.num_layers * fp.num_kv_heads * fp.head_dim
    assert fp.raw_bytes_per_token(torch.bfloat16) == 2 * per_token == fp.raw_bytes_per_token("float16")
    assert fp.raw_bytes_per_token(torch.float32) == 4 * per_token


# ---------------------------------------------------------------------------------------------- the tier chain
def test_tier_registry_builds_the_configured_chain(tmp_path, synth_cal):
    """The chain comes from the registry: host always first, disk when configured, a registered tier when named;
    an unknown name or a kind whose class names another tier is refused."""
    from dynamo_kvtc.tiers.registry import TierKind, build_chain, names, register

    assert names()[:4] == ("host", "disk", "pool", "mem")  # the built-in tiers, then the tests' own
    cfg = TierConfig(host_bytes=1 << 20, page_bytes=1024, disk_bytes=1 << 20, disk_dir=tmp_path / "g3", tiers=("mem",))
    chain = build_chain(cfg)
    assert [type(t) for t in chain] == [HostTier, DiskTier, MemTier]
    chain[1].close()
    assert [t.name for t in build_chain(TierConfig(host_bytes=1 << 20, page_bytes=1024))] == ["host"]
    with pytest.raises(ConfigError, match="unknown tiers"):
        build_chain(TierConfig(host_bytes=1 << 20, page_bytes=1024, tiers=("nope",)))
    with pytest.raises(ConfigError, match="whose name is"):
        register(TierKind("other", MemTier, lambda cfg: None))
    with pytest.raises(ConfigError, match="not in the table"):
        register(TierKind("mem", MemTier, lambda cfg: None, ("no_such_setting",)))


def test_tiers_keep_one_contract(tmp_path, nixl_files):
    """Host, disk and the tests' tier answer the same calls the same way: put hands back Evicted records (bytes
    only when kept), read a BlobView (None when absent), discard forgets."""
    tiers = [HostTier(8 * 1024, page_bytes=1024, pinned=False), DiskTier(tmp_path / "g3", 9000, io=nixl_files),
             MemTier(8 * 1024)]
    for tier in tiers:
        a, b, c = os.urandom(3000), os.urandom(3000), os.urandom(3000)
        assert tier.put("a", a, {"n": 1}) == [] and tier.put("b", b, {"n": 2}) == []
        assert tier.read("zz") is None and tier.meta("a") == {"n": 1}
        view = tier.read("a")  # a is now the most recently used: b is the victim
        assert view.tobytes() == a and len(view) == 3000
        view.release()
        (ev,) = tier.put("c", c, {"n": 3})
        assert ev.blob_id == "b" and bytes(BlobView.of(ev.blob).host()) == b and ev.meta == {"n": 2}, tier.name
        (ev,) = tier.put("d", os.urandom(3000), {}, keep_evicted=False)
        assert ev.blob_id == "a" and not ev.blob
        tier.discard("c")
        assert sorted(tier.ids()) == ["d"] and tier.copy("c") is None
        tier.close()

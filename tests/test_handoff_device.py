"""The hand-off's registered-memory path (connector/handoff/staging.py, server, client) in one process over UCX
loopback: the prefill side stages blobs in one arena, each lease's extent registered on its own, one descriptor per
blob; the decode side READs into one receive buffer registered once. On the CPU both are host memory (what make test
runs); the ``gpu`` variant stages and receives in device memory (VRAM) and restores from it, the same code. Faults: a
stale receive registration, replies that describe the staged bytes wrongly (past the arena, a short blob, another
device), a peer gone — each a failed restore (the engine recomputes), no wrong KV, no lease left open, and the next
fetch works."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nixl_cu13")

from dynamo_kvtc.connector.config import ConnectorConfig  # noqa: E402
from dynamo_kvtc.connector.handoff.server import HandoffServer  # noqa: E402
from dynamo_kvtc.errors import TierError, TierFullError, TransferError  # noqa: E402
from dynamo_kvtc.reliability.testbed import BS, Expect, World, close_store, make_store, restore  # noqa: E402
from dynamo_kvtc.reliability.transfer_faults import LIES, in_process_peers, lying_server  # noqa: E402
from dynamo_kvtc.tiers.keys import sequence_hashes  # noqa: E402
from dynamo_kvtc.transport.nixl_io import PeerAgent, TokenBucket, split_descs  # noqa: E402
from dynamo_kvtc.transport.staging import StagingArena, copy_in  # noqa: E402

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _device(name: str) -> str:
    if name == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    return name


@pytest.fixture
def world(tmp_path, synth_cal):
    return World(tmp_path, seed=0, cal=synth_cal)


def _fetch_restore(world, store, client, srv, toks):
    hashes = _hashes(toks)
    return hashes, restore(world, store, hashes, 60, source=lambda: client.fetch("127.0.0.1", srv.port, hashes))


def _hashes(toks):
    return sequence_hashes(toks[: len(toks) // BS * BS], BS)


@pytest.mark.parametrize("device", DEVICES)
def test_registered_once_fetches_restore_exactly(world, device):
    dev = _device(device)
    dst = make_store(world, True, host=64 << 20)
    expect = Expect(world, True)
    try:
        with in_process_peers(world, dev) as (srv, client, seqs):
            mem = "VRAM" if dev == "cuda" else "DRAM"
            assert client.recv.mem == mem
            for _ in range(2):
                for toks in seqs:
                    hashes, out = _fetch_restore(world, dst, client, srv, toks)
                    assert out.ok, out.error
                    assert expect.check(hashes, 0, out.k, out.v) == (0, 0)  # lossless: bit for bit
                    assert client.last["bytes"] > 0 and client.last["read_s"] > 0
            assert srv.arena(mem).mem == mem
            regs = client.recv.registrations
            assert 1 <= regs <= 2  # grown at most once (powers of two from 1 MiB), then reused by every fetch
            for toks in seqs:
                assert _fetch_restore(world, dst, client, srv, toks)[1].ok
            assert client.recv.registrations == regs
            client.flush()
            assert srv.open_leases == 0 and srv.staged_bytes == 0  # every lease released
            bw, src = client.link.link(f"127.0.0.1:{srv.port}")
            assert src == "learned" and bw > 0
    finally:
        close_store(dst)


@pytest.mark.parametrize("device", DEVICES)
def test_stale_receive_registration_is_a_recompute_then_recovers(world, device):
    dev = _device(device)
    dst = make_store(world, True, host=64 << 20)
    try:
        with in_process_peers(world, dev, seqs=1) as (srv, client, seqs):
            assert _fetch_restore(world, dst, client, srv, seqs[0])[1].ok
            client.agent.agent.deregister_memory(client.recv.registration)  # stale: NIXL no longer knows it
            _, out = _fetch_restore(world, dst, client, srv, seqs[0])
            assert out.status == "failed" and isinstance(out.error, TransferError), out.error
            client.flush()
            assert srv.open_leases == 0
            hashes, out = _fetch_restore(world, dst, client, srv, seqs[0])
            assert out.ok, out.error  # a fresh buffer was registered
            assert Expect(world, True).check(hashes, 0, out.k, out.v)[0] == 0
    finally:
        close_store(dst)


@pytest.mark.parametrize("lie", LIES)
def test_replies_that_misdescribe_staged_bytes_fail_cleanly(world, lie):
    dst = make_store(world, True, host=64 << 20)
    try:
        liar = lambda cfg, s, device: lying_server(cfg, s, lie, device)  # noqa: E731
        with in_process_peers(world, "cpu", server=liar, seqs=1) as (srv, client, seqs):
            hashes, out = _fetch_restore(world, dst, client, srv, seqs[0])
            assert out.status == "failed", (lie, out.status, out.error)
            client.flush()
            assert srv.open_leases == 0 and client.quarantined_bytes == 0
            honest = HandoffServer(ConnectorConfig(transfer_timeout_s=3.0, transfer_staging_mb=32), srv.store)
            try:
                hashes, out = _fetch_restore(world, dst, client, honest, seqs[0])
                assert out.ok, out.error  # the same client still fetches from an honest peer
                assert Expect(world, True).check(hashes, 0, out.k, out.v)[0] == 0
            finally:
                honest.close()
    finally:
        close_store(dst)


def test_peer_gone_before_the_read_is_a_recompute(world):
    dst = make_store(world, True, host=64 << 20)
    try:
        with in_process_peers(world, "cpu", seqs=1) as (srv, client, seqs):
            port = srv.port
            srv.close()
            hashes = _hashes(seqs[0])
            out = restore(world, dst, hashes, 60, source=lambda: client.fetch("127.0.0.1", port, hashes))
            assert out.status == "failed" and isinstance(out.error, TransferError)
    finally:
        close_store(dst)


def test_staging_arena_extents_are_contiguous_next_fit_and_merge():
    agent = PeerAgent("UCX", "kvtc-test")
    arena = StagingArena(agent, 4096, torch.device("cpu"), ready_slots=0)  # the allocator alone, no rotator
    try:
        a, b, c = arena.take("a", 1000), arena.take("b", 1000), arena.take("c", 1000)
        assert (a, b, c) == (0, 1024, 2048) and arena.used == 3072
        with pytest.raises(TierError, match="already holds"):  # one extent per key: a second would orphan the first
            arena.take("a", 100)
        assert arena.registrations == 3 and arena.used == 3072
        with pytest.raises(TierFullError):
            arena.take("d", 2000)
        arena.give("b")
        assert arena.take("e", 900) == 3072  # next fit: the free run after the last extent before the freed hole
        assert arena.take("x", 900) == 1024  # ... then, wrapped, the hole
        assert arena.registrations == 5 and len(arena._leases) == 4  # one registration per open extent
        arena.give("a"), arena.give("e"), arena.give("c"), arena.give("x")
        assert not arena._leases and arena.deregistrations == 5
        assert arena.used == 0 and arena.take("f", 4096) == 0  # the holes merged back into one extent
        arena.give("f")
        blobs = [bytes(range(200)), b"\x07" * 300]
        descs = arena.stage("g", blobs)
        assert [n for _, n in descs] == [200, 300] and descs[1][0] - descs[0][0] == 256
        for (addr, n), blob in zip(descs, blobs):
            off = addr - arena.base
            assert arena.buf[off : off + n].numpy().tobytes() == blob
        with pytest.raises(TierFullError):
            arena.stage("h", [b"x" * 4000])
        assert arena.used == 768  # g alone (256 + 512 aligned): a failed stage holds nothing
    finally:
        arena.close()


def test_copy_in_refuses_what_does_not_fit():
    dst = torch.zeros(600, dtype=torch.uint8)
    assert copy_in(dst, [b"a" * 100, b"b" * 100]) == [(0, 100), (256, 100)]
    with pytest.raises(TierFullError):
        copy_in(dst, [b"a" * 300, b"b" * 300])


def test_split_descs_pairs_equal_lengths_in_chunks():
    local = [(1000, 700, 0)]
    remote = [(5000, 300, 1), (9000, 400, 1)]
    parts = split_descs(local, remote, 256)
    flat_l = [d for lp, _ in parts for d in lp]
    flat_r = [d for _, rp in parts for d in rp]
    assert [d[1] for d in flat_l] == [d[1] for d in flat_r]
    assert all(sum(d[1] for d in lp) <= 256 for lp, _ in parts)
    assert sum(d[1] for d in flat_l) == 700 and flat_l[0][0] == 1000 and flat_r[-1] == (9212, 188, 1)
    covered = sorted((a, a + n) for a, n, _ in flat_r)
    assert covered[0] == (5000, 5256) and covered[-1][1] == 9400
    assert split_descs(local, remote, 10_000) == [(list(zip([1000, 1300], [300, 400], [0, 0])), remote)]
    with pytest.raises(TransferError):
        split_descs(local, [(1, 10, 0)], 256)


def test_token_bucket_holds_a_transfer_to_its_rate():
    import time

    tb = TokenBucket(0.08, chunk_bytes=100_000)  # 10 MB/s
    t = time.perf_counter()
    tb.start()
    for _ in range(5):
        tb.admit(100_000)
    tb.finish()
    assert time.perf_counter() - t >= 0.05  # 500 KB at 10 MB/s
    assert tb.chunk_for(1_000_000) == 100_000 and tb.chunk_for(16_000_000) == 1_000_000  # at most 16 posts per READ


def test_memory_fields_of_fetches_and_replies_are_checked():
    from dynamo_kvtc.connector.handoff.messages import fetch_mem, fetch_request, reply_memory

    assert fetch_mem(fetch_request([1], "a", b"m")) == "DRAM" and "mem" not in fetch_request([1], "a", b"m")
    assert fetch_mem(fetch_request([1], "a", b"m", "VRAM")) == "VRAM"
    assert reply_memory({}) == ("DRAM", 0) and reply_memory({"mem": "VRAM", "dev": 3}) == ("VRAM", 3)
    for bad in ({"mem": "HBM"}, {"mem": "VRAM", "dev": -1}, {"dev": True}, {"dev": 1 << 20}, {"mem": ["VRAM"]}):
        with pytest.raises(TransferError):
            reply_memory(bad)
    with pytest.raises(TransferError):
        fetch_mem({"mem": "FILE"})

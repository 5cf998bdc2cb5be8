"""The hand-off streamed layer group by layer group (issue 17): the prefill side says where each layer group's bytes
end in each blob, the decode side READs range a of every blob in one transfer, a = 0, 1, ..., and the fused restore
decodes group g as soon as its ranges landed (:class:`~dynamo_kvtc.transport.arriving.ArrivingView`), reading the
receive buffer in place.

- RestoreJob (CPU, the fused pipeline's torch stages): layer 0 comes out while group 1's bytes are still garbage in
  the buffer; the result is bit for bit the host-bytes restore's; a reader that fails between ranges fails the
  restore after group 0 and leaves later groups' destination untouched; ranges that lie about where groups end only
  delay the decode (no byte is read before it landed). CUDA (skipped elsewhere): blobs in device memory restore bit
  for bit like host bytes, with or without ranges.
- Over NIXL (UCX loopback, two-group calibration, fused path forced on the CPU): fetches arrive in two ranges and
  restore exactly, one receive registration; replies with wrong ranges (past the blob, overlapping, short) are
  refused (recompute, lease released); ranges that tile the blob but not its groups still restore exactly; the
  second of the READs in flight failing (error, stall, refused post) or a peer process killed between two paced
  range READs is a recompute, and the next fetch works.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dynamo_kvtc import KvtcCodec, calibrate
from dynamo_kvtc.codec.container import parse_blob
from dynamo_kvtc.codec.options import CodecOptions
from dynamo_kvtc.errors import InputError, TransferError
from dynamo_kvtc.transport.arriving import ArrivingView

nixl = pytest.importorskip("nixl_cu13")

from dynamo_kvtc.codec.container import group_ends  # noqa: E402
from dynamo_kvtc.connector.config import ConnectorConfig  # noqa: E402
from dynamo_kvtc.connector.handoff.client import HandoffClient  # noqa: E402
from dynamo_kvtc.connector.handoff.messages import plan_reply, range_descs  # noqa: E402
from dynamo_kvtc.reliability.nixl_faults import FaultyAgent  # noqa: E402
from dynamo_kvtc.reliability.testbed import (  # noqa: E402
    BS,
    SPAN,
    Expect,
    World,
    close_store,
    make_store,
    restore,
    tier_config,
)
from dynamo_kvtc.reliability.transfer_faults import (  # noqa: E402
    RANGE_LIES,
    PeerProcess,
    in_process_peers,
    lying_server,
    transfer_sequences,
)
from dynamo_kvtc.tiers.keys import sequence_hashes  # noqa: E402
from dynamo_kvtc.tiers.store import KvtcStore  # noqa: E402
from dynamo_kvtc.transport.arriving import GroupArrival  # noqa: E402
from dynamo_kvtc.transport.nixl_io import TokenBucket  # noqa: E402

CUDA = torch.cuda.is_available()


# the fused restore (torch stages on the CPU) reads the ranges; a failing fast path must fail the test, not fall back
FORCE = CodecOptions(fused="force", fused_strict=True)


@pytest.fixture(scope="module")
def cal2(synth):
    samples = [synth.sample(512, start=i * 37) for i in range(6)]
    return calibrate(samples, synth.fp, ratios=(8, 16), layer_groups=2, dp_tokens=2048, progress=False, seed=0)


def _codec(cal, device="cpu"):
    tag = "deflate" if device == "cpu" else "store"
    return KvtcCodec(cal, ratio=8, device=device, fused=True, window=32, tag=tag, options=FORCE)


def _blobs(synth, codec, device="cpu", lens=(300, 200)):
    parts = [synth.sample(n, start=7 * i) for i, n in enumerate(lens)]
    return parts, [codec.encode(k.to(device), v.to(device), p) for k, v, p in parts]


def _dest(parts, device="cpu"):
    from dynamo_kvtc.codec.gpu import DenseKV

    K = torch.cat([p[0] for p in parts], dim=1).to(device)
    kk, vv = torch.full_like(K, -7.0), torch.full_like(K, -7.0)
    starts = [0]
    for k, _, _ in parts[:-1]:
        starts.append(starts[-1] + k.shape[1])
    return DenseKV(kk, vv, seq_starts=starts), kk, vv


def _receive(blobs, device="cpu"):
    """A receive buffer (every byte 0xEE: nothing landed) and each blob's offset in it."""
    offs, at = [], 0
    for b in blobs:
        offs.append(at)
        at += -(-len(b) // 256) * 256
    return torch.full((at,), 0xEE, dtype=torch.uint8, device=device), offs


def _land(buf, offs, blobs, ends, a):
    """Copy range a of every blob into the buffer (what READ a does)."""
    for off, b, e in zip(offs, blobs, ends):
        s = e[a - 1] if a else 0
        buf[off + s : off + e[a]] = torch.frombuffer(bytearray(b[s : e[a]]), dtype=torch.uint8).to(buf.device)


def _group0_landed(blobs, ends=None, device="cpu"):
    """A receive buffer holding only range 0 of every blob (by default range g = layer group g), its arrival marked
    so, and the blobs as arriving views of it: (buf, offs, ends, arrival, srcs)."""
    buf, offs = _receive(blobs, device)
    ends = ends or [group_ends(b) for b in blobs]
    arrival = GroupArrival(2, len(blobs), timeout_s=5.0)
    _land(buf, offs, blobs, ends, 0)
    arrival.landed(0)
    return buf, offs, ends, arrival, [ArrivingView(buf, o, len(b), arrival, e) for o, b, e in zip(offs, blobs, ends)]


def _plain(codec, blobs, parts, device="cpu"):
    dest, kk, vv = _dest(parts, device)
    job = codec.fused.open(blobs)
    list(job.layers(dest=dest))
    job.finish()
    return kk, vv


def test_group_ends_tile_each_blob_by_layer_group(synth, cal2):
    codec = _codec(cal2)
    _, blobs = _blobs(synth, codec)
    for b in blobs:
        ends = group_ends(b)
        _, recs = parse_blob(b)
        g0 = [r for r in recs if r.name.startswith("0.")]
        assert len(ends) == 2 and ends[-1] == len(b)
        assert ends[0] == max(r.offset + r.stored_len for r in g0)  # header and group 0, then group 1
        assert min(r.offset for r in recs if r.name.startswith("1.")) == ends[0]
    assert group_ends(b"not a blob") is None
    with pytest.raises(InputError):
        ArrivingView(torch.zeros(10, dtype=torch.uint8), 0, 10, None, [5, 5, 10])


def test_layer_zero_restores_while_group_one_is_still_in_flight(synth, cal2):
    codec = _codec(cal2)
    parts, blobs = _blobs(synth, codec)
    want_k, want_v = _plain(codec, blobs, parts)
    buf, offs, ends, arrival, srcs = _group0_landed(blobs)
    dest, kk, vv = _dest(parts)
    job = codec.fused.open(srcs)
    gen = job.layers(dest=dest)
    g1 = codec.fused.tables[1].layers[0]
    assert [next(gen) for _ in range(g1)] == list(range(g1))  # group 0 decoded; group 1 is still 0xEE garbage
    assert (kk[g1:] == -7.0).all() and not arrival.is_consumed
    _land(buf, offs, blobs, ends, 1)
    arrival.landed(1)
    assert list(gen) == list(range(g1, synth.fp.num_layers))
    job.finish()
    assert arrival.is_consumed  # every blob read out: the buffer may take the next fetch
    assert torch.equal(kk.view(torch.int16), want_k.view(torch.int16))
    assert torch.equal(vv.view(torch.int16), want_v.view(torch.int16))


def test_the_reference_path_reads_arriving_blobs_once_they_settle(synth, cal2):
    """With the fused path off (e.g. turned off mid-restore) the reference decoder gets an arriving blob through
    ``BlobView.host``: it waits for every range, copies the blob out and releases the receive buffer."""
    import threading

    from dynamo_kvtc.codec.blob import BlobView

    codec = _codec(cal2)
    _, blobs = _blobs(synth, codec)
    buf, offs, ends, arrival, srcs = _group0_landed(blobs)

    def land_rest():
        _land(buf, offs, blobs, ends, 1)
        arrival.landed(1)

    threading.Timer(0.2, land_rest).start()  # the second range lands while BlobView.host waits for it
    got = [bytes(x.host()) for x in srcs]
    assert got == [bytes(b) for b in blobs] and arrival.is_consumed
    ref = KvtcCodec(cal2, ratio=8, device="cpu", fused=False, window=32)
    k, _ = ref.decode(got[0])
    assert torch.isfinite(k.float()).all()
    t = torch.frombuffer(bytearray(blobs[1]), dtype=torch.uint8)
    assert bytes(BlobView.of((t, 0, len(blobs[1]))).host()) == bytes(blobs[1])  # a host tensor: a view, as before


def test_a_reader_failing_between_ranges_fails_after_group_zero(synth, cal2):
    codec = _codec(cal2)
    parts, blobs = _blobs(synth, codec)
    _, _, _, arrival, srcs = _group0_landed(blobs)
    arrival.fail(TransferError("peer gone"))
    dest, kk, _ = _dest(parts)
    job = codec.fused.open(srcs)
    got = []
    with pytest.raises(TransferError, match="before byte range 1 landed: peer gone"):
        for layer in job.layers(dest=dest):
            got.append(layer)
    g1 = codec.fused.tables[1].layers[0]
    assert got == list(range(g1)) and (kk[g1:] == -7.0).all()
    assert not arrival.is_consumed


def test_ranges_that_lie_about_groups_only_delay_the_decode(synth, cal2):
    """Range 0 claims to end 20 bytes into each blob (inside the header): nothing is parsed or decoded until range
    1 (the rest) landed, and the result is exact."""
    codec = _codec(cal2)
    parts, blobs = _blobs(synth, codec)
    want_k, _ = _plain(codec, blobs, parts)
    buf, offs, ends, arrival, srcs = _group0_landed(blobs, ends=[[20, len(b)] for b in blobs])
    dest, kk, _ = _dest(parts)
    box: dict = {}

    def run():
        job = codec.fused.open(srcs)
        box["first"] = time.perf_counter()
        list(job.layers(dest=dest))
        job.finish()

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.3)
    assert "first" not in box and (kk == -7.0).all()  # waiting for range 1: the header is not all there
    landed = time.perf_counter()
    _land(buf, offs, blobs, ends, 1)
    arrival.landed(1)
    t.join(30)
    assert box["first"] >= landed and torch.equal(kk.view(torch.int16), want_k.view(torch.int16))


def test_range_descriptors_cut_each_blob_and_its_remote_pieces():
    reply = {
        "blobs": [
            {
                "size": 300,
                "first": 0,
                "count": 1,
                "j": 0,
                "meta": {"hashes": [5]},
                "descs": [[1000, 100], [5000, 200]],
                "ranges": [150, 300],
            },
            {
                "size": 10,
                "first": 0,
                "count": 1,
                "j": 1,
                "meta": {"hashes": [6]},
                "descs": [[9000, 10]],
                "ranges": [4, 10],
            },
        ]
    }
    runs, _ = plan_reply(reply, [5, 6])
    assert [r.offset for r in runs] == [0, 300]  # back to back
    assert range_descs(runs, 0, 10_000, 0, 1) == (
        [(10_000, 150, 0), (10_300, 4, 0)],
        [(1000, 100, 1), (5000, 50, 1), (9000, 4, 1)],
    )
    assert range_descs(runs, 1, 10_000, 0, 1) == ([(10_150, 150, 0), (10_304, 6, 0)], [(5050, 150, 1), (9004, 6, 1)])
    for bad in ([150, 150, 300], [301], [0, 300], [150], [True, 300], "x"):
        blobs = [dict(reply["blobs"][0], ranges=bad), reply["blobs"][1]]
        with pytest.raises(TransferError):
            plan_reply({"blobs": blobs}, [5, 6])
    with pytest.raises(TransferError, match="differ"):  # one blob with ranges, one without
        plan_reply({"blobs": [reply["blobs"][0], {k: v for k, v in reply["blobs"][1].items() if k != "ranges"}]},
                   [5, 6])  # fmt: skip


# ------------------------------------------------------------------------------------------------ over NIXL
@pytest.fixture
def world2(tmp_path, cal2):
    return World(tmp_path, seed=0, cal=cal2)


def _hashes(toks):
    return sequence_hashes(toks[: len(toks) // BS * BS], BS)


def _fetch_restore(world, store, client, port, toks):
    hashes = _hashes(toks)
    return hashes, restore(world, store, hashes, 60, source=lambda: client.fetch("127.0.0.1", port, hashes))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fetches_arrive_in_group_ranges_and_restore_exactly(world2, device):
    """On the CPU host memory both sides; with CUDA the staging arena and the receive buffer are device memory and
    the fused restore gathers each group from the receive buffer device to device."""
    if device == "cuda" and not CUDA:
        pytest.skip("needs CUDA")
    cfg = tier_config(True, 64 << 20, codec=FORCE)
    dst = KvtcStore(world2.cal, cfg, block_size=BS, span_tokens=SPAN, device=device)
    expect = Expect(world2, True)
    try:
        with in_process_peers(world2, device, seqs=2) as (srv, client, seqs):
            assert client.recv.mem == ("VRAM" if device == "cuda" else "DRAM")
            for _ in range(2):
                for toks in seqs:
                    hashes, out = _fetch_restore(world2, dst, client, srv.port, toks)
                    assert out.ok, out.error
                    assert expect.check(hashes, 0, out.k, out.v) == (0, 0)
                    assert client.last["ranges"] == 2 and 0 < client.last["first_range_s"] <= client.last["read_s"]
            assert client.recv.registrations == 1  # every fetch's blobs were read out: the buffer was reused
            assert dst.stats.onboard_fused_batches == 2 * len(seqs)  # the fused restore read the ranges
            client.flush()
            assert srv.open_leases == 0 and client.quarantined_bytes == 0
            host = srv.store.host  # staged from its pages in place: every host-tier lease given back
            assert host._entries and all(e.leases == 0 for e in host._entries.values())
    finally:
        close_store(dst)


@pytest.mark.parametrize("lie", RANGE_LIES)
def test_replies_with_wrong_ranges_are_refused_or_harmless(world2, lie):
    dst = make_store(world2, True, host=64 << 20, codec=FORCE)
    try:
        liar = lambda cfg, s, device: lying_server(cfg, s, lie, device)  # noqa: E731
        with in_process_peers(world2, server=liar, seqs=2) as (srv, client, seqs):
            hashes, out = _fetch_restore(world2, dst, client, srv.port, seqs[0])
            if lie == "ranges_misplaced":  # they tile the blob, just not by group: exact, only later
                assert out.ok, out.error
                assert Expect(world2, True).check(hashes, 0, out.k, out.v)[0] == 0
            else:
                assert out.status == "failed" and isinstance(out.error, TransferError), (lie, out.error)
            client.flush()
            assert srv.open_leases == 0 and client.quarantined_bytes == 0
    finally:
        close_store(dst)


def test_range_reads_are_posted_one_after_another(world2):
    """Posted together, the group READs share the link and group 0 lands with the last (the H200 run of
    2026-12-02): each READ is posted only once the one before it is done, and every range is read."""
    dst = make_store(world2, True, host=64 << 20, codec=FORCE)
    try:
        with in_process_peers(world2, seqs=2) as (srv, client, seqs):
            real, posted, done, early = client.agent.agent, [], set(), []

            class Spy:
                def __getattr__(self, name):
                    return getattr(real, name)

                def transfer(self, h):
                    early.extend(p for p in posted if p not in done)  # a READ posted before this one is unfinished
                    posted.append(id(h))
                    state = real.transfer(h)
                    if state == "DONE":
                        done.add(id(h))
                    return state

                def check_xfer_state(self, h):
                    state = real.check_xfer_state(h)
                    if state == "DONE":
                        done.add(id(h))
                    return state

            client.agent.agent = Spy()
            hashes, out = _fetch_restore(world2, dst, client, srv.port, seqs[0])
            assert out.ok, out.error
            assert Expect(world2, True).check(hashes, 0, out.k, out.v) == (0, 0)
            assert len(posted) == client.last["ranges"] == 2 and not early
            client.agent.agent = real
    finally:
        close_store(dst)


@pytest.mark.parametrize("mode", ["err_state", "stall", "raise"])
def test_a_read_failing_after_group_zero_is_a_recompute(world2, mode):
    """The range READs are posted in order; the second one errs, stalls past the deadline or is refused when
    posted: the restore fails (recompute), nothing is quarantined (every handle released), the lease is released,
    and the next fetch restores exactly."""
    dst = make_store(world2, True, host=64 << 20, codec=FORCE)
    try:
        with in_process_peers(world2, seqs=2) as (srv, client, seqs):
            fa = FaultyAgent(client.agent.agent)
            client.agent.agent = fa
            post, posts = fa.transfer, []

            def second_fails(h, *a, **k):
                posts.append(1)
                if len(posts) == 2:
                    fa.arm(mode, "READ")
                return post(h, *a, **k)

            fa.transfer = second_fails
            hashes, out = _fetch_restore(world2, dst, client, srv.port, seqs[0])
            assert out.status == "failed" and isinstance(out.error, TransferError), out.error
            assert len(posts) == 2 and fa.injected[mode] == 1
            client.flush()
            assert srv.open_leases == 0 and client.quarantined_bytes == 0
            fa.transfer = post
            hashes, out = _fetch_restore(world2, dst, client, srv.port, seqs[1])
            assert out.ok, out.error
            assert Expect(world2, True).check(hashes, 0, out.k, out.v)[0] == 0
    finally:
        close_store(dst)


def test_peer_killed_between_range_reads_is_a_recompute(world2):
    """On an emulated link the range READs go one after another: the prefill process dies once range 0 landed."""
    dst = make_store(world2, True, host=64 << 20, codec=FORCE)
    peer = PeerProcess(world2, 2, 1.5)
    client = HandoffClient(ConnectorConfig(transfer_timeout_s=1.5), pace=TokenBucket(1.0, chunk_bytes=1 << 16))
    expect = Expect(world2, True)
    read_range = client._read_range
    reads = []

    def kill_after_first(*a, **k):  # the fault: the prefill process dies once range 0 landed
        read_range(*a, **k)
        reads.append(1)
        if len(reads) == 1:
            peer.kill()

    try:
        peer.start()
        seqs = transfer_sequences(world2, 2)
        client._read_range = kill_after_first
        hashes, out = _fetch_restore(world2, dst, client, peer.port, seqs[0])
        assert out.status == "failed" and isinstance(out.error, TransferError), out.error
        assert len(reads) == 1 and not peer.alive()
        client._read_range = read_range
        peer.start()
        hashes, out = _fetch_restore(world2, dst, client, peer.port, seqs[1])
        assert out.ok, out.error  # a fresh peer: the same client fetches again
        assert expect.check(hashes, 0, out.k, out.v) == (0, 0)
    finally:
        client.close()
        peer.stop()
        close_store(dst)


# ------------------------------------------------------------------------------------------------ CUDA
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("arriving", [False, True], ids=["device", "device-arriving"])
def test_blobs_in_device_memory_restore_like_host_bytes(synth, cal2, arriving):
    codec = _codec(cal2, "cuda")
    parts, blobs = _blobs(synth, codec, "cuda", lens=(256, 192))
    want_k, want_v = _plain(codec, blobs, parts, "cuda")
    buf, offs, ends, arrival, srcs = _group0_landed(blobs, device="cuda")
    _land(buf, offs, blobs, ends, 1)
    arrival.landed(1)
    torch.cuda.synchronize()
    if not arriving:
        srcs = [(buf, o, len(b)) for o, b in zip(offs, blobs)]
    dest, kk, vv = _dest(parts, "cuda")
    job = codec.fused.open(srcs)
    list(job.layers(dest=dest))
    job.finish()
    assert torch.equal(kk.view(torch.int16), want_k.view(torch.int16))
    assert torch.equal(vv.view(torch.int16), want_v.view(torch.int16))
    assert arrival.is_consumed == arriving

"""Grants registered ahead of use and rotated (issue 36's fallback): the prefill's staging arena keeps extents
registered with NIXL before a fetch needs one, so the hand-off's path registers nothing, and each registration is
granted to one lease only. Real NIXL UCX agents on loopback, a real hand-off server and client on the CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("nixl_cu13")

from dynamo_kvtc.reliability.network_faults import read_outcome  # noqa: E402
from dynamo_kvtc.reliability.testbed import BS, World  # noqa: E402
from dynamo_kvtc.transport.nixl_io import PeerAgent  # noqa: E402
from dynamo_kvtc.transport.staging import StagingArena  # noqa: E402


def test_a_lease_takes_an_extent_registered_ahead_and_its_path_registers_nothing():
    """After the first lease (which sizes the ready extents and registers on its path: nothing was ready), every
    lease takes an extent the rotator registered ahead, with its grant made: ``take`` and ``grant`` call no NIXL
    registration. The grant is what NIXL makes for that extent, and it reaches that lease's blobs."""
    pre, holder = PeerAgent("UCX", "kvtc-test-prefill"), PeerAgent("UCX", "kvtc-test-holder")
    arena = StagingArena(pre, 1 << 20, torch.device("cpu"))
    try:
        blob = bytes(range(1, 201)) * 20  # 4000 bytes: ready extents of 4 KiB
        arena.stage("first", [blob])
        assert (arena.path_registrations, arena.ready_hits) == (1, 0)  # nothing was ready yet: counted fallback
        arena.give("first")
        assert arena.flush() and arena.ready == arena.ready_slots == 2
        for i in range(6):
            (desc,) = arena.stage(f"lease-{i}", [blob])
            grant = arena.grant(f"lease-{i}")
            assert arena.path_registrations == 1  # nothing registered on the hand-off's path (the rotator may be)
            with holder.lock:
                holder.add_remote(pre.name, grant, grant=True)
            assert read_outcome(holder, (desc[0], len(blob)), pre.name) == "data"
            arena.give(f"lease-{i}")
            assert arena.flush()  # the rotator: zeroed, deregistered, and the next extent registered ahead
        assert (arena.path_registrations, arena.ready_hits) == (1, 6)
        assert arena.ready_registrations == 6 + arena.ready  # one registration per lease, plus the ones ready now
        assert arena.deregistrations == 7 and not arena._leases
        assert int(arena.buf.count_nonzero()) == 0
        big = b"\x07" * 10000  # larger than a ready extent: registered on its path (counted), and the size learnt
        arena.stage("big", [big])
        assert arena.path_registrations == 2
        arena.give("big")
        assert arena.flush() and arena.ready == 2
        arena.stage("big-again", [big])
        assert arena.path_registrations == 2 and arena.ready_hits == 7
        arena.give("big-again")
    finally:
        arena.close()
    assert arena.deregistrations == arena.registrations  # close undid every registration, ready ones too


def test_a_released_extent_is_never_granted_again_under_its_old_registration():
    """Leases rotate through a small arena until its extents are reused: each lease's registration (its serial) is
    new, an offset granted again comes under a new registration, the old one was deregistered before, and between
    its release and its next grant a holder of the old grant reads zeros there."""
    pre, holder = PeerAgent("UCX", "kvtc-test-prefill"), PeerAgent("UCX", "kvtc-test-holder")
    arena = StagingArena(pre, 64 << 10, torch.device("cpu"))
    try:
        (first,) = arena.stage("a", [b"\x11" * 4000])
        with holder.lock:
            holder.add_remote(pre.name, arena.grant("a"), grant=True)
        a_at = (first[0], 4000)
        assert read_outcome(holder, a_at, pre.name) == "data"
        arena.give("a")
        assert arena.flush()
        seen: dict[int, list[int]] = {}  # offset -> the serials it was granted under
        serials: list[int] = []
        for i in range(40):
            key = f"lease-{i}"
            (desc,) = arena.stage(key, [bytes([1 + i % 255]) * 4000])
            off, serial = desc[0] - arena.base, arena.serial(key)
            before = arena.deregistrations
            seen.setdefault(off, []).append(serial)
            serials.append(serial)
            if desc[0] != a_at[0] and not any(o == a_at[0] - arena.base for o in seen):
                assert read_outcome(holder, a_at, pre.name) == "zeros"  # lease a's old grant: zeros, nothing of a lease
            arena.give(key)
            assert arena.flush() and arena.deregistrations == before + 1  # its registration undone at release
        assert len(set(serials)) == 40  # one registration per grant
        reused = {o: s for o, s in seen.items() if len(s) > 1}
        assert len(reused) >= 10  # the arena wrapped: offsets came back ...
        assert all(len(set(s)) == len(s) for s in reused.values())  # ... each time under a new registration
        assert arena.path_registrations == 1 and arena.ready_hits == 40
    finally:
        arena.close()


def test_the_hand_off_server_stages_without_registering_on_its_path(tmp_path, synth_cal):
    """End to end: the real hand-off server and client; after a warm-up fetch of each prompt (a lease larger than
    the ready extents registers on its path, counted, and resizes them), fetches register
    nothing on the server's path (every lease took a ready extent), the blobs arrive intact and every lease's
    registration is undone once released."""
    from dynamo_kvtc.reliability.testbed import Expect, close_store, make_store, restore
    from dynamo_kvtc.reliability.transfer_faults import in_process_peers
    from dynamo_kvtc.tiers.keys import sequence_hashes

    world = World(tmp_path, seed=0, cal=synth_cal)
    expect = Expect(world, True)
    dst = make_store(world, True, host=64 << 20)
    try:
        with in_process_peers(world, "cpu", seqs=2, timeout=20.0) as (srv, client, seqs):
            keys = [sequence_hashes(t[: len(t) // BS * BS], BS) for t in seqs]
            for i in range(6):
                if i == 2:  # both prompts' sizes seen: the ready extents fit either from now on
                    warm = srv.arena("DRAM").path_registrations
                    assert 1 <= warm <= 2
                hashes = keys[i % 2]
                out = restore(world, dst, hashes, 60, source=lambda h=hashes: client.fetch("127.0.0.1", srv.port, h))
                assert out.ok, out.error
                assert expect.check(hashes, 0, out.k, out.v) == (0, 0)
                client.flush()  # the release was sent and answered
                arena = srv.arena("DRAM")
                assert arena.flush()
            assert arena.path_registrations == warm  # nothing registered on the path after the warm-up
            assert arena.ready_hits == 6 - warm
            assert srv.open_leases == 0 and not arena._leases
            assert arena.deregistrations == arena.registrations - arena.ready
    finally:
        close_store(dst)


def test_an_expired_lease_leaves_no_record_and_its_grant_reaches_nothing(tmp_path, synth_cal):
    """A fetch whose decode side never releases: after four deadlines the server expires the lease, the arena keeps
    no record of it (no registration, no grant, no bytes held), its extent is zeroed and deregistered, the grant the
    reply carried reads nothing of its blobs any more (zeros on this loopback, where a remote key is not revoked: see
    the exposure test), and a late release of it is refused."""
    import time

    from dynamo_kvtc.connector.handoff.messages import LIMITS, fetch_request
    from dynamo_kvtc.reliability.transfer_faults import in_process_peers
    from dynamo_kvtc.tiers.keys import sequence_hashes
    from dynamo_kvtc.transport.channel import ReqClient

    world = World(tmp_path, seed=0, cal=synth_cal)
    holder = PeerAgent("UCX", "kvtc-test-holder")
    with in_process_peers(world, "cpu", seqs=1, timeout=0.5) as (srv, _client, seqs):  # expiry: 4 x 0.5 s
        hashes = sequence_hashes(seqs[0][: len(seqs[0]) // BS * BS], BS)
        ch = ReqClient(f"tcp://127.0.0.1:{srv.port}", LIMITS, 20.0, name="test decode")
        try:
            reply = ch.ask(fetch_request(hashes, holder.name, holder.metadata()))
            prefill, descs = reply["agent"], [d for b in reply["blobs"] for d in b["descs"]]
            at = (descs[0][0], descs[-1][0] + descs[-1][1] - descs[0][0])
            with holder.lock:
                holder.add_remote(prefill, reply["agent_md"], grant=True)
            assert read_outcome(holder, at, prefill) == "data"  # open: the grant reaches the lease's blobs
            arena = srv.arena("DRAM")
            assert srv.open_leases == 1 and list(arena._leases) == [reply["lease"]] and arena.used >= at[1]
            end = time.monotonic() + 30
            while srv.open_leases and time.monotonic() < end:  # no release sent: the serving thread's tick expires it
                time.sleep(0.05)
            assert srv.open_leases == 0 and arena.flush()
            assert not arena._leases and arena.used == 0 and srv.staged_bytes == 0
            assert arena.deregistrations == arena.registrations - arena.ready  # only unused ready extents registered
            assert int(arena.buf.count_nonzero()) == 0
            assert read_outcome(holder, at, prefill) in ("refused", "zeros")
            assert ch.ask({"op": "release", "lease": reply["lease"], "agent": holder.name}) == {"ok": False}
        finally:
            ch.close()

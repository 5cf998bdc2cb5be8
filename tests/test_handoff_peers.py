"""The hand-off server never lets one waiting fetch hold up other peers (a fetch whose blocks are not stored yet is
parked while the serving thread answers others), and its staging arena never leaves a released lease's bytes behind
for a later reply's NIXL metadata to expose. In one process over UCX loopback, host memory."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

pytest.importorskip("nixl_cu13")

from dynamo_kvtc.connector.config import ConnectorConfig, handoff_settings  # noqa: E402
from dynamo_kvtc.connector.handoff.client import HandoffClient  # noqa: E402
from dynamo_kvtc.errors import TransferError  # noqa: E402
from dynamo_kvtc.reliability.testbed import BS, Expect, World, close_store, make_store, offload, restore  # noqa: E402
from dynamo_kvtc.reliability.transfer_faults import in_process_peers  # noqa: E402
from dynamo_kvtc.tiers.keys import sequence_hashes  # noqa: E402
from dynamo_kvtc.transport.nixl_io import PeerAgent  # noqa: E402
from dynamo_kvtc.transport.staging import StagingArena  # noqa: E402


@pytest.fixture
def world(tmp_path, synth_cal):
    return World(tmp_path, seed=0, cal=synth_cal)


def _hashes(toks):
    return sequence_hashes(toks[: len(toks) // BS * BS], BS)


def _until(cond, limit=5.0):
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, "condition not reached"
        time.sleep(0.002)


def test_a_waiting_fetch_does_not_hold_up_other_peers_or_releases(world):
    """Peer A asks for blocks whose encode has not landed; while its fetch is parked, peer B's fetch is staged,
    READ and restored exactly and B's release is answered. A's fetch is answered once its blocks are stored; a fetch
    for blocks that never land is refused after half the deadline (a recompute), and the server keeps serving."""
    dst = make_store(world, True, host=64 << 20)  # A's decode worker
    b_dst = make_store(world, True, host=64 << 20)  # B's: its own restore lane
    expect = Expect(world, True)
    cfg = ConnectorConfig(transfer_timeout_s=20.0, **handoff_settings())  # A's fetch may stay parked 10 s
    late = world.tokens(("late", 0), 6 * BS + 3)
    try:
        with in_process_peers(world, "cpu", seqs=1, timeout=20.0) as (srv, b_client, seqs):
            a_client = HandoffClient(cfg, "cpu")
            got: dict = {}

            def a_fetch(key, hashes):
                try:
                    got[key] = restore(world, dst, hashes, 60, source=lambda: a_client.fetch("127.0.0.1", srv.port,
                                                                                              hashes))  # fmt: skip
                except Exception as e:  # noqa: BLE001 - asserted below
                    got[key] = e

            try:
                t = threading.Thread(target=a_fetch, args=("late", _hashes(late)))
                t.start()
                _until(lambda: srv._rep.pending == 1)
                hashes = _hashes(seqs[0])
                t0 = time.monotonic()
                out = restore(world, b_dst, hashes, 60, source=lambda: b_client.fetch("127.0.0.1", srv.port, hashes))
                assert out.ok, out.error
                assert expect.check(hashes, 0, out.k, out.v) == (0, 0)
                b_client.flush()  # B's release was sent and answered
                assert srv._rep.pending == 1 and time.monotonic() - t0 < 10, "B waited for A's wait to end"
                assert srv.open_leases == 0  # B's lease is released
                offload(world, srv.store, late)  # A's blocks land: its parked fetch is answered
                t.join(10)
                assert got["late"].ok, got["late"].error
                assert expect.check(_hashes(late), 0, got["late"].k, got["late"].v) == (0, 0)

                srv.cfg = dataclasses.replace(srv.cfg, transfer_timeout_s=1.0)  # parked for 0.5 s from here on
                never = _hashes(world.tokens(("never", 0), 4 * BS))
                t = threading.Thread(target=a_fetch, args=("never", never))
                t.start()
                t.join(10)
                assert got["never"].status == "failed" and isinstance(got["never"].error, TransferError)
                assert "stored here" in str(got["never"].error)
                a_client.flush()
                b_client.flush()
                _until(lambda: srv._rep.pending == 0)  # the server forgets a parked fetch just after its reply went
                assert srv._rep.pending == 0 and srv.open_leases == 0 and srv.staged_bytes == 0
            finally:
                a_client.close()
    finally:
        close_store(dst)
        close_store(b_dst)


def test_a_released_lease_leaves_only_zeros_in_the_staging_arena():
    """What a peer can READ through the arena's registration: open leases' blobs and zeros, never a released one's."""
    agent = PeerAgent("UCX", "kvtc-test-arena")
    arena = StagingArena(agent, 1 << 20, torch.device("cpu"))
    try:
        assert int(arena.buf.count_nonzero()) == 0  # no stale process memory at start
        a = bytes(range(1, 201)) * 5
        b = b"\xff" * 3000
        (da,) = arena.stage("lease-a", [a])
        (db,) = arena.stage("lease-b", [b])
        oa, ob = da[0] - arena.base, db[0] - arena.base
        assert bytes(arena.buf[oa : oa + len(a)].numpy()) == a
        arena.give("lease-a")
        assert arena.flush()  # the rotator zeroed and deregistered it (off the serving thread)
        assert int(arena.buf[:ob].count_nonzero()) == 0  # lease a's extent (and the padding) is zeros
        assert bytes(arena.buf[ob : ob + len(b)].numpy()) == b  # the open lease is untouched
        arena.give("lease-b")
        assert arena.flush()
        assert int(arena.buf.count_nonzero()) == 0
    finally:
        arena.close()


# ---------------------------------------------------------------------------------------------- trusted peers
@pytest.mark.parametrize(
    "host,peers,secret,ok",
    [
        ("10.0.0.2", "", False, False),  # no secret, no list: remote loads are off
        ("127.0.0.1", "", False, True),  # ... except from loopback
        ("[::1]", "", False, True),
        ("localhost", "", False, True),
        ("10.0.0.2", "", True, True),  # a secret: only holders can answer
        ("10.0.0.2", "10.0.0.2, 10.0.0.3", False, True),  # listed: trusted without a secret
        ("10.0.0.9", "10.0.0.2,10.0.0.3", True, False),  # the list restricts even with a secret
        ("127.0.0.1", "10.0.0.2", False, False),  # ... and loopback too
        ("10.0.0.9", "*", False, True),  # explicitly any host, unauthenticated
    ],
)
def test_a_decode_worker_fetches_only_from_trusted_peers(host, peers, secret, ok, monkeypatch, tmp_path, caplog):
    import logging
    from types import SimpleNamespace

    from dynamo_kvtc.connector.handoff import params
    from dynamo_kvtc.connector.vllm.remote_prefill import REFUSED, RemotePrefill

    key = tmp_path / "secret"
    key.write_text("0123456789abcdef-shared")
    cfg = ConnectorConfig(transfer="decode", transfer_peers=peers or None, transfer_secret_file=key if secret else None)
    assert params.trusted(host, peers, secret) is ok
    remote = RemotePrefill(cfg, "engine-d", BS, lambda: None)
    p = {"do_remote_prefill": True, "kvtc_host": host, "kvtc_port": 5555, "kvtc_blocks": 4}
    req = SimpleNamespace(request_id="r", kv_transfer_params=p, prompt_token_ids=list(range(100)))
    before = params.REFUSED[params.UNTRUSTED]
    with caplog.at_level(logging.WARNING, logger="dynamo_kvtc.connector.handoff.params"):
        for _ in range(3):  # asked again every step: counted and logged once
            assert remote.applies(req) is ok
    assert params.REFUSED[params.UNTRUSTED] == before + (0 if ok else 1)
    assert len(caplog.records) == (0 if ok else 1)
    if ok:
        assert remote.load(req, [1], [2]).remote == (host, 5555)
    else:
        assert p["kvtc_choice"] == REFUSED
        with pytest.raises(ValueError):  # a caller that skips applies() still cannot build the fetch
            remote.load(req, [1], [2])


# ---------------------------------------------------------------------------------------------- chaos kinds
def test_hostile_params_poisoning_and_slow_peers_cost_a_recompute_and_nothing_else(world):
    """The chaos kinds of this file's faults at a small size: every hostile offer refused once, every poisoned or
    stalled fetch a clean miss, nothing planted indexed, other fetches unaffected."""
    from dynamo_kvtc.reliability.ledger import Ledger
    from dynamo_kvtc.reliability.peer_faults import (
        POISON_MODES,
        scenario_hostile_params,
        scenario_poisoning_peer,
        scenario_slow_peer,
    )

    ledger = Ledger()
    scenario_hostile_params(world, ledger, 40)
    scenario_poisoning_peer(world, ledger, len(POISON_MODES))
    scenario_slow_peer(world, ledger, 1)
    assert ledger.problems == []
    for kind in ("hostile_params", "poisoning_peer", "slow_peer"):
        c = ledger.kinds[kind]
        assert c["faults_injected"] > 0 and c["faults_detected"] == c["faults_injected"] == c["recomputes"], kind
        assert c["wrong_kv_served"] == c["crashes"] == c["committed_blocks_lost"] == 0, kind
    assert set(ledger.details["poisoning_peer"]) >= set(POISON_MODES)
    assert ledger.details["slow_peer"]["other_fetch_ok_while_stalled"] == 1

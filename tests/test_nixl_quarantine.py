"""The NIXL quarantine (transport/nixl_io.py) on the real POSIX backend: a buffer of a transfer NIXL did not confirm
finished is freed once NIXL later confirms its handle released, and held bytes are capped (new transfers refused, a
miss, instead of growing). Remote agents of a PeerAgent are bounded (LRU) on the real UCX backend. Failures come from
FaultyAgent (the reliability harness's wrapper around the real agent) plus a release that NIXL refuses."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

nixl = pytest.importorskip("nixl_cu13")

from dynamo_kvtc.errors import ConfigError, TransferError  # noqa: E402
from dynamo_kvtc.reliability.nixl_faults import FaultyAgent, nixl_error  # noqa: E402
from dynamo_kvtc.transport.nixl_io import NixlFiles, PeerAgent, Quarantine  # noqa: E402


class UnreleasableAgent(FaultyAgent):
    """NIXL refusing to release a handle (``release`` raises, the handle stays valid), ``refusals`` times."""

    refusals = 0

    def release_xfer_handle(self, h, *a, **k):
        if self.refusals > 0:
            self.refusals -= 1
            raise nixl_error("nixlBackendError")("NIXL_ERR_REPOST_ACTIVE (injected: still in flight)")
        return super().release_xfer_handle(h, *a, **k)


@pytest.fixture
def files():
    nf = NixlFiles(timeout_s=0.2)
    nf.agent = UnreleasableAgent(nf.agent)
    fd, path = tempfile.mkstemp()
    try:
        yield nf, fd
    finally:
        os.close(fd)
        os.unlink(path)


def _stalled_write(nf, fd, data, refusals):
    nf.agent.arm("stall", "WRITE")
    nf.agent.refusals = refusals
    with pytest.raises(TransferError, match="timed out"):
        nf.write(fd, data)


def test_a_quarantined_buffer_is_freed_once_nixl_confirms_the_release(files):
    nf, fd = files
    data = torch.arange(4096, dtype=torch.int64).to(torch.uint8)
    _stalled_write(nf, fd, data, refusals=2)  # the release fails: the write may still be running
    q = nf.quarantine
    assert q.count == 1 and nf.quarantined_bytes == 4096 and q.holds(data)
    assert q.sweep() == 0 and q.count == 1  # NIXL still says no: kept
    nf.write(fd, data)  # the next transfer sweeps first: NIXL now releases the handle, the buffer is freed
    assert q.count == 0 and nf.quarantined_bytes == 0 and q.freed == 1
    assert torch.equal(nf.read(fd, 4096), data)


def test_quarantined_bytes_are_capped_and_transfers_resume_when_released(files):
    nf, fd = files
    nf.quarantine.cap_bytes = 4096
    good = torch.full((4096,), 7, dtype=torch.uint8)
    nf.write(fd, good)
    _stalled_write(nf, fd, torch.ones(4096, dtype=torch.uint8), refusals=1000)
    with pytest.raises(TransferError, match="quarantined"):  # at the cap: a miss, nothing grows
        nf.write(fd, torch.zeros(4096, dtype=torch.uint8))
    with pytest.raises(TransferError, match="quarantined"):
        nf.read(fd, 4096)
    assert nf.quarantine.refused == 2 and nf.quarantined_bytes == 4096
    nf.agent.refusals = 0  # NIXL finally confirms
    assert torch.equal(nf.read(fd, 4096), good) and nf.quarantined_bytes == 0


def test_a_buffer_held_with_nothing_to_retry_is_never_freed():
    q = Quarantine(cap_bytes=1 << 20)
    buf = torch.empty(100, dtype=torch.uint8)
    q.hold(buf, "test")
    assert q.sweep() == 0 and q.holds(buf) and q.bytes == 100
    calls = []
    q.add_undo(buf, lambda: calls.append(1))  # still not freeable: it was held as unconfirmable
    assert q.sweep() == 0 and q.holds(buf) and not calls
    done = torch.empty(50, dtype=torch.uint8)
    q.hold(done, "test", [lambda: calls.append("release")])
    q.add_undo(done, lambda: calls.append("deregister"))
    assert q.sweep() == 1 and calls == ["release", "deregister"] and q.bytes == 100
    with pytest.raises(ConfigError):
        Quarantine(cap_bytes=-1)


def test_remote_agents_are_bounded_and_foreign_metadata_is_unloaded():
    try:
        me = PeerAgent("UCX", "kvtc-test-me", max_remotes=2)
    except TransferError as e:
        pytest.skip(f"UCX unavailable: {e}")
    peers = [PeerAgent("UCX", f"kvtc-test-peer{i}") for i in range(4)]
    with me.lock:
        for p in peers[:3]:
            me.add_remote(p.name, p.metadata())
        assert me.remotes == [peers[1].name, peers[2].name]  # peer 0, the least recently used, unloaded
        assert not me.agent.check_remote_metadata(peers[0].name)
        me.add_remote(peers[1].name, b"not even read")  # known: moved to the end, nothing loaded
        assert me.remotes == [peers[2].name, peers[1].name]
        with pytest.raises(TransferError, match="names agent"):  # metadata of peer 3 under another name
            me.add_remote("kvtc-test-someone-else", peers[3].metadata())
        assert not me.agent.check_remote_metadata(peers[3].name) and peers[3].name not in me.remotes
        me.forget(peers[2].name)
        assert me.remotes == [peers[1].name] and not me.agent.check_remote_metadata(peers[2].name)
        me.add_remote(peers[2].name, peers[2].metadata())  # loaded afresh
        assert me.agent.check_remote_metadata(peers[2].name)


def test_a_hand_off_buffer_quarantined_by_a_stalled_read_is_freed_and_deregistered_later(tmp_path):
    """The decode side's receive buffer, quarantined after a READ that stalled and whose handle NIXL would not
    release: the fetch fails (a recompute); the next fetch first retries the release and the deregistration, frees the
    buffer, and restores exactly. With the cap at zero, a fetch while anything is quarantined is refused instead."""
    from dynamo_kvtc.reliability.testbed import BS, Expect, World, close_store, make_store, restore
    from dynamo_kvtc.reliability.transfer_faults import in_process_peers
    from dynamo_kvtc.tiers.keys import sequence_hashes

    world = World(tmp_path, seed=0)
    dst = make_store(world, True, host=64 << 20)
    try:
        with in_process_peers(world, seqs=2) as (srv, client, seqs):
            fa = UnreleasableAgent(client.agent.agent)
            client.agent.agent = fa

            def fetch(toks):
                hashes = sequence_hashes(toks[: len(toks) // BS * BS], BS)
                return hashes, restore(world, dst, hashes, 60, source=lambda: client.fetch("127.0.0.1", srv.port,
                                                                                          hashes))  # fmt: skip

            fa.arm("stall", "READ")
            fa.refusals = 1000
            _, out = fetch(seqs[0])
            client.flush()
            assert out.status == "failed" and isinstance(out.error, TransferError), out.error
            held = client.quarantined_bytes
            assert held > 0 and client.quarantine.count == 1 and client.recv.buf is None
            client.quarantine.cap_bytes = 0
            _, out = fetch(seqs[1])  # still not released: at the cap, refused before a buffer is taken
            assert out.status == "failed" and "quarantined" in str(out.error)
            assert client.quarantine.refused == 1 and client.recv.buf is None
            fa.refusals = 0  # NIXL confirms: released, deregistered, freed
            hashes, out = fetch(seqs[1])
            assert out.ok, out.error
            assert Expect(world, True).check(hashes, 0, out.k, out.v)[0] == 0
            assert client.quarantined_bytes == 0 and client.quarantine.freed == 1
    finally:
        close_store(dst)


def test_the_hand_off_client_keeps_a_bounded_set_of_peer_channels():
    """Request params name the peer, so any API client can name a new one: at most MAX_PEERS channels stay open,
    the least recently used closed first."""
    from dynamo_kvtc.connector.config import ConnectorConfig
    from dynamo_kvtc.connector.handoff.client import MAX_PEERS, HandoffClient

    client = HandoffClient(ConnectorConfig(transfer="decode", transfer_timeout_s=1), "cpu")
    try:
        first = client._channel("127.0.0.1", 1)
        for port in range(2, MAX_PEERS + 10):
            client._channel("127.0.0.1", port)
            client._channel("127.0.0.1", 1)  # kept in use: never the least recently used
        assert len(client._peers) == MAX_PEERS and client._channel("127.0.0.1", 1) is first
        assert ("127.0.0.1", 2) not in client._peers and ("127.0.0.1", MAX_PEERS + 9) in client._peers
    finally:
        client.close()

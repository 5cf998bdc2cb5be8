"""What a request naming a peer can cost a decode worker, and what a peer it names can learn (issue 36, holes 3 and
4), against real hand-off clients (real NIXL UCX agents), real sockets and real stores on the CPU.

- A request naming a dead peer (``kvtc_host: 127.0.0.1, kvtc_port: 1``) costs a short handshake deadline on the
  peer lane only: a disk restore queued behind three such requests is not delayed.
- A third agent holding only the decode agent's NIXL metadata reads zeros from its receive buffer and cannot change
  a blob after it was checked (hole 1).
- With a secret, a peer the request names learns nothing until it proved it holds the cluster key: a listener
  without it sees a CURVE handshake and never the fetch (no NIXL metadata, no agent name, no hashes).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

pytest.importorskip("nixl_cu13")

from dynamo_kvtc.connector.config import ConnectorConfig, handoff_settings  # noqa: E402
from dynamo_kvtc.connector.handoff.client import HandoffClient  # noqa: E402
from dynamo_kvtc.errors import PeerUnreachableError, TransferError  # noqa: E402
from dynamo_kvtc.reliability.network_faults import read_outcome, third_party  # noqa: E402
from dynamo_kvtc.reliability.testbed import BS, Sink, World, close_store, make_store, offload  # noqa: E402
from dynamo_kvtc.transport.nixl_io import PeerAgent  # noqa: E402

SECRET = "issue-36-cluster-secret-0123456789"


@pytest.fixture
def world(tmp_path, synth_cal):
    return World(tmp_path, seed=0, cal=synth_cal)


def _disk_store(world, tmp_path):
    """A store with two sequences on disk only (a restore promotes what it read: each is measured once)."""
    store = make_store(world, True, host=64 << 10, disk=64 << 20, disk_dir=tmp_path / "disk")
    seqs = [offload(world, store, world.tokens(("d1", i), 8 * BS))[0] for i in range(2)]
    for i in range(6):  # push them out of host memory onto disk
        offload(world, store, world.tokens(("d2", i), 8 * BS))
    assert all(store.where(s[0]) == "disk" for s in seqs)
    return store, seqs


def _disk_restore_s(world, store, hashes) -> float:
    t = time.perf_counter()
    h = store.start_onboard(hashes, sink=Sink(world.L, len(hashes) * BS, world.H, world.D))
    assert h.wait(30), h.error
    return time.perf_counter() - t


@pytest.mark.parametrize("peer", ["dead", "silent"])
def test_requests_naming_a_dead_peer_do_not_delay_a_disk_restore(world, tmp_path, peer):
    """Three requests naming a peer that is not there (``dead``: port 1, nothing listening; ``silent``: a listener
    that accepts and never answers) cost the peer lane one short handshake deadline, the next ones are refused at once
    (the peer's cool-down), and a disk restore started behind them is not delayed."""
    store, (first, second) = _disk_store(world, tmp_path)
    cfg = ConnectorConfig(transfer_timeout_s=2.0, **handoff_settings())  # the 2 s deadline
    client = HandoffClient(cfg, "cpu")
    silent = socket.create_server(("127.0.0.1", 0)) if peer == "silent" else None  # backlog accepts; never answers
    port = silent.getsockname()[1] if silent is not None else 1
    try:
        alone = _disk_restore_s(world, store, first)
        t = time.perf_counter()
        dead = [
            store.start_onboard(first, sink=Sink(world.L, 8 * BS, world.H, world.D),
                                source=lambda: client.fetch("127.0.0.1", port, first))  # fmt: skip
            for _ in range(3)
        ]
        delayed = _disk_restore_s(world, store, second)
        assert delayed - alone <= 0.05 + alone, f"a disk restore took {delayed:.3f} s behind dead-peer fetches"
        for i, h in enumerate(dead):
            assert not h.wait(30) and isinstance(h.error, PeerUnreachableError)
            assert ("no handshake" if i == 0 else "failed its handshake") in str(h.error)
        assert client.connect_timeout_s == 1.0  # half the transfer deadline here
        # one short deadline for all three, not one each (and far from three 2 s transfer deadlines)
        assert time.perf_counter() - t < client.connect_timeout_s + 1.5
        assert client.gate.refused == 2
    finally:
        if silent is not None:
            silent.close()
        client.close()
        close_store(store)


class Listener:
    """A TCP listener that records every byte a connecting client sends (a relay, or a host a client named)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.got = bytearray()
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            conn.settimeout(0.2)
            # answer as a ZMTP 3.0 server offering CURVE, as the real prefill does: the client goes on to its HELLO
            conn.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00") + b"\x01"
                         + b"\x00" * 31)  # fmt: skip
            while not self._stop:
                try:
                    data = conn.recv(1 << 16)
                except TimeoutError:
                    continue
                except OSError:
                    break
                if not data:
                    break
                self.got += data
            conn.close()

    def close(self) -> None:
        self._stop = True
        self._thread.join(5)
        self.sock.close()


def test_with_a_secret_a_named_peer_gets_nothing_before_it_proved_it_holds_the_key(world, monkeypatch):
    monkeypatch.setenv("DYN_KVTC_TRANSFER_SECRET", SECRET)
    cfg = ConnectorConfig(transfer="decode", transfer_timeout_s=2.0, **handoff_settings())
    assert cfg.transfer_secret == SECRET and cfg.transfer_peers is None  # any host may be named
    client = HandoffClient(cfg, "cpu")
    relay = Listener()
    try:
        hashes = [(1 << 100) + i for i in range(4)]
        t = time.perf_counter()
        with pytest.raises(TransferError, match="no handshake"):
            client.fetch("127.0.0.1", relay.port, hashes)
        assert time.perf_counter() - t < client.connect_timeout_s + 0.5
        time.sleep(0.2)
        sent = bytes(relay.got)
        assert sent[0] == 0xFF and sent[9] == 0x7F and b"CURVE" in sent[:64]  # a greeting (then a HELLO)
        assert len(sent) < 512, f"{len(sent)} bytes sent to an unproven peer"
        md = client.agent.metadata()
        for secret in (md[:64], md[-64:], client.agent.name.encode(), hashes[0].to_bytes(16, "big")):
            assert secret not in sent
    finally:
        relay.close()
        client.close()


# ---------------------------------------------------------------------------------------------- NIXL metadata
def test_a_holder_of_the_decode_agents_metadata_reads_zeros_and_cannot_change_what_is_served(world):
    """Issue 36 hole 1: the decode agent's metadata (sent with every fetch) lets a third agent READ and WRITE the
    registered receive buffer. After a fetch landed, that buffer holds zeros (nothing of the blobs to read), and
    garbage written into it does not change what the restore checks, serves and keeps: the blobs were copied out of
    it into memory no agent can write."""
    from dynamo_kvtc.reliability.testbed import Expect, restore
    from dynamo_kvtc.reliability.transfer_faults import in_process_peers
    from dynamo_kvtc.tiers.keys import sequence_hashes

    expect = Expect(world, True)
    dst = make_store(world, True, host=64 << 20)
    third = PeerAgent("UCX", "kvtc-third-party")
    try:
        with in_process_peers(world, "cpu", seqs=1, timeout=20.0) as (srv, client, seqs):
            toks = seqs[0]
            hashes = sequence_hashes(toks[: len(toks) // BS * BS], BS)
            runs = client.fetch("127.0.0.1", srv.port, hashes)  # the READs are posted
            client.flush()  # ... and every range landed
            used = sum(len(r.blob) for r in runs)
            target = (client.recv.buf.data_ptr(), min(client.recv.buf.numel(), used + 4096))
            with third.lock:
                third.add_remote(client.agent.name, client.agent.metadata())  # all it holds
            seen = torch.full((target[1],), 0x5A, dtype=torch.uint8)
            assert third_party(third, "READ", seen, target, client.agent.name)
            assert int(seen.count_nonzero()) == 0, "the blobs stay readable through the receive buffer"
            garbage = torch.randint(0, 256, (target[1],), dtype=torch.uint8)
            assert third_party(third, "WRITE", garbage, target, client.agent.name)
            seen.zero_()
            assert third_party(third, "READ", seen, target, client.agent.name)
            assert torch.equal(seen, garbage)  # the WRITE did land in the registered buffer
            out = restore(world, dst, hashes, 60, source=lambda: runs)  # checked and decoded after the WRITE
            assert out.ok, out.error
            assert expect.check(hashes, 0, out.k, out.v) == (0, 0)
            again = restore(world, dst, hashes, 60)  # what was kept for later turns is the peer's blob, too
            assert again.ok and expect.check(hashes, 0, again.k, again.v) == (0, 0)
    finally:
        close_store(dst)


def _extent(reply: dict) -> tuple[int, int]:
    """(address, length) of what a fetch reply's lease staged: its first blob's start to its last blob's end."""
    descs = [d for b in reply["blobs"] for d in b["descs"]]
    return descs[0][0], descs[-1][0] + descs[-1][1] - descs[0][0]


def test_a_prefill_grant_reaches_its_own_lease_alone_and_nothing_once_it_ended(world):
    """Issue 36 hole 1, the prefill side: the metadata a fetch reply carries names that lease's staging extent alone.
    A third agent holding lease A's metadata reads lease A's blobs while A is open, is refused lease B's extent
    (open at the same time) for READ and WRITE, and once A was released reads nothing of A's or of a later lease's
    blobs (the extent was zeroed and deregistered; a later lease is staged elsewhere). Before, the reply carried the
    agent's whole metadata, which reached every lease in the arena."""
    from dynamo_kvtc.connector.handoff.messages import LIMITS, fetch_request
    from dynamo_kvtc.reliability.transfer_faults import in_process_peers
    from dynamo_kvtc.tiers.keys import sequence_hashes
    from dynamo_kvtc.transport.channel import ReqClient

    third = PeerAgent("UCX", "kvtc-third-party")
    with in_process_peers(world, "cpu", seqs=2, timeout=20.0) as (srv, client, seqs):
        keys = [sequence_hashes(t[: len(t) // BS * BS], BS) for t in seqs]
        ch = ReqClient(f"tcp://127.0.0.1:{srv.port}", LIMITS, 20.0, name="test decode")
        try:
            me, other = (third.name, third.metadata()), (client.agent.name, client.agent.metadata())
            lease_a = ch.ask(fetch_request(keys[0], *me))  # the third agent is lease A's decode side
            lease_b = ch.ask(fetch_request(keys[1], *other))  # another decode worker's lease, open at once
            prefill = lease_a["agent"]
            assert lease_a["agent_md"] != lease_b["agent_md"]  # one grant per lease
            with third.lock:
                third.add_remote(prefill, lease_a["agent_md"])  # all the third agent holds
            a, b = _extent(lease_a), _extent(lease_b)
            assert a[0] + a[1] <= b[0] or b[0] + b[1] <= a[0]
            assert read_outcome(third, a, prefill) == "data"  # its own lease: the blobs
            assert read_outcome(third, b, prefill) == "refused"  # another open lease: NIXL finds no registration
            garbage = torch.randint(1, 256, (b[1],), dtype=torch.uint8)
            assert not third_party(third, "WRITE", garbage, b, prefill)
            assert ch.ask({"op": "release", "lease": lease_a["lease"], "agent": third.name})["ok"]
            assert srv.arena("DRAM").flush()  # its extent zeroed and deregistered by the arena's rotator
            lease_c = ch.ask(fetch_request(keys[0], *other))  # a later lease of the same blobs
            c = _extent(lease_c)
            assert a[0] + a[1] <= c[0] or c[0] + c[1] <= a[0]  # next fit: not where lease A was
            after = read_outcome(third, a, prefill)
            # on this loopback (UCX over TCP / shared memory) a remote key is an address and is not revoked by the
            # deregistration, so the READ completes: it reads the zeros the extent was wiped to
            assert after in ("refused", "zeros"), after
            assert read_outcome(third, c, prefill) == "refused"
            assert read_outcome(third, b, prefill) == "refused"
            for lease in (lease_b, lease_c):
                assert ch.ask({"op": "release", "lease": lease["lease"], "agent": client.agent.name})["ok"]
            assert srv.open_leases == 0 and srv.staged_bytes == 0
            arena = srv.arena("DRAM")
            assert arena.flush()
            # one registration per lease (made on its path or ahead of it), each undone; only unused ready ones left
            assert arena.path_registrations + arena.ready_hits == 3 and not arena._leases
            assert arena.deregistrations == arena.registrations - arena.ready
            assert int(arena.buf.count_nonzero()) == 0
        finally:
            ch.close()


def test_fetches_waiting_on_one_peer_and_on_all_peers_are_capped(world):
    """Per-peer and total limits: while two fetches wait on a listener that never answers, a third to it is refused
    at once without a byte sent; with the total cap reached, a fetch to another peer is refused at once too."""
    from dynamo_kvtc.connector.handoff.peer_gate import PeerGate

    cfg = ConnectorConfig(transfer_timeout_s=4.0, **handoff_settings())
    client = HandoffClient(cfg, "cpu")
    silent = [socket.create_server(("127.0.0.1", 0)) for _ in range(2)]
    ports = [s.getsockname()[1] for s in silent]
    errors: list[BaseException] = []

    def fetch(port: int) -> None:
        try:
            client.fetch("127.0.0.1", port, [1 << 100])
        except TransferError as e:
            errors.append(e)

    try:
        client.gate = PeerGate(per_peer=2, total=3, cooldown_s=0.0)
        waiting = [threading.Thread(target=fetch, args=(ports[0],)) for _ in range(2)]
        for th in waiting:
            th.start()
        deadline = time.monotonic() + 5
        while sum(client.gate._open.values()) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        t = time.perf_counter()
        with pytest.raises(PeerUnreachableError, match="already wait on it"):
            client.fetch("127.0.0.1", ports[0], [1 << 100])
        assert time.perf_counter() - t < 0.5  # at once, not a handshake deadline
        other = threading.Thread(target=fetch, args=(ports[1],))
        other.start()
        while sum(client.gate._open.values()) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(PeerUnreachableError, match="in flight"):
            client.fetch("127.0.0.1", 9, [1 << 100])  # a third peer: the total is reached
        for th in [*waiting, other]:
            th.join(10)
        assert len(errors) == 3 and all(isinstance(e, PeerUnreachableError) for e in errors)
        assert client.gate.refused == 2 and not client.gate._open
    finally:
        for s in silent:
            s.close()
        client.close()

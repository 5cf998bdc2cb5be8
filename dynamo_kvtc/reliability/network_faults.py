"""Faults of a shared network: what a holder of NIXL metadata, a stranger on the control port, a request naming a
dead peer and a restore whose cancel times out can do. All against the real code (NIXL UCX agents on loopback, real
sockets, real stores):

- ``metadata_holder``: a third agent holding the decode agent's metadata (sent with every fetch) and a prefill grant
  of its own lease WRITEs garbage into the decode side's receive buffer while a fetch lands, and into the prefill's
  staging arena outside its own lease. Served KV must still be exact (``wrong_kv_served`` per wrong block
  otherwise); a refused WRITE or a restore that was exact or failed cleanly (a recompute) is ``faults_detected``.
- ``multipart_flood``: a raw ZMTP client sends frames of 8 MiB with MORE set to a sealed hand-off control port and
  never finishes the message. The port must hang up before buffering (the process grows by a few MiB at most) and
  keep serving key holders.
- ``dead_peer_stall``: three restores whose peer is not there (port 1, and a listener that never answers) queued
  ahead of a disk-tier restore: the disk restore's delay is measured (``disk_delay_ms``; a problem above 50 ms), and
  the dead fetches must fail cleanly within one short handshake deadline.
- ``cancel_timeout``: a restore whose cancel does not finish in time (a layer is being written): once the caller's
  second cancel (no deadline, what the vLLM worker does) returned, nothing may be written (each layer written after
  is ``wrong_kv_served``); a restore cancelled before its peer fetch started must not fetch.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time

import torch

from ..errors import KvtcError, PeerUnreachableError, TransferError
from ..tiers.keys import sequence_hashes
from .ledger import Ledger
from .testbed import BS, Expect, Sink, World, close_store, make_store, offload, restore

WAIT_S = 60.0


# ====================================================================================================== NIXL metadata
def third_party(third, op: str, mine: torch.Tensor, target: tuple[int, int], peer: str) -> bool:
    """``op`` (READ or WRITE) between ``mine`` (host memory) and ``target`` (address, length) of ``peer``'s DRAM, as an
    agent that holds nothing but the metadata it loaded; False when NIXL or the transport refused."""
    from ..transport.nixl_io import Quarantine, transfer

    a = third.agent
    with third.lock:
        reg = a.register_memory(mine)
        try:
            local = a.get_xfer_descs([(mine.data_ptr(), target[1], 0)], "DRAM")
            remote = a.get_xfer_descs([(target[0], target[1], 0)], "DRAM")
            transfer(a, third.errors, op, local, remote, peer, 10.0, buf=mine, quarantine=Quarantine())
        except TransferError:
            return False
        finally:
            a.deregister_memory(reg)
    return True


def read_outcome(third, target: tuple[int, int], peer: str) -> str:
    """What a READ of ``target`` through the metadata ``third`` holds gives: ``refused`` (NIXL or the transport failed
    it), ``zeros``, or ``data``."""
    seen = torch.full((target[1],), 0x5A, dtype=torch.uint8)
    if not third_party(third, "READ", seen, target, peer):
        return "refused"
    return "zeros" if int(seen.count_nonzero()) == 0 else "data"


def _third_party(third, op: str, target: tuple[int, int], peer: str) -> torch.Tensor | None:
    """:func:`third_party` with a buffer of random non-zero bytes: the buffer, or None when refused."""
    mine = torch.randint(1, 256, (target[1],), dtype=torch.uint8)
    return mine if third_party(third, op, mine, target, peer) else None


def scenario_metadata_holder(world: World, ledger: Ledger, rounds: int) -> None:
    from ..connector.handoff.messages import LIMITS, fetch_request
    from ..transport.channel import ReqClient
    from ..transport.nixl_io import PeerAgent
    from .transfer_faults import in_process_peers

    kind = "metadata_holder"
    expect = Expect(world, True)
    dst = make_store(world, True, host=64 << 20)
    third = PeerAgent("UCX", "kvtc-chaos-holder")
    try:
        with in_process_peers(world, "cpu", seqs=2, timeout=20.0) as (srv, client, seqs):
            keys = [sequence_hashes(t[: len(t) // BS * BS], BS) for t in seqs]
            ch = ReqClient(f"tcp://127.0.0.1:{srv.port}", LIMITS, 20.0, name="chaos holder")
            try:
                own = ch.ask(fetch_request(keys[1], third.name, third.metadata()))  # a lease of its own
                with third.lock:
                    third.add_remote(own["agent"], own["agent_md"], grant=True)
                for r in range(rounds):
                    hashes = keys[r % 2]
                    runs = client.fetch("127.0.0.1", srv.port, hashes)  # posted; landing now
                    with third.lock:
                        third.add_remote(client.agent.name, client.agent.metadata())
                    recv = client.recv.buf
                    target = (recv.data_ptr(), min(recv.numel(), sum(len(x.blob) for x in runs)))
                    stop, wrote = threading.Event(), [0]

                    def scribble(target=target, stop=stop, wrote=wrote) -> None:
                        while not stop.is_set():
                            wrote[0] += _third_party(third, "WRITE", target, client.agent.name) is not None
                            time.sleep(0.001)

                    th = threading.Thread(target=scribble, daemon=True)
                    th.start()
                    client.flush()
                    arena = srv.arena("DRAM")
                    ledger.add(kind, faults_injected=1)  # WRITE into the staging arena outside its own grant
                    if _third_party(third, "WRITE", (arena.base, arena.capacity), own["agent"]) is None:
                        ledger.add(kind, faults_detected=1)
                    else:
                        ledger.problem(kind, f"round {r}: a grant of one lease wrote the whole staging arena")
                    out = restore(world, dst, hashes, WAIT_S, source=lambda runs=runs: runs)
                    stop.set()
                    th.join(WAIT_S)
                    ledger.add(kind, faults_injected=1)
                    ledger.detail(kind, receive_buffer_writes=wrote[0])
                    if out.ok:
                        wrong, _ = expect.check(hashes, 0, out.k, out.v)
                        ledger.add(kind, wrong_kv_served=wrong, faults_detected=int(wrong == 0))
                        if wrong:
                            ledger.problem(kind, f"round {r}: {wrong} wrong blocks served after a WRITE")
                    else:  # refused, e.g. a section CRC that a WRITE racing the copy-out broke
                        ledger.add(kind, faults_detected=1, recomputes=1)
                        ledger.detail(kind, **{f"refused_{type(out.error).__name__}": 1})
                        ledger.detail(kind, last_refusal=str(out.error)[:200])
                ch.ask({"op": "release", "lease": own["lease"], "agent": third.name})
            finally:
                ch.close()
    finally:
        close_store(dst)


# ====================================================================================================== flood
_FLOOD_SERVER = """
import sys
from dynamo_kvtc.connector.handoff.messages import LIMITS
from dynamo_kvtc.transport.channel import Auth, RepServer
srv = RepServer("tcp://127.0.0.1", lambda m: {"ok": True}, LIMITS, name="flooded", auth=Auth(sys.argv[1].encode()))
print(srv.port, flush=True)
sys.stdin.read()
"""


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def zmtp_flood(port: int, frames: int, frame_bytes: int, deadline_s: float) -> tuple[socket.socket, int]:
    """A raw ZMTP 3.0 client (NULL mechanism, a DEALER) sending ``frames`` frames with MORE set and never the last
    one; (the open connection, the bytes the server took before it hung up or the deadline passed)."""
    greeting = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31
    ready = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    chunk = os.urandom(1 << 20)
    sent, end = 0, time.monotonic() + deadline_s
    s = socket.create_connection(("127.0.0.1", port), timeout=2)
    try:
        s.sendall(greeting)
        s.sendall(b"\x04" + bytes([len(ready)]) + ready)
        for _ in range(frames):
            s.sendall(b"\x03" + struct.pack(">Q", frame_bytes))  # LONG | MORE: never a last frame
            for _ in range(frame_bytes // len(chunk)):
                if time.monotonic() > end:
                    return s, sent
                s.sendall(chunk)
                sent += len(chunk)
    except OSError:  # the server hung up
        pass
    return s, sent


def scenario_multipart_flood(world: World, ledger: Ledger, rounds: int) -> None:
    from ..connector.handoff.messages import LIMITS
    from ..transport.channel import Auth, ReqClient

    kind = "multipart_flood"
    secret = f"chaos-flood-secret-{world.seed}-0123456789abcdef"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    proc = subprocess.Popen([sys.executable, "-c", _FLOOD_SERVER, secret], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        port = int(proc.stdout.readline())
        time.sleep(0.5)
        base = _rss_mib(proc.pid)
        worst = 0.0
        for r in range(rounds):
            ledger.add(kind, faults_injected=1)
            conn, sent = zmtp_flood(port, frames=12, frame_bytes=8 << 20, deadline_s=20)
            time.sleep(0.3)
            grew = _rss_mib(proc.pid) - base  # the flooding connection still open
            conn.close()
            worst = max(worst, grew)
            try:
                c = ReqClient(f"tcp://127.0.0.1:{port}", LIMITS, 5.0, auth=Auth(secret.encode()))
                served = c.ask({"op": "x"}) == {"ok": True}
                c.close()
            except KvtcError:
                served = False
            if grew <= 8 and served:
                ledger.add(kind, faults_detected=1)
            else:
                ledger.problem(kind, f"round {r}: grew {grew:.1f} MiB on {sent >> 20} MiB sent; still serving {served}")
        ledger.detail(kind, max_growth_mib=round(worst, 1))
    finally:
        proc.stdin.close()
        if proc.wait(10) is None:
            proc.kill()


# ====================================================================================================== dead peers
def scenario_dead_peer_stall(world: World, ledger: Ledger, rounds: int) -> None:
    from ..connector.config import ConnectorConfig, handoff_settings
    from ..connector.handoff.client import HandoffClient

    kind = "dead_peer_stall"
    disk_dir = world.workdir / "dead-peer-disk"
    store = make_store(world, True, host=64 << 10, disk=64 << 20, disk_dir=disk_dir)
    client = HandoffClient(ConnectorConfig(transfer_timeout_s=2.0, **handoff_settings()), "cpu")
    expect = Expect(world, True)
    try:
        seqs = [offload(world, store, world.tokens(("dead-peer", i), 8 * BS))[0] for i in range(2 * rounds + 1)]
        for i in range(8):  # push them out of host memory onto disk
            offload(world, store, world.tokens(("dead-peer-fill", i), 8 * BS))

        def disk_restore(hashes):
            t = time.perf_counter()
            out = restore(world, store, hashes, WAIT_S)
            return time.perf_counter() - t, out

        alone, _ = disk_restore(seqs[-1])
        worst = 0.0
        for r in range(rounds):
            silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
            ports = [1, silent.getsockname()[1], 1]
            try:
                t = time.perf_counter()
                dead = [store.start_onboard(seqs[2 * r], sink=Sink(world.L, 8 * BS, world.H, world.D),
                                            source=lambda p=p, k=seqs[2 * r]: client.fetch("127.0.0.1", p, k))
                        for p in ports]  # fmt: skip
                took, out = disk_restore(seqs[2 * r + 1])
                worst = max(worst, took - alone)
                if not out.ok or expect.check(seqs[2 * r + 1], 0, out.k, out.v)[0]:
                    ledger.problem(kind, f"round {r}: the disk restore failed or was wrong: {out.error}")
                if took - alone > 0.05:
                    ledger.problem(kind, f"round {r}: the disk restore waited {1e3 * (took - alone):.0f} ms")
                for h in dead:
                    ledger.add(kind, faults_injected=1)
                    if not h.wait(WAIT_S) and isinstance(h.error, PeerUnreachableError):
                        ledger.add(kind, faults_detected=1, recomputes=1)
                    else:
                        ledger.problem(kind, f"round {r}: a dead-peer restore ended {h.error!r}")
                ledger.detail(kind, dead_fetches_s=round(time.perf_counter() - t, 2))
            finally:
                silent.close()
        ledger.detail(kind, disk_alone_ms=round(1e3 * alone, 1), disk_delay_ms=round(1e3 * worst, 1),
                      refused_at_once=client.gate.refused)  # fmt: skip
    finally:
        client.close()
        close_store(store)


# ====================================================================================================== cancel
class _SlowSink(Sink):
    """A sink whose every layer write takes ``delay_s``; records when each write ended."""

    def __init__(self, world: World, tokens: int, delay_s: float) -> None:
        super().__init__(world.L, tokens, world.H, world.D)
        self.delay_s, self.ends = delay_s, []

    def __call__(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        time.sleep(self.delay_s)
        super().__call__(layer, start, k, v)
        self.ends.append(time.perf_counter())


def scenario_cancel_timeout(world: World, ledger: Ledger, rounds: int) -> None:
    from .queue_faults import SlowPeer

    kind = "cancel_timeout"
    store = make_store(world, True, host=64 << 20)
    try:
        for r in range(rounds):
            hashes, _ = offload(world, store, world.tokens(("cancel-timeout", r), 4 * BS))
            sink = _SlowSink(world, 4 * BS, 0.2)
            h = store.start_onboard(hashes, sink=sink)
            deadline = time.monotonic() + WAIT_S
            while not sink.ends and time.monotonic() < deadline:  # a layer was written; the next is being written
                time.sleep(0.005)
            time.sleep(0.05)
            ledger.add(kind, faults_injected=1)
            if h.cancel(0.01):  # the layer in progress takes 0.2 s: this cancel times out
                ledger.problem(kind, f"round {r}: a cancel during a 0.2 s layer write returned in 10 ms")
            h.cancel(None)  # what the worker does next: wait until the restore let go of its blocks
            let_go = time.perf_counter()
            h.wait(WAIT_S)
            late = sum(t > let_go for t in sink.ends)
            ledger.add(kind, wrong_kv_served=late)
            if late:
                ledger.problem(kind, f"round {r}: {late} layers written after the restore let go")
            else:
                ledger.add(kind, faults_detected=1, recomputes=int(not h.ok))
            # a restore queued behind a slow peer fetch and cancelled before it started must not fetch
            slow = SlowPeer(store, hashes)
            first = store.start_onboard(hashes, sink=Sink(world.L, 4 * BS, world.H, world.D), source=slow)
            if not slow.asked.wait(WAIT_S):
                raise KvtcError("the slow peer was never asked")
            asked = threading.Event()

            def source(asked=asked, hashes=hashes):
                asked.set()
                return store.export(hashes)[0]

            queued = store.start_onboard(hashes, sink=Sink(world.L, 4 * BS, world.H, world.D), source=source)
            ledger.add(kind, faults_injected=1)
            queued.cancel(0)
            slow.answer()
            first.wait(WAIT_S)
            queued.wait(WAIT_S)
            if asked.is_set() or not queued.finished:
                ledger.problem(kind, f"round {r}: a restore cancelled before its fetch fetched ({asked.is_set()})")
            else:
                ledger.add(kind, faults_detected=1, recomputes=1)
    finally:
        close_store(store)

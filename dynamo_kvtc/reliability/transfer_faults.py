"""Faults in the compressed prefill->decode transfer between two processes over NIXL: failed, stalled, corrupted
and dropped READs, a killed peer, and malformed control messages both ways."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

from ..connector.handoff.messages import LIMITS
from ..errors import TransferError
from ..tiers.keys import sequence_hashes
from ..transport.channel import Limits, pack, unpack
from .ledger import Ledger
from .nixl_faults import FaultyAgent
from .process import child_cmd, drain, wait_marker
from .testbed import BS, Expect, Outcome, World, account_faulted_restore, close_store, make_store, offload, restore


# ====================================================================================================== transfer
def transfer_sequences(world: World, n: int) -> list[list[int]]:
    return [world.tokens(("xfer", i), (6 + 3 * i) * BS + 5) for i in range(n)]


@contextlib.contextmanager
def in_process_peers(world: World, device: Any = "cpu", server: Any = None, seqs: int = 3, timeout: float = 3.0):
    """A prefill store (``seqs`` transfer sequences offloaded) behind a hand-off server and a decode client, both in
    this process (staging and receive memory on ``device``); yields ``(server, client, sequences)``. ``server``
    builds the server from ``(cfg, store, device=...)`` (default :class:`HandoffServer`; a liar for fault tests);
    ``timeout``: both sides' transfer deadline."""
    from ..connector.config import ConnectorConfig, handoff_settings
    from ..connector.handoff.client import HandoffClient
    from ..connector.handoff.server import HandoffServer

    cfg = ConnectorConfig(transfer_timeout_s=timeout, transfer_staging_mb=32, **handoff_settings())
    src = make_store(world, True, host=64 << 20)
    tokens = transfer_sequences(world, seqs)
    for toks in tokens:
        offload(world, src, toks)
    srv = (server or HandoffServer)(cfg, src, device=device)
    client = HandoffClient(cfg, device)
    try:
        yield srv, client, tokens
    finally:
        client.close()
        srv.close()
        close_store(src)


def child_server(world: World, args: dict) -> None:
    from ..connector.config import ConnectorConfig, handoff_settings
    from ..connector.handoff.server import HandoffServer

    store = make_store(world, True, host=64 << 20)
    for toks in transfer_sequences(world, args["seqs"]):
        offload(world, store, toks)
    srv = HandoffServer(ConnectorConfig(transfer_timeout_s=args["timeout"], **handoff_settings()), store)
    print(f"PORT {srv.port}", flush=True)
    sys.stdin.read()  # serve until the parent closes our stdin (or dies)
    srv.close()


class PeerProcess:
    """The prefill side in its own process: a real KvtcStore behind a HandoffServer."""

    def __init__(self, world: World, seqs: int, timeout: float, secret: str | None = None) -> None:
        self.world, self.seqs, self.timeout = world, seqs, timeout
        self.secret = secret  # the hand-off's shared secret (DYN_KVTC_TRANSFER_SECRET in the child), or None
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.starts = 0

    def start(self) -> None:
        self.proc = subprocess.Popen(
            child_cmd("server", workdir=str(self.world.workdir), seed=self.world.seed, seqs=self.seqs, timeout=4.0),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                **({"DYN_KVTC_TRANSFER_SECRET": self.secret} if self.secret else {}),
            },
        )
        line = wait_marker(self.proc, "PORT", 120)
        if line is None:
            self.stop()
            raise RuntimeError("the transfer peer did not start")
        drain(self.proc)
        self.port = int(line.split()[1])
        self.starts += 1

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


TRANSFER_MODES = ("raise", "err_state", "stall", "corrupt", "drop", "descs_none", "kill_peer", "peer_gone")


def scenario_transfer(
    world: World, ledger: Ledger, rounds: int, timeout: float = 1.5, modes: Sequence[str] = TRANSFER_MODES
) -> None:
    """The compressed prefill->decode transfer between two processes over NIXL (UCX), with the decode side's real
    agent wrapped to fail transfers, time out, corrupt bytes, and with the prefill process killed before the fetch
    and in the middle of it (remote disconnect). A failed fetch must fail the restore (the engine recomputes); a
    clean fetch after it must restore bit for bit."""
    from ..connector.config import ConnectorConfig, handoff_settings
    from ..connector.handoff.client import HandoffClient

    kind = "nixl_transfer"
    seqs = transfer_sequences(world, 4)
    peer = PeerProcess(world, len(seqs), timeout)
    client = HandoffClient(ConnectorConfig(transfer_timeout_s=timeout, **handoff_settings()))
    agent = FaultyAgent(client.agent.agent, seed=world.seed)
    client.agent.agent = agent
    agent.on_kill = peer.kill
    store = make_store(world, True, host=64 << 20)
    expect = Expect(world, True)
    try:
        peer.start()

        def fetch_restore(toks: list[int]) -> tuple[list[int], Outcome]:
            hashes = sequence_hashes(toks[: len(toks) // BS * BS], BS)
            port = peer.port
            return hashes, restore(world, store, hashes, 60, source=lambda: client.fetch("127.0.0.1", port, hashes))

        for r in range(rounds):
            mode = modes[r % len(modes)]
            toks = seqs[r % len(seqs)]
            if not peer.alive():
                peer.start()
            if mode == "peer_gone":
                peer.kill()
            else:
                agent.arm(mode, None if mode == "descs_none" else "READ")
            hashes, out = fetch_restore(toks)
            agent.disarm()
            ledger.add(kind, faults_injected=1)
            ledger.detail(kind, **{mode: 1})
            account_faulted_restore(ledger, kind, mode, out, expect, hashes)
            if not peer.alive():
                peer.start()
            hashes, out = fetch_restore(toks)  # the fault is gone: a clean fetch restores exactly
            if out.ok:
                wrong, _ = expect.check(hashes, 0, out.k, out.v)
                ledger.add(kind, wrong_kv_served=wrong)
                ledger.detail(kind, clean_fetches_ok=1)
            else:
                ledger.problem(kind, f"clean fetch after {mode} failed: {out.error}")
                ledger.detail(kind, clean_fetches_failed=1)
        ledger.detail(kind, peer_starts=peer.starts, quarantined_bytes=client.quarantined_bytes)
        scenario_transfer_malformed(world, ledger, peer, client)
    finally:
        peer.stop()
        close_store(store)


def _lying_replies(client: Any, hashes: list[int]) -> list[bytes]:
    """Replies of a fake prefill peer that lie about sizes, blocks or layout, are not msgpack or are too big."""
    from ..connector.handoff.messages import MAX_MESSAGE

    blob = {"size": 100, "first": 0, "count": len(hashes), "j": 0, "meta": {"hashes": hashes}, "descs": [[4096, 100]]}
    base = {"lease": "x", "agent": client.agent.name + "-fake", "agent_md": client.agent.metadata()}
    return [
        b"\xc1\xc1 not msgpack",
        pack([1, 2, 3]),
        pack({"lease": "x"}),
        pack({**base, "blobs": [{**blob, "meta": {"hashes": [h ^ 1 for h in hashes]}}]}),
        pack({**base, "blobs": [{**blob, "count": len(hashes) - 1}]}),
        pack({**base, "blobs": [{**blob, "j": 1}]}),
        pack({**base, "blobs": [{**blob, "size": 1 << 40, "descs": [[4096, 1 << 40]]}]}),
        pack({**base, "blobs": [{**blob, "descs": [[4096, 99]]}]}),
        pack({**base, "blobs": [{**blob, "descs": [[4096, -100]]}]}),
        pack({**base, "blobs": [{**blob, "size": True}]}),
        pack({**base, "agent": "../../etc", "blobs": [blob]}),
        pack({**base, "blobs": [blob] * 2}),
        pack({**base, "blobs": [{**blob, "descs": [[4096, 100]] * 70000}]}),
        b"\x00" * (MAX_MESSAGE + 1024),  # bigger than any control message: dropped before it is buffered
    ]


def _fetch_from_liar(ledger: Ledger, kind: str, client: Any, hashes: list[int]) -> None:
    """The client fetches from a fake peer answering each request with the next lying reply: each must be refused."""
    import zmq

    lying = _lying_replies(client, hashes)
    fake = zmq.Context.instance().socket(zmq.REP)
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    queue = list(lying)

    def serve() -> None:
        poller = zmq.Poller()
        poller.register(fake, zmq.POLLIN)
        while not stop.is_set():
            if not poller.poll(50):
                continue
            fake.recv()
            reply = queue.pop(0) if queue else pack({"ok": True})
            fake.send(reply)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        for i in range(len(lying)):
            ledger.add(kind, faults_injected=1)
            try:
                got = client.fetch("127.0.0.1", port, hashes)
                ledger.problem(kind, f"lying reply {i} accepted ({len(got)} runs)")
            except TransferError:
                ledger.add(kind, faults_detected=1, recomputes=1)
            except Exception as e:
                ledger.add(kind, crashes=1)
                ledger.problem(kind, f"lying reply {i}: {type(e).__name__} escaped: {e}")
            if i == len(lying) - 1:  # the REQ/REP pair is out of step after a dropped message: start a new fake
                break
    finally:
        stop.set()
        t.join(2)
        fake.close(0)


def _garbage_to_peer(ledger: Ledger, kind: str, peer: PeerProcess, hashes: list[int]) -> None:
    """Garbage requests to the real prefill peer: each refused with an error reply."""
    import zmq

    raw = zmq.Context.instance().socket(zmq.REQ)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVTIMEO, 5000)
    raw.connect(f"tcp://127.0.0.1:{peer.port}")
    bad_requests = [
        b"\xc1 garbage",
        pack({"op": "fetch", "hashes": [-1], "agent": "a", "agent_md": b"x"}),
        pack({"op": "fetch", "hashes": list(range(1 << 17)), "agent": "a", "agent_md": b"x"}),
        pack({"op": "fetch", "hashes": [1], "agent": "a\x00b", "agent_md": b"x"}),
        pack({"op": "fetch", "hashes": hashes, "agent": "evil", "agent_md": b"not nixl metadata"}),
        pack({"op": "explode"}),
    ]
    try:
        for i, req in enumerate(bad_requests):
            ledger.add(kind, faults_injected=1)
            try:
                raw.send(req)
                reply = unpack(raw.recv(), LIMITS, what="prefill peer reply")
            except (zmq.ZMQError, TransferError) as e:
                ledger.add(kind, crashes=1)
                ledger.problem(kind, f"bad request {i}: the peer did not answer ({e})")
                break
            if isinstance(reply, dict) and "error" in reply:
                ledger.add(kind, faults_detected=1)
            else:
                ledger.problem(kind, f"bad request {i} was not refused: {reply!r:.100}")
    finally:
        raw.close(0)


def scenario_transfer_malformed(world: World, ledger: Ledger, peer: PeerProcess, client: Any) -> None:
    """Hostile or broken control messages: replies from a fake prefill peer that lie about sizes, blocks or layout,
    are not msgpack or are too big; garbage requests to the real prefill peer, which must keep serving."""
    kind = "transfer_malformed"
    hashes = sequence_hashes(transfer_sequences(world, 1)[0][: 6 * BS], BS)
    _fetch_from_liar(ledger, kind, client, hashes)
    if not peer.alive():
        peer.start()
    _garbage_to_peer(ledger, kind, peer, hashes)
    if not peer.alive():
        ledger.add(kind, crashes=1)
        ledger.problem(kind, "the prefill peer died on garbage requests")
        return
    store = make_store(world, True, host=16 << 20)
    try:
        out = restore(world, store, hashes, 60, source=lambda: client.fetch("127.0.0.1", peer.port, hashes))
        if not out.ok:
            ledger.problem(kind, f"the prefill peer stopped serving after garbage requests: {out.error}")
        else:
            wrong, _ = Expect(world, True).check(hashes, 0, out.k, out.v)
            ledger.add(kind, wrong_kv_served=wrong)
    finally:
        close_store(store)


# ====================================================================================================== staged memory
LIES = ("past_arena", "short_blob", "foreign_device")
RANGE_LIES = ("ranges_past_blob", "ranges_overlap", "ranges_short", "ranges_misplaced")


def _lie_about_ranges(blobs: list[dict[str, Any]], lie: str) -> None:
    """Per-layer-group byte ranges that end past the blob, overlap, stop short of it, or tile it but not by group
    (the first range ending inside the header)."""
    for b in blobs:
        n = b["size"]
        if lie == "ranges_past_blob":
            b["ranges"] = [*b.get("ranges", [n])[:-1], n + 4096]
        elif lie == "ranges_overlap":
            b["ranges"] = [n // 2, n // 4, n]
        elif lie == "ranges_short":
            b["ranges"] = [*b.get("ranges", [n])[:-1], n - 1]
        else:
            b["ranges"] = [20, n]


def lying_server(cfg: Any, store: Any, lie: str, device: Any = None) -> Any:
    """A real :class:`HandoffServer` that stages and registers honestly but describes the staged bytes wrongly in
    its replies (``lie`` in :data:`LIES`): descriptors past the end of its registered arena (sizes still add up), a
    blob one byte shorter than staged (first descriptor and size), or another device's memory; or (``lie`` in
    :data:`RANGE_LIES`) the blobs' layer-group byte ranges. The decode side must fail the fetch (the engine
    recomputes) — or, for ranges that tile the blobs, restore them exactly — never read wrong bytes into KV, and
    keep fetching from honest peers."""
    from ..connector.handoff.server import HandoffServer

    if lie not in LIES + RANGE_LIES:
        raise ValueError(f"lie must be one of {LIES + RANGE_LIES}")

    class LyingServer(HandoffServer):
        def _stage(self, *args: Any) -> dict[str, Any]:
            reply = super()._stage(*args)
            b = reply["blobs"][0]
            if lie in RANGE_LIES:
                _lie_about_ranges(reply["blobs"], lie)
            elif lie == "past_arena":
                arena = self.arena(reply["mem"])
                b["descs"] = [[arena.base + arena.capacity + 4096 * (i + 1), n] for i, (_, n) in enumerate(b["descs"])]
            elif lie == "short_blob":
                b["size"] -= 1
                b["descs"][0][1] -= 1
            else:
                reply["dev"] = int(reply.get("dev", 0)) + 7
                reply["mem"] = "VRAM"
            return reply

    return LyingServer(cfg, store, device)


# ====================================================================================================== authentication
AUTH_SECRET = "chaos-shared-secret-0123456789"
SEALED = Limits(max_message=LIMITS.max_message + 256, max_str=1 << 16, max_bin=LIMITS.max_message)


def _client(world: World, timeout: float, secret: str | None) -> Any:
    """A decode-side hand-off client holding ``secret`` (through a secret file, as a deployment would) or none."""
    from ..connector.config import ConnectorConfig, handoff_settings
    from ..connector.handoff.client import HandoffClient

    path = None
    if secret is not None:
        path = world.workdir / f"secret-{abs(hash(secret)) % 10**8}"
        path.write_text(secret + "\n")
        path.chmod(0o600)
    return HandoffClient(ConnectorConfig(transfer_timeout_s=timeout, transfer_secret_file=path, **handoff_settings()))


def _replay(peer: PeerProcess, hashes: list[int], client: Any) -> tuple[bool, bool]:
    """Send one correctly sealed fetch twice, as an insider would (a key holder's CURVE socket: a sniffer sees only
    ciphertext since the channel runs CURVE): (first served, replay refused)."""
    import zmq

    from ..connector.handoff.messages import fetch_request
    from ..transport.curve import curve_keys, secure_client

    sealed, nonce = client.auth.seal_request(pack(fetch_request(hashes, client.agent.name, client.agent.metadata())))
    replies = []
    for _ in range(2):
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        secure_client(sock, curve_keys(client.auth.derive))
        sock.connect(f"tcp://127.0.0.1:{peer.port}")
        try:
            sock.send(sealed)
            replies.append(unpack(sock.recv(), SEALED, what="sealed reply"))
        finally:
            sock.close(0)
    first = "body" in replies[0] and "error" not in unpack(client.auth.open_reply(replies[0], nonce), LIMITS)
    if first:  # give the staged blobs back, authenticated
        lease = unpack(client.auth.open_reply(replies[0], nonce), LIMITS).get("lease", "")
        client.release("127.0.0.1", peer.port, lease)
    return first, "body" not in replies[1] and "replayed" in str(replies[1].get("error", ""))


def scenario_transfer_auth(world: World, ledger: Ledger, timeout: float = 2.0) -> None:
    """An authenticated prefill peer (shared secret): requests without a MAC, with a MAC of another secret, and a
    replayed sealed request must each be refused (a miss, never blobs); the right secret still restores exactly."""
    kind = "transfer_auth"
    hashes = sequence_hashes(transfer_sequences(world, 1)[0][: 6 * BS], BS)
    peer = PeerProcess(world, 1, timeout, secret=AUTH_SECRET)
    good = _client(world, timeout, AUTH_SECRET)
    attempts = {
        "no_mac": _client(world, timeout, None),
        "wrong_secret": _client(world, timeout, "another-secret-0123456"),
    }
    store = make_store(world, True, host=16 << 20)
    try:
        peer.start()
        for mode, client in attempts.items():
            fetch = functools.partial(client.fetch, "127.0.0.1", peer.port, hashes)
            ledger.add(kind, faults_injected=1)
            ledger.detail(kind, **{mode: 1})
            out = restore(world, store, hashes, 60, source=fetch)
            if out.ok:
                ledger.problem(kind, f"{mode}: an unauthenticated fetch was served")
                wrong, _ = Expect(world, True).check(hashes, 0, out.k, out.v)
                ledger.add(kind, wrong_kv_served=wrong)
            elif out.status == "failed":
                ledger.add(kind, faults_detected=1, recomputes=1)
            else:
                ledger.add(kind, crashes=1)
                ledger.problem(kind, f"{mode}: restore {out.status}: {out.error}")
        ledger.add(kind, faults_injected=1)
        ledger.detail(kind, replay=1)
        first, refused = _replay(peer, hashes, good)
        if refused:
            ledger.add(kind, faults_detected=1)
        else:
            ledger.problem(kind, "a replayed sealed request was not refused")
        if not first:
            ledger.problem(kind, "a correctly sealed request was not served")
        out = restore(world, store, hashes, 60, source=lambda: good.fetch("127.0.0.1", peer.port, hashes))
        if out.ok:
            wrong, _ = Expect(world, True).check(hashes, 0, out.k, out.v)
            ledger.add(kind, wrong_kv_served=wrong)
            ledger.detail(kind, authenticated_fetch_ok=1)
        else:
            ledger.problem(kind, f"the authenticated fetch failed: {out.error}")
        if not peer.alive():
            ledger.add(kind, crashes=1)
            ledger.problem(kind, "the prefill peer died")
    finally:
        peer.stop()
        close_store(store)

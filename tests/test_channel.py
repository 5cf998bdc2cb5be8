"""The control channel (dynamo_kvtc/transport/channel.py) over real ZMQ sockets on loopback and IPC."""

from __future__ import annotations

import hmac
import math
import os
import struct
import tempfile
import time

import hypothesis as hyp
import msgpack
import pytest
import zmq
from hypothesis import strategies as hst

from dynamo_kvtc.errors import ConfigError, CorruptBlobError, TransferError
from dynamo_kvtc.transport.channel import Auth, Limits, RepServer, ReqClient, pack, unpack
from dynamo_kvtc.transport.curve import curve_keys, secure_client

LIMITS = Limits(max_message=4096, max_str=64, max_bin=128, max_array=32, max_map=8)


def _echo(msg: dict) -> dict:
    if msg.get("op") == "boom":
        raise ValueError("handler failed")
    return {"echo": msg}


@pytest.fixture
def server():
    srv = RepServer("tcp://127.0.0.1", _echo, LIMITS, name="test-rep")
    yield srv
    srv.close()


def test_round_trip_and_counts(server):
    cli = ReqClient(f"tcp://127.0.0.1:{server.port}", LIMITS, 2.0, name="test peer")
    try:
        msg = {"op": "x", "v": [1, 2, 3], "b": b"\x00\x01"}
        assert cli.ask(msg) == {"echo": msg}
        with pytest.raises(TransferError, match="refused: ValueError: handler failed"):
            cli.ask({"op": "boom"})
        assert cli.ask({"op": "again"})["echo"]["op"] == "again"  # the client recovered, the server kept serving
    finally:
        cli.close()
    assert server.served == 2 and server.refused == 1


def test_garbage_is_answered_with_an_error_and_the_server_keeps_serving(server):
    ctx = zmq.Context.instance()
    for raw in (b"\xc1\xc1 not msgpack", msgpack.packb([1, 2]), msgpack.packb({"s": "x" * 100}), b"\x00" * 5000):
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 500)
        sock.connect(f"tcp://127.0.0.1:{server.port}")
        sock.send(raw)
        try:
            reply = msgpack.unpackb(sock.recv())
            assert "error" in reply
        except zmq.Again:
            assert len(raw) > LIMITS.max_message  # MAXMSGSIZE drops an oversized peer without an answer
        sock.close(0)
    cli = ReqClient(f"tcp://127.0.0.1:{server.port}", LIMITS, 2.0)
    assert cli.ask({"op": "still"})["echo"] == {"op": "still"}
    cli.close()
    assert server.refused == 3


def test_no_server_is_a_transfer_error_within_the_deadline():
    path = os.path.join(tempfile.mkdtemp(), "nobody.sock")
    cli = ReqClient(f"ipc://{path}", LIMITS, 0.2, name="absent")
    t = time.monotonic()
    with pytest.raises(TransferError, match="did not answer"):
        cli.ask({"op": "x"})
    assert time.monotonic() - t < 5
    cli.close()


def test_unpack_limits_and_error_class():
    assert unpack(pack({"a": 1}), LIMITS) == {"a": 1}
    for bad, why in (
        (b"\x00" * 5000, "exceeds"),
        (msgpack.packb({"s": "x" * 65}), "not valid msgpack"),
        (msgpack.packb({"b": b"x" * 129}), "not valid msgpack"),
        (msgpack.packb({"a": list(range(33))}), "not valid msgpack"),
        (msgpack.packb({str(i): i for i in range(9)}), "not valid msgpack"),
        (msgpack.packb({1.5: 1}), "not valid msgpack"),
        (msgpack.packb(msgpack.ExtType(1, b"x")), "not valid msgpack"),
        (msgpack.packb([1]), "not a map"),
    ):
        with pytest.raises(TransferError, match=why):
            unpack(bad, LIMITS)
    with pytest.raises(CorruptBlobError, match="index record is not a map"):
        unpack(msgpack.packb(3), LIMITS, what="index record", error=CorruptBlobError)


# ---------------------------------------------------------------------------------------------- authentication
SECRET = b"0123456789abcdef-shared-secret"


@pytest.fixture
def sealed_server():
    srv = RepServer("tcp://127.0.0.1", _echo, LIMITS, name="test-auth", auth=Auth(SECRET))
    yield srv
    srv.close()


def _raw_exchange(port: int, data: bytes) -> dict:
    """One request's raw bytes to a sealed server, over a CURVE connection made with the cluster secret's keys (an
    insider's socket: what a key holder can send without the envelope's rules)."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 2000)
    secure_client(sock, curve_keys(Auth(SECRET).derive))
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send(data)
        return msgpack.unpackb(sock.recv())
    finally:
        sock.close(0)


def test_authenticated_round_trip_and_refusals(sealed_server):
    port = sealed_server.port
    good = ReqClient(f"tcp://127.0.0.1:{port}", LIMITS, 2.0, auth=Auth(SECRET))
    assert good.ask({"op": "x"}) == {"echo": {"op": "x"}}
    for client in (
        ReqClient(f"tcp://127.0.0.1:{port}", LIMITS, 0.5),  # no secret at all: no CURVE handshake
        ReqClient(f"tcp://127.0.0.1:{port}", LIMITS, 0.5, auth=Auth(b"another-secret-of-16+")),  # another secret
    ):
        with pytest.raises(TransferError, match="did not answer"):  # refused at the handshake: nothing reaches it
            client.ask({"op": "x"})
        client.close()
    assert good.ask({"op": "after"}) == {"echo": {"op": "after"}}  # the server kept serving
    # a key holder's unsealed or wrongly sealed request passes the handshake and is refused by the envelope
    assert "no sealed envelope" in _raw_exchange(port, pack({"op": "x"}))["error"]
    sealed, _ = Auth(b"another-secret-of-16+").seal_request(pack({"op": "x"}))
    assert "wrong MAC" in _raw_exchange(port, sealed)["error"]
    good.close()
    assert sealed_server.auth_refused == 2 and sealed_server.served == 2
    # a client that learnt the server's public key but holds another client key: the ZAP handler refuses it
    pub, sec = zmq.curve_keypair()
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 500)
    sock.curve_serverkey = curve_keys(Auth(SECRET).derive).server_public
    sock.curve_publickey, sock.curve_secretkey = pub, sec
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send(pack({"op": "x"}))
    with pytest.raises(zmq.Again):
        sock.recv()
    sock.close(0)
    assert sealed_server.handshake_refused >= 1 and sealed_server.served == 2


def test_replayed_and_stale_requests_are_refused(sealed_server):
    auth = Auth(SECRET)
    sealed, nonce = auth.seal_request(pack({"op": "fetch"}))
    first = _raw_exchange(sealed_server.port, sealed)
    assert unpack(auth.open_reply(first, nonce), LIMITS) == {"echo": {"op": "fetch"}}
    replay = _raw_exchange(sealed_server.port, sealed)  # the same bytes again, as a sniffer would send them
    assert "replayed" in replay["error"] and "body" not in replay
    env = msgpack.unpackb(sealed)
    env["ts"] -= 120.0  # an old request: outside the window even with a fresh nonce and a valid MAC
    env["nonce"] = b"\x01" * 16
    env["mac"] = hmac.new(
        SECRET, b"kvtc-req" + struct.pack("<d", env["ts"]) + env["nonce"] + env["body"], "sha256"
    ).digest()
    stale = _raw_exchange(sealed_server.port, msgpack.packb(env))
    assert "replay window" in stale["error"]
    assert sealed_server.auth_refused == 2


def test_a_reply_for_another_request_or_with_a_wrong_mac_is_refused():
    auth = Auth(SECRET)
    _, nonce = auth.seal_request(pack({"op": "x"}))
    reply = msgpack.unpackb(auth.seal_reply(pack({"ok": True}), nonce))
    assert unpack(auth.open_reply(reply, nonce), LIMITS) == {"ok": True}
    with pytest.raises(TransferError, match="wrong MAC"):
        auth.open_reply(reply, b"\x00" * 16)  # bound to its request's nonce
    with pytest.raises(TransferError, match="wrong MAC"):
        auth.open_reply({**reply, "body": pack({"ok": False})}, nonce)
    with pytest.raises(TransferError, match="not authenticated"):
        auth.open_reply({"error": "nope"}, nonce)


def test_the_secret_is_never_in_a_repr():
    key = b"a-very-secret-cluster-key-0123456789"
    a = Auth(key)
    for text in (repr(a), str(a), f"{a!r}", repr([a])):
        assert "secret-cluster" not in text and repr(key) not in text
    assert "window_s=30" in repr(a)  # the rest is still shown


def test_short_secrets_are_refused():
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        Auth(b"short")


def _sealed(auth: Auth, body: bytes, ts: float, nonce: bytes) -> dict:
    mac = hmac.new(auth.key, b"kvtc-req" + struct.pack("<d", ts) + nonce + body, "sha256").digest()
    return {"ts": ts, "nonce": nonce, "body": body, "mac": mac}


def test_a_replay_stays_refused_however_many_requests_came_since():
    """Nonces used to be forgotten by count (the oldest of 65 536): a replay reopened after that many requests inside
    the window. Now a nonce is held while its timestamp is in the window, and a full memory refuses new requests."""
    server = Auth(SECRET, max_nonces=64)
    client = Auth(SECRET)
    first = msgpack.unpackb(client.seal_request(pack({"op": "fetch"}))[0])
    assert server.open_request(first)[0] == pack({"op": "fetch"})
    for i in range(63):
        server.open_request(msgpack.unpackb(client.seal_request(pack({"i": i}))[0]))
    assert server.nonces_held == 64
    with pytest.raises(TransferError, match="nonce memory full"):  # the 65th: refused, nothing forgotten
        server.open_request(msgpack.unpackb(client.seal_request(pack({"i": 64}))[0]))
    with pytest.raises(TransferError, match="replayed"):
        server.open_request(first)
    assert server.nonces_held == 64


def test_nonces_age_out_with_their_window_and_never_before():
    server = Auth(SECRET, window_s=0.6, bucket_s=0.1, max_nonces=4)
    now = time.time()
    old = _sealed(server, b"x", now, b"\x01" * 16)
    server.open_request(old)
    for i in range(3):
        server.open_request(_sealed(server, b"x", now, bytes([i + 2]) * 16))
    with pytest.raises(TransferError, match="nonce memory full"):
        server.open_request(_sealed(server, b"x", now, b"\x09" * 16))
    time.sleep(0.3)  # still inside the window: remembered
    with pytest.raises(TransferError, match="replayed"):
        server.open_request(old)
    time.sleep(0.6)  # out of the window: a replay is stale, and its nonce's room is free again
    with pytest.raises(TransferError, match="replay window"):
        server.open_request(old)
    server.open_request(_sealed(server, b"x", time.time(), b"\x0a" * 16))
    assert server.nonces_held == 1


@pytest.mark.parametrize("ts", [float("nan"), float("inf"), float("-inf"), -1e308, 1e308])
def test_non_finite_and_far_timestamps_are_refused_even_with_a_valid_mac(ts):
    server = Auth(SECRET)
    with pytest.raises(TransferError, match="replay window"):
        server.open_request(_sealed(server, b"body", ts, os.urandom(16)))
    assert server.nonces_held == 0


def test_every_field_of_the_envelope_is_type_checked():
    auth = Auth(SECRET)
    good = _sealed(auth, b"body", time.time(), os.urandom(16))
    cases = [
        ({**good, "ts": int(good["ts"])}, "no sealed envelope"),
        ({**good, "ts": str(good["ts"])}, "no sealed envelope"),
        ({**good, "nonce": good["nonce"][:15]}, "no sealed envelope"),
        ({**good, "nonce": good["nonce"].hex()}, "no sealed envelope"),
        ({**good, "body": "body"}, "no sealed envelope"),
        ({**good, "extra": 1}, "no sealed envelope"),
        ({**good, "mac": good["mac"][:31]}, "wrong MAC"),
        ({**good, "mac": good["mac"] + b"\x00"}, "wrong MAC"),
        ({**good, "mac": None}, "wrong MAC"),
        ({k: v for k, v in good.items() if k != "mac"}, "wrong MAC"),
    ]
    for env, why in cases:
        with pytest.raises(TransferError, match=why):
            auth.open_request(env)
    assert auth.open_request(good)[0] == b"body" and auth.nonces_held == 1
    _, nonce = auth.seal_request(b"q")
    reply = msgpack.unpackb(auth.seal_reply(b"r", nonce))
    for env in ({**reply, "extra": 1}, {**reply, "mac": reply["mac"][:16]}, {**reply, "body": "r"}):
        with pytest.raises(TransferError, match="not authenticated"):
            auth.open_reply(env, nonce)
    assert auth.open_reply(reply, nonce) == b"r"


def test_auth_settings_are_checked():
    for kw in ({"window_s": float("nan")}, {"window_s": 0}, {"bucket_s": -1}, {"max_nonces": 0}, {"max_nonces": True}):
        with pytest.raises(ConfigError):
            Auth(SECRET, **kw)


def test_a_full_nonce_memory_over_the_wire_is_a_refusal_and_the_server_keeps_serving():
    wide = Limits(max_message=4096, max_str=1024, max_bin=128, max_array=32, max_map=8)  # room for the error text
    srv = RepServer("tcp://127.0.0.1", _echo, wide, name="test-cap", auth=Auth(SECRET, max_nonces=3))
    cli = ReqClient(f"tcp://127.0.0.1:{srv.port}", wide, 2.0, auth=Auth(SECRET))
    try:
        for i in range(3):
            assert cli.ask({"i": i}) == {"echo": {"i": i}}
        with pytest.raises(TransferError, match="nonce memory full"):
            cli.ask({"i": 3})
        assert srv.auth_refused == 1 and srv.served == 3
    finally:
        cli.close()
        srv.close()


@hyp.settings(deadline=None, database=None, max_examples=300)
@hyp.given(
    env=hst.dictionaries(
        hst.sampled_from(["ts", "nonce", "body", "mac", "x"]),
        hst.none() | hst.booleans() | hst.integers() | hst.floats() | hst.binary(max_size=40) | hst.text(max_size=4),
    ),
    ts=hst.floats() | hst.floats(-60, 60).map(lambda d: time.time() + d),  # around now: inside and outside
    resign=hst.booleans(),
)
def test_fuzzed_envelopes_open_only_when_sealed_finite_and_fresh(env, ts, resign):
    """Any envelope: TransferError, unless it is exactly a sealed request (MAC over its fields) with a finite,
    fresh timestamp — then it opens once."""
    auth = Auth(SECRET)
    if resign:  # a correctly MACed envelope with an arbitrary timestamp
        env = _sealed(auth, b"b", ts, os.urandom(16))
    try:
        body, nonce = auth.open_request(env)
    except TransferError:
        assert auth.nonces_held == 0
        return
    assert resign and math.isfinite(ts) and abs(time.time() - ts) <= auth.window_s and body == b"b"
    with pytest.raises(TransferError, match="replayed"):
        auth.open_request(env)


# ---------------------------------------------------------------------------------------------- multipart flood
_FLOOD_SERVER = """
import sys, time
from dynamo_kvtc.connector.handoff.messages import LIMITS
from dynamo_kvtc.transport.channel import Auth, RepServer
srv = RepServer("tcp://127.0.0.1", lambda m: {"ok": True}, LIMITS, name="flooded",
                auth=Auth(sys.argv[1].encode()) if len(sys.argv) > 1 else None)
print(srv.port, flush=True)
sys.stdin.read()  # until the test closes our stdin
print(srv.served, srv.refused, flush=True)
"""


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def _zmtp_flood(port: int, frames: int, frame_bytes: int, deadline_s: float):
    from dynamo_kvtc.reliability.network_faults import zmtp_flood  # the chaos kind's raw ZMTP client

    return zmtp_flood(port, frames, frame_bytes, deadline_s)


@pytest.mark.parametrize("sealed", [True, False], ids=["secret", "no-secret"])
def test_a_multipart_flood_never_finishing_does_not_grow_a_sealed_server(sealed):
    """Issue 36's reproduction: frames of 8 MiB with MORE set, never finished, at the hand-off's own limits. With a
    secret nothing of a stranger is buffered (CURVE: refused at the greeting): the server's RSS stays within a few
    MiB. Without one (a loopback-only port) libzmq holds the frames: this is what the secret buys."""
    import subprocess
    import sys

    args = [SECRET.decode()] if sealed else []
    proc = subprocess.Popen([sys.executable, "-c", _FLOOD_SERVER, *args], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        port = int(proc.stdout.readline())
        time.sleep(0.5)
        before = _rss_mib(proc.pid)
        conn, sent = _zmtp_flood(port, frames=12, frame_bytes=8 << 20, deadline_s=20)
        time.sleep(0.5)
        grew = _rss_mib(proc.pid) - before  # while the flooding connection is still open
        conn.close()
        if sealed:
            assert grew < 8, f"the server grew by {grew:.0f} MiB ({sent >> 20} MiB sent)"
            assert sent < 8 << 20  # it hung up at the greeting
        else:
            assert grew > 48  # the frames are buffered: the unauthenticated port must stay loopback-only
        if sealed:  # still serving a key holder
            c = ReqClient(f"tcp://127.0.0.1:{port}", LIMITS, 5.0, auth=Auth(SECRET))
            assert c.ask({"op": "x"}) == {"ok": True}
            c.close()
    finally:
        proc.stdin.close()
        proc.wait(10)


def test_a_key_holders_never_finished_message_is_buffered_up_to_what_it_sent_and_freed_at_hang_up():
    """What CURVE does not stop: a peer holding the cluster secret completes the handshake (a raw CURVE client,
    :mod:`dynamo_kvtc.reliability.curve_flood`) and sends encrypted frames with MORE set, never the last. libzmq
    holds every frame of a message until its last (``MAXMSGSIZE`` caps each frame, ``RCVHWM`` counts whole messages
    only; no option caps one message), so the server grows by what the holder sent — no more — while it keeps
    serving other key holders, and gives the memory back when the connection closes (docs/reliability.md)."""
    import subprocess
    import sys

    from dynamo_kvtc.reliability.curve_flood import curve_flood

    proc = subprocess.Popen([sys.executable, "-c", _FLOOD_SERVER, SECRET.decode()], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        port = int(proc.stdout.readline())
        time.sleep(0.5)
        before = _rss_mib(proc.pid)
        conn, sent = curve_flood(port, curve_keys(Auth(SECRET).derive), frames=8, frame_bytes=4 << 20, deadline_s=60)
        try:
            time.sleep(0.5)
            grew = _rss_mib(proc.pid) - before
            assert sent == 32 << 20  # every frame taken: the holder passed CURVE and the ZAP handler
            assert 24 <= grew <= 32 + 8, f"the server grew by {grew:.0f} MiB on {sent >> 20} MiB sent"
            c = ReqClient(f"tcp://127.0.0.1:{port}", LIMITS, 5.0, auth=Auth(SECRET))
            assert c.ask({"op": "x"}) == {"ok": True}  # other key holders are served meanwhile
            c.close()
        finally:
            conn.close()
        time.sleep(1.0)
        left = _rss_mib(proc.pid) - before
        assert left < 8, f"{left:.0f} MiB still held after the flooding connection closed"
    finally:
        proc.stdin.close()
        proc.wait(10)


def test_a_reply_of_more_than_one_frame_is_refused_and_the_socket_dropped():
    """A key-holding peer answering with a multipart reply: the client refuses it (one frame is a reply) and drops
    the socket with the frames libzmq buffered; the next request goes out on a fresh socket and is answered."""
    keys = curve_keys(Auth(SECRET).derive)
    ctx = zmq.Context()
    srv = ctx.socket(zmq.ROUTER)
    srv.curve_server, srv.curve_secretkey = True, keys.server_secret
    port = srv.bind_to_random_port("tcp://127.0.0.1")
    auth = Auth(SECRET)
    c = ReqClient(f"tcp://127.0.0.1:{port}", LIMITS, 5.0, auth=auth)
    server_auth = Auth(SECRET)
    try:
        import threading

        def answer(frames: int) -> None:
            ident, _, data = srv.recv_multipart()
            env = unpack(data, Limits(max_bin=4096))
            _, nonce = server_auth.open_request(env)
            reply = server_auth.seal_reply(pack({"ok": True}), nonce)
            srv.send_multipart([ident, b"", reply] + [b"\x00" * 64] * (frames - 1))

        th = threading.Thread(target=answer, args=(4,))
        th.start()
        with pytest.raises(TransferError, match="more than one frame"):
            c.ask({"op": "x"})
        th.join(10)
        th = threading.Thread(target=answer, args=(1,))
        th.start()
        assert c.ask({"op": "x"}) == {"ok": True}
        th.join(10)
    finally:
        c.close()
        srv.close(0)
        ctx.term()

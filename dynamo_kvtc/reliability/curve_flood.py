"""A secret holder's flood: a raw ZMTP 3.0 client that completes the CURVE handshake with the cluster's derived keys
(RFC 26: HELLO, WELCOME, INITIATE, READY) and then sends encrypted frames with MORE set, never the last one.

libzmq itself cannot send such a message (a socket hands a multipart message to its I/O thread only once its last
frame is written), so this client speaks the wire protocol itself, with the libsodium pyzmq ships (the system one
otherwise) through ctypes. What it shows: how much a peer that holds the cluster secret — and so passes CURVE and
the ZAP handler — can make the receiving side buffer (docs/reliability.md, "What a secret holder can do").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

from ..errors import TransferError


def _sodium() -> Any:
    import zmq

    libs = sorted(glob.glob(str(Path(zmq.__file__).parent.parent / "pyzmq.libs" / "libsodium*.so*")))
    name = libs[0] if libs else ctypes.util.find_library("sodium")
    if name is None:
        raise TransferError("no libsodium found (pyzmq's bundled one or the system's)")
    lib = ctypes.CDLL(name)
    if lib.sodium_init() < 0:
        raise TransferError("libsodium failed to initialise")
    return lib


class _Box:
    """crypto_box (Curve25519, XSalsa20, Poly1305) through libsodium, bytes in and out."""

    def __init__(self) -> None:
        self.lib = _sodium()

    def keypair(self) -> tuple[bytes, bytes]:
        pk, sk = ctypes.create_string_buffer(32), ctypes.create_string_buffer(32)
        self.lib.crypto_box_keypair(pk, sk)
        return pk.raw, sk.raw

    def seal(self, msg: bytes, nonce: bytes, pk: bytes, sk: bytes) -> bytes:
        out = ctypes.create_string_buffer(len(msg) + 16)
        if self.lib.crypto_box_easy(out, msg, ctypes.c_ulonglong(len(msg)), nonce, pk, sk) != 0:
            raise TransferError("crypto_box failed")
        return out.raw

    def open(self, box: bytes, nonce: bytes, pk: bytes, sk: bytes) -> bytes:
        out = ctypes.create_string_buffer(max(1, len(box) - 16))
        if self.lib.crypto_box_open_easy(out, box, ctypes.c_ulonglong(len(box)), nonce, pk, sk) != 0:
            raise TransferError("a CURVE box did not open: the peer does not hold the expected key")
        return out.raw[: len(box) - 16]

    def precompute(self, pk: bytes, sk: bytes) -> bytes:
        k = ctypes.create_string_buffer(32)
        self.lib.crypto_box_beforenm(k, pk, sk)
        return k.raw

    def seal_afternm(self, msg: bytes, nonce: bytes, k: bytes) -> bytes:
        out = ctypes.create_string_buffer(len(msg) + 16)
        self.lib.crypto_box_easy_afternm(out, msg, ctypes.c_ulonglong(len(msg)), nonce, k)
        return out.raw


def _frame(body: bytes, command: bool = False) -> bytes:
    """One ZMTP 3.0 frame (no MORE on the wire: CURVE carries MORE inside the box)."""
    flags = 0x04 if command else 0x00
    if len(body) <= 255:
        return bytes([flags, len(body)]) + body
    return bytes([flags | 0x02]) + struct.pack(">Q", len(body)) + body


def _read_frame(s: socket.socket) -> bytes:
    def exact(n: int) -> bytes:
        out = b""
        while len(out) < n:
            got = s.recv(n - len(out))
            if not got:
                raise TransferError("the server closed the connection during the CURVE handshake")
            out += got
        return out

    flags = exact(1)[0]
    size = struct.unpack(">Q", exact(8))[0] if flags & 0x02 else exact(1)[0]
    return exact(size)


def curve_connect(port: int, keys: Any, host: str = "127.0.0.1", timeout_s: float = 5.0) -> tuple[socket.socket, Any]:
    """A TCP connection that completed the CURVE handshake as a DEALER holding ``keys`` (:class:`..transport.curve.
    CurveKeys`); (the socket, a function ``send(payload, more)`` sending one encrypted frame)."""
    from zmq.utils import z85

    box = _Box()
    server_pk = z85.decode(keys.server_public)
    client_pk, client_sk = z85.decode(keys.client_public), z85.decode(keys.client_secret)
    cn_pk, cn_sk = box.keypair()  # this connection's transient key pair
    s = socket.create_connection((host, port), timeout=timeout_s)
    s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31)
    got = b""
    while len(got) < 64:
        more = s.recv(64 - len(got))
        if not more:
            raise TransferError("the server closed the connection at the greeting")
        got += more
    nonce = 1
    hello_box = box.seal(b"\x00" * 64, b"CurveZMQHELLO---" + struct.pack(">Q", nonce), server_pk, cn_sk)
    s.sendall(_frame(b"\x05HELLO" + b"\x01\x00" + b"\x00" * 72 + cn_pk + struct.pack(">Q", nonce) + hello_box, True))
    welcome = _read_frame(s)
    if not welcome.startswith(b"\x07WELCOME"):
        raise TransferError(f"expected WELCOME, got {welcome[:16]!r}")
    plain = box.open(welcome[24:], b"WELCOME-" + welcome[8:24], server_pk, cn_sk)
    sn_pk, cookie = plain[:32], plain[32:128]
    vouch_nonce = os.urandom(16)
    vouch = box.seal(cn_pk + server_pk, b"VOUCH---" + vouch_nonce, sn_pk, client_sk)
    meta = b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    nonce += 1
    initiate_box = box.seal(client_pk + vouch_nonce + vouch + meta, b"CurveZMQINITIATE" + struct.pack(">Q", nonce),
                            sn_pk, cn_sk)  # fmt: skip
    s.sendall(_frame(b"\x08INITIATE" + cookie + struct.pack(">Q", nonce) + initiate_box, True))
    ready = _read_frame(s)
    if not ready.startswith(b"\x05READY"):
        raise TransferError(f"the server refused the handshake: {ready[:64]!r}")
    key = box.precompute(sn_pk, cn_sk)
    counter = [nonce]

    def send(payload: bytes, more: bool) -> None:
        counter[0] += 1
        n = struct.pack(">Q", counter[0])
        sealed = box.seal_afternm(bytes([1 if more else 0]) + payload, b"CurveZMQMESSAGEC" + n, key)
        s.sendall(_frame(b"\x07MESSAGE" + n + sealed))

    return s, send


def curve_flood(port: int, keys: Any, frames: int, frame_bytes: int, deadline_s: float) -> tuple[socket.socket, int]:
    """Complete the handshake as a key holder, then send ``frames`` encrypted frames of ``frame_bytes`` with MORE set
    and never the last one; (the open connection, the payload bytes the server took before it hung up or the
    deadline passed)."""
    s, send = curve_connect(port, keys)
    payload = os.urandom(frame_bytes)
    sent, end = 0, time.monotonic() + deadline_s
    try:
        for _ in range(frames):
            if time.monotonic() > end:
                break
            send(payload, more=True)
            sent += frame_bytes
    except OSError:  # the server hung up
        pass
    return s, sent

"""A measured stand-in for the ``bench pool`` file: put/get over TCP loopback sockets on this machine, AES-GCM
sealing, and the stored bytes per token from the ``bench gpu`` file's measured kvtc blobs.

It is not Mooncake: a socket pair moving whole objects, one thread each side, which bounds what a TCP pool on this
host could do. Its JSON has the ``bench pool`` schema (``results.put_gbps``/``get_gbps``/``stored_bytes_per_token``
...) and says ``"source": "tcp-loopback"`` so that nobody mistakes it for a pool measurement.
"""

from __future__ import annotations

import os
import socket
import statistics
import threading
import time
from typing import Any

__all__ = ["measure_loopback"]

SEAL_OVERHEAD = 12 + 16  # AES-GCM nonce and tag per sealed object


def _recv_exact(sock: socket.socket, buf: memoryview) -> None:
    got = 0
    while got < len(buf):
        n = sock.recv_into(buf[got:])
        if not n:
            raise ConnectionError("peer closed")
        got += n


def _transfer_s(payload: bytes, repeat: int) -> list[float]:
    """Seconds to move ``payload`` through a loopback TCP connection and have it whole on the other side."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    n = len(payload)
    ready = threading.Event()
    times: list[float] = []

    def server() -> None:
        conn, _ = srv.accept()
        buf = memoryview(bytearray(n))
        with conn:
            for _ in range(repeat):
                ready.set()
                _recv_exact(conn, buf)
                conn.sendall(b"k")

    th = threading.Thread(target=server, daemon=True)
    th.start()
    with socket.create_connection(("127.0.0.1", port)) as c:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ack = bytearray(1)
        for _ in range(repeat):
            ready.wait()
            t = time.perf_counter()
            c.sendall(payload)
            _recv_exact(c, memoryview(ack))
            times.append(time.perf_counter() - t)
    th.join(timeout=10)
    srv.close()
    return times


def _seal_rates(n: int, repeat: int) -> tuple[float, float]:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    key = AESGCM(AESGCM.generate_key(bit_length=256))
    data = os.urandom(n)
    nonce = os.urandom(12)
    seal, open_ = [], []
    for _ in range(repeat):
        t = time.perf_counter()
        ct = key.encrypt(nonce, data, b"kvtc")
        seal.append(time.perf_counter() - t)
        t = time.perf_counter()
        key.decrypt(nonce, ct, b"kvtc")
        open_.append(time.perf_counter() - t)
    return n / min(seal) / 1e9, n / min(open_) / 1e9


def measure_loopback(
    raw_bytes_per_token: float, kvtc_bytes_per_token: float, tokens: int = 1024, repeat: int = 5
) -> dict[str, Any]:
    """Put/get GB/s of a ``tokens``-token object, raw and kvtc (sealed: its seal/open time added), over loopback."""
    raw = os.urandom(int(raw_bytes_per_token * tokens))
    kvtc = os.urandom(int(kvtc_bytes_per_token * tokens) + SEAL_OVERHEAD)
    seal_gbps, open_gbps = _seal_rates(len(kvtc), repeat)
    raw_s = _transfer_s(raw, repeat)
    kvtc_s = _transfer_s(kvtc, repeat)
    wire = {"raw": len(raw) / statistics.median(raw_s) / 1e9, "kvtc": len(kvtc) / statistics.median(kvtc_s) / 1e9}
    sealed_put = len(kvtc) / (len(kvtc) / (seal_gbps * 1e9) + len(kvtc) / (wire["kvtc"] * 1e9)) / 1e9
    sealed_get = len(kvtc) / (len(kvtc) / (open_gbps * 1e9) + len(kvtc) / (wire["kvtc"] * 1e9)) / 1e9

    def ms(xs: list[float]) -> dict[str, float]:
        ys = sorted(x * 1e3 for x in xs)
        return {"mean": statistics.fmean(ys), "p50": ys[len(ys) // 2], "p99": ys[-1]}

    return {
        "source": "tcp-loopback",
        "note": "TCP loopback sockets on this machine (one object per transfer, both ends in one process), not "
        "Mooncake; kvtc_sealed adds measured AES-GCM seal/open time; kvtc stored bytes per token from the bench gpu "
        "file's measured blobs plus the seal's nonce and tag",
        "results": {
            "put_gbps": {"kvtc_sealed": sealed_put, "kvtc": wire["kvtc"], "raw": wire["raw"]},
            "get_gbps": {"kvtc_sealed": sealed_get, "kvtc": wire["kvtc"], "raw": wire["raw"]},
            "restore_ms": {"kvtc_sealed": ms([x + len(kvtc) / (open_gbps * 1e9) for x in kvtc_s]), "raw": ms(raw_s)},
            "tokens_per_restore": tokens,
            "raw_bytes_per_token": raw_bytes_per_token,
            "stored_bytes_per_token": {"kvtc_sealed": len(kvtc) / tokens, "raw": raw_bytes_per_token},
            "seal_gbps": seal_gbps,
            "open_gbps": open_gbps,
        },
    }

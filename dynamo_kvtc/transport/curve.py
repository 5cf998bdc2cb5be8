"""The control channel's transport security when it has a shared secret: ZeroMQ's CURVE with a ZAP handler.

Both key pairs of a channel are derived from its :class:`~.channel.Auth` secret (HMAC-SHA256 of a label: the server's
and the client's Curve25519 secret keys; their public keys follow), so every holder of the cluster secret knows them
and nobody else does. The server socket is a CURVE server with its derived secret key and a ZAP domain; its ZAP
handler (:class:`ZapHandler`, one per server, in the server's own ZeroMQ context) admits exactly the client public key
derived from the secret. The client socket names the server's derived public key. So a connection completes its
handshake only between two holders of the secret (mutual authentication), everything after it is encrypted, and
libzmq accepts no application frame before it: a peer without the secret cannot make a server (or a decode worker
waiting on a reply) buffer anything — the multipart flood of issue 36 is refused at the greeting. The HMAC envelope
of :class:`~.channel.Auth` stays on top (replay window, requests bound to replies).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler (RFC 27)
ZAP_DOMAIN = b"kvtc"


@dataclass(frozen=True)
class CurveKeys:
    """The derived key pairs of one secret (Z85 text, as libzmq takes them); never logged."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __repr__(self) -> str:
        return "CurveKeys(<derived from the channel secret>)"


def curve_keys(derive: Any) -> CurveKeys:
    """Both key pairs from ``derive(label) -> 32 bytes`` (:meth:`Auth.derive <.channel.Auth.derive>`)."""
    import zmq
    from zmq.utils import z85

    server = z85.encode(derive(b"kvtc-curve-server"))
    client = z85.encode(derive(b"kvtc-curve-client"))
    return CurveKeys(zmq.curve_public(server), server, zmq.curve_public(client), client)


def secure_server(sock: Any, keys: CurveKeys) -> None:
    """Make ``sock`` (before it binds) a CURVE server that asks the ZAP handler of its context."""
    sock.curve_server = True
    sock.curve_secretkey = keys.server_secret
    sock.zap_domain = ZAP_DOMAIN


def secure_client(sock: Any, keys: CurveKeys) -> None:
    """Make ``sock`` (before it connects) a CURVE client that completes a handshake only with the derived server."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


class ZapHandler:
    """The ZAP handler of one server's context: admits a CURVE client whose public key is the derived client key,
    refuses everything else (and counts it). Served from the server's own thread (:meth:`answer` when its socket is
    readable); owns its REP socket."""

    def __init__(self, sock: Any, keys: CurveKeys) -> None:
        """``sock``: a new REP socket of the server's own context (made by the channel, the one home of sockets)."""
        from zmq.utils import z85

        self._allowed = z85.decode(keys.client_public)
        self.sock = sock
        self.sock.bind(ZAP_ENDPOINT)
        self.refused = 0

    def answer(self) -> None:
        """Answer every ZAP request waiting now."""
        import zmq

        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            ok = len(frames) >= 7 and frames[0] == b"1.0" and frames[5] == b"CURVE" and frames[6] == self._allowed
            if not ok:
                self.refused += 1
                log.warning("kvtc control channel: a peer without the cluster key was refused at the handshake "
                            "(from %s)", frames[3].decode(errors="replace") if len(frames) > 3 else "?")  # fmt: skip
            rid = frames[1] if len(frames) > 1 else b""
            code, text = (b"200", b"OK") if ok else (b"400", b"not a holder of the cluster key")
            self.sock.send_multipart([b"1.0", rid, code, text, b"kvtc-peer" if ok else b"", b""])

    def close(self) -> None:
        self.sock.close(0)

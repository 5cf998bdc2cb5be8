"""The control channel: msgpack messages with hard limits, a REP server thread and a REQ client with deadlines.

Every message this package receives from outside its own process goes through :func:`unpack`: a size check before
anything is parsed, then msgpack with explicit limits (string, binary, array and map sizes; map keys must be strings
or integers; one extension type only: :data:`EXT_U128`, an unsigned integer of 65 to 128 bits such as a block key, as
16 big-endian bytes), then "must be a map". Callers name the error class a bad message raises, so the
disk tier reports damage as its own error and the network channels as :class:`~dynamo_kvtc.errors.TransferError`.
Never pickle.

The sockets are ZMQ (pyzmq, imported when the first socket is made):

- :class:`RepServer` binds one ROUTER socket (REQ clients talk to it as to a REP socket), serves it from one daemon
  thread and answers every request with the handler's reply; a request that fails to unpack or whose handler raises
  gets ``{"error": "..."}`` and is counted (``refused``), and the server keeps serving. A handler that cannot answer
  yet returns a :class:`Deferred`: the request is parked (at most ``max_pending``; beyond, it is refused as busy)
  and polled every few milliseconds while the thread goes on answering others, so one request waiting never holds
  up the rest. ``MAXMSGSIZE`` drops a peer that sends a frame over the limit before it is buffered (libzmq holds the
  frames of a multipart message until its last: only CURVE, below, keeps a stranger from sending any).
- :class:`ReqClient` connects one REQ socket with send/receive deadlines. A socket that missed its reply is stuck in
  ZMQ's REQ state machine, so it is closed and made anew on the next call. An ``{"error": ...}`` reply raises.

With an :class:`Auth` (a shared secret) both ends seal every message: a request travels as ``{ts, nonce, body,
mac}`` with ``mac = HMAC-SHA256(key, "kvtc-req" | ts | nonce | body)``; the server refuses (and counts,
``auth_refused``) a request whose envelope is not exactly those four fields of their types (a finite float, 16, any
and 32 bytes), whose MAC is wrong, whose timestamp is outside the replay window, or whose nonce it has seen within the
window (a replay). Nonces are remembered by the second of their timestamp for as long as that timestamp is inside the
window — never forgotten early — and at most ``max_nonces`` at once: beyond that (an authenticated peer sending more
than about ``max_nonces / window`` requests a second) new requests are refused until old nonces age out. The reply
is ``{body, mac}`` with the MAC over the request's nonce too, so a reply cannot be forged, nor replayed to another
request. Beneath the envelope, the secret also keys ZeroMQ's CURVE (:mod:`.curve`): the server runs in its own context
with a ZAP handler that admits only a client holding the derived key, the client accepts only the derived server, and
libzmq accepts no frame of a peer before that handshake (``handshake_refused`` counts the refusals) — a peer without
the secret cannot make either side buffer anything. Without a secret the channel is unauthenticated (the lookup
channel, an IPC socket in a private directory, needs none).

Users: the lookup channel (connector/vllm/lookup.py), the prefill→decode hand-off (connector/handoff/), the transfer
benchmark and the reliability harness; the disk tier's index records use :func:`unpack` alone.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ..errors import ConfigError, KvtcError, PeerUnreachableError, TransferError
from .curve import ZapHandler, curve_keys, secure_client, secure_server

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """Hard limits of one kind of message (bytes for the message and for str/bin values, items for arrays/maps)."""

    max_message: int = 1 << 22
    max_str: int = 4096
    max_bin: int = 0
    max_array: int = 1 << 20
    max_map: int = 64


EXT_U128 = 1  # msgpack extension code of an unsigned integer too wide for msgpack's own (64 bits): 16 bytes, big-endian


def _wide(o: Any) -> msgpack.ExtType:
    if isinstance(o, int) and (1 << 64) <= o < (1 << 128):
        return msgpack.ExtType(EXT_U128, o.to_bytes(16, "big"))
    raise TypeError(f"cannot pack {type(o).__name__} {o!r:.40}")


def _ext(code: int, data: bytes) -> int:
    if code != EXT_U128 or len(data) != 16:
        raise ValueError(f"unknown extension type {code} of {len(data)} bytes")
    v = int.from_bytes(data, "big")
    if v < 1 << 64:
        raise ValueError("a 128-bit integer extension holding a 64-bit value")  # one encoding per value
    return v


def pack(msg: dict[str, Any]) -> bytes:
    """One message; integers of 65 to 128 bits (block keys) travel as :data:`EXT_U128`."""
    return msgpack.packb(msg, use_bin_type=True, default=_wide)


def unpack(
    data: bytes | memoryview, limits: Limits, *, what: str = "control message", error: type[KvtcError] = TransferError
) -> dict[str, Any]:
    """Parse one message within ``limits``; anything else raises ``error`` naming ``what`` and the problem."""
    if len(data) > limits.max_message:
        raise error(f"{what} of {len(data)} bytes exceeds {limits.max_message}")
    try:
        msg = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=limits.max_str,
            max_bin_len=limits.max_bin,
            max_ext_len=16,
            ext_hook=_ext,
            max_array_len=limits.max_array,
            max_map_len=limits.max_map,
        )
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise error(f"{what} is not valid msgpack: {type(e).__name__}") from None
    if not isinstance(msg, dict):
        raise error(f"{what} is not a map")
    return msg


MIN_SECRET_BYTES = 16
_REQ, _REP = b"kvtc-req", b"kvtc-rep"
_ENVELOPE_OVERHEAD = 256  # msgpack framing, timestamp, nonce, MAC
_MAC_BYTES = 32  # HMAC-SHA256
_SEALED_REQUEST = frozenset(("ts", "nonce", "body", "mac"))
_SEALED_REPLY = frozenset(("body", "mac"))


@dataclass
class Auth:
    """A shared secret keying an HMAC-SHA256 on every request and reply of one channel, with replay protection.

    Owns the secret and, on a server, the nonces of requests whose timestamps are still inside ``window_s``, in
    buckets of ``bucket_s`` seconds of timestamp: a bucket is dropped once every timestamp in it is older than the
    window (a replay of its nonces is then refused as stale), never earlier. At most ``max_nonces`` are held: when
    full, new requests are refused (``nonce memory full``) instead of forgetting a nonce that could still be
    replayed. Never logs the secret."""

    key: bytes = field(repr=False)  # repr(Auth) never shows the secret
    window_s: float = 30.0
    max_nonces: int = 1 << 16
    bucket_s: float = 1.0
    _buckets: dict = field(default_factory=dict, repr=False)  # int(ts // bucket_s) -> set of nonces
    _held: int = field(default=0, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.key, bytes) or len(self.key) < MIN_SECRET_BYTES:
            raise ConfigError(f"a channel secret must be at least {MIN_SECRET_BYTES} bytes")
        for name, v in (("window_s", self.window_s), ("bucket_s", self.bucket_s)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ConfigError(f"channel auth {name} must be a positive number of seconds, got {v!r}")
        if isinstance(self.max_nonces, bool) or not isinstance(self.max_nonces, int) or self.max_nonces < 1:
            raise ConfigError(f"channel auth max_nonces must be a positive integer, got {self.max_nonces!r}")

    @property
    def nonces_held(self) -> int:
        """Nonces remembered now (at most ``max_nonces``)."""
        return self._held

    def _mac(self, *parts: bytes) -> bytes:
        return hmac.new(self.key, b"".join(parts), hashlib.sha256).digest()

    def derive(self, label: bytes) -> bytes:
        """32 bytes derived from the secret for ``label`` (the CURVE keys of :mod:`.curve`)."""
        return self._mac(b"kvtc-derive|", label)

    def seal_request(self, body: bytes) -> tuple[bytes, bytes]:
        """(the sealed request, its nonce)."""
        ts, nonce = time.time(), os.urandom(16)
        mac = self._mac(_REQ, struct.pack("<d", ts), nonce, body)
        return pack({"ts": ts, "nonce": nonce, "body": body, "mac": mac}), nonce

    def open_request(self, env: dict[str, Any]) -> tuple[bytes, bytes]:
        """(body, nonce) of a sealed request; TransferError naming why it is refused."""
        ts, nonce, body, mac = env.get("ts"), env.get("nonce"), env.get("body"), env.get("mac")
        if (
            not (isinstance(ts, float) and isinstance(nonce, bytes) and len(nonce) == 16 and isinstance(body, bytes))
            or set(env) - _SEALED_REQUEST
        ):
            raise TransferError("request not authenticated (no sealed envelope)")
        if not (isinstance(mac, bytes) and len(mac) == _MAC_BYTES) or not hmac.compare_digest(
            mac, self._mac(_REQ, struct.pack("<d", ts), nonce, body)
        ):
            raise TransferError("request not authenticated (wrong MAC)")
        now = time.time()
        if not math.isfinite(ts) or abs(now - ts) > self.window_s:
            raise TransferError(f"request outside the {self.window_s:g} s replay window (clock skew or a replay)")
        self._remember(nonce, ts, now)
        return body, nonce

    def _remember(self, nonce: bytes, ts: float, now: float) -> None:
        """Refuse a nonce seen with this timestamp's bucket, else hold it until the bucket leaves the window."""
        b, key = self.bucket_s, int(ts // self.bucket_s)
        with self._lock:
            for k in [k for k in self._buckets if (k + 1) * b + self.window_s < now]:  # every ts in it is stale
                self._held -= len(self._buckets.pop(k))
            seen = self._buckets.get(key)
            if seen is not None and nonce in seen:
                raise TransferError("request replayed (nonce seen before)")
            if self._held >= self.max_nonces:
                raise TransferError(
                    f"nonce memory full ({self.max_nonces} requests inside the {self.window_s:g} s window): "
                    "refused until older requests age out"
                )
            self._buckets.setdefault(key, set()).add(nonce)
            self._held += 1

    def seal_reply(self, body: bytes, nonce: bytes) -> bytes:
        return pack({"body": body, "mac": self._mac(_REP, nonce, body)})

    def open_reply(self, env: dict[str, Any], nonce: bytes) -> bytes:
        body, mac = env.get("body"), env.get("mac")
        if (
            not isinstance(body, bytes)
            or not (isinstance(mac, bytes) and len(mac) == _MAC_BYTES)
            or set(env) - _SEALED_REPLY
        ):
            raise TransferError(f"reply not authenticated: {str(env.get('error', 'no sealed envelope'))[:200]}")
        if not hmac.compare_digest(mac, self._mac(_REP, nonce, body)):
            raise TransferError("reply not authenticated (wrong MAC)")
        return body


def _envelope_limits(limits: Limits) -> Limits:
    return Limits(
        max_message=limits.max_message + _ENVELOPE_OVERHEAD, max_str=limits.max_str, max_bin=limits.max_message,
        max_array=16, max_map=8,
    )  # fmt: skip


def zmq_module():
    """pyzmq, or a ConfigError that says what is missing (a dependency of vLLM and of this package)."""
    try:
        import zmq
    except ImportError as e:
        raise ConfigError("the kvtc control channels need pyzmq: pip install pyzmq") from e
    return zmq


def _socket(kind: str, limits: Limits, timeout_s: float | None = None, ctx: Any = None):
    zmq = zmq_module()
    sock = (ctx or zmq.Context.instance()).socket(getattr(zmq, kind))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(
        zmq.MAXMSGSIZE, limits.max_message + _ENVELOPE_OVERHEAD
    )  # a bigger message drops the peer before it is buffered
    if timeout_s is not None:
        ms = max(1, int(timeout_s * 1000))
        sock.setsockopt(zmq.RCVTIMEO, ms)
        sock.setsockopt(zmq.SNDTIMEO, ms)
    return sock


@dataclass(frozen=True)
class Deferred:
    """A handler's answer that is not ready yet: the server calls ``poll`` on its thread every few milliseconds until
    it returns the reply (a map) or raises (the error reply); None means not yet. ``poll`` must keep its own
    deadline."""

    poll: Callable[[], dict[str, Any] | None]


Handler = Callable[[dict[str, Any]], "dict[str, Any] | Deferred"]
MAX_PENDING = 256  # requests parked on a Deferred at once; beyond, refused as busy


class RepServer:
    """One bound ROUTER socket answered by one daemon thread, request by request (REQ clients see a REP server).

    Owns the socket, the thread and the parked (:class:`Deferred`) requests; it never lets a bad request stop the loop
    (the handler's exceptions become ``{"error": ...}`` replies), never lets a parked request hold up another, and
    never unpacks without :class:`Limits`. ``endpoint`` is ``ipc://PATH``,
    ``tcp://HOST:PORT`` or ``tcp://HOST`` (a free port is picked; see :attr:`port`). ``tick`` runs about every 100 ms
    on the serving thread (expiry of leases and the like).
    """

    def __init__(
        self,
        endpoint: str,
        handle: Handler,
        limits: Limits,
        *,
        name: str,
        tick: Callable[[], None] | None = None,
        auth: Auth | None = None,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self._ctx = self._zap = None  # with a secret: the server's own context and its ZAP handler (CURVE)
        if auth is not None:
            keys = curve_keys(auth.derive)
            self._ctx = zmq_module().Context()
            self._zap = ZapHandler(_socket("REP", limits, ctx=self._ctx), keys)
        self._sock = _socket("ROUTER", limits, ctx=self._ctx)
        self.port: int | None = None
        try:
            if auth is not None:
                secure_server(self._sock, keys)
            if endpoint.startswith("tcp://") and endpoint.count(":") == 1:
                self.port = self._sock.bind_to_random_port(endpoint)
            else:
                self._sock.bind(endpoint)
                if endpoint.startswith("tcp://"):
                    self.port = int(endpoint.rsplit(":", 1)[1])
        except Exception:
            self._sock.close(0)
            self._close_context()
            raise
        self.endpoint = endpoint
        self.limits = limits
        self.name = name
        self.served = 0
        self.refused = 0
        self.auth_refused = 0  # requests refused for a missing or wrong MAC, a stale timestamp or a replay
        self.auth = auth
        self._handle = handle
        self._tick = tick
        self._pending: list[tuple[bytes, bytes | None, Deferred]] = []  # (peer identity, nonce, parked answer)
        self.max_pending = max_pending
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def handshake_refused(self) -> int:
        """Connections the ZAP handler refused (a client that knows the server's public key but not the client key;
        one without the server's key fails the handshake before that, uncounted); 0 without a secret."""
        return self._zap.refused if self._zap is not None else 0

    @property
    def pending(self) -> int:
        """Requests parked on a :class:`Deferred` now."""
        return len(self._pending)

    def _serve(self) -> None:
        zmq = zmq_module()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if self._tick is not None:
                self._tick()
            self._poll_pending()
            ready = dict(poller.poll(5 if self._pending else 100))
            if self._zap is not None and self._zap.sock in ready:
                self._zap.answer()  # a handshake waits on it: before anything else
            if self._sock not in ready:
                continue
            frames = self._sock.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":  # not a REQ peer's envelope: nothing to answer
                self.refused += 1
                continue
            self._answer(frames[0], frames[2])

    def _send(self, ident: bytes, reply: dict[str, Any], nonce: bytes | None) -> None:
        data = pack(reply) if nonce is None else self.auth.seal_reply(pack(reply), nonce)
        self._sock.send_multipart([ident, b"", data])  # a peer gone meanwhile: ROUTER drops it

    def _refuse(self, e: Exception) -> dict[str, Any]:
        self.refused += 1
        log.warning("%s request refused: %s", self.name, e)
        return {"error": f"{type(e).__name__}: {e}"}

    def _answer(self, ident: bytes, data: bytes) -> None:
        nonce = None  # unauthenticated channel, or a request that failed authentication: the reply is not sealed
        try:
            if self.auth is not None:
                env = unpack(data, _envelope_limits(self.limits), what=f"{self.name} request")
                try:
                    data, nonce = self.auth.open_request(env)
                except TransferError:
                    self.auth_refused += 1
                    raise
            reply = self._handle(unpack(data, self.limits, what=f"{self.name} request"))
            if isinstance(reply, Deferred):
                if len(self._pending) >= self.max_pending:
                    raise TransferError(f"busy: {len(self._pending)} requests waiting")
                self._pending.append((ident, nonce, reply))
                return
            self.served += 1
        except Exception as e:
            reply = self._refuse(e)
        self._send(ident, reply, nonce)

    def _poll_pending(self) -> None:
        """Answer each parked request whose reply is ready (or whose poll raised); keep the others."""
        keep = []
        for ident, nonce, d in self._pending:
            try:
                reply = d.poll()
                if reply is None:
                    keep.append((ident, nonce, d))
                    continue
                self.served += 1
            except Exception as e:
                reply = self._refuse(e)
            self._send(ident, reply, nonce)
        self._pending = keep

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)
        self._close_context()

    def _close_context(self) -> None:
        if self._zap is not None:
            self._zap.close()
        if self._ctx is not None:
            self._ctx.term()


class ReqClient:
    """A REQ socket to one server with send/receive deadlines; errors are :class:`TransferError`.

    Thread-safe (one request at a time). Owns its socket; after a missed reply it starts over with a fresh one.
    """

    def __init__(  # fmt: skip
        self, endpoint: str, limits: Limits, timeout_s: float, *, name: str = "peer", auth: Auth | None = None,
        connect_timeout_s: float | None = None,
    ) -> None:
        if not timeout_s > 0:
            raise ConfigError(f"{name} channel deadline must be > 0 s, got {timeout_s!r}")
        self.connect_timeout_s = connect_timeout_s  # a fresh socket's handshake deadline (None: the request's)
        self.endpoint = endpoint
        self.limits = limits
        self.timeout_s = timeout_s
        self.name = name
        self.auth = auth
        self._keys = curve_keys(auth.derive) if auth is not None else None
        self._sock = None
        self._lock = threading.Lock()

    def ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Send ``msg`` and return the reply; no answer in time, a malformed reply or ``{"error"}`` raise."""
        zmq = zmq_module()
        with self._lock:
            if self._sock is None:
                self._sock = _socket("REQ", self.limits, self.timeout_s)
                if self._keys is not None:
                    secure_client(self._sock, self._keys)
                try:
                    self._connect()
                except (zmq.ZMQError, TransferError):
                    self._sock.close(0)
                    self._sock = None
                    raise
            try:
                reply = self._exchange(msg)
            except (zmq.ZMQError, TransferError) as e:
                self._sock.close(0)  # a REQ socket that missed its reply is stuck: start over
                self._sock = None
                if isinstance(e, TransferError):
                    raise
                raise TransferError(f"{self.name} at {self.endpoint} did not answer ({e})") from e
        if "error" in reply:
            raise TransferError(f"{self.name} refused: {str(reply['error'])[:500]}")
        return reply

    def _connect(self) -> None:
        """Connect; with ``connect_timeout_s``, wait for the handshake (with a secret: the peer proved it holds the
        key) that long, so a dead or wrong peer costs a short deadline, not the request's."""
        zmq = zmq_module()
        if self.connect_timeout_s is None:
            self._sock.connect(self.endpoint)
            return
        mon = self._sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            self._sock.connect(self.endpoint)
            if not mon.poll(max(1, int(self.connect_timeout_s * 1000))):
                raise PeerUnreachableError(
                    f"{self.name} at {self.endpoint}: no handshake within {self.connect_timeout_s:g} s "
                    "(nothing listening, or not a holder of the cluster key)"
                )
        finally:
            self._sock.disable_monitor()
            mon.close(0)

    def _exchange(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.auth is None:
            self._sock.send(pack(msg))
            return unpack(self._one_frame(), self.limits, what=f"{self.name} reply")
        sealed, nonce = self.auth.seal_request(pack(msg))
        self._sock.send(sealed)
        env = unpack(self._one_frame(), _envelope_limits(self.limits), what=f"{self.name} reply")
        return unpack(self.auth.open_reply(env, nonce), self.limits, what=f"{self.name} reply")

    def _one_frame(self) -> bytes:  # the reply's one frame; more are refused (the caller closes the socket with them)
        data = self._sock.recv()
        if self._sock.get(zmq_module().RCVMORE):
            raise TransferError(f"{self.name} reply has more than one frame")
        return data

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close(0)
                self._sock = None

"""The control channel: msgpack messages with hard limits, a REP server thread and a REQ client with deadlines.

Every message this package receives from outside its own process goes through :func:`unpack`: a size check before
anything is parsed, then msgpack with explicit limits (string, binary, array and map sizes; no extension types; map
keys must be strings or integers), then "must be a map". Callers name the error class a bad message raises, so the
disk tier reports damage as its own error and the network channels as :class:`~dynamo_kvtc.errors.TransferError`.
Never pickle.

The sockets are ZMQ (pyzmq, imported when the first socket is made):

- :class:`RepServer` binds one REP socket, serves it from one daemon thread and answers every request with the
  handler's reply; a request that fails to unpack or whose handler raises gets ``{"error": "..."}`` and is counted
  (``refused``), and the server keeps serving. ``MAXMSGSIZE`` drops a peer that sends more than the limit before it is
  buffered.
- :class:`ReqClient` connects one REQ socket with send/receive deadlines. A socket that missed its reply is stuck in
  ZMQ's REQ state machine, so it is closed and made anew on the next call. An ``{"error": ...}`` reply raises.

Users: the lookup channel (connector/lookup.py), the prefill→decode hand-off (connector/handoff/), the transfer
benchmark and the reliability harness; the disk tier's index records use :func:`unpack` alone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from ..errors import ConfigError, KvtcError, TransferError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    """Hard limits of one kind of message (bytes for the message and for str/bin values, items for arrays/maps)."""

    max_message: int = 1 << 22
    max_str: int = 4096
    max_bin: int = 0
    max_array: int = 1 << 20
    max_map: int = 64


def pack(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


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
            max_ext_len=0,
            max_array_len=limits.max_array,
            max_map_len=limits.max_map,
        )
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise error(f"{what} is not valid msgpack: {type(e).__name__}") from None
    if not isinstance(msg, dict):
        raise error(f"{what} is not a map")
    return msg


def zmq_module():
    """pyzmq, or a ConfigError that says what is missing (a dependency of vLLM and of this package)."""
    try:
        import zmq
    except ImportError as e:
        raise ConfigError("the kvtc control channels need pyzmq: pip install pyzmq") from e
    return zmq


def _socket(kind: str, limits: Limits, timeout_s: float | None = None):
    zmq = zmq_module()
    sock = zmq.Context.instance().socket(getattr(zmq, kind))
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message)  # a bigger message drops the peer before it is buffered
    if timeout_s is not None:
        ms = max(1, int(timeout_s * 1000))
        sock.setsockopt(zmq.RCVTIMEO, ms)
        sock.setsockopt(zmq.SNDTIMEO, ms)
    return sock


Handler = Callable[[dict[str, Any]], dict[str, Any]]


class RepServer:
    """One bound REP socket answered by one daemon thread.

    Owns the socket and the thread; it never lets a bad request stop the loop (the handler's exceptions become
    ``{"error": ...}`` replies) and never unpacks without :class:`Limits`. ``endpoint`` is ``ipc://PATH``,
    ``tcp://HOST:PORT`` or ``tcp://HOST`` (a free port is picked; see :attr:`port`). ``tick`` runs about every 100 ms
    on the serving thread (expiry of leases and the like).
    """

    def __init__(
        self, endpoint: str, handle: Handler, limits: Limits, *, name: str, tick: Callable[[], None] | None = None
    ) -> None:
        self._sock = _socket("REP", limits)
        self.port: int | None = None
        try:
            if endpoint.startswith("tcp://") and endpoint.count(":") == 1:
                self.port = self._sock.bind_to_random_port(endpoint)
            else:
                self._sock.bind(endpoint)
                if endpoint.startswith("tcp://"):
                    self.port = int(endpoint.rsplit(":", 1)[1])
        except Exception:
            self._sock.close(0)
            raise
        self.endpoint = endpoint
        self.limits = limits
        self.name = name
        self.served = 0
        self.refused = 0
        self._handle = handle
        self._tick = tick
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        zmq = zmq_module()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if self._tick is not None:
                self._tick()
            if not poller.poll(100):
                continue
            data = self._sock.recv()
            try:
                reply = self._handle(unpack(data, self.limits, what=f"{self.name} request"))
                self.served += 1
            except Exception as e:
                self.refused += 1
                log.warning("%s request refused: %s", self.name, e)
                reply = {"error": f"{type(e).__name__}: {e}"}
            self._sock.send(pack(reply))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)


class ReqClient:
    """A REQ socket to one server with send/receive deadlines; errors are :class:`TransferError`.

    Thread-safe (one request at a time). Owns its socket; after a missed reply it starts over with a fresh one.
    """

    def __init__(self, endpoint: str, limits: Limits, timeout_s: float, *, name: str = "peer") -> None:
        if not timeout_s > 0:
            raise ConfigError(f"{name} channel deadline must be > 0 s, got {timeout_s!r}")
        self.endpoint = endpoint
        self.limits = limits
        self.timeout_s = timeout_s
        self.name = name
        self._sock = None
        self._lock = threading.Lock()

    def ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Send ``msg`` and return the reply; no answer in time, a malformed reply or ``{"error"}`` raise."""
        zmq = zmq_module()
        with self._lock:
            if self._sock is None:
                self._sock = _socket("REQ", self.limits, self.timeout_s)
                self._sock.connect(self.endpoint)
            try:
                self._sock.send(pack(msg))
                reply = unpack(self._sock.recv(), self.limits, what=f"{self.name} reply")
            except (zmq.ZMQError, TransferError) as e:
                self._sock.close(0)  # a REQ socket that missed its reply is stuck: start over
                self._sock = None
                if isinstance(e, TransferError):
                    raise
                raise TransferError(f"{self.name} at {self.endpoint} did not answer ({e})") from e
        if "error" in reply:
            raise TransferError(f"{self.name} refused: {str(reply['error'])[:500]}")
        return reply

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close(0)
                self._sock = None

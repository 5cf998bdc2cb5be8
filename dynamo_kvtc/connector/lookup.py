"""The lookup channel: a scheduler in another process than the worker (TP > 1) asks rank 0's store what it holds.

One ZMQ REQ/REP pair over an IPC socket named after the engine id; requests and replies are msgpack (never pickle),
unpacked with size limits (ZMQ drops a connection that sends a bigger message before it is buffered). The socket lives
in a private directory (``$TMPDIR/kvtc-<uid>``, 0700, owned by this user, not a symlink): other users cannot connect
to it or plant a socket of their own under its name. A slow or absent worker is a miss, never a stall: the client
gives up after a deadline.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import threading
from collections.abc import Callable, Sequence

import msgpack

from ..errors import ConfigError, TransferError

log = logging.getLogger(__name__)
MAX_MESSAGE = 1 << 22  # 4 MiB: ~500K hashes, far above any request


def _zmq():
    try:
        import zmq
    except ImportError as e:  # vLLM depends on pyzmq; this only hits outside an engine
        raise ConfigError("the lookup channel needs pyzmq") from e
    return zmq


def socket_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"kvtc-{os.getuid()}")


def private_dir(path: str) -> str:
    """Create (0700) or check the directory holding the sockets: ours, not a symlink, not open to others."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ConfigError(f"cannot create the lookup socket directory {path}: {e}") from None
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"lookup socket directory {path} is not a directory (a symlink?); refusing")
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(
            f"lookup socket directory {path} is owned by uid {st.st_uid} with mode {oct(st.st_mode & 0o777)}; "
            f"it must be ours and 0700: refusing"
        )
    return path


def socket_path(engine_id: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)[:64]
    return os.path.join(socket_dir(), f"lookup-{safe}.sock")


def _unpack(data: bytes) -> dict:
    if len(data) > MAX_MESSAGE:
        raise TransferError(f"lookup message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    try:
        msg = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=4096,
            max_bin_len=0,
            max_ext_len=0,
            max_array_len=1 << 20,
            max_map_len=16,
        )
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise TransferError(f"lookup message is not valid msgpack: {type(e).__name__}") from None
    if not isinstance(msg, dict):
        raise TransferError("lookup message is not a map")
    return msg


class LookupServer:
    def __init__(self, engine_id: str, match: Callable[[list[int]], tuple[int, int]]) -> None:
        zmq = _zmq()
        private_dir(socket_dir())
        self.path = socket_path(engine_id)
        if os.path.lexists(self.path):
            os.unlink(self.path)  # a stale socket of a dead engine with the same id
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        self._sock.bind(f"ipc://{self.path}")
        os.chmod(self.path, 0o600)  # inside our 0700 directory: nobody else can swap the path
        self._match = match
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvtc-lookup", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        zmq = _zmq()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            data = self._sock.recv()
            try:
                msg = _unpack(data)
                hashes = msg.get("hashes")
                if (
                    msg.get("op") != "match"
                    or not isinstance(hashes, list)
                    or not all(isinstance(h, int) and 0 <= h < 1 << 64 for h in hashes)
                ):
                    raise TransferError("bad lookup request")
                n, n_host = self._match(hashes)
                reply = {"n": n, "host": n_host}
            except Exception as e:
                log.warning("kvtc lookup request rejected: %s", e)
                reply = {"error": str(e)}
            self._sock.send(msgpack.packb(reply))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class LookupClient:
    def __init__(self, engine_id: str, timeout_s: float = 1.0) -> None:
        self.path = socket_path(engine_id)
        self.timeout_ms = int(timeout_s * 1000)
        self._sock = None
        self._lock = threading.Lock()

    def _socket(self):
        zmq = _zmq()
        if self._sock is None:
            self._sock = zmq.Context.instance().socket(zmq.REQ)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
            self._sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
            self._sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            self._sock.connect(f"ipc://{self.path}")
        return self._sock

    def __call__(self, hashes: Sequence[int]) -> tuple[int, int]:
        zmq = _zmq()
        with self._lock:
            sock = self._socket()
            try:
                sock.send(msgpack.packb({"op": "match", "hashes": [int(h) for h in hashes]}))
                reply = _unpack(sock.recv())
            except zmq.ZMQError as e:
                self._sock.close(0)  # a REQ socket that missed its reply is stuck: start over
                self._sock = None
                raise TransferError(f"kvtc lookup channel {self.path}: {e}") from e
        if "error" in reply:
            raise TransferError(f"kvtc lookup refused: {str(reply['error'])[:200]}")
        n, n_host = reply.get("n"), reply.get("host")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (n, n_host)) or not 0 <= n_host <= n:
            raise TransferError(f"kvtc lookup reply malformed: {reply!r:.200}")
        return min(n, len(hashes)), min(n_host, len(hashes))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

"""The lookup channel: the scheduler asks the worker's store (TP rank 0) what it holds.

:class:`LazyLookup` is the factory the scheduler gets: the worker itself when vLLM runs it in the same process, else
:class:`LookupClient`, one ZMQ REQ/REP pair over an IPC socket named after the engine id, through the control channel
(:mod:`dynamo_kvtc.transport.channel`: msgpack with size limits, never pickle; deadlines on every request). The
socket lives in a private directory (``$TMPDIR/kvtc-<uid>``, 0700, owned by this user, not a symlink): other users
cannot connect
to it or plant a socket of their own under its name. A slow or absent worker is a miss, never a stall: the client
gives up after a deadline.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
from collections.abc import Sequence
from typing import Protocol

from ...errors import ConfigError, TransferError
from ...transport.channel import Limits, RepServer, ReqClient

log = logging.getLogger(__name__)
MAX_MESSAGE = 1 << 22  # 4 MiB: ~230K block keys (18 bytes each), far above any request


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


LIMITS = Limits(max_message=MAX_MESSAGE, max_str=4096, max_bin=0, max_array=1 << 20, max_map=16)


class Matcher(Protocol):
    """What a scheduler asks of the worker's store: how many leading blocks any tier holds, and host memory holds,
    and the worker's hand-off port (prefill side; None when it serves none)."""

    def match(self, hashes: Sequence[int]) -> tuple[int, int]: ...

    def handoff_port(self) -> int | None: ...


class LookupServer:
    """The worker's end of the lookup channel (TP rank 0): answers ``match`` and ``info`` from its store.

    Owns the IPC socket in the private socket directory; it only reads the store through ``match``."""

    def __init__(self, engine_id: str, worker: Matcher) -> None:
        private_dir(socket_dir())
        self.path = socket_path(engine_id)
        if os.path.lexists(self.path):
            os.unlink(self.path)  # a stale socket of a dead engine with the same id
        self._worker = worker
        self._rep = RepServer(f"ipc://{self.path}", self._handle, LIMITS, name="kvtc-lookup")
        os.chmod(self.path, 0o600)  # inside our 0700 directory: nobody else can swap the path

    def _handle(self, msg: dict) -> dict:
        op = msg.get("op")
        if op == "info":
            return {"handoff_port": self._worker.handoff_port() or 0}
        hashes = msg.get("hashes")
        if (
            op != "match"
            or not isinstance(hashes, list)
            or not all(isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 1 << 128 for h in hashes)
        ):
            raise TransferError("bad lookup request")
        n, n_host = self._worker.match(hashes)
        return {"n": n, "host": n_host}

    def close(self) -> None:
        self._rep.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class LookupClient:
    """The scheduler's end when the worker is in another process: ZMQ over the engine's IPC socket.

    A slow or absent worker is a miss (TransferError, which the scheduler turns into 0 matched tokens), never a stall
    longer than the deadline."""

    def __init__(self, engine_id: str, timeout_s: float = 1.0) -> None:
        self.path = socket_path(engine_id)
        self._req = ReqClient(f"ipc://{self.path}", LIMITS, timeout_s, name="kvtc lookup")

    def match(self, hashes: Sequence[int]) -> tuple[int, int]:
        reply = self._req.ask({"op": "match", "hashes": [int(h) for h in hashes]})
        n, n_host = reply.get("n"), reply.get("host")
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in (n, n_host)) or not 0 <= n_host <= n:
            raise TransferError(f"kvtc lookup reply malformed: {reply!r:.200}")
        return min(n, len(hashes)), min(n_host, len(hashes))

    def handoff_port(self) -> int | None:
        port = self._req.ask({"op": "info"}).get("handoff_port")
        return port if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536 else None

    def close(self) -> None:
        self._req.close()


def _in_process_worker(engine_id: str) -> Matcher | None:
    """The KvtcConnector worker half of this engine when vLLM runs it in this process (uniprocess executor)."""
    try:
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    except ImportError:
        return None
    if not has_kv_transfer_group():
        return None
    worker = getattr(get_kv_transfer_group(), "worker", None)
    if worker is None or getattr(worker, "engine_id", None) != engine_id:
        return None
    return worker


class LazyLookup:
    """Lookup-client factory: the worker in this process when vLLM has one here, else the IPC client — decided at
    the first lookup (vLLM creates the scheduler's connector after the workers' in one process, but not in all
    executors), and kept."""

    def __init__(self, engine_id: str, timeout_s: float = 1.0) -> None:
        self.engine_id = engine_id
        self.timeout_s = timeout_s
        self._impl: Matcher | None = None

    def _get(self) -> Matcher:
        if self._impl is None:
            self._impl = _in_process_worker(self.engine_id) or LookupClient(self.engine_id, self.timeout_s)
        return self._impl

    def match(self, hashes: Sequence[int]) -> tuple[int, int]:
        return self._get().match(hashes)

    def handoff_port(self) -> int | None:
        try:
            return self._get().handoff_port()
        except TransferError as e:
            log.warning("kvtc: cannot ask the worker for its hand-off port: %s", e)
            return None

    def close(self) -> None:
        if isinstance(self._impl, LookupClient):
            self._impl.close()

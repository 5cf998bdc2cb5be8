"""The pool tier's link to Mooncake's master, kept off the engine's threads: a plain-socket dial of the master's RPC
port, the health probe that notices a lost master before a lookup calls into the client, and the bounded readers
that run each client call within its deadline.

Why: Mooncake's binding runs some calls holding the GIL (a client's teardown joins its ping thread and retries the
unmount against a dead master for 7-13 s; ``setup`` retries an absent master for ~80 s), and a call to a frozen
master blocks its thread for ~30 s. So the tier (:mod:`.pool`) calls ``setup`` only once :func:`dial` connects,
never closes a client mid-run, stops calling one as soon as :class:`MasterProbe` fails, and runs calls on
:class:`Readers`, which never queue a call behind hung ones. :class:`MasterLink` is the tier's side of all that
(connect, reconnect, probe, lose the master, call within the deadline).
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from ..errors import TierError

log = logging.getLogger("dynamo_kvtc.tiers.pool")

PROBE_S = 0.2  # the probe's period: one select on a kept-open socket and one local flag read, no traffic
REUSE_S = 60.0  # the master answers, the kept client is still unhealthy after this long: a new client


def dial(address: str, timeout: float = 1.0) -> socket.socket:
    """A plain TCP connection to ``address`` ("host:port"); TierError when it does not answer."""
    host, port = address.rsplit(":", 1)
    try:
        return socket.create_connection((host, int(port)), timeout=timeout)
    except (OSError, ValueError) as e:
        raise TierError(f"pool: the master {address} does not answer ({e})") from None


def healthy(client: Any) -> bool:
    """The client's own view of its master: ``health_check()`` reads a flag its ping thread sets (no call to the
    master; 0 is healthy). A client without the method (another Mooncake build) counts as healthy: the socket
    decides."""
    check = getattr(client, "health_check", None)
    return check is None or check() == 0


class MasterProbe:
    """Whether a client's master is there: one TCP connection to its port held open (the master's death closes it at
    once; a closed port refuses the redial) and the client's ``health_check()`` flag (set by Mooncake's own ping
    thread; a frozen master fails it after ~30 s). :meth:`check` waits up to one period."""

    def __init__(self, address: str, period: float = PROBE_S) -> None:
        self.address, self.period = address, period
        self._sock: socket.socket | None = None

    def check(self, client: Any) -> str | None:
        """None when the master is there, else why not."""
        try:
            if self._sock is None:
                self._sock = dial(self.address, self.period)
            if select.select([self._sock], [], [], self.period)[0] and not self._sock.recv(4096):
                self.reset()  # closed by the master: it died (the redial is refused) or it drops idle connections
                self._sock = dial(self.address, self.period)
            ok = healthy(client)
        except (OSError, TierError) as e:
            self.reset()
            return str(e)
        return None if ok else "the client's pings to the master fail"

    def reset(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Readers:
    """At most ``n`` calls in flight, each on a reader thread; :meth:`submit` waits for a free reader up to
    ``timeout`` and gives up (TierError) rather than queueing a call behind hung ones."""

    def __init__(self, n: int) -> None:
        self._slots = threading.BoundedSemaphore(n)
        self._pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="kvtc-pool-read")

    def submit(self, timeout: float, fn: Any, *args: Any) -> Any:
        """A future of ``fn(*args)``; TierError when no reader frees within ``timeout`` or the readers are shut."""
        if not self._slots.acquire(timeout=timeout):
            raise TierError(f"pool: no reader free within {timeout} s")
        try:
            return self._pool.submit(self._run, fn, *args)
        except RuntimeError:  # shut down
            self._slots.release()
            raise TierError("pool: closed") from None

    def _run(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        finally:
            self._slots.release()

    def shutdown(self, wait: bool = False) -> None:
        """No new call starts; queued ones are cancelled; ``wait``: until the calls running now returned."""
        self._pool.shutdown(wait=wait, cancel_futures=True)


def close_client(client: Any) -> None:
    try:
        client.close()
    except Exception:  # closing a client whose master is gone: nothing left to do
        pass


def local_host() -> str:
    return socket.gethostbyname(socket.gethostname())


class MasterLink:
    """The pool tier's side of the connection (a mixin of :class:`~dynamo_kvtc.tiers.pool.PoolTier`, which owns the
    state it reads: ``cfg``, ``capacity``, ``metadata_server``, ``counts``, the lock ``_lock`` and its condition
    ``_wake``, ``_client`` (connected, or None), ``_kept`` / ``_lost_at`` (a client that lost its master, kept),
    ``_retired``, ``_epoch``, ``_closed`` and the bounded readers ``_reads``): connecting, the health probe, losing
    the master, and every client call within its deadline."""

    cfg: Any
    capacity: int
    metadata_server: str
    counts: Counter[str]
    _lock: threading.RLock
    _wake: threading.Condition
    _client: Any
    _kept: Any
    _lost_at: float
    _retired: list[Any]
    _epoch: int
    _closed: bool
    _reads: Readers

    def _connect(self) -> Any:
        from . import mooncake_lib

        dial(self.cfg.pool_master).close()  # Mooncake's setup retries an absent master for ~80 s holding the GIL
        store = mooncake_lib.load().MooncakeDistributedStore()
        rc = store.setup("127.0.0.1" if self._loopback() else local_host(), self.metadata_server,
                         self.capacity, 64 << 20, self.cfg.pool_protocol, self.cfg.pool_device or "",
                         self.cfg.pool_master)  # fmt: skip
        if rc != 0:
            close_client(store)
            raise TierError(f"pool: mooncake setup against {self.cfg.pool_master} failed ({rc})")
        return store

    def _reconnect(self) -> Any:
        """A connected client: the kept one once its pings found the master again, else (none kept, or one kept
        past :data:`REUSE_S` while the master answers) a new one. None: the kept client is not back yet; TierError:
        the master does not answer."""
        dial(self.cfg.pool_master).close()
        kept = self._kept
        if kept is None:
            return self._connect()
        if healthy(kept):  # its own pings found the master (no call to it)
            self._kept = None
            return kept
        if time.monotonic() - self._lost_at < REUSE_S:
            return None
        log.warning("kvtc pool: the kept client did not find %s again; starting a new one", self.cfg.pool_master)
        self._retired.append(kept)
        self._kept = None
        return self._connect()

    def _probe(self) -> None:
        """The health probe thread: while connected, a failed :class:`MasterProbe` check disconnects the tier."""
        probe = MasterProbe(self.cfg.pool_master)
        while not self._closed:
            client, epoch = self._client, self._epoch
            if client is None:
                probe.reset()
                with self._lock:
                    if self._client is None and not self._closed:
                        self._wake.wait(PROBE_S)
                continue
            why = probe.check(client)
            if why is not None:
                self._lost(client, f"health probe: {why}", epoch)
        probe.reset()

    def _loopback(self) -> bool:
        return self.cfg.pool_master.startswith(("127.", "localhost"))

    def _lost(self, client: Any, why: str, epoch: int | None = None) -> None:
        """A failed operation (of connection ``epoch``, when given): the tier is disconnected and the client kept,
        not closed; the writer reconnects in the background (:meth:`_reconnect`)."""
        with self._lock:
            if self._client is client and client is not None and epoch in (None, self._epoch):
                log.warning("kvtc pool: lost the master (%s); reconnecting in the background", why)
                self._client = None
                self._kept, self._lost_at = client, time.monotonic()
                self.counts["disconnects"] += 1
                self._wake.notify_all()

    def _call(self, fn: Any, *args: Any) -> Any:
        """``fn(client, *args)`` within ``pool_timeout_s``; TierError on a timeout, no client or a failure."""
        client, epoch = self._client, self._epoch
        if client is None:
            self.counts["unreachable"] += 1
            raise TierError("pool: not connected")
        deadline = time.monotonic() + self.cfg.pool_timeout_s
        try:
            fut = self._reads.submit(self.cfg.pool_timeout_s, fn, client, *args)
        except TierError:  # every reader stuck in an earlier call (a frozen master)
            self.counts["busy"] += 1
            raise
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except FutureTimeout:
            self.counts["timeout"] += 1
            raise TierError(f"pool: no answer within {self.cfg.pool_timeout_s} s") from None
        except Exception as e:
            self._lost(client, str(e), epoch)
            raise TierError(f"pool: {type(e).__name__}: {e}") from None

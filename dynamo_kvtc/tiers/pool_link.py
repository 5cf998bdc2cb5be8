"""The pool tier's link to Mooncake's master, kept off the engine's threads: a plain-socket dial of the master's RPC
port, the health probe that notices a lost master before a lookup calls into the client, and the bounded readers
that run each client call within its deadline.

Why: Mooncake's binding runs some calls holding the GIL (a client's teardown joins its ping thread and retries the
unmount against a dead master for 7-13 s; ``setup`` retries an absent master for ~80 s), and a call to a frozen
master blocks its thread for ~30 s. So the tier (:mod:`.pool`) calls ``setup`` only once :func:`dial` connects,
never closes a client mid-run, stops calling one as soon as :class:`MasterProbe` fails, and runs calls on
:class:`Readers`, which never queue a call behind hung ones.
"""

from __future__ import annotations

import select
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..errors import TierError

PROBE_S = 0.2  # the probe's period: one select on a kept-open socket and one local flag read, no traffic


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

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)

"""Limits on the decode side's fetches from prefill peers, so a dead or slow peer a request names costs little and
nothing else waits on it.

A request's ``kvtc_host``/``kvtc_port`` name the peer, so any API client can name one that never answers. Each fetch
passes :class:`PeerGate` before it asks: at most ``per_peer`` fetches wait on or talk to one peer, at most ``total``
on all peers together, and a peer that failed its handshake (see
:class:`~dynamo_kvtc.transport.channel.ReqClient`'s short connect deadline) is refused at once for ``cooldown_s``
after. A refused fetch is a :class:`~dynamo_kvtc.errors.PeerUnreachableError`: a miss, the engine recomputes. Host
and disk restores never pass here (they run on their own onboard lanes).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from ...errors import PeerUnreachableError

PER_PEER = 2  # fetches waiting on or talking to one peer
TOTAL = 8  # ... on all peers together
COOLDOWN_S = 5.0  # a peer that failed its handshake is refused at once this long after


class PeerGate:
    """Counts fetches per peer and in all, and remembers when each peer last failed its handshake. Thread-safe."""

    def __init__(self, per_peer: int = PER_PEER, total: int = TOTAL, cooldown_s: float = COOLDOWN_S) -> None:
        self.per_peer, self.total, self.cooldown_s = max(1, per_peer), max(1, total), cooldown_s
        self._open: Counter[str] = Counter()
        self._failed: dict[str, float] = {}  # peer -> monotonic time of its last failed handshake
        self._lock = threading.Lock()
        self.refused = 0  # fetches refused here without a byte sent

    @contextmanager
    def enter(self, peer: str) -> Iterator[None]:
        """Hold one of ``peer``'s slots for the body; PeerUnreachableError at once when none is free or the peer
        failed its handshake within ``cooldown_s``. A handshake failure in the body starts the peer's cool-down."""
        with self._lock:
            why = self._refusal(peer, time.monotonic())
            if why:
                self.refused += 1
                raise PeerUnreachableError(f"prefill peer {peer}: {why}; not asked (a miss)")
            self._open[peer] += 1
        try:
            yield
        except PeerUnreachableError:
            with self._lock:
                self._failed[peer] = time.monotonic()
            raise
        finally:
            with self._lock:
                self._open[peer] -= 1
                if not self._open[peer]:
                    del self._open[peer]

    def _refusal(self, peer: str, now: float) -> str:
        failed = self._failed.get(peer)
        if failed is not None:
            if now - failed < self.cooldown_s:
                return f"failed its handshake {now - failed:.1f} s ago"
            del self._failed[peer]
        if self._open[peer] >= self.per_peer:
            return f"{self._open[peer]} fetches already wait on it"
        if sum(self._open.values()) >= self.total:
            return f"{self.total} peer fetches already in flight"
        return ""

"""A blob whose bytes are still landing: a receive buffer read range by range as the ranges land.

:class:`ArrivingView` is a :class:`~dynamo_kvtc.codec.blob.BlobView` over ``(tensor, offset, length)`` of a receive
buffer (host or device memory) whose range a — bytes ``[ends[a-1], ends[a])`` of the blob — is in place once
``arrival.wait(a)`` returned. The fused restore waits group by group (so layer group 0 decodes while later groups
still move); every other reader calls :meth:`~dynamo_kvtc.codec.blob.BlobView.host`, which waits for every byte.
:class:`GroupArrival` is the record of which ranges landed, kept by the one thread that lands them: the hand-off's
reader (one NIXL READ per layer group, ``connector/handoff``) and the pool tier's (one sealed segment per layer
group, ``tiers/pool.py``). Range a is usually layer group a (``codec.container.group_ends``).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from ..codec.blob import BlobView
from ..errors import InputError, TransferError

log = logging.getLogger(__name__)


class Arrival(Protocol):
    """Byte ranges landing one after another (a hand-off's per-layer-group READs)."""

    def wait(self, index: int) -> None:
        """Return once ranges 0..``index`` have landed; raise (TransferError) when they never will."""

    def consumed(self, event: Any) -> None:
        """One blob's bytes were read out (on CUDA: once ``event`` completes); called once per blob."""

    def then(self, fn: Callable[[BaseException | None], None]) -> None:
        """Call ``fn(None)`` once every range landed, ``fn(error)`` once one never will (at once if already so)."""


class ArrivingView(BlobView):
    """A blob in a receive buffer whose bytes land range by range (``ends``: where each range ends in the blob).

    Owns nothing but the view and the ranges; it never reads a byte of a range that was not confirmed landed.
    ``owned``: the receive buffer is this view's alone, never reused for another fetch (the pool tier's): once every
    byte landed, :meth:`host` returns it in place instead of a copy."""

    arriving = True

    def __init__(self, tensor: torch.Tensor, offset: int, length: int, arrival: Arrival, ends: Sequence[int], *,
                 owned: bool = False) -> None:  # fmt: skip
        ends = tuple(int(e) for e in ends)
        if not ends or ends[0] < 1 or ends[-1] != length or any(b <= a for a, b in zip(ends, ends[1:])):
            raise InputError(f"arrival ranges must increase strictly up to the blob's {length} bytes, got {ends[:8]}")
        super().__init__(tensor, offset, length)
        self.arrival, self.ends, self._consumed, self.owned = arrival, ends, False, owned

    def host(self) -> memoryview:
        """Every byte, once landed: in place for an ``owned`` host buffer, else a copy (a receive buffer is reused)."""
        if self.owned and self._host is None and self._mv is not None:
            self.wait_for(self.nbytes)
            self._host = self._mv
            self.consumed(None)
        return super().host()

    def wait_for(self, end: int) -> None:
        """Block until bytes ``[0, end)`` of the blob have landed."""
        self.arrival.wait(min(bisect.bisect_left(self.ends, end), len(self.ends) - 1))

    def when_landed(self, fn: Callable[[BaseException | None], None]) -> None:
        """``fn(None)`` once every byte landed, ``fn(error)`` once some never will (on the thread landing them)."""
        self.arrival.then(fn)

    def consumed(self, event: Any = None) -> None:
        """Tell the arrival this blob was read out (once; later calls do nothing)."""
        if not self._consumed:
            self._consumed = True
            self.arrival.consumed(event)

    def again(self, arrival: Arrival) -> ArrivingView:
        """The same bytes landing again under another arrival (a benchmark replaying one fetch's schedule)."""
        return ArrivingView(self.tensor, self.offset, self.nbytes, arrival, self.ends, owned=self.owned)


class GroupArrival:
    """Which byte ranges of one fetch (one or more blobs, read range by range) have landed, and whether its blobs were
    read out.

    Owns only events, counters and the callbacks of :meth:`then`: the landing thread calls :meth:`landed` per range
    in order (or :meth:`fail`), then :meth:`finish`; restores call :meth:`wait` and :meth:`consumed`. It never
    touches the bytes."""

    def __init__(self, ranges: int, blobs: int, timeout_s: float) -> None:
        self.ranges = ranges
        self._landed = [threading.Event() for _ in range(ranges)]
        self.landed_s: list[float | None] = [None] * ranges  # seconds after the arrival was made (the first read)
        self.error: BaseException | None = None
        self.finished = threading.Event()  # every read of the fetch over (landed or failed)
        self.timeout_s = timeout_s * (ranges + 1)  # each read has its own deadline: this is only a backstop
        self.started = time.perf_counter()
        self.event: Any = None  # CUDA event after which the blobs' bytes are no longer read (the last consumer's)
        self._left = blobs
        self._lock = threading.Lock()
        self._then: list[Callable[[BaseException | None], None]] | None = []  # None once told

    def landed(self, a: int) -> None:
        self.landed_s[a] = time.perf_counter() - self.started
        self._landed[a].set()

    def fail(self, e: BaseException) -> None:
        """No further range will land: the :meth:`then` callbacks hear it first (a tier forgets the blob before a
        restore sees the miss), then every waiter is released and raises."""
        self.error = e
        self._tell(e)
        for ev in self._landed:
            ev.set()

    def finish(self) -> None:
        """Every read is over: the :meth:`then` callbacks hear how (unless :meth:`fail` told them), then
        ``finished`` is set."""
        ok = self.error is None and all(t is not None for t in self.landed_s)
        self._tell(None if ok else self.error or TransferError("the fetch ended with byte ranges not landed"))
        self.finished.set()

    def then(self, fn: Callable[[BaseException | None], None]) -> None:
        """Call ``fn(None)`` once every range landed, ``fn(error)`` once one never will (on the landing thread, or at
        once when that is already known). ``fn`` must not raise (what it raises is logged)."""
        with self._lock:
            if self._then is not None:
                self._then.append(fn)
                return
            err = self.error
        _call(fn, err)

    def _tell(self, err: BaseException | None) -> None:
        with self._lock:
            fns, self._then = self._then, None
        for fn in fns or ():
            _call(fn, err)

    def wait(self, a: int) -> None:
        """Return once ranges 0..a landed (they land in order); TransferError when they never will."""
        if not self._landed[a].wait(self.timeout_s):
            raise TransferError(f"byte range {a} did not land within {self.timeout_s:g} s")
        if self.landed_s[a] is None:
            raise TransferError(f"read failed before byte range {a} landed: {self.error}")

    def consumed(self, event: Any) -> None:
        with self._lock:
            self._left -= 1
            if event is not None:
                self.event = event

    @property
    def is_consumed(self) -> bool:
        """Every blob of the fetch was read out (its receive buffer may take the next fetch)."""
        return self._left <= 0


def _call(fn: Callable[[BaseException | None], None], err: BaseException | None) -> None:
    try:
        fn(err)
    except Exception:  # noqa: BLE001 - a listener's failure never fails the landing thread
        log.exception("kvtc: a listener of a landed blob failed")

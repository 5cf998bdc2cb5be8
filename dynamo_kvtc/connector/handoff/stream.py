"""The hand-off streamed layer group by layer group: where each group's bytes end in a blob (the prefill side sends
it), and the decode side's record of which byte ranges have landed.

A blob's sections are ordered by layer group (codec/container.py), so group g of a blob is one contiguous byte range
and the header sits before group 0. The decode side READs range a of every blob of a fetch in one transfer, a = 0,
1, ..., one after another, and the fused restore (:class:`~dynamo_kvtc.codec.gpu.restore.ArrivingBlob`) decodes
group g as soon as the ranges holding it landed, while later ranges still move.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ...codec.container import parse_blob
from ...errors import DecodeError, TransferError


def group_ends(blob: Any) -> list[int] | None:
    """Where each layer group's sections end in ``blob`` (strictly increasing, the last = the blob's length), or
    None when the blob cannot be parsed here (it then travels as one range)."""
    try:
        _, recs = parse_blob(blob)
        ends: dict[int, int] = {}
        for r in recs:
            g = int(r.name.split(".", 1)[0])
            ends[g] = max(ends.get(g, 0), r.offset + r.stored_len)
    except (DecodeError, ValueError):
        return None
    out: list[int] = []
    for g in sorted(ends):
        if not out or ends[g] > out[-1]:  # an empty group adds no range
            out.append(ends[g])
    n = len(memoryview(blob).cast("B"))
    if not out or out[-1] != n:
        return None
    return out


class GroupArrival:
    """Which byte ranges of one fetch have landed in the receive buffer, and whether its blobs were read out.

    Owns only events and counters: the reader thread calls :meth:`landed` per range in order (or :meth:`fail`), then
    sets ``finished``; restores call :meth:`wait` and :meth:`consumed`. It never touches the bytes."""

    def __init__(self, ranges: int, blobs: int, timeout_s: float) -> None:
        self.ranges = ranges
        self._landed = [threading.Event() for _ in range(ranges)]
        self.landed_s: list[float | None] = [None] * ranges  # seconds after the first READ was posted
        self.error: BaseException | None = None
        self.finished = threading.Event()  # every READ of the fetch over (landed or failed)
        self.timeout_s = timeout_s * (ranges + 1)  # each READ has its own deadline: this is only a backstop
        self.started = time.perf_counter()
        self.event: Any = None  # CUDA event after which the blobs' bytes are no longer read (the last consumer's)
        self._left = blobs
        self._lock = threading.Lock()

    def landed(self, a: int) -> None:
        self.landed_s[a] = time.perf_counter() - self.started
        self._landed[a].set()

    def fail(self, e: BaseException) -> None:
        """No further range will land: every waiter is released and raises."""
        self.error = e
        for ev in self._landed:
            ev.set()

    def wait(self, a: int) -> None:
        """Return once ranges 0..a landed (they land in order); TransferError when they never will."""
        if not self._landed[a].wait(self.timeout_s):
            raise TransferError(f"hand-off byte range {a} did not land within {self.timeout_s:g} s")
        if self.landed_s[a] is None:
            raise TransferError(f"hand-off READ failed before byte range {a} landed: {self.error}")

    def consumed(self, event: Any) -> None:
        with self._lock:
            self._left -= 1
            if event is not None:
                self.event = event

    @property
    def is_consumed(self) -> bool:
        """Every blob of the fetch was read out (its receive buffer may take the next fetch)."""
        return self._left <= 0

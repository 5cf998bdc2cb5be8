"""A pool object in parts: one sealed part per layer group, read part by part into registered memory.

The pool tier (:mod:`.pool`) writes a blob as ONE Mooncake object holding its layer groups as separately sealed parts,
back to back (:meth:`~dynamo_kvtc.tiers.seal.Sealer.seal_parts`; a blob whose groups do not parse is one part).
:class:`Parts` is where they end: ``sealed`` in the object, ``plain`` in the blob (``codec.container.group_ends``);
it travels in the blob's sealed locator, so it is trusted once that opened (and still checked for shape).

Readers (:class:`PartQueue`) fetch part 0, then 1, ... of each blob (part 0 of every blob asked for before any
part 1, so a restore of many blobs gets every first layer group first) with Mooncake's range reads
(``get_into_ranges``), which land only in memory registered with the client (``register_buffer``; on the TCP
transport too: a range read into unregistered memory gets -600, while a whole-object ``get_into`` works
unregistered). One call fetches every part waiting at the lowest index (several objects in flight together, in one
Mooncake batch), and one call is in flight at a time while the other readers open what the last one brought: calls
made side by side from several threads were slower than the same calls one after another (three threads' gets of one
conversation's three objects ~11 ms against ~3.4 ms, on this 2-core machine): Mooncake's client waits for a call's
transfers by polling on the caller's thread (its default build, without event-driven completion), and those threads
compete with the transfer threads that move the bytes. A call still in flight after ``stall_s`` no longer holds the
next one back (one slow or dead segment does not stall every read for the whole deadline). Each call lands in a
:class:`Landing`, a registered host buffer taking the parts back to back, kept for the next call (:class:`Landings`).
A landing whose read outlived its deadline is dropped, never reused: it is unregistered once that read returned.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import BadRecordError, TierError

MAX_PARTS = 1 << 12  # parts one object may have (a blob has at most one layer group per layer)
NOT_FOUND = -704  # Mooncake's OBJECT_NOT_FOUND (a range read of a missing object)
OUT_OF_RANGE = -600  # Mooncake's INVALID_PARAMS: a range outside the object (one shorter than its locator says)
STALE = -(1 << 30)  # not Mooncake's: the landing's client was replaced (a reconnect) or the landing dropped
SMALLEST_LANDING = 1 << 20
BATCH_BYTES = 32 << 20  # sealed bytes one call fetches at most (a larger part goes alone)
BATCH_PARTS = 64  # parts one call fetches at most
STALL_S = 0.05  # a call in flight this long lets the next one start beside it


@dataclass(frozen=True)
class Parts:
    """Where each sealed part ends in the object (``sealed``) and each layer group in the blob (``plain``)."""

    sealed: tuple[int, ...]
    plain: tuple[int, ...]

    @classmethod
    def whole(cls, sealed: Sequence[int], plain: Sequence[int]) -> Parts:
        return cls(tuple(int(x) for x in sealed), tuple(int(x) for x in plain))

    def record(self) -> dict[str, list[int]]:
        return {"sealed": list(self.sealed), "plain": list(self.plain)}

    @classmethod
    def from_record(cls, rec: Any, overhead: int, size: int) -> Parts:
        """The parts a locator records for a blob of ``size`` bytes sealed with ``overhead`` bytes a part;
        BadRecordError for anything else."""
        if not isinstance(rec, dict) or set(rec) != {"sealed", "plain"}:
            raise BadRecordError("pool locator: the parts record must be {sealed, plain}")
        sealed, plain = rec["sealed"], rec["plain"]
        ok = isinstance(sealed, list) and isinstance(plain, list) and 0 < len(plain) == len(sealed) <= MAX_PARTS
        ok = ok and all(isinstance(x, int) and not isinstance(x, bool) for x in (*sealed, *plain))
        if not ok or plain[-1] != size:
            raise BadRecordError(f"pool locator: parts that do not cover the blob's {size} bytes")
        for a, b, sa, sb in zip([0, *plain], plain, [0, *sealed], sealed):
            if b <= a or sb - sa != b - a + overhead:
                raise BadRecordError("pool locator: part ends that do not increase by their sealed sizes")
        return cls.whole(sealed, plain)

    def spans(self) -> list[tuple[int, int, int, int]]:
        """Per part: (offset in the object, sealed size, offset in the blob, plain size)."""
        return [self.span(k) for k in range(len(self.plain))]

    def span(self, k: int) -> tuple[int, int, int, int]:
        """Part k: (offset in the object, sealed size, offset in the blob, plain size)."""
        s0, p0 = (self.sealed[k - 1], self.plain[k - 1]) if k else (0, 0)
        return s0, self.sealed[k] - s0, p0, self.plain[k] - p0


class Landing:
    """A host buffer registered with one Mooncake client, taking one call's sealed parts back to back.

    Owns the buffer and its registration; :meth:`drop` gives both up, at once or, while a read is still landing in
    it (one that outlived its deadline), when that read returns."""

    def __init__(self, client: Any, size: int) -> None:
        self.client, self.size = client, max(SMALLEST_LANDING, 1 << (max(size, 1) - 1).bit_length())
        self.buf = torch.empty(self.size, dtype=torch.uint8)
        self.registered, self._busy, self._dropped, self._unregister = False, False, False, True
        self._lock = threading.Lock()

    def register(self, client: Any) -> int:
        """Register the buffer with its client (run within the tier's deadline): Mooncake's code (0: registered), or
        :data:`STALE` when ``client`` is no longer the one it was made for."""
        if client is not self.client:
            return STALE
        rc = int(client.register_buffer(self.buf.data_ptr(), self.size))
        self.registered = rc == 0
        return rc

    def read(self, client: Any, ranges: Sequence[tuple[str, int, int]]) -> list[int]:
        """Ranges ``(key, offset, size)`` of objects into the buffer back to back from its start, in ONE call: per
        range the bytes read or Mooncake's (negative) code (every range :data:`STALE` when the landing is no longer
        this client's or too small). Raises TierError when the call failed as a whole (the tier reconnects): no range
        read, for a code that says the connection failed, or an answer not shaped as asked."""
        total = sum(n for _, _, n in ranges)
        with self._lock:
            if self._dropped or client is not self.client or total > self.size:
                return [STALE] * len(ranges)
            self._busy = True
        try:
            keys: dict[str, list[int]] = {}  # key -> its ranges (a key asked for twice is one entry)
            for i, (key, _, _) in enumerate(ranges):
                keys.setdefault(key, []).append(i)
            dst = list(itertools.accumulate((n for _, _, n in ranges), initial=0))
            ix = list(keys.values())
            got = client.get_into_ranges([self.buf.data_ptr()], [list(keys)], [[[dst[i] for i in r] for r in ix]],
                                         [[[ranges[i][1] for i in r] for r in ix]],
                                         [[[ranges[i][2] for i in r] for r in ix]])  # fmt: skip
            if len(got) != 1 or len(got[0]) != len(ix) or any(len(a) != len(r) for a, r in zip(got[0], ix)):
                raise TierError(f"pool: get_into_ranges answered {len(got)} buffers for 1 ({ranges[0][0]}, ...)")
            out = [0] * len(ranges)
            for r, answer in zip(ix, got[0]):
                for i, g in zip(r, answer):
                    out[i] = int(g)
        finally:
            with self._lock:
                self._busy = False
                free = self._dropped
            if free:
                self._free(self._unregister)
        failed = [g for g in out if g < 0 and g not in (NOT_FOUND, OUT_OF_RANGE)]
        if failed and len(failed) == len(out):
            raise TierError(f"pool: get_into_ranges failed ({failed[0]})")
        return out

    def view(self, offset: int, n: int) -> memoryview:
        return memoryview(self.buf.numpy())[offset : offset + n]

    def drop(self, unregister: bool = True) -> None:
        """Give the buffer up (``unregister``: tell its client, which is still the tier's)."""
        with self._lock:
            self._dropped, self._unregister = True, unregister
            free = not self._busy
        if free:
            self._free(unregister)

    def _free(self, unregister: bool) -> None:
        if self.registered and unregister:
            self.registered = False
            try:
                self.client.unregister_buffer(self.buf.data_ptr())
            except Exception:  # noqa: BLE001 - a client that is going away: its registrations go with it
                pass


class Landings:
    """The landing buffers not in use (at most ``keep``), each registered with the client that made it."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._free: list[Landing] = []
        self._lock = threading.Lock()

    def take(self, client: Any, size: int) -> Landing | None:
        """A free landing of ``client`` holding ``size`` bytes, or None (the caller makes and registers one)."""
        with self._lock:
            for i, ld in enumerate(self._free):
                if ld.client is client and ld.size >= size:
                    return self._free.pop(i)
            stale = [ld for ld in self._free if ld.client is not client]
            self._free = [ld for ld in self._free if ld.client is client]
        for ld in stale:
            ld.drop(unregister=False)  # a lost client's: closed with it
        return None

    def give(self, landing: Landing, client: Any) -> None:
        """Back after a read that returned: kept for the next (the smallest one dropped when over ``keep``)."""
        with self._lock:
            if landing.client is not client:
                landing.drop(unregister=False)
                return
            self._free.append(landing)
            self._free.sort(key=lambda x: -x.size)
            extra = self._free[self.keep :]
            del self._free[self.keep :]
        for ld in extra:
            ld.drop()

    def clear(self) -> None:
        with self._lock:
            gone, self._free = self._free, []
        for ld in gone:
            ld.drop(unregister=False)


@dataclass
class PartJob:
    """One blob being read: its object's key, its parts' associated data, where its parts end, the buffer they open
    into and the arrival they land in."""

    blob_id: str
    key: str
    aad: bytes
    parts: Parts
    buf: torch.Tensor
    arrival: Any


@dataclass
class Fetched:
    """What one call brought for a batch of parts: the landing holding them back to back and per part the bytes read
    or Mooncake's code, or why the call failed (``error``: every part of the batch failed)."""

    landing: Landing | None
    got: list[int]
    error: BaseException | None = None


Batch = list[tuple[PartJob, int]]  # parts (blob, part index) fetched by one call


class PartQueue:
    """The pool tier's readers: ``n`` threads. One at a time takes every part waiting at the lowest part index (in the
    order the blobs were asked for, up to ``batch_bytes`` sealed bytes and :data:`BATCH_PARTS` parts) and fetches
    them in one call, ``fetch(batch)``; the lane is free again once that returned, or after ``stall_s`` if it did not.
    Then that thread lands them, ``land(batch, fetched)`` (which says which landed; for those part k + 1 is queued)
    while the next batch is fetched. So a restore of many blobs gets every blob's first layer group before any blob's
    second, and one call carries every object waiting. ``fetch`` and ``land`` must not raise."""

    def __init__(self, fetch: Callable[[Batch], Fetched], land: Callable[[Batch, Fetched], list[bool]], n: int,
                 name: str, *, batch_bytes: int = BATCH_BYTES, stall_s: float = STALL_S) -> None:  # fmt: skip
        self._fetch, self._land = fetch, land
        self.batch_bytes, self.stall_s = batch_bytes, stall_s
        self._heap: list[tuple[int, int, PartJob]] = []  # (part index, blob's order, blob)
        self._cv = threading.Condition()
        self._seq, self.closed = itertools.count(), False
        self._fetching, self._stall_at = 0, 0.0  # calls in flight; when the newest stops holding the next back
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, job: PartJob) -> None:
        with self._cv:
            if self.closed:
                raise TierError("pool: closed")
            heapq.heappush(self._heap, (0, next(self._seq), job))
            self._cv.notify()

    def _take(self) -> list[tuple[int, int, PartJob]] | None:
        """(Under the condition) once a part waits and the lane is free: every part waiting at the lowest index, in
        order, within the batch's bounds; None once closed and nothing waits."""
        while True:
            wait = None
            if self._heap:
                wait = self._stall_at - time.monotonic() if self._fetching else 0.0
                if wait <= 0:
                    break
            elif self.closed:
                return None
            self._cv.wait(wait)
        k, batch, size = self._heap[0][0], [], 0
        while self._heap and self._heap[0][0] == k and len(batch) < BATCH_PARTS:
            job = self._heap[0][2]
            n = job.parts.span(k)[1]
            if batch and size + n > self.batch_bytes:
                break
            batch.append(heapq.heappop(self._heap))
            size += n
        self._fetching += 1
        self._stall_at = time.monotonic() + self.stall_s
        return batch

    def _run(self) -> None:
        while True:
            with self._cv:
                taken = self._take()
            if taken is None:
                return
            batch = [(job, k) for k, _, job in taken]
            try:
                fetched = self._fetch(batch)
            finally:
                with self._cv:
                    self._fetching -= 1
                    self._cv.notify_all()
            landed = self._land(batch, fetched)
            with self._cv:
                for (k, seq, job), ok in zip(taken, landed):
                    if ok and k + 1 < len(job.parts.plain):
                        heapq.heappush(self._heap, (k + 1, seq, job))
                self._cv.notify_all()

    def close(self) -> None:
        """Let the readers end once every part queued was taken (a closed tier's reads fail at once)."""
        with self._cv:
            self.closed = True
            self._cv.notify_all()

"""A pool object in parts: one sealed part per layer group, read part by part into registered memory.

The pool tier (:mod:`.pool`) writes a blob as ONE Mooncake object holding its layer groups as separately sealed parts,
back to back (:meth:`~dynamo_kvtc.tiers.seal.Sealer.seal_parts`; a blob whose groups do not parse is one part).
:class:`Parts` is where they end: ``sealed`` in the object, ``plain`` in the blob (``codec.container.group_ends``);
it travels in the blob's sealed locator, so it is trusted once that opened (and still checked for shape).

Readers (:class:`PartQueue`) fetch part 0, then 1, ... of each blob (part 0 of every blob asked for before any
part 1, so a restore of many blobs gets every first layer group first) with Mooncake's range reads
(``get_into_ranges``), which land only in memory registered with the client (``register_buffer``; on the TCP
transport too: a range read into unregistered memory gets -600, while a whole-object ``get_into`` works
unregistered). Each read lands in a :class:`Landing`, a registered host buffer taking one part at a time, kept for
the next read (:class:`Landings`). A landing whose read outlived its deadline is dropped, never reused: it is
unregistered once that read returned.
"""

from __future__ import annotations

import itertools
import queue
import threading
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
        out, s0, p0 = [], 0, 0
        for s1, p1 in zip(self.sealed, self.plain):
            out.append((s0, s1 - s0, p0, p1 - p0))
            s0, p0 = s1, p1
        return out


class Landing:
    """A host buffer registered with one Mooncake client, taking one sealed part at a time.

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

    def read(self, client: Any, key: str, offset: int, size: int) -> int:
        """Bytes ``[offset, offset + size)`` of object ``key`` into the buffer's start: the bytes read, Mooncake's
        (negative) code, or :data:`STALE`. Raises TierError for a code that says the connection failed (the tier
        reconnects)."""
        with self._lock:
            if self._dropped or client is not self.client or size > self.size:
                return STALE
            self._busy = True
        try:
            got = client.get_into_ranges([self.buf.data_ptr()], [[key]], [[[0]]], [[[offset]]], [[[size]]])
            got = int(got[0][0][0])
        finally:
            with self._lock:
                self._busy = False
                free = self._dropped
            if free:
                self._free(self._unregister)
        if got < 0 and got not in (NOT_FOUND, OUT_OF_RANGE):
            raise TierError(f"pool: get_into_ranges failed ({got})")
        return got

    def view(self, n: int) -> memoryview:
        return memoryview(self.buf.numpy())[:n]

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


def register(client: Any, landing: Landing) -> int:
    """:meth:`Landing.register` as the tier's calls take it (the client first)."""
    return landing.register(client)


def read_part(client: Any, landing: Landing, key: str, offset: int, size: int) -> int:
    """:meth:`Landing.read` as the tier's calls take it (the client first)."""
    return landing.read(client, key, offset, size)


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


class PartQueue:
    """The pool tier's readers: ``n`` threads taking the next part to read, lowest part index first (then the blob
    asked for first), so a restore of many blobs gets every blob's first layer group before any blob's second.
    ``read(job, k)`` reads part k of ``job`` and says whether it landed (then part k + 1 is queued); it must not
    raise."""

    def __init__(self, read: Callable[[PartJob, int], bool], n: int, name: str) -> None:
        self._read, self._q = read, queue.PriorityQueue()
        self._seq, self.closed = itertools.count(), False
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def submit(self, job: PartJob) -> None:
        if self.closed:
            raise TierError("pool: closed")
        self._q.put((0, next(self._seq), job))

    def _run(self) -> None:
        while True:
            k, seq, job = self._q.get()
            if job is None:
                return
            if self._read(job, k) and k + 1 < len(job.parts.plain):
                self._q.put((k + 1, seq, job))

    def close(self) -> None:
        """Let the readers end once every part queued was taken (a closed tier's reads fail at once)."""
        self.closed = True
        for _ in self._threads:
            self._q.put((1 << 30, next(self._seq), None))

"""NIXL-registered memory of the hand-off: the prefill side's staging arena (registered per lease), the decode side's
receive buffer (registered once). Host (DRAM) or device (VRAM) alike, so the CPU loopback in the test suite runs the
same code as two GPUs.

- :class:`StagingArena` (prefill): one buffer allocated at start-up; each fetch takes one contiguous extent of it
  (next fit: a just-freed extent is the last to be taken again), registered with NIXL for that lease alone (ahead of
  the fetch, by the arena's rotator thread, which also zeroes and deregisters released extents), its
  blobs copied in back to back (CUDA copies on a GPU — one DMA each from the host tier's pinned pages when the blobs
  come as views of them —, one numpy copy per blob on the host) and described by one descriptor per blob. The
  metadata a fetch reply carries (:meth:`StagingArena.grant`) names that one registration: through NIXL it reaches
  that lease's extent and nothing else; when the lease ends the extent is zeroed and deregistered.
- :class:`RecvBuffer` (decode): one buffer registered once and reused by every fetch (grown, re-registered, when a
  fetch is larger), zeroed when made; the hand-off client copies each landed range out of it into memory no agent
  can write and zeroes what a fetch used once it is over, so a holder of the decode agent's metadata reads zeros
  and cannot change a blob after it was checked. A READ that NIXL could not confirm finished leaves it with the
  quarantine: the next fetch gets a fresh buffer, the old one (and its registration) is never touched again.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
import warnings
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..codec.blob import BlobView
from ..errors import TierError, TierFullError, TransferError
from .nixl_io import PeerAgent

log = logging.getLogger(__name__)
ALIGN = 256  # every extent starts on a 256-byte boundary (CUDA copies, NIXL descriptors)
READY_SLOTS = 2  # extents a staging arena keeps registered ahead of use (each granted to one lease)


def _up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def memory_device(device: Any, want: str) -> torch.device:
    """Where the hand-off stages and receives: ``device`` when it is a GPU and ``want`` (the config's
    ``handoff_memory``) allows it (``auto``/``device``), else the host. ``device`` None means the current CUDA device
    where there is one."""
    if want == "host":
        return torch.device("cpu")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev if dev.type == "cuda" else torch.device("cpu")


def mem_kind(dev: torch.device) -> tuple[str, int]:
    """NIXL's memory type and device id for a buffer on ``dev``."""
    return ("VRAM", dev.index or 0) if dev.type == "cuda" else ("DRAM", 0)


def copy_in(dst: torch.Tensor, blobs: Sequence[Any]) -> list[tuple[int, int]]:
    """Copy ``blobs`` (BlobViews or what :meth:`BlobView.of` takes; from pinned memory one asynchronous DMA each)
    back to back into ``dst`` at 256-byte
    aligned offsets; (offset, size) of each. On a GPU the copies are queued on the current stream and waited for
    before returning."""
    out, off = [], 0
    for b in map(BlobView.of, blobs):
        n = len(b)
        if off + n > dst.numel():
            raise TierFullError(f"{off + n} bytes do not fit a {dst.numel()}-byte extent")
        src = b.slice()
        if n == 0:
            pass
        elif src is not None:
            if dst.is_cuda:
                dst[off : off + n].copy_(src, non_blocking=b.pinned)
            else:
                dst[off : off + n].numpy()[:] = src.numpy()
        elif dst.is_cuda:
            with warnings.catch_warnings():  # a read-only bytes object: torch only reads it
                warnings.simplefilter("ignore")
                host = torch.frombuffer(b.host(), dtype=torch.uint8)
            dst[off : off + n].copy_(host)
        else:
            dst[off : off + n].numpy()[:] = np.frombuffer(b.host(), dtype=np.uint8)
        out.append((off, n))
        off = _up(off + n)
    if dst.is_cuda:
        torch.cuda.current_stream(dst.device).synchronize()
    return out


@dataclass(frozen=True, slots=True)
class _Extent:
    """One registered extent and all the arena knows of it: ready (registered ahead, its grant made), then one
    lease's (the same record, moved), then retiring (zeroed, deregistered, freed). A lease is one record in one dict,
    so taking, releasing and expiring it each touch one place."""

    off: int
    n: int
    reg: Any  # its NIXL registration, granted to one lease at most
    serial: int  # which registration it is (serials are never reused)
    grant: bytes | None = None  # its metadata, when made ahead with the registration (ready extents)


class StagingArena:
    """The prefill side's staging memory: one buffer (VRAM on a GPU, else DRAM) cut into contiguous extents, one per
    open lease, each registered with NIXL on its own and granted to that lease alone.

    Owns the buffer, the extents' registrations, the extent bookkeeping and a background thread (the *rotator*).
    Registration is kept off the hand-off path: the rotator keeps up to ``ready_slots`` free extents registered ahead
    of use, each with its grant (partial metadata) already made, sized from the leases seen (the next power of two of
    the largest of the last few; at most half the arena in all), and makes them up after a release — not when a lease
    takes one, which is while that lease's blobs are being copied in and READ (on a loaded host, NIXL calls beside a
    READ slowed it down). :meth:`take` hands one of them to the lease
    (``ready_hits``) and registers on the path only when none fits (``path_registrations``). Each registration is
    granted once: when its lease is given back the extent goes to the rotator, which zeroes it, deregisters it and
    only then frees it; a later lease of those bytes gets a registration of its own (``ready_registrations``). So
    nothing a lease's metadata names is ever granted again, and the hand-off's serving thread neither registers,
    zeroes nor deregisters while a ready extent fits.

    It never frees the buffer while a lease holds an extent of it, never hands out overlapping extents, and never
    leaves a released lease's bytes behind: the buffer starts zeroed, an extent is zeroed before it is freed, and a
    ready extent is carved from free (zeroed) memory. The metadata of a lease (:meth:`grant`) names only that lease's
    registration, so a holder's NIXL refuses descriptors outside it. On transports whose remote key is the address
    (UCX over TCP or shared memory, what loopback uses) deregistering does not revoke a key a holder already has: what
    it then reaches is zeros until the extent is taken again, and extents are carved next-fit so that is as late as
    the arena allows (see docs/reliability.md, threat model). A released lease's extent is zeroed by the rotator just
    after the release (:meth:`flush` waits for it), not before the release returns: until then its grantee reads
    what it was granted, nothing else."""

    def __init__(self, agent: PeerAgent, nbytes: int, device: torch.device, ready_slots: int = READY_SLOTS) -> None:
        self.agent = agent
        self.device = device
        self.mem, self.dev = mem_kind(device)
        self.buf = torch.zeros(_up(nbytes), dtype=torch.uint8, device=device)  # no stale process memory exposed
        self.base = self.buf.data_ptr()
        self._free: list[tuple[int, int]] = [(0, self.buf.numel())]  # sorted (offset, length)
        self._leases: dict[str, _Extent] = {}  # open lease -> its extent
        self._next = 0  # next fit starts here: the end of the extent carved last
        self._ready: list[_Extent] = []
        self._retire: list[_Extent] = []  # released extents the rotator zeroes, deregisters and frees
        self._seen: deque[int] = deque(maxlen=8)  # the sizes of the last leases (they size the ready extents)
        self.ready_slots = max(0, ready_slots)
        self.registrations = 0  # extents registered so far: on the path plus ahead of use
        self.path_registrations = 0  # ... of which by take(), on the hand-off path (no ready extent fitted)
        self.ready_registrations = 0  # ... of which ahead of use, by the rotator
        self.ready_hits = 0  # leases that took a ready extent (nothing registered on their path)
        self.deregistrations = 0
        self._serial = 0
        self._mu = threading.Condition()  # the bookkeeping; never held while waiting for the agent's lock
        self._busy = False  # the rotator is working (flush waits for it)
        self._retiring = 0  # released extents being zeroed and deregistered now
        self._starved = False  # the rotator found no room for a ready extent; retried when something is freed
        self._due = False  # a lease ended since the rotator last made up the ready extents
        self._closed = False
        self._rotator: threading.Thread | None = None
        if self.ready_slots:
            self._rotator = threading.Thread(target=self._rotate, name="kvtc-staging-rotator", daemon=True)
            self._rotator.start()

    @property
    def capacity(self) -> int:
        return self.buf.numel()

    @property
    def used(self) -> int:
        """Bytes held by open leases (ready extents and extents still being retired are not counted)."""
        with self._mu:
            return sum(e.n for e in self._leases.values())

    @property
    def ready(self) -> int:
        """Extents registered ahead of use and not granted yet."""
        with self._mu:
            return len(self._ready)

    def take(self, key: str, nbytes: int) -> int:
        """Reserve a contiguous extent of at least ``nbytes`` for ``key``, registered with NIXL for it alone; its
        offset. A ready extent when one fits (nothing registered here), else one registered now. TierFullError when
        none is free, TransferError when NIXL refuses the registration, TierError when ``key`` already holds one (its
        record would be overwritten and its extent never retired)."""
        need = _up(max(nbytes, 1))
        with self._mu:
            if key in self._leases:
                raise TierError(f"staging lease {key!r} already holds an extent")
            self._seen.append(need)
            fits = [r for r in self._ready if r.n >= need]
            if fits:
                r = min(fits, key=lambda r: (r.n, r.serial))
                self._ready.remove(r)
                self._leases[key] = r
                self.ready_hits += 1  # the rotator registers the next one after a release, not during a hand-off
                return r.off
            at = self._carve(need)
            late = at is None and bool(self._retire)
        if late:  # released extents the rotator has not freed yet: freed here, on the path
            self._retire_all()
            with self._mu:
                at = self._carve(need)
        with self._mu:
            spare = [] if at is not None else self._ready
            if spare:  # the room is in ready extents that do not fit this lease: give them back first
                self._ready = []
        if spare:
            self._drop(spare)
            with self._mu:
                at = self._carve(need)
        if at is None:
            raise TierFullError(
                f"transfer staging arena is full ({self.used} of {self.capacity} bytes held; raise transfer_staging_mb)"
            )
        try:
            reg = self._register(at, need)
        except TransferError:
            with self._mu:
                self._free_extent(at, need)
            raise
        with self._mu:
            self._serial += 1
            self.path_registrations += 1
            self._leases[key] = _Extent(at, need, reg, self._serial)
        return at

    def grant(self, key: str) -> bytes:
        """NIXL metadata naming ``key``'s extent alone (with the agent's connection info): what a fetch reply
        carries; made ahead with a ready extent's registration. KeyError if ``key`` holds no extent."""
        with self._mu:
            e = self._leases[key]
        return e.grant if e.grant is not None else self._make_grant(e.off, e.n)

    def serial(self, key: str) -> int:
        """Which registration ``key``'s extent is granted under (serials are never reused). KeyError if none."""
        with self._mu:
            return self._leases[key].serial

    def give(self, key: str) -> None:
        """End ``key``'s lease: its extent goes to the rotator, which zeroes and deregisters it, then frees it (off
        the caller's path; without a rotator, here). Nothing if ``key`` holds none."""
        with self._mu:
            got = self._leases.pop(key, None)
            if got is None:
                return
            self._retire.append(got)
            self._due = True  # after the retirement, the ready extents are made up again
            self._mu.notify_all()
        if self._rotator is None:
            self._retire_all()

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every released extent is zeroed and deregistered and the ready extents are made; False if that
        did not happen within ``timeout`` seconds."""
        end = time.monotonic() + timeout
        with self._mu:
            while self._retire or self._retiring or self._busy or (self._rotator and self._due and self._wants_more()):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._mu.wait(min(left, 0.05))
        return True

    def stage(self, key: str, blobs: Sequence[Any]) -> list[list[int]]:
        """Copy ``blobs`` into a new extent for ``key``; one ``[address, length]`` descriptor per blob."""
        total = sum(_up(len(BlobView.of(b))) for b in blobs)
        off = self.take(key, total)
        try:
            placed = copy_in(self.buf[off : off + total], blobs)
        except BaseException:
            self.give(key)
            raise
        return [[self.base + off + o, n] for o, n in placed]

    def close(self) -> None:
        with self._mu:
            self._closed = True
            self._mu.notify_all()
        if self._rotator is not None:
            self._rotator.join(30)
        with self._mu:
            self._retire.extend(self._leases.values())
            self._leases.clear()
            spare, self._ready = self._ready, []
        self._retire_all()
        self._drop(spare)

    # ------------------------------------------------------------------------------------------ bookkeeping
    def _carve(self, need: int) -> int | None:
        """Cut ``need`` bytes out of the free runs, next fit (free runs reaching past the extent carved last first,
        then from the start: a just-freed extent is the last to be carved again); its offset, None if none fits."""
        runs = sorted(enumerate(self._free), key=lambda r: r[1][0] + r[1][1] <= self._next)  # stable sort
        for i, (off, n) in runs:
            at = max(off, self._next)
            if at + need > off + n:
                at = off
                if need > n:
                    continue
            self._free[i : i + 1] = [(o, m) for o, m in ((off, at - off), (at + need, off + n - at - need)) if m > 0]
            self._next = at + need
            return at
        return None

    def _free_extent(self, off: int, n: int) -> None:
        """Give ``off, n`` back to the free runs, merged with free neighbours (the caller holds ``_mu``)."""
        i = bisect.bisect(self._free, (off, n))
        self._free.insert(i, (off, n))
        merged: list[tuple[int, int]] = []
        for o, m in self._free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + m)
            else:
                merged.append((o, m))
        self._free = merged
        self._starved = False

    # ------------------------------------------------------------------------------------------ NIXL
    def _register(self, off: int, n: int) -> Any:
        with self.agent.lock:
            try:
                reg = self.agent.agent.register_memory(self.buf[off : off + n])
            except self.agent.errors as e:
                raise TransferError(f"NIXL could not register a {n}-byte staging extent: {e}") from e
        with self._mu:
            self.registrations += 1
        return reg

    def _make_grant(self, off: int, n: int) -> bytes:
        a = self.agent.agent
        with self.agent.lock:
            return bytes(a.get_partial_agent_metadata(a.get_reg_descs(self.buf[off : off + n]), True))

    def _deregister(self, reg: Any) -> bool:
        with self.agent.lock:
            try:
                self.agent.agent.deregister_memory(reg)
            except self.agent.errors:
                log.warning("NIXL could not deregister a hand-off staging extent; it is never reused")
                return False
        with self._mu:
            self.deregistrations += 1
        return True

    def _retire_all(self) -> None:
        """Zero, deregister and free every released extent (an extent NIXL could not deregister is zeroed and never
        taken again)."""
        while True:
            with self._mu:
                if not self._retire:
                    return
                e = self._retire.pop(0)
                self._retiring += 1
            try:
                # a released lease's blobs are unreadable, whatever key a holder kept
                self.buf[e.off : e.off + e.n].zero_()
                if self.buf.is_cuda:
                    torch.cuda.current_stream(self.device).synchronize()
                if self._deregister(e.reg):
                    with self._mu:
                        self._free_extent(e.off, e.n)
            finally:
                with self._mu:
                    self._retiring -= 1
                    self._mu.notify_all()

    def _drop(self, spare: list[_Extent]) -> None:
        """Deregister ready extents never granted (zeros: nothing to wipe) and free them."""
        for r in spare:
            if self._deregister(r.reg):
                with self._mu:
                    self._free_extent(r.off, r.n)

    # ------------------------------------------------------------------------------------------ the rotator
    def _target(self) -> int:
        """The size of a ready extent: the next power of two of the largest recent lease (0: none seen, or too large
        for ``ready_slots`` of them to fit half the arena)."""
        if not self._seen:
            return 0
        size = _up(1 << (max(self._seen) - 1).bit_length())
        return size if size * self.ready_slots <= self.capacity // 2 else 0

    def _wants_more(self) -> bool:
        size = self._target()
        return bool(size) and not self._starved and len(self._ready) < self.ready_slots

    def _rotate(self) -> None:
        if self.buf.is_cuda:
            torch.cuda.set_device(self.device)
        while True:
            with self._mu:
                self._busy = False
                self._mu.notify_all()
                while not self._closed and not self._retire and not (self._due and self._wants_more()):
                    self._mu.wait()
                if self._closed:
                    return
                self._busy, self._due = True, False
                size = self._target()
                small = [r for r in self._ready if r.n < size]  # outgrown: the leases got larger
                self._ready = [r for r in self._ready if r.n >= size]
            try:
                self._retire_all()
                self._drop(small)
                self._refill(size)
            except Exception:  # noqa: BLE001 - the rotator must keep running; the path falls back to registering
                log.exception("kvtc staging rotator failed; leases register on their own path meanwhile")
                with self._mu:
                    self._starved = True

    def _refill(self, size: int) -> None:
        """Register ready extents of ``size`` until ``ready_slots`` are made or the arena has no room."""
        while size:
            with self._mu:
                if self._closed or len(self._ready) >= self.ready_slots or self._retire:
                    return
                at = self._carve(size)
                if at is None:
                    self._starved = True
                    return
            reg = None
            try:
                reg = self._register(at, size)
                grant = self._make_grant(at, size)
            except (TransferError, *self.agent.errors):
                if reg is None or self._deregister(reg):
                    with self._mu:
                        self._free_extent(at, size)
                with self._mu:
                    self._starved = True
                raise
            with self._mu:
                self._serial += 1
                self.ready_registrations += 1
                self._ready.append(_Extent(at, size, reg, self._serial, grant))


class RecvBuffer:
    """The decode side's receive memory: one NIXL-registered buffer reused by every fetch, grown when a fetch needs
    more. Call with the agent's lock held.

    Owns the buffer and its registration. A buffer handed to the quarantine (a READ not confirmed finished) is
    forgotten here — never reused, never deregistered — and the next fetch gets a fresh one."""

    def __init__(self, agent: PeerAgent, device: torch.device) -> None:
        self.agent = agent
        self.device = device
        self.mem, self.dev = mem_kind(device)
        self.buf: torch.Tensor | None = None
        self._reg: Any = None
        self._kept: list[torch.Tensor] = []  # buffers whose deregistration failed: never freed
        self.registrations = 0  # how often a buffer was registered (grown or replaced)

    def get(self, nbytes: int) -> torch.Tensor:
        """A registered buffer of at least ``nbytes`` (its first ``nbytes`` are what a READ fills)."""
        if self.buf is None or self.buf.numel() < nbytes:
            self._drop_registration()
            size = 1 << max(20, (max(nbytes, 1) - 1).bit_length())  # powers of two from 1 MiB: few re-registrations
            buf = torch.zeros(size, dtype=torch.uint8, device=self.device)  # no stale memory behind the registration
            try:
                self._reg = self.agent.agent.register_memory(buf)
            except self.agent.errors as e:
                raise TransferError(f"NIXL could not register a {size}-byte receive buffer: {e}") from e
            self.buf = buf
            self.registrations += 1
        return self.buf

    @property
    def registration(self) -> Any:
        """NIXL's handle of the current buffer's registration (None before the first fetch or after a reset)."""
        return self._reg

    def reset(self) -> None:
        """Deregister and drop the buffer (a READ into it failed cleanly): the next fetch registers a fresh one."""
        self._drop_registration()

    def forget(self) -> None:
        """The buffer went to the quarantine: never use or deregister it again."""
        self.buf, self._reg = None, None

    def _drop_registration(self) -> None:
        if self._reg is None:
            return
        try:
            self.agent.agent.deregister_memory(self._reg)
        except self.agent.errors:
            log.warning("NIXL could not deregister a hand-off receive buffer; it is kept")
            self._kept.append(self.buf)  # never freed: the backend may still know it
        self.buf, self._reg = None, None

    def close(self) -> None:
        self._drop_registration()

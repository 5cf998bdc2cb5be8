"""NIXL: file I/O (POSIX backend; GDS_MT when asked for and loadable on a GPU node) and READs between peer agents
(UCX; :func:`read_descs`, optionally paced by a :class:`TokenBucket` to emulate a slower link in benchmarks; and
:func:`read_ranges`, several READs posted in order, each reported as it lands).

NIXL reports failures as exceptions from ``nixl._bindings`` (``nixlBackendError``, ``nixlNotFoundError``, ...) with no
common base; they are caught as a tuple and re-raised as :class:`~dynamo_kvtc.errors.TransferError`. Every transfer
has a deadline. NIXL does not fsync: the disk tier does.

A transfer that failed or timed out may still be running inside the backend. If NIXL does not confirm that its handle
was released (or a registration was undone), the buffer it reads into or writes from is *quarantined*: kept alive
instead of being freed, so a late completion can never write into memory that was reused for something else
(``quarantined_bytes`` counts it). NIXL keeps a handle it could not release valid (``release`` raises and may be
called again), so the quarantine retries what was not confirmed — releasing the handles, undoing the registrations —
before each later transfer, and frees a buffer once all of it succeeded (``freed``). A buffer held with nothing to
retry stays for the life of the process. Held bytes are capped (``cap_bytes``, default 1 GiB): at the cap, new
transfers are refused (:class:`~dynamo_kvtc.errors.TransferError`, a miss) instead of growing, so a flaky peer cannot
leak device or host memory without bound.

:class:`PeerAgent` loads at most ``max_remotes`` remote agents (least recently used unloaded first) and unloads
metadata that named another agent than the one expected.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import ConfigError, TransferError
from .nixl_agent import import_nixl, new_agent

log = logging.getLogger(__name__)
_names = itertools.count()


QUARANTINE_CAP_BYTES = 1 << 30
MAX_REMOTES = 256
GRANTS_PER_LOAD = 64  # per-lease metadata loads of one peer before it is unloaded and loaded afresh


class Quarantine:
    """Buffers a NIXL backend may still touch: kept alive, never reused, freed only once NIXL confirms it is done.

    Each held buffer carries the NIXL calls that did not succeed (``undo``: releasing a transfer handle, undoing a
    registration); :meth:`sweep` retries them in order and drops the buffer once every one succeeded. A buffer held
    with no ``undo`` is never freed. Call :meth:`sweep`, :meth:`admit` and :meth:`add_undo` with the owning agent's
    lock held (the retries call the agent)."""

    def __init__(self, cap_bytes: int = QUARANTINE_CAP_BYTES) -> None:
        if isinstance(cap_bytes, bool) or not isinstance(cap_bytes, int) or cap_bytes < 0:
            raise ConfigError(f"quarantine cap must be a byte count >= 0, got {cap_bytes!r}")
        self._held: list[tuple[torch.Tensor, list[Callable[[], Any]], bool]] = []  # buf, undo steps left, freeable
        self.bytes = 0
        self.cap_bytes = cap_bytes
        self.freed = 0  # buffers given back after NIXL confirmed it was done with them
        self.refused = 0  # transfers refused because the held bytes reached the cap

    def hold(self, buf: torch.Tensor, why: str, undo: Sequence[Callable[[], Any]] = ()) -> None:
        log.warning("NIXL %s: its %d-byte buffer is kept alive (no late write into freed memory)", why, buf.numel())
        self._held.append((buf, list(undo), bool(undo)))
        self.bytes += buf.numel()

    def add_undo(self, buf: torch.Tensor, step: Callable[[], Any]) -> None:
        """One more call that must succeed before ``buf`` may be freed (its owner's registration, say)."""
        for held, steps, _ in self._held:
            if held is buf:
                steps.append(step)
                return

    def holds(self, buf: torch.Tensor) -> bool:
        return any(held is buf for held, _, _ in self._held)

    def sweep(self) -> int:
        """Retry what NIXL did not confirm; free the buffers it now confirms. Returns the buffers freed."""
        keep, freed = [], 0
        for buf, steps, freeable in self._held:
            while freeable and steps:
                try:
                    steps[0]()
                except Exception:  # noqa: BLE001 - NIXL's errors share no base; not confirmed yet: keep it
                    break
                steps.pop(0)
            if freeable and not steps:
                self.bytes -= buf.numel()
                freed += 1
            else:
                keep.append((buf, steps, freeable))
        self._held = keep
        if freed:
            self.freed += freed
            log.info("NIXL confirmed %d quarantined buffer(s) released; freed (%d bytes still held)", freed, self.bytes)
        return freed

    def admit(self) -> None:
        """Before a new transfer: sweep, then refuse it (TransferError, a miss) while the held bytes are at the cap."""
        if not self._held:
            return
        self.sweep()
        if self._held and self.bytes >= self.cap_bytes:
            self.refused += 1
            raise TransferError(
                f"{self.bytes} bytes of NIXL buffers are quarantined (cap {self.cap_bytes}): transfers refused "
                "until NIXL confirms earlier ones finished"
            )

    @property
    def count(self) -> int:
        """Buffers held."""
        return len(self._held)


def transfer(
    agent: Any,
    errors: tuple,
    op: str,
    local: Any,
    remote: Any,
    peer: str,
    timeout_s: float,
    *,
    buf: torch.Tensor,
    quarantine: Quarantine,
    registrations: Sequence[Any] = (),
    poll_s: float = 0.0002,
) -> None:
    """Post one NIXL ``op`` (READ/WRITE) from ``local`` to ``remote`` descriptors, wait for DONE within
    ``timeout_s``, release the handle and deregister ``registrations``. Every failure is a :class:`TransferError`.
    If NIXL cannot confirm the backend is finished with ``buf`` (handle not released, a registration not undone),
    ``buf`` goes to ``quarantine``. (:func:`read_ranges` waits on several at once under the same rules.)"""
    unsafe = False  # True while the backend may still touch ``buf``
    undo: list[Callable[[], Any]] = []  # what NIXL did not confirm: retried by the quarantine
    try:
        quarantine.admit()
        if local is None or remote is None:
            raise TransferError("NIXL rejected the transfer descriptors")
        h = agent.initialize_xfer(op, local, remote, peer)
        try:
            unsafe = True
            state = agent.transfer(h)
            deadline = time.monotonic() + timeout_s
            while state != "DONE":
                if state == "ERR":
                    raise TransferError(f"NIXL {op} reported an error")
                if time.monotonic() > deadline:
                    raise TransferError(f"NIXL {op} of {buf.numel()} bytes timed out after {timeout_s} s")
                time.sleep(poll_s)  # 0: busy-poll (benchmarks timing a fast link)
                state = agent.check_xfer_state(h)
            unsafe = False
        finally:
            try:
                agent.release_xfer_handle(h)
                unsafe = False  # released: the backend is done with the buffer
            except errors:
                log.warning("NIXL could not release a %s handle", op)
                undo.append(lambda h=h: agent.release_xfer_handle(h))
    except errors as e:
        raise TransferError(f"NIXL {op} failed: {type(e).__name__}: {e}") from e
    finally:
        for reg in reversed(registrations):
            try:
                agent.deregister_memory(reg)
            except errors:  # cleanup must not hide the real error
                log.warning("NIXL deregistration failed")
                unsafe = True
                undo.append(lambda reg=reg: agent.deregister_memory(reg))
        if unsafe:
            quarantine.hold(buf, f"{op} not confirmed finished", undo)


class TokenBucket:
    """Paces READs to an emulated link of ``gbps`` Gbit/s (benchmarks: 100/200/400 Gb/s between two processes on one
    host): a transfer goes out in chunks (:meth:`chunk_for`), chunk i posted no earlier than ``start + bytes before
    it / rate``, and it counts as done no earlier than ``start + all its bytes / rate``. Whichever is slower, the real
    link or the emulated one, sets the time. Owns a clock; never touches the bytes."""

    def __init__(self, gbps: float, chunk_bytes: int = 4 << 20, max_chunks: int = 16) -> None:
        if not gbps > 0 or chunk_bytes < 1 or max_chunks < 1:
            raise ConfigError(f"a paced link needs gbps > 0 and chunks >= 1, got {gbps!r}, {chunk_bytes!r}")
        self.gbps = gbps
        self.rate = gbps * 1e9 / 8  # bytes/s
        self.chunk_bytes = chunk_bytes
        self.max_chunks = max_chunks
        self._t0 = 0.0
        self._sent = 0

    def chunk_for(self, total: int) -> int:
        """The chunk of a ``total``-byte READ: ``chunk_bytes``, larger where that would make more than ``max_chunks``
        (each chunk is a NIXL post: its fixed cost must stay below the time the emulated link gives it)."""
        return max(self.chunk_bytes, -(-total // self.max_chunks))

    def start(self) -> None:
        self._t0, self._sent = time.perf_counter(), 0

    def _until(self, t: float) -> None:
        while True:
            left = t - time.perf_counter()
            if left <= 0:
                return
            time.sleep(min(left, 0.001) if left > 0.0002 else 0)

    def admit(self, nbytes: int) -> None:
        """Wait until ``nbytes`` more may go out."""
        self._until(self._t0 + self._sent / self.rate)
        self._sent += nbytes

    def finish(self) -> None:
        """Wait until every admitted byte would have crossed the emulated link."""
        self._until(self._t0 + self._sent / self.rate)


def split_descs(local: Sequence[tuple], remote: Sequence[tuple], chunk: int) -> list[tuple[list, list]]:
    """Matching (local, remote) descriptor lists of at most ``chunk`` bytes each, cut from two lists of ``(address,
    length, device)`` that describe the same number of bytes in order (a descriptor may be cut in two)."""
    if sum(d[1] for d in local) != sum(d[1] for d in remote):
        raise TransferError("local and remote descriptors describe different byte counts")
    out: list[tuple[list, list]] = []
    li = ri = lo = ro = 0  # descriptor index and offset into it, local and remote
    cur: tuple[list, list] = ([], [])
    room = chunk
    while li < len(local):
        la, ln, ld = local[li]
        ra, rn, rd = remote[ri]
        n = min(ln - lo, rn - ro, room)
        cur[0].append((la + lo, n, ld))
        cur[1].append((ra + ro, n, rd))
        lo, ro, room = lo + n, ro + n, room - n
        if lo == ln:
            li, lo = li + 1, 0
        if ro == rn:
            ri, ro = ri + 1, 0
        if room == 0:
            out.append(cur)
            cur, room = ([], []), chunk
    if cur[0]:
        out.append(cur)
    return out


def read_descs(
    agent: PeerAgent,
    local: Sequence[tuple],
    local_mem: str,
    remote: Sequence[tuple],
    remote_mem: str,
    peer: str,
    timeout_s: float,
    *,
    buf: torch.Tensor,
    quarantine: Quarantine,
    pace: TokenBucket | None = None,
    poll_s: float = 0.0,
    start_pace: bool = True,
) -> float:
    """READ ``remote`` into ``local`` (``(address, length, device)`` lists of equal total size, cut here into pairs
    of equal lengths as NIXL needs) from ``peer`` through :func:`transfer`; with ``pace`` in chunks paced by its token
    bucket (``start_pace`` False: the bucket was started by the caller, this READ continues one paced transfer made
    of several READs). Returns the seconds the READ took (posting to done). Call with ``agent.lock`` held; ``buf``
    (the local memory) must already be registered."""
    a = agent.agent
    total = sum(d[1] for d in local)
    parts = split_descs(local, remote, pace.chunk_for(total) if pace is not None else max(total, 1))  # paired
    t = time.perf_counter()
    if pace is not None and start_pace:
        pace.start()
    for lp, rp in parts:
        if pace is not None:
            pace.admit(sum(d[1] for d in lp))
        try:
            ld, rd = a.get_xfer_descs(lp, local_mem), a.get_xfer_descs(rp, remote_mem)
        except agent.errors as e:
            raise TransferError(f"NIXL rejected the transfer descriptors: {type(e).__name__}: {e}") from e
        transfer(a, agent.errors, "READ", ld, rd, peer, timeout_s, buf=buf, quarantine=quarantine, poll_s=poll_s)
    if pace is not None:
        pace.finish()
    return time.perf_counter() - t


def read_ranges(
    agent: PeerAgent,
    ranges: Sequence[tuple[Sequence[tuple], Sequence[tuple]]],
    local_mem: str,
    remote_mem: str,
    peer: str,
    timeout_s: float,
    *,
    buf: torch.Tensor,
    quarantine: Quarantine,
    landed: Any,
    poll_s: float = 0.0001,
    in_flight: int = 1,
) -> None:
    """READ several ``(local, remote)`` descriptor lists (each of equal lengths pairwise, as NIXL needs) from
    ``peer`` in order: every READ is prepared up front, ``in_flight`` of them are posted at once and each next one
    the moment one lands, so READ 0 gets the whole link (posted together, READs share it and the first lands almost
    with the last: on the H200, group 0 of four landed at 98% of the fetch) and the link idles only for one poll
    between READs. ``landed(i)`` is called as soon as READ i and every READ before it are done. One deadline for all.
    Every failure is a :class:`TransferError`; a posted READ not done whose handle NIXL could not release sends
    ``buf`` to ``quarantine`` (as :func:`transfer` does). Takes ``agent.lock`` only to prepare, post, poll and
    release, never while sleeping."""
    a, errors = agent.agent, agent.errors
    handles: list[Any] = []
    states: list[str | None] = []  # None: prepared, not posted (the backend cannot touch ``buf`` for it)

    def post_until(n: int) -> None:
        with agent.lock:
            while len(states) < min(n, len(handles)):
                states.append(None)
                states[-1] = a.transfer(handles[len(states) - 1])

    try:
        with agent.lock:
            quarantine.admit()
            for lp, rp in ranges:
                ld, rd = a.get_xfer_descs(list(lp), local_mem), a.get_xfer_descs(list(rp), remote_mem)
                if ld is None or rd is None:
                    raise TransferError("NIXL rejected the transfer descriptors")
                handles.append(a.initialize_xfer("READ", ld, rd, peer))
        deadline = time.monotonic() + timeout_s
        post_until(max(1, in_flight))
        for i in range(len(handles)):
            while states[i] != "DONE":
                if states[i] == "ERR":
                    raise TransferError(f"NIXL READ {i} of {len(handles)} reported an error")
                if time.monotonic() > deadline:
                    raise TransferError(f"NIXL READs into a {buf.numel()}-byte buffer timed out after {timeout_s} s")
                time.sleep(poll_s)
                with agent.lock:
                    states[i] = a.check_xfer_state(handles[i])
            post_until(i + 1 + max(1, in_flight))  # the next READ first: the link must not wait on ``landed``
            landed(i)
    except errors as e:
        raise TransferError(f"NIXL READ failed: {type(e).__name__}: {e}") from e
    finally:
        unsafe = False  # a posted READ not confirmed done whose handle could not be released: it may still write
        undo: list[Callable[[], Any]] = []
        with agent.lock:
            for i, h in enumerate(handles):
                try:
                    a.release_xfer_handle(h)
                except errors:
                    log.warning("NIXL could not release a READ handle")
                    unsafe = unsafe or (i < len(states) and states[i] not in (None, "DONE"))
                    undo.append(lambda h=h: a.release_xfer_handle(h))
            if unsafe:
                quarantine.hold(buf, "READ not confirmed finished", undo)


class PeerAgent:
    """A NIXL agent on a network backend (UCX) plus the remote agents it has loaded.

    Owns the agent; ``lock`` serialises its use (NIXL agents are not thread-safe; call :meth:`add_remote` and
    :meth:`forget` with it held). A peer's metadata is loaded once and must name the agent the peer says it is
    (metadata naming another, unknown agent is unloaded again); at most ``max_remotes`` are kept loaded, the least
    recently used unloaded first (every new peer, e.g. each restart of a prefill worker, is a new agent name).
    ``progress_us``: how long the agent's progress thread may wait between polls (:func:`new_agent`)."""

    def __init__(self, backend: str, prefix: str, max_remotes: int = MAX_REMOTES, progress_us: int = 0) -> None:
        self.errors = import_nixl()[2]
        self.name = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.agent = new_agent(self.name, [backend], progress_us)
        except self.errors + (RuntimeError,) as e:
            raise TransferError(f"NIXL {backend} backend unavailable: {type(e).__name__}: {e}") from e
        self._remotes: OrderedDict[str, int] = OrderedDict()  # name -> metadata loads since it was loaded
        self.max_remotes = max(1, max_remotes)
        self.lock = threading.Lock()

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    @property
    def remotes(self) -> list[str]:
        """Remote agents loaded now, least recently used first."""
        return list(self._remotes)

    def add_remote(self, name: str, md: bytes, grant: bool = False) -> None:
        """Load ``name``'s metadata ``md`` unless ``name`` is loaded already. ``grant``: ``md`` names one lease's
        registration (a prefill's fetch reply) and is loaded even then, on top of what was loaded before; after
        :data:`GRANTS_PER_LOAD` of them the remote is unloaded first, so what is kept of earlier leases stays bounded
        (one reconnection that often)."""
        if name in self._remotes:
            self._remotes.move_to_end(name)
            if not grant:
                return
            if self._remotes[name] >= GRANTS_PER_LOAD:
                del self._remotes[name]
                self._unload(name)
        got = self.agent.add_remote_agent(md)
        got = got.decode() if isinstance(got, bytes) else str(got)
        if got != name:
            if got not in self._remotes:  # loaded under a name nobody vouched for: not kept
                self._unload(got)
            raise TransferError(f"NIXL peer metadata names agent {got[:256]!r}, expected {name!r}")
        self._remotes[name] = self._remotes.get(name, 0) + 1
        while len(self._remotes) > self.max_remotes:
            self._unload(self._remotes.popitem(last=False)[0])

    def forget(self, name: str) -> None:
        """Unload a remote agent (a peer that failed): its metadata is loaded afresh if it is asked for again."""
        if name in self._remotes:
            del self._remotes[name]
            self._unload(name)

    def _unload(self, name: str) -> None:
        try:
            self.agent.remove_remote_agent(name)
        except self.errors as e:
            log.warning("NIXL could not unload remote agent %.256s: %s", name, e)


class NixlFiles:
    """One NIXL agent doing DRAM <-> FILE transfers. Thread-safe (transfers are serialised per agent)."""

    def __init__(self, backend: str = "POSIX", timeout_s: float = 30.0, name: str | None = None) -> None:
        nixl_agent, nixl_agent_config, self.errors = import_nixl()
        self.name = name or f"kvtc-files-{_names.__next__()}"
        self.timeout_s = timeout_s
        if not timeout_s > 0:
            raise ConfigError(f"NIXL timeout must be > 0 seconds, got {timeout_s!r}")
        self._lock = threading.Lock()
        self.quarantine = Quarantine()
        try:
            self.agent = nixl_agent(self.name, nixl_agent_config(backends=[]))
            self.agent.create_backend(backend, {})
        except self.errors + (RuntimeError,) as e:
            raise TransferError(f"NIXL {backend} backend unavailable: {type(e).__name__}: {e}") from e
        self.backend = backend

    @property
    def quarantined_bytes(self) -> int:
        return self.quarantine.bytes

    def _xfer(self, op: str, buf: torch.Tensor, fd: int, offset: int, nbytes: int) -> None:
        a = self.agent
        regs: list[Any] = []
        with self._lock:
            try:
                regs.append(a.register_memory(buf[:nbytes]))
                regs.append(a.register_memory([(offset, nbytes, fd, "kvtc")], "FILE"))
                local = a.get_xfer_descs([(buf.data_ptr(), nbytes, 0)], "DRAM")
                remote = a.get_xfer_descs([(offset, nbytes, fd)], "FILE")
            except self.errors as e:
                undo: list[Callable[[], Any]] = []
                for reg in reversed(regs):
                    try:
                        a.deregister_memory(reg)
                    except self.errors:
                        undo.append(lambda reg=reg: a.deregister_memory(reg))
                if undo:
                    self.quarantine.hold(buf, f"{op} registration not undone", undo)
                raise TransferError(f"NIXL {op} failed: {type(e).__name__}: {e}") from e
            transfer(
                a,
                self.errors,
                op,
                local,
                remote,
                self.name,
                self.timeout_s,
                buf=buf,
                quarantine=self.quarantine,
                registrations=regs,
            )

    def write(self, fd: int, data: torch.Tensor, offset: int = 0) -> None:
        """Write a contiguous CPU uint8 tensor to ``fd`` at ``offset``."""
        if data.numel():
            self._xfer("WRITE", data.contiguous(), fd, offset, data.numel())

    def read(self, fd: int, nbytes: int, offset: int = 0) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            self._xfer("READ", out, fd, offset, nbytes)
        return out

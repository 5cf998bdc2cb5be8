"""NIXL-registered memory of the hand-off: the prefill side's staging arena (registered per lease), the decode side's
receive buffer (registered once). Host (DRAM) or device (VRAM) alike, so the CPU loopback in the test suite runs the
same code as two GPUs.

- :class:`StagingArena` (prefill): one buffer allocated at start-up; each fetch takes one contiguous extent of it
  (next fit: a just-freed extent is the last to be taken again), registered with NIXL for that lease alone, its
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
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ..codec.blob import BlobView
from ..errors import TierFullError, TransferError
from .nixl_io import PeerAgent

log = logging.getLogger(__name__)
ALIGN = 256  # every extent starts on a 256-byte boundary (CUDA copies, NIXL descriptors)


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


class StagingArena:
    """The prefill side's staging memory: one buffer (VRAM on a GPU, else DRAM) cut into contiguous extents, one per
    open lease, each registered with NIXL on its own for as long as its lease is open.

    Owns the buffer, the extents' registrations and the extent bookkeeping. It never frees the buffer while a lease
    holds an extent of it, never hands out overlapping extents, and never leaves a released lease's bytes behind: the
    buffer starts zeroed and an extent is zeroed, then deregistered, when its lease is given back. The metadata of a
    lease (:meth:`grant`) names only that lease's registration, so a holder's NIXL refuses descriptors outside it.
    On transports whose remote key is the address (UCX over TCP or shared memory, what loopback uses) deregistering
    does not revoke a key a holder already has: what it then reaches is zeros until the extent is taken again, and
    extents are taken next-fit so that is as late as the arena allows (see docs/reliability.md, threat model)."""

    def __init__(self, agent: PeerAgent, nbytes: int, device: torch.device) -> None:
        self.agent = agent
        self.device = device
        self.mem, self.dev = mem_kind(device)
        self.buf = torch.zeros(_up(nbytes), dtype=torch.uint8, device=device)  # no stale process memory exposed
        self.base = self.buf.data_ptr()
        self._free: list[tuple[int, int]] = [(0, self.buf.numel())]  # sorted (offset, length)
        self._held: dict[str, tuple[int, int]] = {}
        self._regs: dict[str, Any] = {}  # lease -> its extent's NIXL registration
        self._next = 0  # next fit starts here: the end of the extent taken last
        self.registrations = 0  # extents registered so far (one per lease)

    @property
    def capacity(self) -> int:
        return self.buf.numel()

    @property
    def used(self) -> int:
        return sum(n for _, n in self._held.values())

    def take(self, key: str, nbytes: int) -> int:
        """Reserve a contiguous extent of ``nbytes`` for ``key`` and register it with NIXL; its offset.
        TierFullError when none is free, TransferError when NIXL refuses the registration."""
        need = _up(max(nbytes, 1))
        runs = sorted(enumerate(self._free), key=lambda r: r[1][0] + r[1][1] <= self._next)  # stable sort
        for i, (off, n) in runs:  # free runs reaching past the last extent taken first, then from the start
            at = max(off, self._next)
            if at + need > off + n:
                at = off
                if need > n:
                    continue
            rest = [(o, m) for o, m in ((off, at - off), (at + need, off + n - at - need)) if m > 0]
            with self.agent.lock:
                try:
                    reg = self.agent.agent.register_memory(self.buf[at : at + need])
                except self.agent.errors as e:
                    raise TransferError(f"NIXL could not register a {need}-byte staging extent: {e}") from e
            self._free[i : i + 1] = rest
            self._held[key] = (at, need)
            self._regs[key] = reg
            self._next = at + need
            self.registrations += 1
            return at
        raise TierFullError(
            f"transfer staging arena is full ({self.used} of {self.capacity} bytes held; raise transfer_staging_mb)"
        )

    def grant(self, key: str) -> bytes:
        """NIXL metadata naming ``key``'s extent alone (with the agent's connection info): what a fetch reply
        carries. KeyError if ``key`` holds no extent."""
        off, n = self._held[key]
        a = self.agent.agent
        with self.agent.lock:
            return bytes(a.get_partial_agent_metadata(a.get_reg_descs(self.buf[off : off + n]), True))

    def give(self, key: str) -> None:
        """Zero and deregister ``key``'s extent, then free it (merged with free neighbours); nothing if ``key`` holds
        none. An extent NIXL could not deregister is zeroed and never taken again."""
        got = self._held.pop(key, None)
        if got is None:
            return
        off, n = got
        self.buf[off : off + n].zero_()  # a released lease's blobs are not readable, whatever key a holder kept
        if self.buf.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        reg = self._regs.pop(key, None)
        if reg is not None:
            with self.agent.lock:
                try:
                    self.agent.agent.deregister_memory(reg)
                except self.agent.errors:
                    log.warning("NIXL could not deregister a hand-off staging extent; it is never reused")
                    return
        i = bisect.bisect(self._free, (off, n))
        self._free.insert(i, (off, n))
        merged: list[tuple[int, int]] = []
        for o, m in self._free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + m)
            else:
                merged.append((o, m))
        self._free = merged

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
        for key in list(self._held):
            self.give(key)


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

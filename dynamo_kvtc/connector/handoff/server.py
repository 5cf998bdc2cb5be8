"""Prefill side of the hand-off: serves a worker's compressed blobs to decode workers over NIXL.

A ``fetch`` names blocks by sequence hash; when the prompt's encode has not landed in the store yet the fetch is
parked (:class:`~dynamo_kvtc.transport.channel.Deferred`, up to half the transfer deadline, then refused) and the
serving thread goes on answering other peers, releases and expiry meanwhile. It copies the covering blobs (from the
host tier's pinned pages in place, under a lease) back to back into one contiguous extent of a staging arena
(:class:`StagingArena`: device memory on a GPU worker when the decode side asks for ``VRAM``, host memory otherwise),
registered with NIXL for that lease alone, and replies with NIXL metadata naming only that extent, the arena's memory
type, one descriptor per blob and where each blob's layer groups end (the decode side READs group by group) under a
lease. The decode side READs them and sends ``release``; a lease that is never released expires after four
deadlines; either way its extent is zeroed and deregistered. Both happen off the serving thread: the arena's rotator
registers extents (and makes their grants) ahead of the fetches that take them, and zeroes and deregisters released
ones, so a fetch normally makes no NIXL registration call (see :class:`StagingArena`).
"""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any

import torch

from ...codec.blob import BlobView
from ...codec.container import group_ends
from ...errors import TierError
from ...transport.auth import channel_auth
from ...transport.channel import Deferred, RepServer
from ...transport.nixl_io import PeerAgent
from ...transport.staging import StagingArena, memory_device
from ..config import ConnectorConfig
from .messages import LIMITS, check_fetch, fetch_mem

log = logging.getLogger(__name__)


class HandoffServer:
    """Serves blobs of one store to decode workers (in the prefill worker process, TP rank 0).

    Owns a NIXL agent, the staging arenas (host memory, made on the first ``DRAM`` fetch, and device memory on a GPU
    worker; each lease's extent registered with NIXL while it is open) and the leases on them. It reads the store
    only through its public lookup and leased export (host-tier leases, released as soon as the blobs are staged);
    it never writes to the store and never serves bytes it did not stage."""

    def __init__(self, cfg: ConnectorConfig, store: Any, device: Any = None) -> None:
        self.cfg = cfg
        self.store = store
        self.agent = PeerAgent(cfg.nixl_backend, "kvtc-prefill", progress_us=cfg.nixl_progress_us)
        dev = memory_device(device if device is not None else getattr(store, "device", "cpu"), cfg.handoff_memory)
        self._arenas: dict[str, StagingArena] = {}
        if dev.type == "cuda":
            self._arenas["VRAM"] = StagingArena(self.agent, cfg.transfer_staging_mb << 20, dev)
        self._leases: dict[str, tuple[StagingArena, float, str]] = {}
        self.served = 0  # fetches answered with staged blobs (releases are not counted)
        endpoint = f"tcp://{cfg.transfer_host}" + (f":{cfg.transfer_port}" if cfg.transfer_port else "")
        self._rep = RepServer(
            endpoint,
            self._handle,
            LIMITS,
            name="kvtc-handoff",
            tick=self._expire,
            auth=channel_auth(
                cfg.transfer_secret_file, cfg.transfer_secret, cfg.transfer, cfg.transfer_host
            ),
        )
        self.host, self.port = cfg.transfer_host, self._rep.port
        log.info("kvtc hand-off server on tcp://%s:%d (NIXL %s)", self.host, self.port, cfg.nixl_backend)

    @property
    def refused(self) -> int:
        return self._rep.refused

    @property
    def auth_refused(self) -> int:
        """Requests refused for a missing or wrong MAC, a stale timestamp or a replay."""
        return self._rep.auth_refused

    @property
    def open_leases(self) -> int:
        """Fetches whose staged bytes are still held (not released, not expired)."""
        return len(self._leases)

    @property
    def staged_bytes(self) -> int:
        """Bytes of the staging arenas held by open leases."""
        return sum(a.used for a in self._arenas.values())

    def arena(self, mem: str) -> StagingArena:
        """The arena a fetch asking for ``mem`` is staged in: device memory when asked and present, else host."""
        if mem == "VRAM" and "VRAM" in self._arenas:
            return self._arenas["VRAM"]
        if "DRAM" not in self._arenas:
            self._arenas["DRAM"] = StagingArena(self.agent, self.cfg.transfer_staging_mb << 20, torch.device("cpu"))
        return self._arenas["DRAM"]

    def _handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "fetch":
            return self._fetch(msg)
        if op == "release":
            return {"ok": self._release(str(msg.get("lease", "")), str(msg.get("agent", "")))}
        raise TierError(f"unknown op {op!r}")

    def _fetch(self, msg: dict[str, Any]) -> dict[str, Any] | Deferred:
        """Stage the blobs now when every block is stored, else park the fetch until they are (or half the transfer
        deadline passed: refused, the decode side recomputes)."""
        hashes, peer, md = check_fetch(msg)
        arena = self.arena(fetch_mem(msg))
        if self.store.match(hashes) >= len(hashes):
            return self._stage(hashes, peer, md, arena)
        deadline = time.monotonic() + self.cfg.transfer_timeout_s / 2

        def ready() -> dict[str, Any] | None:
            stored = self.store.match(hashes)  # the prompt's encode may still be running
            if stored >= len(hashes):
                return self._stage(hashes, peer, md, arena)
            if time.monotonic() > deadline:
                raise TierError(f"only {stored} of {len(hashes)} blocks are stored here")
            return None

        return Deferred(ready)

    def _stage(self, hashes: list[int], peer: str, md: bytes, arena: StagingArena) -> dict[str, Any]:
        runs, held = self.store.export(hashes, lease=True)
        lease = secrets.token_hex(16)  # unguessable; bound to the fetching peer below
        try:
            # one READ per layer group on the decode side
            ends = [group_ends(BlobView.of(run.blob).host()) for run in runs]
            descs = arena.stage(lease, [run.blob for run in runs])
            with self.agent.lock:
                self.agent.add_remote(peer, md)
        except Exception:
            arena.give(lease)
            raise
        finally:
            for h in held:  # staged (the copies were waited for): the host tier may move or evict them again
                h.release()
        blobs = [
            {
                "size": len(BlobView.of(run.blob)),
                "first": run.first,
                "count": run.count,
                "j": run.at,
                "meta": run.meta.to_dict(),
                "descs": [d],
            }
            for run, d in zip(runs, descs)
        ]
        if all(e is not None for e in ends) and len({len(e) for e in ends}) == 1:
            for b, e in zip(blobs, ends):
                b["ranges"] = e
        self._leases[lease] = (arena, time.monotonic() + 4 * self.cfg.transfer_timeout_s, peer)
        self.served += 1
        try:
            grant = arena.grant(lease)  # this lease's extent alone, not the agent's every registration
        except Exception:
            arena.give(lease)
            raise
        reply = {"lease": lease, "agent": self.agent.name, "agent_md": grant, "blobs": blobs}
        return {**reply, "mem": arena.mem, "dev": arena.dev}

    def _release(self, lease: str, peer: str | None = None) -> bool:
        """Free ``lease``'s staged bytes; a release naming a peer other than the one that fetched is refused."""
        held = self._leases.get(lease)
        if held is None or (peer is not None and peer != held[2]):
            return False
        del self._leases[lease]
        held[0].give(lease)
        return True

    def _expire(self) -> None:
        now = time.monotonic()
        for lease, (_, until, _peer) in list(self._leases.items()):
            if until < now:
                log.warning("kvtc hand-off lease %s expired without a release", lease)
                self._release(lease)

    def close(self) -> None:
        self._rep.close()
        for arena in self._arenas.values():
            arena.close()

"""Prefill side of the hand-off: serves a worker's compressed blobs to decode workers over NIXL.

A ``fetch`` names blocks by sequence hash; the server waits (up to half the transfer deadline) for the prompt's encode
to land in the store, copies the covering blobs into a staging arena registered with NIXL, and replies with its agent
metadata and the staged pages' addresses under a lease. The decode side READs them and sends ``release``; a lease
that is never released expires after four deadlines.
"""

from __future__ import annotations

import itertools
import logging
import time
from typing import Any

from ...errors import TierError, TierFullError
from ...tiers.channel import RepServer
from ...tiers.host import HostTier
from ...tiers.nixl_io import PeerAgent
from ..config import ConnectorConfig
from .auth import channel_auth
from .messages import LIMITS, check_fetch

log = logging.getLogger(__name__)
_ids = itertools.count()


class HandoffServer:
    """Serves blobs of one store to decode workers (in the prefill worker process, TP rank 0).

    Owns a NIXL agent, the staging arena (registered with NIXL once) and the leases on it. It reads the store only
    through its public lookup and export; it never writes to the store and never serves bytes it did not stage."""

    def __init__(self, cfg: ConnectorConfig, store: Any) -> None:
        self.cfg = cfg
        self.store = store
        self.agent = PeerAgent(cfg.nixl_backend, "kvtc-prefill")
        self.staging = HostTier(cfg.transfer_staging_mb << 20, 1 << 16, pinned=False)
        self._reg = self.agent.agent.register_memory(self.staging.arena)
        self._base = self.staging.arena.data_ptr()
        self._leases: dict[str, tuple[list[str], float]] = {}
        self.served = 0  # fetches answered with staged blobs (releases are not counted)
        endpoint = f"tcp://{cfg.transfer_host}" + (f":{cfg.transfer_port}" if cfg.transfer_port else "")
        self._rep = RepServer(
            endpoint, self._handle, LIMITS, name="kvtc-handoff", tick=self._expire, auth=channel_auth(cfg)
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

    def _handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg.get("op")
        if op == "fetch":
            return self._fetch(msg)
        if op == "release":
            self._release(str(msg.get("lease", "")))
            return {"ok": True}
        raise TierError(f"unknown op {op!r}")

    def _wait_stored(self, hashes: list[int]) -> None:
        deadline = time.monotonic() + self.cfg.transfer_timeout_s / 2
        while self.store.match(hashes) < len(hashes):  # the prompt's encode may still be running
            if time.monotonic() > deadline:
                raise TierError(f"only {self.store.match(hashes)} of {len(hashes)} blocks are stored here")
            time.sleep(0.005)

    def _stage(self, key: str, blob: bytes) -> list[list[int]]:
        if self.staging.put(key, blob):
            raise TierFullError("transfer staging arena is full (raise transfer_staging_mb)")
        return [[self._base + off, n] for off, n in self.staging.extents(key)]

    def _fetch(self, msg: dict[str, Any]) -> dict[str, Any]:
        hashes, peer, md = check_fetch(msg)
        self._wait_stored(hashes)
        runs = self.store.export(hashes)
        lease = f"{peer}/{next(_ids)}"
        keys, blobs = [], []
        try:
            for i, run in enumerate(runs):
                key = f"{lease}/{i}"
                descs = self._stage(key, run.blob)
                keys.append(key)
                blobs.append(
                    {
                        "size": len(run.blob),
                        "first": run.first,
                        "count": run.count,
                        "j": run.at,
                        "meta": run.meta.to_dict(),
                        "descs": descs,
                    }
                )
            with self.agent.lock:
                self.agent.add_remote(peer, md)
        except Exception:
            for k in keys:
                self.staging.pop(k)
            raise
        self._leases[lease] = (keys, time.monotonic() + 4 * self.cfg.transfer_timeout_s)
        self.served += 1
        return {"lease": lease, "agent": self.agent.name, "agent_md": self.agent.metadata(), "blobs": blobs}

    def _release(self, lease: str) -> None:
        keys, _ = self._leases.pop(lease, ([], 0))
        for k in keys:
            self.staging.pop(k)

    def _expire(self) -> None:
        now = time.monotonic()
        for lease, (_, until) in list(self._leases.items()):
            if until < now:
                log.warning("kvtc hand-off lease %s expired without a release", lease)
                self._release(lease)

    def close(self) -> None:
        self._rep.close()
        try:
            self.agent.agent.deregister_memory(self._reg)
        except self.agent.errors:
            pass

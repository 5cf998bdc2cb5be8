"""Decode side of the hand-off: pulls a prompt's blobs from a prefill worker over NIXL.

Before a byte is read the reply is checked against the request (:func:`~.messages.plan_reply`); after the read each
blob is verified whole by the decoder (structure, every section CRC, calibration id) before its first layer is
written. A READ that failed or timed out and whose NIXL handle could not be confirmed released keeps its buffer alive
(quarantine): no late write into freed memory.
"""

from __future__ import annotations

import logging
import threading

import torch

from ...errors import TransferError
from ...tiers.blobs import BlobMeta, BlobRun
from ...tiers.channel import ReqClient
from ...tiers.nixl_io import PeerAgent, Quarantine, transfer
from ..config import ConnectorConfig
from .auth import channel_auth
from .messages import LIMITS, fetch_request, peer_ok, plan_reply

log = logging.getLogger(__name__)


def _meta(d: dict) -> BlobMeta | None:
    """The peer's blob metadata when it is well-formed (the blob is then kept here too), else None."""
    try:
        return BlobMeta.from_dict(d)
    except (TypeError, KeyError, ValueError):
        return None


class HandoffClient:
    """Pulls blobs from prefill workers: one NIXL agent, one control-channel client per peer.

    Owns the agent, the channels and the quarantine of unconfirmed READ buffers. It never writes into the engine's
    blocks: it returns :class:`~dynamo_kvtc.tiers.blobs.BlobRun` s that the store verifies and restores."""

    def __init__(self, cfg: ConnectorConfig) -> None:
        self.cfg = cfg
        self.auth = channel_auth(cfg)  # before the agent: a bad secret is a ConfigError at start-up
        self.agent = PeerAgent(cfg.nixl_backend, "kvtc-decode")
        self.bytes_moved = 0
        self.quarantine = Quarantine()
        self._peers: dict[tuple[str, int], ReqClient] = {}
        self._lock = threading.Lock()

    @property
    def quarantined_bytes(self) -> int:
        return self.quarantine.bytes

    def _channel(self, host: str, port: int) -> ReqClient:
        with self._lock:
            ch = self._peers.get((host, port))
            if ch is None:
                ch = ReqClient(
                    f"tcp://{host}:{port}", LIMITS, self.cfg.transfer_timeout_s, name="prefill peer", auth=self.auth
                )
                self._peers[(host, port)] = ch
            return ch

    def fetch(self, host: str, port: int, hashes: list[int]) -> list[BlobRun]:
        """The blob runs covering ``hashes`` from the prefill worker at ``host:port``; TransferError on any fault."""
        ch = self._channel(host, port)
        reply = ch.ask(fetch_request(hashes, self.agent.name, self.agent.metadata()))
        try:
            return self._read(reply, hashes)
        finally:
            self.release(host, port, str(reply.get("lease", "")))

    def release(self, host: str, port: int, lease: str) -> None:
        """Tell the prefill worker its staged bytes for ``lease`` may go (best effort: leases also expire)."""
        try:
            self._channel(host, port).ask({"op": "release", "lease": lease})
        except TransferError as e:
            log.info("kvtc hand-off release not acknowledged: %s", e)

    def _read(self, reply: dict, hashes: list[int]) -> list[BlobRun]:
        peer, md = reply.get("agent"), reply.get("agent_md")
        if not peer_ok(peer, md):
            raise TransferError("malformed fetch reply: the peer's NIXL agent name and metadata")
        runs, remote = plan_reply(reply, hashes)
        total = sum(r.size for r in runs)
        buf = torch.empty(total, dtype=torch.uint8)
        local, off = [], buf.data_ptr()
        for _, n, _ in remote:
            local.append((off, n, 0))
            off += n
        a = self.agent.agent
        with self.agent.lock:
            regs = []
            try:
                self.agent.add_remote(peer, md)
                regs.append(a.register_memory(buf))
                ld, rd = a.get_xfer_descs(local, "DRAM"), a.get_xfer_descs(remote, "DRAM")
            except self.agent.errors as e:
                for reg in regs:
                    try:
                        a.deregister_memory(reg)
                    except self.agent.errors:
                        self.quarantine.hold(buf, "READ registration not undone")
                raise TransferError(f"NIXL transfer setup failed: {type(e).__name__}: {e}") from e
            transfer(
                a, self.agent.errors, "READ", ld, rd, peer, self.cfg.transfer_timeout_s,
                buf=buf, quarantine=self.quarantine, registrations=regs,
            )  # fmt: skip
        self.bytes_moved += total
        data = buf.numpy().tobytes()
        return [BlobRun(data[r.offset : r.offset + r.size], r.first, r.count, r.at, _meta(r.meta)) for r in runs]

    def close(self) -> None:
        with self._lock:
            for ch in self._peers.values():
                ch.close()
            self._peers.clear()

"""Decode side of the hand-off: pulls a prompt's blobs from a prefill worker over NIXL.

Before a byte is read the reply is checked against the request (:func:`~.messages.plan_reply`); the blobs are READ
into one receive buffer registered with NIXL once (:class:`~.staging.RecvBuffer`: device memory on a GPU worker, so a
prefill GPU's staged blobs move GPU to GPU; host memory otherwise); after the read each blob is verified whole by the
decoder (structure, every section CRC, calibration id) before its first layer is written. A READ that failed or timed
out and whose NIXL handle could not be confirmed released keeps its buffer alive (quarantine): no late write into
freed memory, and the next fetch gets a fresh buffer. Every completed READ feeds the per-peer link estimate of a
:class:`~.linkpolicy.LinkPolicy` (:meth:`HandoffClient.choose` asks it raw or compressed).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ...errors import TransferError
from ...tiers.blobs import BlobMeta, BlobRun
from ...tiers.channel import ReqClient
from ...tiers.nixl_io import PeerAgent, Quarantine, TokenBucket, read_descs
from ..config import ConnectorConfig
from .auth import channel_auth
from .linkpolicy import LinkChoice, LinkPolicy
from .messages import LIMITS, fetch_request, peer_ok, plan_reply, reply_memory
from .staging import RecvBuffer, memory_device

log = logging.getLogger(__name__)


def _meta(d: dict) -> BlobMeta | None:
    """The peer's blob metadata when it is well-formed (the blob is then kept here too), else None."""
    try:
        return BlobMeta.from_dict(d)
    except (TypeError, KeyError, ValueError):
        return None


class HandoffClient:
    """Pulls blobs from prefill workers: one NIXL agent, one control-channel client per peer.

    Owns the agent, the channels, the receive buffer, the link estimates and the quarantine of unconfirmed READ
    buffers. It never writes into the engine's blocks: it returns :class:`~dynamo_kvtc.tiers.blobs.BlobRun` s that
    the store verifies and restores (bytes; on a GPU ``(pinned tensor, offset, length)``, read in place by the
    fused restore). ``device``: where to receive (None: the current CUDA device, else the host; see
    :func:`~.staging.memory_device`); ``pace``: a token bucket emulating a slower link (benchmarks only)."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        device: Any = None,
        *,
        link: LinkPolicy | None = None,
        pace: TokenBucket | None = None,
    ) -> None:
        self.cfg = cfg
        self.auth = channel_auth(cfg)  # before the agent: a bad secret is a ConfigError at start-up
        self.agent = PeerAgent(cfg.nixl_backend, "kvtc-decode")
        self.device = memory_device(device)
        self.recv = RecvBuffer(self.agent, self.device)
        self.link = link if link is not None else LinkPolicy.from_env(gpu=self.device.type == "cuda")
        self.pace = pace
        self.bytes_moved = 0
        self.last: dict[str, float] = {}  # the last fetch: ask_s, read_s, bytes
        self.quarantine = Quarantine()
        self._peers: dict[tuple[str, int], ReqClient] = {}
        self._lock = threading.Lock()
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix="kvtc-handoff-release")  # off the fetch's path

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
        t = time.perf_counter()
        reply = ch.ask(fetch_request(hashes, self.agent.name, self.agent.metadata(), self.recv.mem))
        ask_s = time.perf_counter() - t
        try:
            runs, read_s, total = self._read(reply, hashes)
        finally:  # the READ is over (done, failed, or its buffer quarantined): the staged bytes may go
            self._releaser.submit(self.release, host, port, str(reply.get("lease", "")))
        peer = f"{host}:{port}"
        self.link.observe(peer, total, read_s)
        self.link.observe_staging(total, time.perf_counter() - t - read_s)
        raw = sum(r.meta.raw_bytes for r in runs if r.meta is not None)
        if raw:  # what the policy, knowing this READ, says about such a prompt from this peer (metrics, one log line)
            self.link.choose(peer, raw, total)
        self.last = {"ask_s": ask_s, "read_s": read_s, "bytes": float(total)}
        return runs

    def flush(self) -> None:
        """Wait until every release queued so far was sent (and answered or given up)."""
        self._releaser.submit(lambda: None).result()

    def choose(self, host: str, port: int, raw_bytes: int, compressed_bytes: int) -> LinkChoice:
        """Raw KV or compressed blobs from ``host:port`` for a prompt of these sizes (see :class:`LinkPolicy`)."""
        return self.link.choose(f"{host}:{port}", raw_bytes, compressed_bytes)

    def release(self, host: str, port: int, lease: str) -> None:
        """Tell the prefill worker its staged bytes for ``lease`` may go (best effort: leases also expire)."""
        try:
            self._channel(host, port).ask({"op": "release", "lease": lease})
        except TransferError as e:
            log.info("kvtc hand-off release not acknowledged: %s", e)

    def _read(self, reply: dict, hashes: list[int]) -> tuple[list[BlobRun], float, int]:
        """READ a checked reply's blobs into the receive buffer: (runs, seconds of the READ, bytes)."""
        peer, md = reply.get("agent"), reply.get("agent_md")
        if not peer_ok(peer, md):
            raise TransferError("malformed fetch reply: the peer's NIXL agent name and metadata")
        runs, remote = plan_reply(reply, hashes)
        rmem, rdev = reply_memory(reply)
        total = sum(r.size for r in runs)
        remote = [(addr, n, rdev) for addr, n, _ in remote]
        with self.agent.lock:
            try:
                self.agent.add_remote(peer, md)
            except self.agent.errors as e:
                raise TransferError(f"NIXL could not load the peer's metadata: {type(e).__name__}: {e}") from e
            buf = self.recv.get(total)
            local = [(buf.data_ptr(), total, self.recv.dev)]
            held = self.quarantine.count
            try:
                read_s = read_descs(
                    self.agent, local, self.recv.mem, remote, rmem, peer, self.cfg.transfer_timeout_s,
                    buf=buf, quarantine=self.quarantine, pace=self.pace,
                )  # fmt: skip
            except TransferError:
                if self.quarantine.count > held:
                    self.recv.forget()  # the backend may still write into it: never reuse it
                else:
                    self.recv.reset()  # a stale or refused registration must not fail every later fetch
                raise
            self.bytes_moved += total
            return self._runs(buf, runs), read_s, total

    def _runs(self, buf: torch.Tensor, runs: list) -> list[BlobRun]:
        """The received blobs as runs: on the host one bytes object per blob; from device memory one copy into a
        fresh pinned buffer, the runs reading it in place (the receive buffer is free again when this returns)."""
        if buf.is_cuda:
            total = sum(r.size for r in runs)
            pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            pinned.copy_(buf[:total])  # synchronous: the next fetch may reuse the receive buffer
            return [BlobRun((pinned, r.offset, r.size), r.first, r.count, r.at, _meta(r.meta)) for r in runs]
        host = buf.numpy()
        return [
            BlobRun(host[r.offset : r.offset + r.size].tobytes(), r.first, r.count, r.at, _meta(r.meta)) for r in runs
        ]

    def close(self) -> None:
        self._releaser.shutdown(wait=True)
        with self._lock:
            for ch in self._peers.values():
                ch.close()
            self._peers.clear()
        with self.agent.lock:
            self.recv.close()

"""Decode side of the hand-off: pulls a prompt's blobs from a prefill worker over NIXL, layer group by layer group.

Before a byte is read the reply is checked against the request (:func:`~.messages.plan_reply`); the blobs are READ
into one receive buffer registered with NIXL once (:class:`RecvBuffer`: device memory on a GPU worker, so a
prefill GPU's staged blobs move GPU to GPU; host memory otherwise), one READ per byte range (range a = every blob's
layer-group-a bytes, the header with group 0), posted one after another by a reader thread while :meth:`fetch` has
already returned the runs. Each range, once landed, is copied out into the fetch's own memory, which is never
registered (:func:`copy_out`; device to device on a GPU), and the receive buffer is zeroed after the last: the NIXL
metadata this agent hands every peer it asks grants READ and WRITE on the registered buffer, so nothing is checked
or decoded there. Each blob is an :class:`~dynamo_kvtc.transport.arriving.ArrivingView` over the copy, which the
fused restore reads in place, group g as soon as its range landed, and still verifies (structure, every section CRC,
calibration id) before its bytes are written anywhere. A READ that failed or timed out and whose NIXL handle could
not be confirmed released keeps its buffer alive (quarantine): no late write into freed memory, and the next fetch
gets a fresh buffer. Every completed fetch feeds the per-peer link estimate of a
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
from ...transport.arriving import ArrivingView, GroupArrival
from ...transport.auth import channel_auth
from ...transport.channel import ReqClient
from ...transport.nixl_io import PeerAgent, Quarantine, TokenBucket, read_descs, read_ranges, split_descs
from ...transport.staging import RecvBuffer, memory_device
from ..config import ConnectorConfig
from .link_choice import LinkChoice, LinkPolicy
from .messages import LIMITS, PlannedRun, fetch_request, peer_ok, plan_reply, range_descs, reply_memory
from .peer_gate import COOLDOWN_S, PeerGate

log = logging.getLogger(__name__)
MAX_PEERS = 64  # control-channel clients kept open (request params name the peer: any client can name a new one)
CONNECT_TIMEOUT_S = 2.0  # a new peer connection's handshake deadline (at most half transfer_timeout_s): a dead peer
# or one without the cluster key costs this, not the whole transfer deadline (a busy prefill answers handshakes
# between requests: not less)


def _meta(d: dict) -> BlobMeta | None:
    """The peer's blob metadata when it is well-formed (the blob is then kept here too), else None."""
    try:
        return BlobMeta.from_dict(d)
    except (TypeError, KeyError, ValueError):
        return None


def _bind_device(device: torch.device) -> None:
    """Make ``device`` (and its CUDA context) current on this thread: UCX posts GPU copies in the caller's context."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.current_stream(device).query()  # a runtime call: binds the primary context to this thread


def copy_out(buf: torch.Tensor, kept: torch.Tensor, local: list, last: bool) -> None:
    """Copy one landed byte range (its ``local`` descriptors in ``buf``) into ``kept``, the fetch's private memory
    that no NIXL agent can write; after the last range zero what the fetch used of ``buf``. The blobs are checked and
    decoded from ``kept`` only: a holder of this agent's NIXL metadata (which every peer asked gets) can READ and
    WRITE the registered receive buffer, so bytes checked there could change before they are used."""
    base = buf.data_ptr()
    for addr, n, _dev in local:
        off = addr - base
        kept[off : off + n].copy_(buf[off : off + n], non_blocking=True)
    if last:
        buf[: kept.numel()].zero_()  # the blobs do not stay readable through the registration
    if buf.is_cuda:
        torch.cuda.current_stream(buf.device).synchronize()


class HandoffClient:
    """Pulls blobs from prefill workers: one NIXL agent, one control-channel client per peer.

    Owns the agent, the channels, the receive buffer, the reader thread, the link estimates and the quarantine of
    unconfirmed READ buffers. It never writes into the engine's blocks: it returns
    :class:`~dynamo_kvtc.tiers.blobs.BlobRun` s over the receive buffer that the store verifies and restores, and
    never lets a later fetch write into a buffer whose blobs were not read out. ``device``: where to receive (None:
    the current CUDA device, else the host; see :func:`~...transport.staging.memory_device`); ``pace``: a token bucket
    emulating a slower link (benchmarks only)."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        device: Any = None,
        *,
        link: LinkPolicy | None = None,
        pace: TokenBucket | None = None,
    ) -> None:
        self.cfg = cfg
        self.auth = channel_auth(
            cfg.transfer_secret_file, cfg.transfer_secret, cfg.transfer, cfg.transfer_host
        )  # before the agent: a bad secret is a ConfigError at start-up
        self.agent = PeerAgent(cfg.nixl_backend, "kvtc-decode", progress_us=cfg.nixl_progress_us)
        self.device = memory_device(device, cfg.handoff_memory)
        self.recv = RecvBuffer(self.agent, self.device)
        self.link = link if link is not None else LinkPolicy.from_config(cfg, gpu=self.device.type == "cuda")
        self.pace = pace
        self.bytes_moved = 0
        self.last: dict[str, float] = {}  # the last fetch: ask_s, read_s, bytes
        self.quarantine = Quarantine()
        self.connect_timeout_s = min(CONNECT_TIMEOUT_S, cfg.transfer_timeout_s / 2)
        self.gate = PeerGate(cooldown_s=max(COOLDOWN_S, cfg.transfer_timeout_s))  # per-peer and total fetch limits
        self._peers: dict[tuple[str, int], ReqClient] = {}
        self._lock = threading.Lock()
        self._releaser = ThreadPoolExecutor(1, thread_name_prefix="kvtc-handoff-release")  # off the fetch's path
        self._reader = ThreadPoolExecutor(  # posts the range READs, with the receive device's context current
            1, thread_name_prefix="kvtc-handoff-read", initializer=_bind_device, initargs=(self.device,)
        )
        self._inflight: tuple[GroupArrival, torch.Tensor] | None = None  # the last fetch's arrival and buffer

    @property
    def quarantined_bytes(self) -> int:
        return self.quarantine.bytes

    def _channel(self, host: str, port: int) -> ReqClient:
        with self._lock:
            ch = self._peers.pop((host, port), None)
            if ch is None:
                ch = ReqClient(
                    f"tcp://{host}:{port}", LIMITS, self.cfg.transfer_timeout_s, name="prefill peer", auth=self.auth,
                    connect_timeout_s=self.connect_timeout_s,
                )  # fmt: skip
            self._peers[(host, port)] = ch  # most recently used last; the least recently used beyond MAX_PEERS go
            old = [self._peers.pop(next(iter(self._peers))) for _ in range(len(self._peers) - MAX_PEERS)]
        for c in old:  # outside the lock: closing waits for a request in flight on it
            c.close()
        return ch

    def fetch(self, host: str, port: int, hashes: list[int]) -> list[BlobRun]:
        """The blob runs covering ``hashes`` from the prefill worker at ``host:port``, returned once the READs are
        posted (the blobs' bytes land range by range: see :class:`~dynamo_kvtc.transport.arriving.ArrivingView`);
        TransferError on any fault found before that, the waiting restore's TransferError on any fault after."""
        with self.gate.enter(f"{host}:{port}"):  # a dead peer: one short handshake deadline, then refused at once
            self._settle()
            ch = self._channel(host, port)
            t = time.perf_counter()
            reply = ch.ask(fetch_request(hashes, self.agent.name, self.agent.metadata(), self.recv.mem))
            ask_s = time.perf_counter() - t
        lease = str(reply.get("lease", ""))
        try:
            return self._post(reply, hashes, (host, port, lease), ask_s)
        except BaseException:
            self._releaser.submit(self.release, host, port, lease)  # nothing was posted: the staged bytes may go
            raise

    def flush(self) -> None:
        """Wait until the last fetch's READs are over and every release queued so far was sent (and answered or
        given up)."""
        cur = self._inflight
        if cur is not None:
            cur[0].finished.wait()
        self._releaser.submit(lambda: None).result()

    def choose(self, host: str, port: int, raw_bytes: int, compressed_bytes: int) -> LinkChoice:
        """Raw KV or compressed blobs from ``host:port`` for a prompt of these sizes (see :class:`LinkPolicy`)."""
        return self.link.choose(f"{host}:{port}", raw_bytes, compressed_bytes)

    def release(self, host: str, port: int, lease: str) -> None:
        """Tell the prefill worker its staged bytes for ``lease`` may go (best effort: leases also expire)."""
        try:
            self._channel(host, port).ask({"op": "release", "lease": lease, "agent": self.agent.name})
        except TransferError as e:
            log.info("kvtc hand-off release not acknowledged: %s", e)

    def _settle(self) -> None:
        """Before a new fetch: the previous fetch's READs are over. Its blobs were copied out of the receive buffer
        range by range (:func:`copy_out`), so the buffer takes the next fetch at once."""
        cur, self._inflight = self._inflight, None
        if cur is not None:
            cur[0].finished.wait()

    def _post(self, reply: dict, hashes: list[int], where: tuple[str, int, str], ask_s: float) -> list[BlobRun]:
        """Check a reply, take the receive buffer and start the reader thread on its byte ranges; the runs."""
        peer, md = reply.get("agent"), reply.get("agent_md")
        if not peer_ok(peer, md):
            raise TransferError("malformed fetch reply: the peer's NIXL agent name and metadata")
        runs, _ = plan_reply(reply, hashes)
        rmem, rdev = reply_memory(reply)
        total = runs[-1].offset + runs[-1].size
        with self.agent.lock:
            try:
                self.agent.add_remote(peer, md, grant=True)  # this lease's extent
            except self.agent.errors as e:
                raise TransferError(f"NIXL could not load the peer's metadata: {type(e).__name__}: {e}") from e
            self.quarantine.admit()  # a miss while too many bytes are quarantined, before a fresh buffer is taken
            buf = self.recv.get(total)
        kept = torch.empty(total, dtype=torch.uint8, device=self.recv.device)  # never registered: no remote writes
        parts = [range_descs(runs, a, buf.data_ptr(), self.recv.dev, rdev) for a in range(len(runs[0].ranges))]
        arrival = GroupArrival(len(parts), len(runs), self.cfg.transfer_timeout_s)
        self._inflight = (arrival, buf)
        info = (ask_s, sum(r.size for r in runs), kept)
        self._reader.submit(self._read, arrival, parts, buf, (peer, rmem), where, info)
        return self._runs(kept, runs, arrival)

    def _read(self, arrival: GroupArrival, parts: list, buf: torch.Tensor, src: tuple, where: tuple, info: tuple):
        """The reader thread: READ the byte ranges — in order, each posted the moment the one before it landed, or
        through the token bucket of an emulated link — and mark each landed; on a fault fail the arrival (the waiting
        restore raises). Then release the lease and learn the link."""
        (peer, rmem), (host, port, lease), (ask_s, nbytes, kept) = src, where, info

        def landed(a: int) -> None:
            copy_out(buf, kept, parts[a][0], last=a == len(parts) - 1)
            if a == len(parts) - 1:  # the fetch's numbers are in place before the last range counts as landed
                self._learned(f"{host}:{port}", nbytes, time.perf_counter() - arrival.started, ask_s, arrival)
            arrival.landed(a)

        try:
            if self.pace is None:
                pairs = [split_descs(local, remote, max(1, sum(d[1] for d in local)))[0] for local, remote in parts]
                self._guarded(
                    buf, read_ranges, self.agent, pairs, self.recv.mem, rmem, peer, self.cfg.transfer_timeout_s,
                    buf=buf, quarantine=self.quarantine, landed=landed,
                )  # fmt: skip
            else:
                self.pace.start()
                for a, (local, remote) in enumerate(parts):
                    self._read_range(local, remote, rmem, peer, buf)
                    landed(a)
            self.bytes_moved += nbytes
        except TransferError as e:
            arrival.fail(e)
        except BaseException as e:  # noqa: BLE001 - the restore waiting on it must fail, not hang
            arrival.fail(TransferError(f"hand-off reader failed: {type(e).__name__}: {e}"))
        finally:
            self._releaser.submit(self.release, host, port, lease)
            arrival.finish()

    def _read_range(self, local: list, remote: list, rmem: str, peer: str, buf: torch.Tensor) -> None:
        """One paced READ of one byte range (the emulated link's bucket was started for the whole fetch)."""

        def paced() -> None:
            with self.agent.lock:
                read_descs(
                    self.agent, local, self.recv.mem, remote, rmem, peer, self.cfg.transfer_timeout_s,
                    buf=buf, quarantine=self.quarantine, pace=self.pace, start_pace=False,
                )  # fmt: skip

        self._guarded(buf, paced)

    def _guarded(self, into: torch.Tensor, read: Any, *args: Any, **kw: Any) -> None:
        """Run a READ into ``into``; if it fails, the receive buffer is never reused: quarantined (the backend may
        still write into it) or deregistered (a stale or refused registration must not fail every later fetch)."""
        try:
            read(*args, **kw)
        except TransferError:
            with self.agent.lock:
                if self.recv.buf is into:
                    if self.quarantine.holds(into):  # freed once NIXL confirms the READ and the registration undone
                        reg, agent = self.recv.registration, self.agent.agent
                        self.quarantine.add_undo(into, lambda: agent.deregister_memory(reg))
                        self.recv.forget()
                    else:
                        self.recv.reset()
            raise

    def _learned(self, peer: str, nbytes: int, read_s: float, ask_s: float, arrival: GroupArrival) -> None:
        self.link.observe(peer, nbytes, read_s)
        self.link.observe_staging(nbytes, ask_s)
        first = arrival.landed_s[0] if arrival.ranges > 1 else read_s
        self.last = {"ask_s": ask_s, "read_s": read_s, "bytes": float(nbytes), "first_range_s": first or read_s}
        self.last["ranges"] = float(arrival.ranges)

    def _runs(self, buf: torch.Tensor, runs: list[PlannedRun], arrival: GroupArrival) -> list[BlobRun]:
        """The blobs as runs reading the receive buffer in place, each landing range by range."""
        return [
            BlobRun(ArrivingView(buf, r.offset, r.size, arrival, r.ranges), r.first, r.count, r.at, _meta(r.meta))
            for r in runs
        ]

    def close(self) -> None:
        self._reader.shutdown(wait=True)
        self._releaser.shutdown(wait=True)
        with self._lock:
            for ch in self._peers.values():
                ch.close()
            self._peers.clear()
        with self.agent.lock:
            self.recv.close()

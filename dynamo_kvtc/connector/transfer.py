"""Compressed prefill→decode transfer: the prefill side serves KVTC blobs over NIXL, the decode side pulls and restores.

Flow (vLLM's disaggregation protocol, as Dynamo drives it):

1. The prefill engine gets the request with ``kv_transfer_params={"do_remote_decode": true}``. Its prompt blocks are
   saved as usual (encoded into the host tier); ``request_finished`` answers with ``do_remote_prefill`` and where to
   fetch them: ``kvtc_host``, ``kvtc_port``, ``kvtc_blocks``.
2. The decode engine gets those params. Its scheduler asks for the prompt's full blocks as an asynchronous load; its
   worker sends a ``fetch`` (msgpack over ZMQ) naming the blocks by Dynamo sequence hash, with its NIXL agent
   metadata. The prefill worker copies the covering blobs into a staging arena registered with NIXL and replies with
   its agent metadata and the pages' addresses; the decode worker READs them (UCX), sends ``release``, and restores
   layer by layer into its own blocks (keeping the blobs in its host tier for the next turn).
3. Anything that goes wrong (peer gone, timeout, NIXL error, corrupt bytes, blocks not there) fails the receive: vLLM
   recomputes the prompt on the decode side. Control messages are msgpack with size limits — never pickle (NIXL's own
   descriptor serialisation is pickle and is not used).

What the decode side checks before it reads a byte: the reply is well-formed (types, ranges, at most
``MAX_FETCH_BYTES`` in all), its runs tile exactly the requested blocks in order, and each run's block hashes (from
the blob's metadata) are the requested ones. After the read, every blob is verified whole by the decoder (structure,
every section CRC, calibration id) before its first layer is written. A read that failed or timed out and whose NIXL
handle could not be confirmed released keeps its buffer alive (no late write into freed memory). The prefill side
refuses requests for more than ``MAX_FETCH_BLOCKS`` blocks or with a malformed peer name or metadata.

Only compressed bytes cross the wire; the prefill engine's blocks are free as soon as they were copied out, not after
the decode side read them.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import threading
import time
import uuid
from typing import Any

import msgpack
import torch

from ..errors import TierError, TierFullError, TransferError
from ..tiers.host import HostTier
from ..tiers.keys import block_hashes, chain
from ..tiers.nixl_io import _import_nixl
from .config import ConnectorConfig
from .protocol import LoadOp, StepPlan

log = logging.getLogger(__name__)
MAX_MESSAGE = 1 << 24
MAX_FETCH_BLOCKS = 1 << 16  # 1M tokens at block size 16
MAX_FETCH_BYTES = MAX_MESSAGE * 64  # 1 GiB of compressed blobs for one prompt
MAX_AGENT_MD = 1 << 22
_PEER_NAME = re.compile(r"[A-Za-z0-9_.:/-]{1,256}")
STAGING_BYTES = int(os.environ.get("DYN_KVTC_TRANSFER_STAGING_MB", "256")) << 20
_ids = itertools.count()


def _zmq():
    import zmq

    return zmq


def _pack(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def _unpack(data: bytes) -> dict:
    if len(data) > MAX_MESSAGE:
        raise TransferError(f"control message of {len(data)} bytes exceeds {MAX_MESSAGE}")
    try:
        msg = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_str_len=1 << 16,
            max_bin_len=MAX_AGENT_MD,
            max_ext_len=0,
            max_array_len=1 << 20,
            max_map_len=64,
        )
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise TransferError(f"control message is not valid msgpack: {type(e).__name__}") from None
    if not isinstance(msg, dict):
        raise TransferError("control message is not a map")
    return msg


def _hashes_ok(hashes: Any) -> bool:
    return isinstance(hashes, list) and all(isinstance(h, int) and 0 <= h < 1 << 64 for h in hashes)


class _Agent:
    """A NIXL agent on UCX plus the bookkeeping of remote agents it knows."""

    def __init__(self, backend: str, prefix: str) -> None:
        nixl_agent, nixl_agent_config, self.errors = _import_nixl()
        self.name = f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            self.agent = nixl_agent(self.name, nixl_agent_config(backends=[backend]))
        except self.errors + (RuntimeError,) as e:
            raise TransferError(f"NIXL {backend} backend unavailable: {type(e).__name__}: {e}") from e
        self._remotes: set[str] = set()
        self.lock = threading.Lock()

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def add_remote(self, name: str, md: bytes) -> None:
        if name in self._remotes:
            return
        got = self.agent.add_remote_agent(md)
        got = got.decode() if isinstance(got, bytes) else str(got)
        if got != name:
            raise TransferError(f"NIXL peer metadata names agent {got!r}, expected {name!r}")
        self._remotes.add(name)


class TransferServer:
    """Prefill side: serves blobs of the worker's store to decode workers (in the worker process)."""

    def __init__(self, cfg: ConnectorConfig, store: Any) -> None:
        zmq = _zmq()
        self.cfg = cfg
        self.store = store
        self.agent = _Agent(cfg.nixl_backend, "kvtc-prefill")
        self.staging = HostTier(STAGING_BYTES, 1 << 16, pinned=False)
        self._reg = self.agent.agent.register_memory(self.staging.arena)
        self._base = self.staging.arena.data_ptr()
        self._leases: dict[str, tuple[list[str], float]] = {}
        self._sock = zmq.Context.instance().socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)  # a bigger message drops the peer before it is buffered
        if cfg.transfer_port:
            self._sock.bind(f"tcp://{cfg.transfer_host}:{cfg.transfer_port}")
            self.port = cfg.transfer_port
        else:
            self.port = self._sock.bind_to_random_port(f"tcp://{cfg.transfer_host}")
        self.host = cfg.transfer_host
        self.served = 0
        self.refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvtc-transfer", daemon=True)
        self._thread.start()
        log.info("kvtc transfer server on tcp://%s:%d (NIXL %s)", self.host, self.port, cfg.nixl_backend)

    def _serve(self) -> None:
        zmq = _zmq()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            self._expire()
            if not poller.poll(100):
                continue
            data = self._sock.recv()
            try:
                msg = _unpack(data)
                op = msg.get("op")
                if op == "fetch":
                    reply = self._fetch(msg)
                elif op == "release":
                    self._release(str(msg.get("lease", "")))
                    reply = {"ok": True}
                else:
                    raise TransferError(f"unknown op {op!r}")
            except Exception as e:
                self.refused += 1
                log.warning("kvtc transfer request refused: %s", e)
                reply = {"error": f"{type(e).__name__}: {e}"}
            self._sock.send(_pack(reply))

    def _fetch(self, msg: dict) -> dict:
        hashes = msg.get("hashes")
        if not _hashes_ok(hashes) or not hashes or len(hashes) > MAX_FETCH_BLOCKS:
            raise TransferError(f"fetch needs a list of 1..{MAX_FETCH_BLOCKS} 64-bit block hashes")
        peer, md = msg.get("agent"), msg.get("agent_md")
        if not isinstance(peer, str) or not _PEER_NAME.fullmatch(peer) or not isinstance(md, bytes) or not md:
            raise TransferError("fetch needs the peer's NIXL agent name and metadata")
        deadline = time.monotonic() + self.cfg.transfer_timeout_s / 2
        while self.store.match(hashes) < len(hashes):  # the prompt's encode may still be running
            if time.monotonic() > deadline:
                raise TierError(f"only {self.store.match(hashes)} of {len(hashes)} blocks are stored here")
            time.sleep(0.005)
        runs = self.store.export(hashes)
        lease = f"{peer}/{next(_ids)}"
        keys, blobs = [], []
        try:
            for i, (blob, first, count, j, meta) in enumerate(runs):
                key = f"{lease}/{i}"
                evicted = self.staging.put(key, blob)
                if evicted:
                    raise TierFullError("transfer staging arena is full")
                keys.append(key)
                e = self.staging._entries[key]
                descs, left = [], len(blob)
                for p in e.pages:
                    n = min(self.staging.page, left)
                    descs.append([self._base + p * self.staging.page, n])
                    left -= n
                blobs.append({"size": len(blob), "first": first, "count": count, "j": j, "meta": meta, "descs": descs})
        except Exception:
            for k in keys:
                self.staging.pop(k)
            raise
        with self.agent.lock:
            self.agent.add_remote(peer, md)
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
                log.warning("kvtc transfer lease %s expired without a release", lease)
                self._release(lease)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)
        try:
            self.agent.agent.deregister_memory(self._reg)
        except self.agent.errors:
            pass


class TransferClient:
    """Decode side: pulls a prompt's blobs from a prefill worker over NIXL."""

    def __init__(self, cfg: ConnectorConfig) -> None:
        self.cfg = cfg
        self.agent = _Agent(cfg.nixl_backend, "kvtc-decode")
        self.bytes_moved = 0
        self._quarantine: list[torch.Tensor] = []  # buffers of reads NIXL did not confirm finished
        self.quarantined_bytes = 0

    def fetch(self, host: str, port: int, hashes: list[int]) -> list[tuple[bytes, int, int, int, dict | None]]:
        zmq = _zmq()
        timeout_ms = int(self.cfg.transfer_timeout_s * 1000)
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)
        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
        sock.setsockopt(zmq.SNDTIMEO, timeout_ms)
        sock.connect(f"tcp://{host}:{port}")
        try:
            msg = {"op": "fetch", "hashes": hashes, "agent": self.agent.name, "agent_md": self.agent.metadata()}
            reply = self._ask(sock, msg)
            try:
                return self._read(reply, hashes)
            finally:
                try:
                    self._ask(sock, {"op": "release", "lease": reply.get("lease", "")})
                except TransferError as e:
                    log.info("kvtc transfer release not acknowledged: %s", e)
        finally:
            sock.close(0)

    def _ask(self, sock, msg: dict) -> dict:
        zmq = _zmq()
        try:
            sock.send(_pack(msg))
            reply = _unpack(sock.recv())
        except zmq.ZMQError as e:
            raise TransferError(f"prefill peer did not answer ({e})") from e
        if "error" in reply:
            raise TransferError(f"prefill peer refused: {str(reply['error'])[:500]}")
        return reply

    @staticmethod
    def _plan(reply: dict, hashes: list[int]) -> tuple[list, list, list]:
        """Check a fetch reply against the request before anything is allocated or read; returns the runs, remote
        descriptors and (offset, size) of each blob in the local buffer."""

        def whole(v: Any, lo: int, hi: int) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi

        blobs = reply.get("blobs")
        if not isinstance(blobs, list) or not 0 < len(blobs) <= len(hashes):
            raise TransferError("malformed fetch reply: no blob list")
        runs, remote, spans = [], [], []
        total = j_next = 0
        for b in blobs:
            if not isinstance(b, dict):
                raise TransferError("malformed fetch reply: a blob entry is not a map")
            size, first, count, j = b.get("size"), b.get("first"), b.get("count"), b.get("j")
            descs, meta = b.get("descs"), b.get("meta")
            if not (
                whole(size, 1, MAX_FETCH_BYTES)
                and whole(first, 0, 1 << 32)
                and whole(count, 1, len(hashes))
                and j == j_next
                and whole(j, 0, len(hashes) - count)
            ):
                raise TransferError("fetch reply runs do not tile the requested blocks in order")
            held = meta.get("hashes") if isinstance(meta, dict) else None
            if not isinstance(held, list) or held[first : first + count] != hashes[j : j + count]:
                raise TransferError(f"fetch reply blob for blocks {j}..{j + count - 1} holds other blocks")
            if not isinstance(descs, list) or not 0 < len(descs) <= 1 << 16:
                raise TransferError("malformed fetch reply: descriptors")
            n_sum = 0
            for d in descs:
                if not (isinstance(d, list) and len(d) == 2 and whole(d[0], 1, (1 << 64) - 1) and whole(d[1], 1, size)):
                    raise TransferError("malformed fetch reply: a descriptor")
                remote.append((d[0], d[1], 0))
                n_sum += d[1]
            if n_sum != size:
                raise TransferError("fetch reply descriptors do not add up to the blob size")
            spans.append((total, size))
            runs.append((first, count, j, meta))
            total += size
            j_next += count
            if total > MAX_FETCH_BYTES:
                raise TransferError(f"peer offers more than {MAX_FETCH_BYTES} bytes, more than a prompt's blobs can be")
        if j_next != len(hashes):
            raise TransferError(f"fetch reply covers {j_next} of {len(hashes)} requested blocks")
        return runs, remote, spans

    def _read(self, reply: dict, hashes: list[int]) -> list[tuple[bytes, int, int, int, dict | None]]:
        peer, md = reply.get("agent"), reply.get("agent_md")
        if not isinstance(peer, str) or not _PEER_NAME.fullmatch(peer) or not isinstance(md, bytes):
            raise TransferError("malformed fetch reply")
        runs, remote, spans = self._plan(reply, hashes)
        total = sum(n for _, n in spans)
        buf = torch.empty(total, dtype=torch.uint8)
        local, off = [], buf.data_ptr()
        for _, n, _ in remote:
            local.append((off, n, 0))
            off += n
        a = self.agent.agent
        unsafe = False  # True while the backend may still write into ``buf``
        with self.agent.lock:
            try:
                self.agent.add_remote(peer, md)
                reg = a.register_memory(buf)
                try:
                    ld, rd = a.get_xfer_descs(local, "DRAM"), a.get_xfer_descs(remote, "DRAM")
                    if ld is None or rd is None:
                        raise TransferError("NIXL rejected the transfer descriptors")
                    h = a.initialize_xfer("READ", ld, rd, peer)
                    try:
                        unsafe = True
                        state = a.transfer(h)
                        deadline = time.monotonic() + self.cfg.transfer_timeout_s
                        while state != "DONE":
                            if state == "ERR":
                                raise TransferError("NIXL READ reported an error")
                            if time.monotonic() > deadline:
                                raise TransferError(f"NIXL READ of {total} bytes timed out")
                            time.sleep(0.0002)
                            state = a.check_xfer_state(h)
                        unsafe = False
                    finally:
                        try:
                            a.release_xfer_handle(h)
                            unsafe = False
                        except self.agent.errors:
                            log.warning("kvtc transfer: NIXL could not release a READ handle")
                finally:
                    try:
                        a.deregister_memory(reg)
                    except self.agent.errors:
                        log.warning("kvtc transfer: NIXL deregistration failed")
                        unsafe = True
            except self.agent.errors as e:
                raise TransferError(f"NIXL transfer failed: {type(e).__name__}: {e}") from e
            finally:
                if unsafe:
                    self._quarantine.append(buf)
                    self.quarantined_bytes += buf.numel()
        self.bytes_moved += total
        data = buf.numpy().tobytes()
        return [(data[o : o + n], first, count, j, meta) for (o, n), (first, count, j, meta) in zip(spans, runs)]


class TransferSide:
    """The connector's transfer role: prefill (serve) or decode (pull), on the scheduler or worker half."""

    def __init__(self, cfg: ConnectorConfig, engine_id: str, scheduler: bool) -> None:
        self.cfg = cfg
        self.engine_id = engine_id
        self.scheduler = scheduler
        self.server: TransferServer | None = None
        self.client: TransferClient | None = None
        self._loads: list[LoadOp] = []
        self._local: dict[str, int] = {}

    # ----------------------------------------------------------------- scheduler half
    def is_remote(self, request: Any) -> bool:
        p = getattr(request, "kv_transfer_params", None) or {}
        return self.cfg.transfer == "decode" and bool(p.get("do_remote_prefill")) and "kvtc_port" in p

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int, bs: int) -> tuple[int, bool]:
        p = request.kv_transfer_params
        prompt = request.prompt_token_ids or []
        n = min((len(prompt) - 1) // bs, int(p.get("kvtc_blocks", 0)))
        ext = n * bs - num_computed_tokens
        self._local[request.request_id] = num_computed_tokens
        return (ext, True) if ext > 0 else (0, False)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int, bs: int) -> None:
        if num_external_tokens <= 0:
            return
        p = request.kv_transfer_params
        prompt = request.prompt_token_ids or []
        local = self._local.pop(request.request_id, 0) // bs
        n = num_external_tokens // bs
        hashes = chain(block_hashes(prompt[: (local + n) * bs], bs))
        ids = list(blocks.get_block_ids()[0])
        op = LoadOp(request.request_id, hashes[local : local + n], ids[local : local + n], True)
        op.remote = (str(p["kvtc_host"]), int(p["kvtc_port"]))
        self._loads.append(op)
        p["do_remote_prefill"] = False  # consumed: a preemption later recomputes instead of fetching again

    def add_to_plan(self, plan: StepPlan) -> None:
        plan.loads.extend(self._loads)
        self._loads = []

    def request_finished(self, request: Any, block_ids: list[int], held: bool, sched: Any):
        p = getattr(request, "kv_transfer_params", None) or {}
        if self.cfg.transfer != "prefill" or not p.get("do_remote_decode"):
            return held, None
        from .worker import LOCAL_WORKERS

        port = self.cfg.transfer_port
        w = LOCAL_WORKERS.get(self.engine_id)
        if not port and w is not None and w.transfer is not None and w.transfer.server is not None:
            port = w.transfer.server.port
        bs = sched.block_size
        n = (request.num_prompt_tokens - 1) // bs
        if not port:
            log.warning(
                "kvtc: transfer=prefill without transfer_port and no worker in this process; the decode side "
                "cannot be told where to fetch (set transfer_port). Request %s hands off nothing.",
                request.request_id,
            )
            return held, None
        if n <= 0:
            return held, None
        return held, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "kvtc_host": self.cfg.transfer_host,
            "kvtc_port": int(port),
            "kvtc_blocks": n,
            "remote_engine_id": self.engine_id,
        }

    # ----------------------------------------------------------------- worker half
    def attach_worker(self, worker: Any) -> None:
        worker.transfer = self
        if worker.store is None:
            return
        try:
            if self.cfg.transfer == "prefill" and worker.tp_rank == 0:
                self.server = TransferServer(self.cfg, worker.store)
            elif self.cfg.transfer == "decode":
                self.client = TransferClient(self.cfg)
        except Exception as e:
            log.error("kvtc compressed transfer unavailable (requests recompute instead): %s", e)
            worker.stats["fallback_transfer_setup"] += 1

    def source(self, op: LoadOp):
        if self.client is None:
            raise TransferError("no transfer client on this worker")
        host, port = op.remote
        return lambda: self.client.fetch(host, port, list(op.hashes))

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

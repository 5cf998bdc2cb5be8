"""Pool tier: sealed blobs in a cluster-wide Mooncake Store, so any worker restores any conversation.

The ``pool`` tier is a :class:`~dynamo_kvtc.tiers.base.BlobTier` at the end of the chain (host -> pool, or host ->
disk -> pool). It differs from the per-node tiers in three ways:

- **Write-through** (``write_through = True``): :meth:`Placement.put` hands every saved blob to it as well as to the
  first tier, so another worker finds it on the next turn. :meth:`put` only copies the blob into a bounded queue
  (``pool_queue_mb``) and returns; one thread seals and writes it. Over the budget a put is skipped and counted
  (TierFullError, ``pool_skipped``): the engine never waits for the network.
- **Discovery**: a store asks :meth:`discover` for blocks its own index does not hold. One batched existence check
  (``batch_is_exist``) over the blocks' locator keys finds the pool's blobs that start at the first missing block;
  their metadata objects (sealed) are read, checked (the calibration, block keys equal to the ones asked for) and
  indexed: the pool then holds them (``in``) and a restore reads them through :meth:`read`.
- **Misses, not errors**: an unreachable, slow or restarted master, a vanished object (its worker left, Mooncake
  evicted it), a forged or corrupted one: :meth:`read` returns None (counted in :attr:`counts`), within
  ``pool_timeout_s``. The client connects (and reconnects after failures) in the background with backoff; until it
  is connected every read is a miss and every put is dropped (counted). A client that lost its master is kept, never
  closed mid-run (a Mooncake client's teardown holds the GIL for seconds: every engine thread stops), and serves
  again once Mooncake's own pings find the master (it remounts its segment itself); :mod:`.pool_link`'s probe marks
  the tier disconnected the moment the master goes, before a lookup calls into the client.

- **Streamed restores**: :meth:`read` returns at once an :class:`~dynamo_kvtc.transport.arriving.ArrivingView` over
  a host buffer of the blob's size; the readers (:mod:`.pool_parts`) fetch the object's sealed parts (one per layer
  group) in order with range reads into a registered buffer, the parts of every blob waiting at the same index in ONE
  call (one call in flight at a time: Mooncake polls each call on its caller's thread), each within
  ``pool_timeout_s``; another reader opens each part straight into place meanwhile and marks that range landed: the
  fused GPU restore decodes layer group 0 while later groups still move (the CPU reference restore waits for the
  whole blob). A part that is missing, late or does not open fails the arrival (the restore raises TransferError: a
  miss, the engine recomputes), is counted (``miss``, ``timeout``, ``refused``) and the blob is forgotten, in the
  pool tier and (through the view's :meth:`~dynamo_kvtc.codec.blob.BlobView.when_landed`) the whole store; a blob
  still on the write-through queue is read from there (a plain view).

Objects, in Mooncake (``<cal>``: the calibration id, ``<salt>``: the tenant salt's hex, ``-`` for the store's own
keys, which already fold the tenant into every block key): ``kvtc/<cal>/<salt>/<blob id>`` the sealed blob, its layer
groups sealed one by one as parts back to back (a blob whose groups do not parse is one part), and
``kvtc/<cal>/<salt>/at/<first block key, 32 hex>`` its sealed metadata (the locator: the blob's BlobMeta and where
each part ends, sealed and plain). Sealing: :mod:`.seal` (AES-GCM; every part's associated data binds its calibration,
salt, every block key, the part's index and the number of parts; the locator's its first key).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from typing import Any

import torch

from ..codec.blob import BlobView
from ..codec.container import group_ends
from ..errors import BadRecordError, ConfigError, TierError, TierFullError, TransferError
from ..transport.arriving import ArrivingView, GroupArrival
from ..transport.channel import pack, unpack
from .base import BlobTier, Evicted
from .blobs import BlobMeta
from .config import TierConfig
from .disk_format import RECORD_LIMITS
from .pool_link import MasterLink, Readers, close_client
from .pool_parts import NOT_FOUND, OUT_OF_RANGE, STALE, Batch, Fetched, Landing, Landings, PartJob, PartQueue, Parts
from .seal import Sealer, SealError, associated

log = logging.getLogger(__name__)

BACKOFF_S = (0.5, 30.0)  # reconnect backoff: first wait, longest wait
RESUME_S = 0.25  # how often a kept client is asked whether its pings found the master again
READERS = 4  # Mooncake calls in flight at once (reads and lookups)
REFUSED_KEPT = 4096  # refused blob ids remembered (a corrupted object is not read again and again)
NOT_LOST = (-704, -200)  # put codes that say nothing about the connection (OBJECT_ALREADY_EXISTS; NO_AVAILABLE_HANDLE:
# no room, in a full pool or for a second after a master restart, before the segments are mounted again)


class _Gone(TierError):
    """The object is not in the pool (its worker left, Mooncake evicted it, its write failed)."""


class PoolTier(BlobTier, MasterLink):
    """The ``pool`` tier (see the module docstring). Owns its Mooncake client, its write-through queue and the ids of
    the pool's blobs this store wrote or discovered (``_entries``: id -> BlobMeta map); never serves an object that
    does not open under its secret and answer for the keys asked."""

    name = "pool"
    write_through = True
    entries_kept = 1 << 18  # blobs (written or discovered) this worker remembers; ~1 KiB each

    def __init__(self, cfg: TierConfig, *, salt: str = "-", connect: bool = True) -> None:
        if not cfg.pool_master:
            raise ConfigError("the pool tier needs pool_master (mooncake_master's host:port)")
        self.sealer = Sealer(cfg.pool_secret, insecure=cfg.pool_insecure)  # ConfigError without a secret
        self.cfg = cfg
        self.salt = salt
        self.cal: str | None = None  # bound by the store (Placement.adopt): the calibration its keys name
        host = cfg.pool_master.rsplit(":", 1)[0]
        self.metadata_server = cfg.pool_metadata_server or f"http://{host}:8080/metadata"
        self.capacity = int(cfg.pool_segment_gb * (1 << 30))
        self.used_bytes = 0  # bytes this worker wrote to the pool (Mooncake evicts; this is not what it holds)
        self._entries: OrderedDict[str, dict] = OrderedDict()
        self._parts: dict[str, Parts] = {}  # blob id -> where its parts end (written or discovered; as _entries)
        self._refused: OrderedDict[str, None] = OrderedDict()  # blobs that did not open: not discovered again
        self._lock = threading.RLock()
        self._own: set[str] = set()  # blobs this worker wrote (the only ones its discard deletes from the pool)
        self.counts: Counter[str] = Counter()  # put, skipped, put_failed, hit, miss, refused, timeout, unreachable
        self._queue: deque[tuple[str, bytes, dict]] = deque()
        self._queued = 0
        self._budget = cfg.pool_queue_mb << 20
        self._wake = threading.Condition(self._lock)
        self._client: Any = None
        self._kept: Any = None  # the client that lost its master: reused once it finds it again (never closed mid-run)
        self._lost_at = 0.0
        self._retired: list[Any] = []  # kept clients replaced after REUSE_S: closed with the tier
        self._epoch = 0  # counts connections: a late failure of a call made before the last one drops nothing
        self._closed = False
        self._reads = Readers(READERS)
        self._readers = PartQueue(self._fetch, self._land, READERS, "kvtc-pool-part")  # first parts first
        self._landings = Landings(READERS)  # registered buffers the range reads land in
        self._writer = threading.Thread(target=self._run, name="kvtc-pool", daemon=True)
        self._prober = threading.Thread(target=self._probe, name="kvtc-pool-probe", daemon=True)
        if connect:
            self._writer.start()
            self._prober.start()

    # ------------------------------------------------------------------ keys
    def bind(self, cal_id: str, block_size: int) -> None:
        self.cal = cal_id

    def object_key(self, blob_id: str) -> str:
        return f"kvtc/{self.cal}/{self.salt}/{blob_id}"

    def _at(self, h: int) -> str:
        return f"kvtc/{self.cal}/{self.salt}/at/{h:032x}"

    @property
    def connected(self) -> bool:
        return self._client is not None

    def _run(self) -> None:
        wait = BACKOFF_S[0]
        while not self._closed:
            if self._client is None:
                try:
                    client = self._reconnect()
                except Exception as e:  # an unreachable master: the engine serves without the pool meanwhile
                    self.counts["connect_failed"] += 1
                    log.warning("kvtc pool: cannot reach %s (%s); retrying in %.1f s", self.cfg.pool_master, e, wait)
                    with self._lock:
                        self._wake.wait(wait)
                    wait = min(wait * 2, BACKOFF_S[1])
                    continue
                with self._lock:
                    if client is None or self._closed:  # the kept client is not back yet / closed meanwhile
                        self._retired += [client] if client is not None else []
                        self._wake.wait(RESUME_S)
                        continue
                    self._client, self._epoch = client, self._epoch + 1
                    self._wake.notify_all()
                wait = BACKOFF_S[0]
                log.info("kvtc pool: connected to %s", self.cfg.pool_master)
            with self._lock:
                while not self._queue and not self._closed and self._client is not None:
                    self._wake.wait(1.0)
                if self._closed or self._client is None or not self._queue:
                    continue
                blob_id, data, meta = self._queue[0]  # left on the queue (readers use it) until written
                client = self._client
            try:
                if data is None:
                    self._remove(client, blob_id)
                else:
                    self._write(client, blob_id, data, meta)
            except Exception as e:  # one blob lost to the pool, never the writer
                log.warning("kvtc pool: %s %s failed: %s", "removing" if data is None else "writing", blob_id, e)
                self.counts["put_failed" if data is not None else "remove_failed"] += 1
            with self._lock:
                self._queue.popleft()
                self._queued -= len(data or b"")

    def _write(self, client: Any, blob_id: str, data: bytes, meta: dict) -> None:
        from . import mooncake_lib

        hashes = meta["hashes"]
        plain = group_ends(data) or [len(data)]  # one sealed part per layer group
        blob, sealed = self.sealer.seal_parts(data, plain, associated("blob", self.cal, self.salt, hashes))
        parts = Parts.whole(sealed, plain)
        locator = pack({"meta": meta, "parts": parts.record()})
        rec = self.sealer.seal(locator, associated("meta", self.cal, self.salt, hashes[:1]))
        rc = mooncake_lib.load().ReplicateConfig()
        rc.replica_num = self.cfg.pool_replicas
        try:
            got = client.put(self.object_key(blob_id), blob, rc)
            got = got or client.upsert(self._at(hashes[0]), rec, rc)  # the newest blob starting at this block
        except Exception as e:  # the binding raises on a broken connection
            got = str(e)
        ok = got == 0
        if not ok and got not in NOT_LOST:
            self._lost(client, f"put returned {got}")
        if ok:
            with self._lock:
                self._own.add(blob_id)
                if blob_id in self._entries:
                    self._parts[blob_id] = parts
            self.counts["put"] += 1
            self.used_bytes += len(blob)
        else:
            self.counts["put_failed"] += 1

    def _remove(self, client: Any, blob_id: str) -> None:
        """Delete a superseded or refused blob's object (its locator stays until a newer blob's replaces it; a
        locator naming a removed object reads as a miss)."""
        got = client.remove(self.object_key(blob_id))
        self.counts["removed" if got == 0 else "remove_failed"] += 1

    # ------------------------------------------------------------------ BlobTier
    def put(self, blob_id: str, blob: Any, meta: Any, *, keep_evicted: bool = True) -> list[Evicted]:
        """Queue the blob for the pool (a copy) and return at once; TierFullError (skipped, counted) when the queue
        holds its budget or the pool is not connected."""
        with self._lock:
            if blob_id in self._entries:
                self._entries.move_to_end(blob_id)
                return []
            if self._client is None:
                self.counts["skipped"] += 1
                raise TierFullError("pool: not connected, put skipped")
            data = bytes(BlobView.of(blob).host())
            if self._queued + len(data) > self._budget:
                self.counts["skipped"] += 1
                raise TierFullError(f"pool: write-through queue holds {self._queued} bytes, put skipped")
            self._queue.append((blob_id, data, meta))
            self._queued += len(data)
            self._entries[blob_id] = meta
            self._wake.notify_all()
            return self._forget_oldest()

    def _forget_oldest(self) -> list[Evicted]:
        """Keep at most :attr:`entries_kept` blobs known here (the pool itself evicts; what this worker forgets is
        found again by discovery): the oldest are returned as victims, their objects left in the pool."""
        out = []
        while len(self._entries) > self.entries_kept:
            blob_id, meta = self._entries.popitem(last=False)
            self._own.discard(blob_id)
            self._parts.pop(blob_id, None)
            out.append(Evicted(blob_id, b"", meta))
        return out

    def read(self, blob_id: str) -> BlobView | None:
        """The blob as it arrives, part by part (an :class:`ArrivingView`, returned at once; a part that does not come
        or does not open fails it), a plain view while it is still queued here, or None (not known here, never
        written, or not connected)."""
        with self._lock:
            meta = self._entries.get(blob_id)
            parts = self._parts.get(blob_id)
            queued = next((d for i, d, _ in self._queue if i == blob_id and d is not None), None)
        if meta is None:
            return None
        if queued is not None:  # still on its way out: this worker has the bytes
            return BlobView(queued)
        if self._client is None:
            self.counts["unreachable"] += 1
            return None
        if parts is None:  # known here but never written (its put failed)
            self.counts["miss"] += 1
            self.discard(blob_id)
            return None
        buf = torch.empty(parts.plain[-1], dtype=torch.uint8)
        arrival = GroupArrival(len(parts.plain), 1, self.cfg.pool_timeout_s)
        aad = associated("blob", self.cal, self.salt, meta["hashes"])
        try:
            self._readers.submit(PartJob(blob_id, self.object_key(blob_id), aad, parts, buf, arrival))
        except TierError:  # closed
            return None
        return ArrivingView(buf, 0, buf.numel(), arrival, parts.plain, owned=True)  # host(): no copy

    def _fetch(self, batch: Batch) -> Fetched:
        """A reader: part k of every blob of the batch in ONE range read, within the deadline, into a registered
        landing buffer (back to back); the failure of the call as a whole is returned, never raised."""
        spans = [job.parts.span(k) for job, k in batch]
        size = sum(s[1] for s in spans)
        client, landing, settled = self._client, None, True  # settled: no read may still land in the landing
        try:
            if self._closed:
                raise TierError("pool: closed during the read")
            landing = self._landings.take(client, size)
            if landing is None:
                landing, settled = Landing(client, size), False
                rc = self._call(_register, landing)
                settled = True
                if rc != 0:
                    raise TierError(f"pool: the landing buffer was not registered ({rc})")
            settled = False
            got = self._call(_read_ranges, landing, [(job.key, s[0], s[1]) for (job, _), s in zip(batch, spans)])
            settled = True
            if STALE in got:
                raise TierError("pool: the client was replaced during the read")
            return Fetched(landing, got)
        except Exception as e:  # noqa: BLE001 - any failure is a miss of every part of the batch (_land fails them)
            self._release(landing, settled)
            return Fetched(None, [], e)

    def _release(self, landing: Landing | None, settled: bool) -> None:
        if landing is None:
            return
        if settled:
            self._landings.give(landing, self._client)
        else:  # a read that outlived its deadline may still land in it
            landing.drop(unregister=landing.client is self._client)

    def _land(self, batch: Batch, fetched: Fetched) -> list[bool]:
        """A reader: each part the fetch brought opened into place and marked landed (a blob's last part: a hit, the
        arrival's listeners told); which landed. A part that did not come or does not open fails its blob's
        arrival (after the blob was forgotten here and the arrival's listeners heard it); the others go on."""
        out, at = [], 0
        try:
            for i, (job, k) in enumerate(batch):
                out.append(self._open(job, k, fetched, i, at))
                at += job.parts.span(k)[1]
        finally:
            self._release(fetched.landing, True)
        return out

    def _open(self, job: PartJob, k: int, fetched: Fetched, i: int, at: int) -> bool:
        """Part k of the job's blob, the batch's i-th, at ``at`` in the fetch's landing: True once it landed."""
        _, s_len, p_off, p_len = job.parts.span(k)
        n, arrival = len(job.parts.plain), job.arrival
        try:
            if fetched.error is not None:
                raise fetched.error
            got = fetched.got[i]
            if got == NOT_FOUND:
                raise _Gone(f"pool: object {job.key} is gone")
            if got < 0 and got != OUT_OF_RANGE:
                raise TierError(f"pool: reading {job.key} failed ({got})")
            if got != s_len:
                raise SealError(f"part {k} of {n}: the object's length does not match its locator ({got})")
            into = memoryview(job.buf.numpy())[p_off : p_off + p_len]
            self.sealer.open_part_into(fetched.landing.view(at, s_len), job.aad, k, n, into)  # opened in place
        except Exception as e:  # noqa: BLE001 - any failure is a miss: the restore waiting on it must fail, not hang
            self._failed(job.blob_id, e)
            arrival.fail(e if isinstance(e, TierError) else TransferError(f"pool read: {type(e).__name__}: {e}"))
            arrival.finish()
            return False
        arrival.landed(k)
        if k + 1 == n:
            self.counts["hit"] += 1
            arrival.finish()  # its listeners (the promotion into the host tier) run here, after the last part landed
        return True

    def _failed(self, blob_id: str, e: BaseException) -> None:
        """Count a failed read and forget the blob here as :meth:`read` always did (refused: never discovered again)."""
        if isinstance(e, SealError):
            log.warning("kvtc pool: refusing blob %s: %s", blob_id, e)
            self.counts["refused"] += 1
            self.discard(blob_id)
            with self._lock:
                self._refused[blob_id] = None
                while len(self._refused) > REFUSED_KEPT:
                    self._refused.popitem(last=False)
        elif isinstance(e, _Gone):
            self.counts["miss"] += 1
            self.discard(blob_id)
        else:  # a timeout, a lost or absent master (counted by _call)
            log.info("kvtc pool: reading blob %s failed: %s", blob_id, e)

    def discard(self, blob_id: str) -> None:
        """Forget the blob here and, when this worker wrote it, delete its object from the pool (queued behind its
        own write, so the pool's memory goes to blobs still in use: a superseded raw window, an unusable blob)."""
        with self._lock:
            self._entries.pop(blob_id, None)
            self._parts.pop(blob_id, None)
            mine = blob_id in self._own  # never another worker's object (a worker with a wrong secret would refuse all)
            self._own.discard(blob_id)
            if mine and self._client is not None:
                self._queue.append((blob_id, None, None))
                self._wake.notify_all()

    def ids(self) -> list[str]:
        return []  # the pool is not listed at start: a store discovers what it needs (discover)

    def meta(self, blob_id: str) -> Any:
        with self._lock:
            return self._entries.get(blob_id)

    def parts(self, blob_id: str) -> Parts | None:
        """Where the blob's sealed parts end in its object and in the blob (written or discovered here), or None."""
        with self._lock:
            return self._parts.get(blob_id)

    # ------------------------------------------------------------------ discovery
    def discover(self, hashes: Sequence[int], block_size: int) -> list[BlobMeta]:
        """The pool's blobs that cover ``hashes`` from its first block on, in order (each starts where the last
        ended), each checked: it opens under the secret, is of this calibration and block size, and its keys are the
        ones asked for. One batched existence check, then one metadata read per blob found."""
        if self.cal is None or not hashes or self._client is None:
            return []
        try:
            exists = self._call(_exist, [self._at(h) for h in hashes])
        except TierError:
            return []
        found, pos = [], 0
        while pos < len(hashes) and pos < len(exists) and exists[pos] == 1:
            got = self._locate(hashes, pos, block_size)
            if got is None:
                break
            meta, parts = got
            with self._lock:
                self._entries[meta.id] = meta.to_dict()
                self._parts[meta.id] = parts
                self._forget_oldest()  # victims of discovery: the index finds them gone at their read (a miss)
            found.append(meta)
            pos += len(meta.hashes)
        return found

    def _locate(self, hashes: Sequence[int], pos: int, block_size: int) -> tuple[BlobMeta, Parts] | None:
        try:
            obj = self._call(_get, self._at(hashes[pos]))
            if not obj:
                return None
            rec = self.sealer.open(obj, associated("meta", self.cal, self.salt, hashes[pos : pos + 1]))
            loc = unpack(rec, RECORD_LIMITS, what="pool locator", error=BadRecordError)
            if set(loc) != {"meta", "parts"}:
                raise BadRecordError("pool locator: not a {meta, parts} record")
            meta = BlobMeta.from_dict(loc["meta"])
            parts = Parts.from_record(loc["parts"], self.sealer.overhead(), meta.stored_bytes)
        except (SealError, BadRecordError) as e:
            log.warning("kvtc pool: refusing the locator of block %032x: %s", hashes[pos], e)
            self.counts["refused"] += 1
            return None
        except TierError:
            return None
        n = len(meta.hashes)
        if meta.id in self._refused:
            return None
        if meta.cal != self.cal or meta.block_size != block_size or list(hashes[pos : pos + n]) != meta.hashes:
            self.counts["refused"] += 1  # another calibration, or keys that are not the ones asked for
            return None
        return meta, parts

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """Whether the write-through queue emptied within ``timeout`` (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._queue and self._client is not None:
                    return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        """Stop the threads and close the clients (a close may hold the GIL for seconds: at shutdown only)."""
        with self._lock:
            self._closed = True
            clients = [c for c in (self._client, self._kept, *self._retired) if c is not None]
            self._client = self._kept = None
            self._retired = []
            self._wake.notify_all()
        self._readers.close()  # the parts still queued fail at once
        # a client must not close under a call still in it (a range read into a landing crashed the process):
        # wait for the calls running now, as long as one may take
        drain = threading.Thread(target=self._reads.shutdown, kwargs={"wait": True}, name="kvtc-pool-drain",
                                 daemon=True)  # fmt: skip
        drain.start()
        drain.join(self.cfg.pool_timeout_s + 1.0)
        self._landings.clear()
        for client in clients:
            close_client(client)


def _get(client: Any, key: str) -> bytes:
    return client.get(key)


def _register(client: Any, landing: Landing) -> int:
    return landing.register(client)


def _read_ranges(client: Any, landing: Landing, ranges: list[tuple[str, int, int]]) -> list[int]:
    return landing.read(client, ranges)


def _exist(client: Any, keys: list[str]) -> list[int]:
    got = list(client.batch_is_exist(keys))
    if any(x < 0 for x in got):  # the master did not answer: a lost connection (the caller reconnects)
        raise TierError(f"batch_is_exist failed ({min(got)})")
    return got

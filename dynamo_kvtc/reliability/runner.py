"""``dynamo-kvtc bench chaos``: inject faults into the real tiers and count what happens.

Everything runs against the real code: :class:`~dynamo_kvtc.tiers.KvtcStore`, the host arena, the disk tier's files
through NIXL (POSIX backend), the compressed prefill->decode transfer between two processes over NIXL (UCX), real
calibrations on disk and real processes killed with SIGKILL. NIXL failures are injected by :class:`FaultyAgent`, a
wrapper around the real agent; ENOSPC by a small tmpfs; allocation failure by an impossible arena size and by
``RLIMIT_AS`` in a child process. Counts, per fault kind and in total (docs/reliability.md defines them precisely):

- ``faults_injected``  faults applied.
- ``faults_detected``  faults the system noticed and refused: the damaged data was not served (the restore failed
  cleanly or the file was dropped at start-up), the write was refused with nothing left behind, or (a crash) the
  restarted store recovered the directory.
- ``wrong_kv_served``  restores that completed without error whose tensors differ from the reference: bit for bit the
  original KV in lossless mode, the codec's own decode of a blob written for those blocks in lossy mode (counted per
  block).
- ``committed_blocks_lost``  blocks of a blob whose disk write returned (fsync + rename done) and whose own bytes no
  fault touched, that are not restorable afterwards.
- ``crashes``  a process that died unexpectedly, a restore that hung past its deadline, or an exception outside
  ``KvtcError`` escaping a store or tier call.
- ``recomputes``  restores that failed or missed blocks that had been stored: the engine recomputes them.

``python -m dynamo_kvtc.cli.chaos`` runs the same command as ``dynamo-kvtc bench chaos``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import torch

from ..calibration.artifact import Calibration
from ..codec.kvtc import KvtcCodec
from ..errors import CalibrationError, DecodeError, KvtcError, TransferError
from ..tiers import KvtcStore, TierConfig
from ..tiers.keys import sequence_hashes

log = logging.getLogger(__name__)

KEYS = ("faults_injected", "faults_detected", "wrong_kv_served", "committed_blocks_lost", "crashes", "recomputes")
BS = 16
SHAPE = (4, 2, 16)  # layers, kv heads, head_dim of the synthetic model
RATIO = 8.0
LOSSLESS_WINDOW = 1 << 20  # a window this large keeps every blob raw: restores are bit-exact
LOSSY_WINDOW = 32
SPAN = 128
KINDS = (
    "bitflip_disk",
    "truncate_disk",
    "misfile_disk",
    "bitflip_host",
    "enospc",
    "kill9_write",
    "nixl_disk",
    "nixl_transfer",
    "transfer_malformed",
    "calibration",
    "host_alloc",
    "soak_lossless",
    "soak_lossy",
)


# ====================================================================================================== counts
class Ledger:
    """Counts per fault kind (the six KEYS), free-form details, and a description of every bad outcome."""

    def __init__(self) -> None:
        self.kinds: dict[str, Counter] = {}
        self.details: dict[str, dict[str, Any]] = {}
        self.problems: list[str] = []
        self.seconds: Counter = Counter()

    def add(self, kind: str, **kw: int) -> None:
        c = self.kinds.setdefault(kind, Counter({k: 0 for k in KEYS}))
        for k, v in kw.items():
            if k not in KEYS:
                raise KeyError(k)
            c[k] += v

    def detail(self, kind: str, **kw: Any) -> None:
        d = self.details.setdefault(kind, {})
        for k, v in kw.items():
            d[k] = d.get(k, 0) + v if isinstance(v, (int, float)) and not isinstance(v, bool) else v

    def problem(self, kind: str, what: str) -> None:
        log.error("chaos %s: %s", kind, what)
        self.problems.append(f"{kind}: {what}")

    def total(self) -> dict[str, int]:
        out = Counter({k: 0 for k in KEYS})
        for c in self.kinds.values():
            out.update({k: c[k] for k in KEYS})
        return {k: out[k] for k in KEYS}

    def report(self) -> dict[str, Any]:
        kinds = {}
        for kind in sorted(self.kinds, key=lambda k: KINDS.index(k) if k in KINDS else len(KINDS)):
            c = self.kinds[kind]
            kinds[kind] = {k: c[k] for k in KEYS}
            if kind in self.details:
                kinds[kind]["details"] = self.details[kind]
        steps = {k: round(v, 1) for k, v in self.seconds.items()}
        return {"total": self.total(), "kinds": kinds, "seconds_by_step": steps, "problems": self.problems[:200]}

    @contextlib.contextmanager
    def timed(self, kind: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[kind] += time.perf_counter() - t0


# ====================================================================================================== the world
def make_calibration(seed: int = 0) -> Calibration:
    from ..calibration.synthetic import synthetic_calibration

    L, H, D = SHAPE
    return synthetic_calibration(L, H, D, ratios=(8, 16), dp_rows=512, seed=seed, name=f"chaos-{seed}")


class World:
    """A calibration, a deterministic KV generator (a block's K/V is a function of its sequence hash and position,
    so any process can rebuild the reference of any block), token streams and fresh directories."""

    def __init__(self, workdir: str | os.PathLike, seed: int = 0, cal: Calibration | None = None) -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.seed = seed
        self.rng = random.Random(seed)
        self.cal_dir = self.workdir / "calibration"
        if cal is None:
            cal = Calibration.load(self.cal_dir) if (self.cal_dir / "calibration.json").is_file() else None
        if cal is None:
            cal = make_calibration(seed)
        if not (self.cal_dir / "calibration.json").is_file():
            cal.save(self.cal_dir)
        self.cal = cal
        fp = cal.fingerprint
        self.L, self.H, self.D = fp.num_layers, fp.num_kv_heads, fp.head_dim
        grp = cal.groups[0]
        self._single_group = len(cal.groups) == 1
        self._parts = [(grp.k_mean.float(), grp.k_basis.float()), (grp.v_mean.float(), grp.v_basis.float())]
        self._cache: OrderedDict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = OrderedDict()
        self._dirs = 0
        self._codec: KvtcCodec | None = None

    @property
    def codec(self) -> KvtcCodec:  # the reference decoder: the codec's own decode of a blob
        if self._codec is None:
            self._codec = KvtcCodec(self.cal, ratio=RATIO)
        return self._codec

    def fresh_dir(self, name: str) -> Path:
        self._dirs += 1
        return self.workdir / f"{name}-{self._dirs}"

    def tokens(self, seed: Any, n: int) -> list[int]:
        r = random.Random(f"{self.seed}/{seed}")
        return [r.randrange(32000) for _ in range(n)]

    def block_kv(self, h: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        key = (h, index)
        got = self._cache.get(key)
        if got is not None:
            self._cache.move_to_end(key)
            return got
        from ..codec.rope import apply_rope

        g = torch.Generator().manual_seed(h & ((1 << 63) - 1))
        L, H, D = self.L, self.H, self.D
        out = []
        for mean, basis in self._parts if self._single_group else ():
            r = basis.shape[1]
            z = torch.randn(BS, r, generator=g) * torch.arange(1, r + 1, dtype=torch.float32).pow(-0.55)
            out.append((z @ basis.t() + mean).view(BS, L, H, D).permute(1, 0, 2, 3))
        if not out:
            out = [torch.randn(L, BS, H, D, generator=g) for _ in range(2)]
        pos = torch.arange(index * BS, (index + 1) * BS)
        k = torch.stack([apply_rope(out[0][i], pos, self.cal.fingerprint.rotary[i]) for i in range(L)])
        kv = (k.to(torch.bfloat16).contiguous(), out[1].to(torch.bfloat16).contiguous())
        self._cache[key] = kv
        if len(self._cache) > 4096:  # a bounded cache (~32 MiB): the soak measures the store's memory, not ours
            self._cache.popitem(last=False)
        return kv

    def seq_kv(self, hashes: Sequence[int], first_index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        parts = [self.block_kv(h, first_index + i) for i, h in enumerate(hashes)]
        return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)


def tier_config(lossless: bool, host: int, disk: int = 0, disk_dir: Path | None = None, **kw: Any) -> TierConfig:
    return TierConfig(
        host_bytes=host,
        disk_bytes=disk,
        disk_dir=disk_dir,
        ratio=RATIO,
        min_tokens=0,
        page_bytes=1024,
        window=LOSSLESS_WINDOW if lossless else LOSSY_WINDOW,
        **kw,
    )


def make_store(world: World, lossless: bool, host: int, disk: int = 0, disk_dir: Path | None = None, **kw) -> KvtcStore:
    return KvtcStore(world.cal, tier_config(lossless, host, disk, disk_dir, **kw), block_size=BS, span_tokens=SPAN)


def close_store(store: KvtcStore) -> None:
    store.close()
    if store.disk is not None:
        store.disk.close()


def offload(world: World, store: KvtcStore, tokens: Sequence[int], timeout: float = 60.0):
    n = len(tokens) // BS
    hashes = sequence_hashes(list(tokens[: n * BS]), BS)
    k, v = world.seq_kv(hashes)
    fut = store.submit_offload(hashes, list(tokens[: n * BS]), keys=k, values=v, tail=True)
    return hashes, fut.result(timeout)


class Sink:
    def __init__(self, L: int, T: int, H: int, D: int) -> None:
        self.k = torch.zeros(L, T, H, D, dtype=torch.bfloat16)
        self.v = torch.zeros_like(self.k)

    def __call__(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer, start : start + k.shape[0]] = k
        self.v[layer, start : start + v.shape[0]] = v


@dataclass
class Outcome:
    status: str  # "ok", "failed", "hang", "escaped"
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def restore(world: World, store: KvtcStore, hashes: Sequence[int], timeout: float = 60.0, source=None) -> Outcome:
    """One restore through the store's public entry point, into a sink."""
    sink = Sink(world.L, len(hashes) * BS, world.H, world.D)
    try:
        h = store.start_onboard(list(hashes), sink=sink, source=source)
    except KvtcError as e:
        return Outcome("failed", error=e)
    except Exception as e:  # outside the error contract
        return Outcome("escaped", error=e)
    if h.wait(timeout):
        return Outcome("ok", sink.k, sink.v)
    if h.error is None:
        return Outcome("hang")
    return Outcome("failed", error=h.error)


def _digest(k: torch.Tensor, v: torch.Tensor) -> bytes:
    b = hashlib.blake2b(digest_size=16)
    b.update(k.contiguous().view(torch.int16).numpy().tobytes())
    b.update(v.contiguous().view(torch.int16).numpy().tobytes())
    return b.digest()


class Expect:
    """What a restore may return. Lossless: the original KV, bit for bit. Lossy: the codec's own decode of one of the
    blobs written for the block (a block re-stored in another span decodes differently, and both are correct)."""

    def __init__(self, world: World, lossless: bool) -> None:
        self.world = world
        self.lossless = lossless
        self.digests: dict[int, set[bytes]] = {}
        self.served: set[tuple[int, bytes]] = set()
        self._served_lock = threading.Lock()

    def add_blob(self, blob: bytes, hashes: Sequence[int]) -> None:
        if self.lossless:
            return
        k, v = self.world.codec.decode(blob)
        got = [_digest(k[:, i * BS : (i + 1) * BS], v[:, i * BS : (i + 1) * BS]) for i in range(len(hashes))]
        with self._served_lock:
            for h, d in zip(hashes, got):
                self.digests.setdefault(h, set()).add(d)

    def snapshot(self, store: KvtcStore, hashes: Sequence[int]) -> None:
        """Record the blobs now covering ``hashes`` (right after they were written)."""
        if self.lossless:
            return
        n = store.match(hashes)
        try:
            runs = store.export(list(hashes[:n]))
        except KvtcError:  # a blob left the tiers meanwhile: take the others one block at a time
            runs = []
            for h in hashes[:n]:
                with contextlib.suppress(KvtcError):
                    runs.extend(store.export([h]))
        seen = set()
        for blob, _first, _count, _j, meta in runs:
            key = (meta["id"], zlib.crc32(blob))
            if key not in seen:
                seen.add(key)
                self.add_blob(blob, meta["hashes"])

    def record(self, hashes: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Lossy, concurrent use: remember what was served; :meth:`check_recorded` judges it once every blob written
        during the run has been snapshotted (a restore may read a blob before its writer took the snapshot)."""
        with self._served_lock:
            for i, h in enumerate(hashes):
                self.served.add((h, _digest(k[:, i * BS : (i + 1) * BS], v[:, i * BS : (i + 1) * BS])))

    def check_recorded(self) -> tuple[int, int]:
        wrong = unverified = 0
        for h, d in self.served:
            ok = self.digests.get(h)
            if not ok:
                unverified += 1
            elif d not in ok:
                wrong += 1
        return wrong, unverified

    def check(self, hashes: Sequence[int], first_index: int, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
        """(blocks that differ from every acceptable reference, blocks with no reference to compare against)."""
        wrong = unverified = 0
        for i, h in enumerate(hashes):
            kb, vb = k[:, i * BS : (i + 1) * BS], v[:, i * BS : (i + 1) * BS]
            if self.lossless:
                rk, rv = self.world.block_kv(h, first_index + i)
                wrong += not (torch.equal(kb, rk) and torch.equal(vb, rv))
            else:
                ok = self.digests.get(h)
                if not ok:
                    unverified += 1
                elif _digest(kb, vb) not in ok:
                    wrong += 1
        return wrong, unverified


def _committed(store: KvtcStore, blob_ids: Sequence[str]) -> dict[str, tuple[list[int], int]]:
    out = {}
    for bid in blob_ids:
        meta = store.disk.meta(bid) if store.disk is not None else None
        if meta is not None:
            out[bid] = (list(meta["hashes"]), meta["first_position"] // BS)
    return out


def check_blobs(
    ledger: Ledger,
    kind: str,
    world: World,
    store: KvtcStore,
    expect: Expect,
    committed: dict[str, tuple[list[int], int]],
    touched: set[str],
) -> dict[str, str]:
    """Restore every committed blob by its own hashes. Untouched ones must come back exactly; touched ones must come
    back exactly or fail cleanly. Returns each blob's result ("ok", "failed", ...)."""
    results = {}
    for bid, (hashes, first) in committed.items():
        out = restore(world, store, hashes)
        results[bid] = out.status
        if out.status in ("hang", "escaped"):
            ledger.add(kind, crashes=1)
            ledger.problem(kind, f"restore of {bid} {out.status}: {out.error}")
        if out.ok:
            wrong, _ = expect.check(hashes, first, out.k, out.v)
            if wrong:
                ledger.add(kind, wrong_kv_served=wrong)
                ledger.problem(kind, f"blob {bid}: {wrong} blocks served wrong")
            continue
        ledger.add(kind, recomputes=1)
        if bid not in touched:
            ledger.add(kind, committed_blocks_lost=len(hashes))
            ledger.problem(kind, f"committed blob {bid} not restorable although untouched: {out.error}")
    for bid, status in results.items():  # a blob that is gone is counted once
        if status != "ok":
            committed.pop(bid, None)
    return results


# ====================================================================================================== file faults
def _regions(path: Path) -> dict[str, tuple[int, int]]:
    """Byte ranges of a disk-tier file: its prefix and metadata (the index record), the blob's prefix and header, and
    the blob's sections."""
    data = path.read_bytes()
    mlen = struct.unpack_from("<I", data, 8)[0]
    b0 = 16 + mlen
    hlen = struct.unpack_from("<I", data, b0 + 8)[0]
    return {
        "index_prefix": (0, 16),
        "index_meta": (16, b0),
        "blob_prefix": (b0, b0 + 16),
        "blob_header": (b0 + 16, b0 + 16 + hlen),
        "blob_sections": (b0 + 16 + hlen, len(data)),
    }


def damage_file(path: Path, op: str, rng: random.Random, other: Path | None = None) -> str:
    """Apply one fault to a disk-tier file; returns where (for the details)."""
    if op in ("flip", "scribble", "truncate"):
        regions = {k: v for k, v in _regions(path).items() if v[1] > v[0]}
        region = rng.choice(sorted(regions))
        lo, hi = regions[region]
        data = bytearray(path.read_bytes())
        if op == "flip":
            at = rng.randrange(lo, hi)
            data[at] ^= 1 << rng.randrange(8)
        elif op == "scribble":
            at = rng.randrange(lo, hi)
            n = min(rng.randint(2, 64), len(data) - at)
            new = bytes(rng.randrange(256) for _ in range(n))
            if new == bytes(data[at : at + n]):
                new = bytes((b ^ 0xFF) for b in new)
            data[at : at + n] = new
        else:
            data = data[: rng.randrange(lo, hi)]
        path.write_bytes(bytes(data))
        return region
    if op == "extend":
        with open(path, "ab") as f:
            f.write(os.urandom(rng.randint(1, 4096)))
        return "tail"
    if op == "delete":
        path.unlink()
        return "file"
    if op == "swap":  # the file's bytes replaced by another committed blob's file
        shutil.copyfile(other, path)
        return "file"
    if op == "rename":  # the file moved under another (unused) blob id
        path.rename(path.with_name("0123456789abcdef0123456789abcdef.kvtc"))
        return "file"
    if op == "symlink":  # the file replaced by a symlink to another blob's file
        path.unlink()
        path.symlink_to(other)
        return "file"
    raise ValueError(op)


FILE_OPS = {
    "bitflip_disk": ("flip", "scribble"),
    "truncate_disk": ("truncate", "extend"),
    "misfile_disk": ("delete", "swap", "rename", "symlink"),
}


def scenario_disk_files(world: World, ledger: Ledger, rounds: int) -> None:
    """Bit flips, scribbles, truncation, extension and misfiled files anywhere in disk-tier files (index record, blob
    header, sections), at rest (then a restart) or under a running store."""
    rng = random.Random(f"{world.seed}/disk")
    kinds = list(FILE_OPS)
    for r in range(rounds):
        kind = kinds[r % len(kinds)]
        op = rng.choice(FILE_OPS[kind])
        lossless = r % 2 == 0
        d = world.fresh_dir("disk")
        store = make_store(world, lossless, host=0, disk=64 << 20, disk_dir=d)
        expect = Expect(world, lossless)
        committed: dict[str, tuple[list[int], int]] = {}
        try:
            for s in range(3):
                toks = world.tokens(("disk", r, s), rng.randint(6, 14) * BS + rng.randrange(BS))
                _, res = offload(world, store, toks)
                new = _committed(store, res.blobs)
                for bid, (hashes, _) in new.items():
                    expect.add_blob(store.disk.get(bid)[0], hashes)
                committed.update(new)
            at_rest = rng.random() < 0.5
            if at_rest:
                close_store(store)
            target = rng.choice(sorted(committed))
            other = rng.choice(sorted(set(committed) - {target}) or [target])
            where = damage_file(d / f"{target}.kvtc", op, rng, d / f"{other}.kvtc")
            ledger.add(kind, faults_injected=1)
            ledger.detail(kind, **{f"{op}@{where}": 1, "at_rest" if at_rest else "at_runtime": 1})
            if at_rest:
                store = make_store(world, lossless, host=0, disk=64 << 20, disk_dir=d)
            results = check_blobs(ledger, kind, world, store, expect, committed, {target})
            if results[target] == "ok":
                ledger.detail(kind, served_after_damage=1)  # never expected: every byte is covered by a CRC
            else:
                ledger.add(kind, faults_detected=1)
            if list(d.glob("*.tmp")):
                ledger.problem(kind, "a .tmp file was left behind")
        finally:
            close_store(store)
            shutil.rmtree(d, ignore_errors=True)


def scenario_host_flips(world: World, ledger: Ledger, rounds: int) -> None:
    """Bit flips in the host arena (no checksum of its own there): the decoder's full verification must refuse them."""
    kind = "bitflip_host"
    rng = random.Random(f"{world.seed}/host")
    for r in range(rounds):
        lossless = r % 2 == 1
        store = make_store(world, lossless, host=4 << 20)
        expect = Expect(world, lossless)
        blobs: dict[str, tuple[list[int], int]] = {}
        try:
            for s in range(3):
                toks = world.tokens(("host", r, s), rng.randint(6, 14) * BS)
                hashes, res = offload(world, store, toks)
                expect.snapshot(store, hashes)
                for bid in res.blobs:
                    meta = store._blobs.get(bid)
                    if meta is not None:
                        blobs[bid] = (list(meta.hashes), meta.first_position // BS)
            target = rng.choice(sorted(blobs))
            entry = store.host._entries[target]
            off = rng.randrange(entry.nbytes)
            at = entry.pages[off // store.host.page] * store.host.page + off % store.host.page
            store.host.arena[at] ^= 1 << rng.randrange(8)
            hlen = struct.unpack_from("<I", store.host.get(target)[0], 8)[0]
            region = "blob_prefix" if off < 16 else ("blob_header" if off < 16 + hlen else "blob_sections")
            ledger.add(kind, faults_injected=1)
            ledger.detail(kind, **{region: 1})
            for bid, (hashes, first) in blobs.items():
                out = restore(world, store, hashes)
                if out.ok:
                    wrong, _ = expect.check(hashes, first, out.k, out.v)
                    if wrong:
                        ledger.add(kind, wrong_kv_served=wrong)
                        ledger.problem(kind, f"host blob {bid}: {wrong} blocks served wrong")
                    if bid == target:
                        ledger.detail(kind, served_after_damage=1)
                else:
                    ledger.add(kind, recomputes=1)
                    if bid == target:
                        ledger.add(kind, faults_detected=1)
                    else:
                        ledger.problem(kind, f"undamaged host blob {bid} failed: {out.error}")
        finally:
            close_store(store)


# ====================================================================================================== ENOSPC
def _mount_tmpfs(path: Path, size: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], capture_output=True
        )
    except OSError:
        return False
    return r.returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True)


def scenario_enospc(world: World, ledger: Ledger, fills: int) -> None:
    """A disk tier configured far larger than its device (a small tmpfs): writes hit ENOSPC. Each refused write must
    leave nothing behind, every committed blob must stay restorable, before and after a restart on the full device,
    and writes must succeed again once space is freed."""
    kind = "enospc"
    rng = random.Random(f"{world.seed}/enospc")
    mnt = world.fresh_dir("tmpfs")
    if not _mount_tmpfs(mnt, 512 * 1024):
        ledger.detail(kind, skipped="cannot mount a tmpfs here (needs root or a user namespace)")
        log.warning("chaos enospc: skipped (cannot mount a tmpfs)")
        return
    try:
        for fill in range(fills):
            d = mnt / f"g3-{fill}"
            lossless = fill % 2 == 0
            store = make_store(world, lossless, host=0, disk=1 << 30, disk_dir=d)
            expect = Expect(world, lossless)
            committed: dict[str, tuple[list[int], int]] = {}
            refused = 0
            freed_at = 0
            try:
                for s in range(60):
                    toks = world.tokens(("enospc", fill, s), rng.randint(4, 10) * BS)
                    before = store.stats["disk_write_error_TierFullError"]
                    hashes, res = offload(world, store, toks)
                    new = _committed(store, res.blobs)
                    for bid, (h, _) in new.items():
                        expect.add_blob(store.disk.get(bid)[0], h)
                    committed.update(new)
                    if store.stats["disk_write_error_TierFullError"] > before:
                        refused += 1
                        ledger.add(kind, faults_injected=1)
                        clean = not list(d.glob("*.tmp")) and store.disk.used_bytes == sum(
                            (d / f"{b}.kvtc").stat().st_size for b in store.disk.ids()
                        )
                        ledger.add(kind, faults_detected=int(clean))
                        if not clean:
                            ledger.problem(kind, "ENOSPC left a .tmp file or inconsistent accounting")
                        out = restore(world, store, hashes[: max(1, store.match(hashes))])
                        ledger.add(kind, recomputes=int(not out.ok))
                        if refused == 2:  # free the two oldest blobs: writes must work again
                            for bid in store.disk.ids()[:2]:
                                store.disk.delete(bid)
                                committed.pop(bid, None)
                            freed_at = len(committed)
                        if refused >= 4:
                            break
                    elif refused >= 2 and new:
                        ledger.detail(kind, writes_after_space_freed=len(new))
                check_blobs(ledger, kind, world, store, expect, committed, set())
                close_store(store)
                store = make_store(world, lossless, host=0, disk=1 << 30, disk_dir=d)  # restart on a full device
                check_blobs(ledger, kind, world, store, expect, committed, set())
                ledger.detail(kind, committed_blobs=len(committed), refused_writes=refused)
                del freed_at
            finally:
                close_store(store)
                shutil.rmtree(d, ignore_errors=True)
    finally:
        _umount(mnt)
        with contextlib.suppress(OSError):
            mnt.rmdir()


# ====================================================================================================== kill -9
def _child_cmd(role: str, **kw: Any) -> list[str]:
    return [sys.executable, "-m", "dynamo_kvtc.cli.chaos", "_child", role, json.dumps(kw)]


def _wait_marker(proc: subprocess.Popen, marker: str, timeout: float) -> str | None:
    """Read the child's stdout until a line starting with ``marker`` (NIXL logs to stdout too)."""
    deadline = time.monotonic() + timeout
    box: list[str] = []

    def reader() -> None:
        for line in proc.stdout:
            if line.startswith(marker):
                box.append(line.strip())
                return

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    t.join(max(0.0, deadline - time.monotonic()))
    return box[0] if box else None


def _drain(proc: subprocess.Popen) -> None:
    threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()


def _child_kill9(world: World, args: dict) -> None:
    """Writer child: recover the directory, verify everything earlier generations committed, report, then write blobs
    until killed, appending one line per committed blob."""
    d = Path(args["dir"])
    gen = args["gen"]
    tmp_found = sum(1 for n in os.listdir(d) if n.endswith(".tmp")) if d.exists() else 0
    store = make_store(world, True, host=0, disk=1 << 30, disk_dir=d)
    log_path = Path(args["log"])
    committed: dict[str, tuple[list[int], int]] = {}
    if log_path.exists():
        for line in log_path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[0] == "C":
                committed[parts[1]] = ([int(x, 16) for x in parts[3].split(",")], int(parts[2]))
    ledger = Ledger()
    expect = Expect(world, True)
    check_blobs(ledger, "kill9_write", world, store, expect, committed, set())
    unreported = [b for b in store.disk.ids() if b not in committed]  # committed but killed before the report line
    check_blobs(ledger, "kill9_write", world, store, expect, _committed(store, unreported), set(unreported))
    verdict = {
        "gen": gen,
        "tmp_found": tmp_found,
        "tmp_removed": store.disk.tmp_removed,
        "dropped": store.disk.dropped,
        "recovered": store.disk.recovered,
        "checked": len(committed),
        "unreported": len(unreported),
        **ledger.kinds.get("kill9_write", {}),
        "problems": ledger.problems,
    }
    Path(args["verdict"]).write_text(json.dumps(verdict))
    print("WRITING", flush=True)
    if args.get("verify_only"):
        close_store(store)
        return
    rng = random.Random(f"{world.seed}/kill9/{gen}")
    slow = FaultyAgent(store.disk.io.agent)  # nothing armed: a pass-through that makes writes slow, so that
    slow.write_delay_s = 0.03  # a random kill lands inside a write (fallocate .. rename) much of the time
    store.disk.io.agent = slow
    fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    for s in range(10_000):
        toks = world.tokens(("kill9", gen, s), rng.randint(16, 48) * BS)
        _, res = offload(world, store, toks)
        for bid, (hashes, first) in _committed(store, res.blobs).items():
            os.write(fd, f"C {bid} {first} {','.join(f'{h:x}' for h in hashes)}\n".encode())


def scenario_kill9(world: World, ledger: Ledger, kills: int) -> None:
    """``kill -9`` of a process in the middle of disk writes, then a restart: the next process recovers the
    directory, every blob the killed process reported committed must restore bit for bit, torn ``.tmp`` files must be
    gone and never served."""
    kind = "kill9_write"
    rng = random.Random(f"{world.seed}/kill9")
    d = world.fresh_dir("kill9")
    log_path = d.with_name(d.name + ".log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        for gen in range(kills + 1):
            final = gen == kills
            verdict = d.with_name(f"{d.name}.verdict-{gen}.json")
            args = {"dir": str(d), "log": str(log_path), "gen": gen, "verdict": str(verdict), "verify_only": final}
            proc = subprocess.Popen(
                _child_cmd("kill9", workdir=str(world.workdir), seed=world.seed, **args),
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
            try:
                if _wait_marker(proc, "WRITING", 120) is None:
                    ledger.add(kind, crashes=1)
                    ledger.problem(kind, f"generation {gen} never reached its write loop (rc {proc.poll()})")
                    continue
                _drain(proc)
                if final:
                    rc = proc.wait(60)
                    if rc != 0:
                        ledger.add(kind, crashes=1)
                        ledger.problem(kind, f"final verification exited {rc}")
                else:
                    size0 = log_path.stat().st_size if log_path.exists() else 0
                    deadline = time.monotonic() + 60  # let it commit something, then kill it at a random moment
                    while time.monotonic() < deadline and proc.poll() is None:
                        if log_path.exists() and log_path.stat().st_size > size0:
                            break
                        time.sleep(0.01)
                    time.sleep(rng.uniform(0.0, 0.6))
                    if proc.poll() is not None:
                        ledger.add(kind, crashes=1)
                        ledger.problem(kind, f"writer generation {gen} died by itself (rc {proc.returncode})")
                    else:
                        os.kill(proc.pid, signal.SIGKILL)
                        proc.wait(30)
                        ledger.add(kind, faults_injected=1)
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(30)
            if verdict.exists():
                v = json.loads(verdict.read_text())
                if gen:  # this generation recovered what the killed one left
                    ledger.add(kind, faults_detected=1, recomputes=int(v["tmp_found"] > 0))
                    ledger.detail(kind, killed_mid_write=int(v["tmp_found"] > 0), tmp_removed=v["tmp_removed"])
                ledger.add(kind, **{k: v.get(k, 0) for k in ("wrong_kv_served", "committed_blocks_lost", "crashes")})
                ledger.detail(kind, committed_checked=v["checked"], unreported_checked=v["unreported"])
                for p in v["problems"]:
                    ledger.problem(kind, f"gen {gen}: {p}")
            elif not final or proc.returncode:
                ledger.add(kind, crashes=1)
                ledger.problem(kind, f"generation {gen} wrote no verdict")
    finally:
        shutil.rmtree(d, ignore_errors=True)
        for p in d.parent.glob(d.name + ".*"):
            p.unlink(missing_ok=True)


# ====================================================================================================== NIXL
def nixl_error(name: str = "nixlBackendError") -> type[BaseException]:
    for mod in ("nixl._bindings", "nixl_cu13._bindings"):
        try:
            m = __import__(mod, fromlist=["_"])
        except ImportError:
            continue
        if hasattr(m, name):
            return getattr(m, name)
    raise RuntimeError("NIXL bindings not found")


class FaultyAgent:
    """Wraps a real NIXL agent and makes armed transfers fail the ways NIXL transfers fail; everything else, and every
    unarmed transfer, goes to the real agent.

    Modes: ``raise`` (a real ``nixlBackendError`` from ``transfer``), ``err_state`` (the transfer reports ``ERR``),
    ``stall`` (stays ``PROC`` past the deadline), ``descs_none`` (descriptor lists rejected), ``drop`` (reports
    ``DONE`` without moving a byte), ``corrupt`` (one bit flipped in the bytes moved), ``kill_peer`` (the remote
    process is killed right before the transfer is posted)."""

    MODES = ("raise", "err_state", "stall", "descs_none", "drop", "corrupt", "kill_peer")

    def __init__(self, agent: Any, seed: int = 0) -> None:
        self._agent = agent
        self._armed: list[tuple[str, str | None]] = []
        self._ops: dict[int, tuple[str, list | None]] = {}
        self._stalled: set[int] = set()
        self._err: set[int] = set()
        self._descs: dict[int, tuple[Any, list]] = {}  # id(descriptor list) -> (it, the (addr, len, dev) tuples)
        self._rng = random.Random(seed)
        self.on_kill: Callable[[], None] | None = None
        self.injected: Counter = Counter()
        self.write_delay_s = 0.0  # a slow disk: every WRITE waits this long before it is posted

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def arm(self, mode: str, op: str | None = None) -> None:
        if mode not in self.MODES:
            raise ValueError(mode)
        self._armed.append((mode, op))

    def disarm(self) -> int:
        left = len(self._armed)
        self._armed.clear()
        return left

    def _take(self, op: str | None, modes: Sequence[str] | None = None) -> str | None:
        for i, (mode, want) in enumerate(self._armed):
            if (want is None or want == op) and (modes is None or mode in modes):
                del self._armed[i]
                self.injected[mode] += 1
                return mode
        return None

    def get_xfer_descs(self, descs: Any, mem_type: Any = None, *a: Any, **k: Any) -> Any:
        if self._take(None, ("descs_none",)):
            return None
        got = self._agent.get_xfer_descs(descs, mem_type, *a, **k)
        if got is not None and mem_type == "DRAM" and isinstance(descs, list):
            self._descs[id(got)] = (got, list(descs))
        return got

    def initialize_xfer(self, op: str, local: Any, remote: Any, peer: Any, *a: Any, **k: Any) -> Any:
        h = self._agent.initialize_xfer(op, local, remote, peer, *a, **k)
        mine = self._descs.pop(id(local), (None, None))[1]  # the *local* buffer: the only memory we may touch
        self._descs.pop(id(remote), None)
        self._ops[id(h)] = (op, mine)
        return h

    def _flip(self, dram: list | None) -> None:
        if not dram:
            return
        addr, n, _ = self._rng.choice(dram)
        at = addr + self._rng.randrange(n)
        cell = ctypes.c_ubyte.from_address(at)
        cell.value ^= 1 << self._rng.randrange(8)

    def _finish(self, h: Any) -> str:
        state = self._agent.transfer(h)
        deadline = time.monotonic() + 10
        while state != "DONE" and time.monotonic() < deadline:
            time.sleep(0.0005)
            state = self._agent.check_xfer_state(h)
        return state

    def transfer(self, h: Any, *a: Any, **k: Any) -> Any:
        op, dram = self._ops.get(id(h), (None, None))
        if op == "WRITE" and self.write_delay_s:
            time.sleep(self.write_delay_s)
        mode = self._take(op, ("raise", "err_state", "stall", "drop", "corrupt", "kill_peer"))
        if mode is None:
            return self._agent.transfer(h, *a, **k)
        if mode == "raise":
            raise nixl_error("nixlBackendError")("NIXL_ERR_BACKEND (injected)")
        if mode == "err_state":
            self._err.add(id(h))
            return "PROC"
        if mode == "stall":
            self._stalled.add(id(h))
            return "PROC"
        if mode == "drop":
            return "DONE"
        if mode == "kill_peer":
            if self.on_kill is not None:
                self.on_kill()
            return self._agent.transfer(h, *a, **k)
        # corrupt: the bytes moved are not the bytes sent
        if op == "WRITE":
            self._flip(dram)
            return self._finish(h)
        state = self._finish(h)
        if state == "DONE":
            self._flip(dram)
        return state

    def check_xfer_state(self, h: Any) -> Any:
        if id(h) in self._stalled:
            return "PROC"
        if id(h) in self._err:
            return "ERR"
        return self._agent.check_xfer_state(h)

    def release_xfer_handle(self, h: Any, *a: Any, **k: Any) -> Any:
        self._stalled.discard(id(h))
        self._err.discard(id(h))
        self._ops.pop(id(h), None)
        return self._agent.release_xfer_handle(h, *a, **k)


def scenario_nixl_disk(world: World, ledger: Ledger, rounds: int, ops: Sequence[str] = ("WRITE", "READ")) -> None:
    """NIXL failures on the disk tier's writes (demotion) and reads (restore), through a wrapper around the real
    agent. A refused write stores nothing; a failed read is a miss that keeps the committed file; the blob must
    restore exactly once the fault is gone."""
    kind = "nixl_disk"
    rng = random.Random(f"{world.seed}/nixl")
    d = world.fresh_dir("nixl")
    store = make_store(world, True, host=0, disk=256 << 20, disk_dir=d)
    expect = Expect(world, True)
    agent = FaultyAgent(store.disk.io.agent, seed=world.seed)
    store.disk.io.agent = agent
    store.disk.io.timeout_s = 0.25
    modes = ("raise", "err_state", "stall", "descs_none", "drop", "corrupt")
    committed: dict[str, tuple[list[int], int]] = {}
    try:
        for s in range(4):
            _, res = offload(world, store, world.tokens(("nixl", "base", s), rng.randint(4, 12) * BS))
            committed.update(_committed(store, res.blobs))
        for r in range(rounds):
            mode = modes[r % len(modes)]
            op = ops[(r // len(modes)) % len(ops)]
            ledger.detail(kind, **{f"{op}:{mode}": 1})
            if op == "WRITE":
                before = sum(v for k, v in store.stats.items() if k.startswith("disk_write_error"))
                agent.arm(mode, None if mode == "descs_none" else "WRITE")
                hashes, res = offload(world, store, world.tokens(("nixl", r), rng.randint(4, 12) * BS))
                agent.disarm()
                ledger.add(kind, faults_injected=1)
                refused = sum(v for k, v in store.stats.items() if k.startswith("disk_write_error")) > before
                new = _committed(store, res.blobs)
                out = restore(world, store, hashes)
                if out.ok:
                    wrong, _ = expect.check(hashes, 0, out.k, out.v)
                    ledger.add(kind, wrong_kv_served=wrong)
                    if wrong:
                        ledger.problem(kind, f"{op}:{mode}: {wrong} blocks served wrong")
                    if not refused:
                        ledger.detail(kind, **{f"{op}:{mode}:written_anyway": 1})
                        committed.update(new)
                else:
                    ledger.add(kind, recomputes=1)
                if refused or not out.ok:
                    ledger.add(kind, faults_detected=1)
                if list(d.glob("*.tmp")):
                    ledger.problem(kind, f"{op}:{mode} left a .tmp file behind")
            else:
                if not committed:
                    continue
                target = rng.choice(sorted(committed))
                hashes, first = committed[target]
                agent.arm(mode, None if mode == "descs_none" else "READ")
                out = restore(world, store, hashes)
                agent.disarm()
                ledger.add(kind, faults_injected=1)
                if out.ok:
                    wrong, _ = expect.check(hashes, first, out.k, out.v)
                    ledger.add(kind, wrong_kv_served=wrong)
                    if wrong:
                        ledger.problem(kind, f"{op}:{mode}: {wrong} blocks served wrong")
                    ledger.detail(kind, **{f"{op}:{mode}:served_ok": 1})
                else:
                    ledger.add(kind, faults_detected=1, recomputes=1)
                    if out.status != "failed":
                        ledger.add(kind, crashes=1)
                        ledger.problem(kind, f"{op}:{mode}: restore {out.status}")
                # the fault is gone: the committed blob must come back exactly
                if check_blobs(ledger, kind, world, store, expect, {target: committed[target]}, set())[target] != "ok":
                    committed.pop(target)
        ledger.detail(kind, quarantined_bytes=store.disk.io.quarantined_bytes)
        check_blobs(ledger, kind, world, store, expect, committed, set())
    finally:
        close_store(store)
        shutil.rmtree(d, ignore_errors=True)


# ====================================================================================================== transfer
def transfer_sequences(world: World, n: int) -> list[list[int]]:
    return [world.tokens(("xfer", i), (6 + 3 * i) * BS + 5) for i in range(n)]


def _child_server(world: World, args: dict) -> None:
    from ..connector.config import ConnectorConfig
    from ..connector.transfer import TransferServer

    store = make_store(world, True, host=64 << 20)
    for toks in transfer_sequences(world, args["seqs"]):
        offload(world, store, toks)
    srv = TransferServer(ConnectorConfig(transfer_timeout_s=args["timeout"]), store)
    print(f"PORT {srv.port}", flush=True)
    sys.stdin.read()  # serve until the parent closes our stdin (or dies)
    srv.close()


class PeerProcess:
    """The prefill side in its own process: a real KvtcStore behind a TransferServer."""

    def __init__(self, world: World, seqs: int, timeout: float) -> None:
        self.world, self.seqs, self.timeout = world, seqs, timeout
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.starts = 0

    def start(self) -> None:
        self.proc = subprocess.Popen(
            _child_cmd("server", workdir=str(self.world.workdir), seed=self.world.seed, seqs=self.seqs, timeout=4.0),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        line = _wait_marker(self.proc, "PORT", 120)
        if line is None:
            self.stop()
            raise RuntimeError("the transfer peer did not start")
        _drain(self.proc)
        self.port = int(line.split()[1])
        self.starts += 1

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(Exception):
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


TRANSFER_MODES = ("raise", "err_state", "stall", "corrupt", "drop", "descs_none", "kill_peer", "peer_gone")


def scenario_transfer(
    world: World, ledger: Ledger, rounds: int, timeout: float = 1.5, modes: Sequence[str] = TRANSFER_MODES
) -> None:
    """The compressed prefill->decode transfer between two processes over NIXL (UCX), with the decode side's real
    agent wrapped to fail transfers, time out, corrupt bytes, and with the prefill process killed before the fetch
    and in the middle of it (remote disconnect). A failed fetch must fail the restore (the engine recomputes); a
    clean fetch after it must restore bit for bit."""
    from ..connector.config import ConnectorConfig
    from ..connector.transfer import TransferClient

    kind = "nixl_transfer"
    seqs = transfer_sequences(world, 4)
    peer = PeerProcess(world, len(seqs), timeout)
    client = TransferClient(ConnectorConfig(transfer_timeout_s=timeout))
    agent = FaultyAgent(client.agent.agent, seed=world.seed)
    client.agent.agent = agent
    agent.on_kill = peer.kill
    store = make_store(world, True, host=64 << 20)
    expect = Expect(world, True)
    try:
        peer.start()

        def fetch_restore(toks: list[int]) -> tuple[list[int], Outcome]:
            hashes = sequence_hashes(toks[: len(toks) // BS * BS], BS)
            port = peer.port
            return hashes, restore(world, store, hashes, 60, source=lambda: client.fetch("127.0.0.1", port, hashes))

        for r in range(rounds):
            mode = modes[r % len(modes)]
            toks = seqs[r % len(seqs)]
            if not peer.alive():
                peer.start()
            if mode == "peer_gone":
                peer.kill()
            else:
                agent.arm(mode, None if mode == "descs_none" else "READ")
            hashes, out = fetch_restore(toks)
            agent.disarm()
            ledger.add(kind, faults_injected=1)
            ledger.detail(kind, **{mode: 1})
            if out.ok:
                wrong, _ = expect.check(hashes, 0, out.k, out.v)
                ledger.add(kind, wrong_kv_served=wrong)
                if wrong:
                    ledger.problem(kind, f"{mode}: {wrong} blocks served wrong")
                ledger.detail(kind, **{f"{mode}:served_ok": 1})
            else:
                ledger.add(kind, faults_detected=1, recomputes=1)
                if out.status != "failed":
                    ledger.add(kind, crashes=1)
                    ledger.problem(kind, f"{mode}: restore {out.status}: {out.error}")
            if not peer.alive():
                peer.start()
            hashes, out = fetch_restore(toks)  # the fault is gone: a clean fetch restores exactly
            if out.ok:
                wrong, _ = expect.check(hashes, 0, out.k, out.v)
                ledger.add(kind, wrong_kv_served=wrong)
                ledger.detail(kind, clean_fetches_ok=1)
            else:
                ledger.problem(kind, f"clean fetch after {mode} failed: {out.error}")
                ledger.detail(kind, clean_fetches_failed=1)
        ledger.detail(kind, peer_starts=peer.starts, quarantined_bytes=client.quarantined_bytes)
        scenario_transfer_malformed(world, ledger, peer, client)
    finally:
        peer.stop()
        close_store(store)


def scenario_transfer_malformed(world: World, ledger: Ledger, peer: PeerProcess, client: Any) -> None:
    """Hostile or broken control messages: replies from a fake prefill peer that lie about sizes, blocks or layout,
    are not msgpack or are too big; garbage requests to the real prefill peer, which must keep serving."""
    import zmq

    from ..connector.transfer import MAX_MESSAGE

    kind = "transfer_malformed"
    hashes = sequence_hashes(transfer_sequences(world, 1)[0][: 6 * BS], BS)
    blob = {"size": 100, "first": 0, "count": len(hashes), "j": 0, "meta": {"hashes": hashes}, "descs": [[4096, 100]]}
    good_md = client.agent.metadata()
    base = {"lease": "x", "agent": client.agent.name + "-fake", "agent_md": good_md}
    lying = [
        b"\xc1\xc1 not msgpack",
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"lease": "x"}),
        msgpack.packb({**base, "blobs": [{**blob, "meta": {"hashes": [h ^ 1 for h in hashes]}}]}),
        msgpack.packb({**base, "blobs": [{**blob, "count": len(hashes) - 1}]}),
        msgpack.packb({**base, "blobs": [{**blob, "j": 1}]}),
        msgpack.packb({**base, "blobs": [{**blob, "size": 1 << 40, "descs": [[4096, 1 << 40]]}]}),
        msgpack.packb({**base, "blobs": [{**blob, "descs": [[4096, 99]]}]}),
        msgpack.packb({**base, "blobs": [{**blob, "descs": [[4096, -100]]}]}),
        msgpack.packb({**base, "blobs": [{**blob, "size": True}]}),
        msgpack.packb({**base, "agent": "../../etc", "blobs": [blob]}),
        msgpack.packb({**base, "blobs": [blob] * 2}),
        msgpack.packb({**base, "blobs": [{**blob, "descs": [[4096, 100]] * 70000}]}),
        b"\x00" * (MAX_MESSAGE + 1024),  # bigger than any control message: dropped before it is buffered
    ]
    ctx = zmq.Context.instance()
    fake = ctx.socket(zmq.REP)
    fake.setsockopt(zmq.LINGER, 0)
    port = fake.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()
    queue = list(lying)

    def serve() -> None:
        poller = zmq.Poller()
        poller.register(fake, zmq.POLLIN)
        while not stop.is_set():
            if not poller.poll(50):
                continue
            fake.recv()
            reply = queue.pop(0) if queue else msgpack.packb({"ok": True})
            fake.send(reply)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        for i in range(len(lying)):
            ledger.add(kind, faults_injected=1)
            try:
                got = client.fetch("127.0.0.1", port, hashes)
                ledger.problem(kind, f"lying reply {i} accepted ({len(got)} runs)")
            except TransferError:
                ledger.add(kind, faults_detected=1, recomputes=1)
            except Exception as e:
                ledger.add(kind, crashes=1)
                ledger.problem(kind, f"lying reply {i}: {type(e).__name__} escaped: {e}")
            if i == len(lying) - 1:  # the REQ/REP pair is out of step after a dropped message: start a new fake
                break
    finally:
        stop.set()
        t.join(2)
        fake.close(0)
    # garbage requests to the real peer: refused with an error reply, and it keeps serving
    if not peer.alive():
        peer.start()
    raw = ctx.socket(zmq.REQ)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.RCVTIMEO, 5000)
    raw.connect(f"tcp://127.0.0.1:{peer.port}")
    bad_requests = [
        b"\xc1 garbage",
        msgpack.packb({"op": "fetch", "hashes": [-1], "agent": "a", "agent_md": b"x"}),
        msgpack.packb({"op": "fetch", "hashes": list(range(1 << 17)), "agent": "a", "agent_md": b"x"}),
        msgpack.packb({"op": "fetch", "hashes": [1], "agent": "a\x00b", "agent_md": b"x"}),
        msgpack.packb({"op": "fetch", "hashes": hashes, "agent": "evil", "agent_md": b"not nixl metadata"}),
        msgpack.packb({"op": "explode"}),
    ]
    try:
        for i, req in enumerate(bad_requests):
            ledger.add(kind, faults_injected=1)
            try:
                raw.send(req)
                reply = msgpack.unpackb(
                    raw.recv(), max_bin_len=1 << 20, max_str_len=1 << 16, max_array_len=1024, max_map_len=64
                )
            except zmq.ZMQError as e:
                ledger.add(kind, crashes=1)
                ledger.problem(kind, f"bad request {i}: the peer did not answer ({e})")
                break
            if isinstance(reply, dict) and "error" in reply:
                ledger.add(kind, faults_detected=1)
            else:
                ledger.problem(kind, f"bad request {i} was not refused: {reply!r:.100}")
    finally:
        raw.close(0)
    if not peer.alive():
        ledger.add(kind, crashes=1)
        ledger.problem(kind, "the prefill peer died on garbage requests")
        return
    store = make_store(world, True, host=16 << 20)
    try:
        out = restore(world, store, hashes, 60, source=lambda: client.fetch("127.0.0.1", peer.port, hashes))
        if not out.ok:
            ledger.problem(kind, f"the prefill peer stopped serving after garbage requests: {out.error}")
        else:
            wrong, _ = Expect(world, True).check(hashes, 0, out.k, out.v)
            ledger.add(kind, wrong_kv_served=wrong)
    finally:
        close_store(store)


# ====================================================================================================== calibration
def scenario_calibration(world: World, ledger: Ledger) -> None:
    """A calibration replaced or mismatched under a running store: another calibration's blobs on disk (restart with
    a new calibration, and a forged index record claiming ours), calibration files replaced underneath a running
    store, and a peer that sends blobs of another calibration."""
    kind = "calibration"
    other = make_calibration(world.seed + 1)
    d = world.fresh_dir("cal")
    cal_path = world.fresh_dir("cal-files")
    world.cal.save(cal_path)
    store_b = store = None
    try:
        # a store loaded from files that are then replaced under it: it keeps serving what it holds
        store = KvtcStore(
            Calibration.load(cal_path), tier_config(True, 0, 64 << 20, d), block_size=BS, span_tokens=SPAN
        )
        expect = Expect(world, True)
        committed: dict[str, tuple[list[int], int]] = {}
        for s in range(3):
            _, res = offload(world, store, world.tokens(("cal", s), (5 + s) * BS))
            committed.update(_committed(store, res.blobs))
        tmp = world.fresh_dir("cal-other")
        other.save(tmp)
        shutil.copyfile(tmp / "tensors.safetensors", cal_path / "tensors.safetensors")  # tensors of another model
        ledger.add(kind, faults_injected=1)
        ledger.detail(kind, tensors_replaced_under_running_store=1)
        check_blobs(ledger, kind, world, store, expect, committed, set())  # the running store is unaffected
        try:
            Calibration.load(cal_path)
            ledger.problem(kind, "a calibration with replaced tensors loaded without complaint")
        except CalibrationError:
            ledger.add(kind, faults_detected=1)
        close_store(store)
        store = None
        # the whole calibration replaced: the restarted store must not serve the old blobs
        shutil.rmtree(cal_path)
        shutil.copytree(tmp, cal_path)
        store_b = KvtcStore(
            Calibration.load(cal_path), tier_config(True, 0, 64 << 20, d), block_size=BS, span_tokens=SPAN
        )
        ledger.add(kind, faults_injected=1)
        ledger.detail(kind, calibration_replaced_then_restart=1)
        served = sum(store_b.match(h) for h, _ in committed.values())
        if served:
            ledger.problem(kind, f"{served} blocks of another calibration offered after a restart")
        else:
            ledger.add(kind, faults_detected=1, recomputes=len(committed))
        ledger.detail(kind, foreign_blobs_not_adopted=store_b.stats["disk_foreign_blobs"])
        close_store(store_b)
        store_b = None
        # a forged index record: a blob of calibration A whose disk metadata claims calibration B
        target = sorted(committed)[0]
        path = d / f"{target}.kvtc"
        data = path.read_bytes()
        mlen = struct.unpack_from("<I", data, 8)[0]
        m = msgpack.unpackb(data[16 : 16 + mlen], raw=False, max_bin_len=0, max_array_len=1 << 20, max_map_len=64)
        m["meta"]["cal"] = other.id
        mb = msgpack.packb(m, use_bin_type=True)
        path.write_bytes(struct.pack("<8sII", b"KVTCD001", len(mb), zlib.crc32(mb)) + mb + data[16 + mlen :])
        store_b = KvtcStore(other, tier_config(True, 0, 64 << 20, d), block_size=BS, span_tokens=SPAN)
        ledger.add(kind, faults_injected=1)
        ledger.detail(kind, forged_index_record=1)
        out = restore(world, store_b, committed[target][0])
        if out.ok:
            ledger.add(kind, wrong_kv_served=len(committed[target][0]))
            ledger.problem(kind, "a blob of another calibration was decoded and served")
        elif isinstance(out.error, DecodeError):
            ledger.add(kind, faults_detected=1, recomputes=1)
        else:
            ledger.problem(kind, f"forged record refused, but not by the decoder: {out.error}")
            ledger.add(kind, faults_detected=1, recomputes=1)
        # a peer of another calibration: its blobs arrive through the transfer path and must be refused
        store_a = make_store(world, True, host=16 << 20)
        try:
            toks = world.tokens(("cal", "peer"), 6 * BS)
            hashes, _ = offload(world, store_a, toks)
            ledger.add(kind, faults_injected=1)
            ledger.detail(kind, peer_with_other_calibration=1)
            out = restore(world, store_b, hashes, source=lambda: store_a.export(hashes))
            if out.ok:
                ledger.add(kind, wrong_kv_served=len(hashes))
                ledger.problem(kind, "a peer's blob of another calibration was served")
            else:
                ledger.add(kind, faults_detected=int(isinstance(out.error, DecodeError)), recomputes=1)
        finally:
            close_store(store_a)
    finally:
        for s in (store, store_b):
            if s is not None:
                close_store(s)
        shutil.rmtree(d, ignore_errors=True)


# ====================================================================================================== memory
def scenario_host_alloc(world: World, ledger: Ledger, rlimit_ops: int, headroom_mb: int = 16) -> None:
    """Host-tier memory: an arena that cannot be allocated must be a clean KvtcError at start; and a store running
    with almost no address space left (RLIMIT_AS in a child process) must turn every allocation failure into a miss
    or a skipped offload, never a crash or a wrong block."""
    kind = "host_alloc"
    ledger.add(kind, faults_injected=1)
    try:
        s = make_store(world, True, host=1 << 50)
        close_store(s)
        ledger.problem(kind, "a 1 PiB host tier was created")
    except KvtcError as e:
        ledger.add(kind, faults_detected=1)
        ledger.detail(kind, arena_error=str(e)[:120])
    except Exception as e:
        ledger.add(kind, crashes=1)
        ledger.problem(kind, f"{type(e).__name__} escaped creating an impossible host tier: {e}")
    if rlimit_ops <= 0:
        return
    verdict = world.fresh_dir("rlimit").with_suffix(".json")
    proc = subprocess.run(
        _child_cmd(
            "rlimit",
            workdir=str(world.workdir),
            seed=world.seed,
            ops=rlimit_ops,
            verdict=str(verdict),
            headroom_mb=headroom_mb,
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    if proc.returncode != 0 or not verdict.exists():
        ledger.add(kind, crashes=1)
        ledger.problem(kind, f"the RLIMIT_AS child exited {proc.returncode}: {proc.stderr[-400:]}")
        return
    v = json.loads(verdict.read_text())
    verdict.unlink()
    ledger.add(kind, **{k: v[k] for k in KEYS})
    ledger.detail(kind, **v["details"])
    for p in v["problems"]:
        ledger.problem(kind, p)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _vm_size() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _child_rlimit(world: World, args: dict) -> None:
    """Offload/onboard cycles of growing size with the address space capped just above what is in use: the store's
    own allocations (encode buffers, host-tier copies, decode tensors) fail part of the time."""
    import resource

    kind = "host_alloc"
    ledger = Ledger()
    store = make_store(world, True, host=64 << 20)
    for i in range(2):  # warm every code path (and the OpenMP thread teams of big ops) before the cap
        hashes, _ = offload(world, store, world.tokens(("rlimit-warm", i), 256 * BS))
        restore(world, store, hashes)
    store.host = type(store.host)(store.host.capacity, store.host.page, pinned=False)  # empty again
    work = []  # the harness's own tensors, made before the cap (plain random KV: lossless, compared bit for bit)
    for i in range(args["ops"]):
        toks = world.tokens(("rlimit", i), (128 << (i % 5)) * BS)  # 128 .. 2048 blocks: past the warm-up sizes
        hashes = sequence_hashes(toks, BS)
        g = torch.Generator().manual_seed(hashes[0] & 0xFFFFFFFF)
        shape = (world.L, len(toks), world.H, world.D)
        k = torch.randn(shape, generator=g).to(torch.bfloat16)
        v = torch.randn(shape, generator=g).to(torch.bfloat16)
        work.append((toks, hashes, k, v, Sink(world.L, len(hashes) * BS, world.H, world.D)))

    def wrong_blocks(n: int, k: torch.Tensor, v: torch.Tensor, sink: Sink) -> int:
        kk, vv = sink.k[:, : n * BS], sink.v[:, : n * BS]
        return sum(
            not (torch.equal(kk[:, b * BS : (b + 1) * BS], k[:, b * BS : (b + 1) * BS]))
            or not torch.equal(vv[:, b * BS : (b + 1) * BS], v[:, b * BS : (b + 1) * BS])
            for b in range(n)
        )

    headroom = args.get("headroom_mb", 12) << 20
    resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + headroom, resource.RLIM_INFINITY))
    c: Counter = Counter()
    for i, (toks, hashes, k, v, sink) in enumerate(work):
        try:
            res = store.submit_offload(hashes, toks, keys=k, values=v, tail=True).result(120)
            if res.skipped and res.skipped.startswith("error"):
                c["failed_offloads"] += 1
            n = store.match(hashes)
            if not n:
                c["nothing_stored"] += 1
                continue
            h = store.start_onboard(hashes[:n], sink=sink)
            if not h.wait(120):
                if h.error is None:
                    ledger.add(kind, crashes=1)
                    ledger.problem(kind, f"op {i}: restore hung")
                c["failed_restores"] += 1
                ledger.add(kind, recomputes=1)
                continue
            c["ok_restores"] += 1
            wrong = wrong_blocks(n, k, v, sink)
            if wrong:
                ledger.add(kind, wrong_kv_served=wrong)
                ledger.problem(kind, f"op {i}: {wrong} blocks wrong under memory pressure")
        except KvtcError:
            c["refused"] += 1
        except (MemoryError, RuntimeError) as e:  # raised in this thread: the harness or a store entry point
            c["raised_in_caller"] += 1
            ledger.detail(kind, rlimit_caller_error=f"{type(e).__name__}: {str(e)[:80]}")
    # tighter still: restores of what is stored (decode tensors and host-tier copies must fail cleanly)
    resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + (1 << 20), resource.RLIM_INFINITY))
    for _, hashes, k, v, sink in work:
        try:
            n = store.match(hashes)
            if not n:
                continue
            h = store.start_onboard(hashes[:n], sink=sink)
            if not h.wait(120):
                c["failed_restores_tight"] += 1
                ledger.add(kind, recomputes=1)
                if h.error is None:
                    ledger.add(kind, crashes=1)
                continue
            c["ok_restores_tight"] += 1
            ledger.add(kind, wrong_kv_served=wrong_blocks(n, k, v, sink))
        except KvtcError:
            c["refused"] += 1
        except (MemoryError, RuntimeError) as e:
            c["raised_in_caller"] += 1
            ledger.detail(kind, rlimit_caller_error=f"{type(e).__name__}: {str(e)[:80]}")
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    errors = {k: v for k, v in store.stats.items() if "error" in k}
    failures = sum(c[k] for k in ("failed_offloads", "failed_restores", "failed_restores_tight", "refused"))
    failures += c["raised_in_caller"]
    ledger.add(kind, faults_injected=failures, faults_detected=failures)
    counts = ledger.kinds.get(kind, Counter())
    out = {
        **{k: int(counts[k]) for k in KEYS},
        "details": {
            "rlimit_ops": args["ops"],
            "rlimit_headroom_mb": headroom >> 20,
            **{f"rlimit_{k}": v for k, v in c.items()},
            "rlimit_store_errors": json.dumps(errors),
            **ledger.details.get(kind, {}),
        },
        "problems": ledger.problems,
    }
    Path(args["verdict"]).write_text(json.dumps(out))
    close_store(store)


# ====================================================================================================== soak
async def _soak_client(world, store, expect, ledger, kind, cid, deadline, stats) -> None:
    rng = random.Random(f"{world.seed}/soak/{kind}/{cid}")
    system = world.tokens(("system", cid % 3), 3 * BS + 4)  # a few shared system prompts: shared prefixes
    conv = 0
    while time.monotonic() < deadline:
        conv += 1
        tokens = list(system)
        for turn in range(rng.randint(2, 5)):
            if time.monotonic() >= deadline:
                break
            tokens += world.tokens(("turn", cid, conv, turn), rng.randint(BS, 5 * BS))
            n_full = len(tokens) // BS
            hashes = sequence_hashes(tokens[: n_full * BS], BS)
            n = store.match(hashes)
            stats["turns"] += 1
            if n:
                sink = Sink(world.L, n * BS, world.H, world.D)
                try:
                    h = store.start_onboard(hashes[:n], sink=sink)
                    ok = await asyncio.wait_for(h.done(), 60)
                except asyncio.TimeoutError:
                    ledger.add(kind, crashes=1)
                    ledger.problem(kind, f"client {cid}: restore hung")
                    ok = False
                except KvtcError:
                    ok = False
                if ok:
                    stats["restores"] += 1
                    stats["blocks_restored"] += n
                    if expect.lossless:
                        wrong, _ = await asyncio.to_thread(expect.check, hashes[:n], 0, sink.k, sink.v)
                        if wrong:
                            ledger.add(kind, wrong_kv_served=wrong)
                            ledger.problem(kind, f"client {cid}: {wrong} blocks served wrong")
                    else:  # checked at the end, against every blob written for the block during the run
                        await asyncio.to_thread(expect.record, hashes[:n], sink.k, sink.v)
                else:
                    stats["restores_failed"] += 1
                    ledger.add(kind, recomputes=1)
            else:
                stats["misses"] += 1
            k, v = world.seq_kv(hashes)
            fut = store.submit_offload(hashes, tokens[: n_full * BS], keys=k, values=v, tail=True)
            res = await asyncio.wrap_future(fut)
            if res.skipped and res.skipped.startswith("error"):
                stats["offload_errors"] += 1
            await asyncio.to_thread(expect.snapshot, store, hashes)


def scenario_soak(world: World, ledger: Ledger, seconds: float, clients: int, lossless: bool) -> None:
    """Many concurrent clients doing multi-turn offload/onboard cycles for a bounded time, through host and disk
    tiers small enough to evict, demote and promote all the time. Every restored block must equal its reference;
    tier sizes and process memory must stay bounded."""
    kind = "soak_lossless" if lossless else "soak_lossy"
    d = world.fresh_dir("soak")
    store = make_store(
        world, lossless, host=(256 if lossless else 128) << 10, disk=(8 if lossless else 2) << 20, disk_dir=d
    )
    expect = Expect(world, lossless)
    stats: Counter = Counter()
    rss: list[tuple[float, int]] = []
    stop = threading.Event()
    bounds_ok = [True]

    def sample() -> None:
        t0 = time.monotonic()
        while not stop.wait(0.5):
            rss.append((time.monotonic() - t0, _rss()))
            if store.host.used_bytes > store.host.capacity or store.disk.used_bytes > store.disk.capacity:
                bounds_ok[0] = False

    async def main() -> None:
        deadline = time.monotonic() + seconds
        await asyncio.gather(
            *(_soak_client(world, store, expect, ledger, kind, c, deadline, stats) for c in range(clients))
        )

    ledger.add(kind)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        asyncio.run(main())
    finally:
        stop.set()
        sampler.join(2)
        snap = store.snapshot()
        with store._lock:  # blobs on disk the store no longer indexes (dropped while moving host -> disk)
            snap["disk_orphans"] = sum(1 for b in store.disk.ids() if b not in store._blobs)
        close_store(store)
        shutil.rmtree(d, ignore_errors=True)
    if not bounds_ok[0]:
        ledger.problem(kind, "a tier exceeded its capacity")
    if not lossless:
        wrong, unverified = expect.check_recorded()
        stats["distinct_blocks_served"] = len(expect.served)
        stats["blocks_unverified"] = unverified
        if wrong:
            ledger.add(kind, wrong_kv_served=wrong)
            ledger.problem(kind, f"{wrong} distinct served blocks match no blob written for them")
    early = [m for t, m in rss if t >= seconds * 0.25] or [m for _, m in rss] or [_rss()]
    growth = (max(early) - early[0]) / (1 << 20)
    ledger.detail(
        kind,
        seconds=seconds,
        clients=clients,
        **dict(stats),
        rss_mb_at_quarter=round(early[0] / (1 << 20), 1),
        rss_mb_peak=round(max(m for _, m in rss) / (1 << 20), 1) if rss else None,
        rss_growth_mb_after_quarter=round(growth, 1),
        rss_mb_by_tenth=[
            round(next((m for t, m in rss if t >= seconds * f / 10), rss[-1][1] if rss else 0) / (1 << 20))
            for f in range(1, 11)
        ],
        tiers_within_capacity=bounds_ok[0],
        host_evictions=snap.get("host_evictions", 0),
        disk_demotions=snap.get("disk_demotions", 0),
        disk_evictions=snap.get("disk_evictions", 0),
        onboard_disk_hits=snap.get("onboard_disk_hits", 0),
        disk_orphans=snap["disk_orphans"],
        store_errors=json.dumps({k: v for k, v in snap.items() if "error" in k}),
    )


# ====================================================================================================== command
@dataclass
class Plan:
    disk_rounds: int = 240
    host_rounds: int = 60
    enospc_fills: int = 4
    kills: int = 20
    nixl_rounds: int = 96
    transfer_rounds: int = 32
    rlimit_ops: int = 20
    soak_seconds: float = 60.0
    clients: int = 8
    kinds: tuple[str, ...] = KINDS
    extra: dict = field(default_factory=dict)

    @classmethod
    def quick(cls) -> Plan:
        return cls(
            disk_rounds=12,
            host_rounds=4,
            enospc_fills=1,
            kills=2,
            nixl_rounds=24,
            transfer_rounds=8,
            rlimit_ops=6,
            soak_seconds=6.0,
            clients=4,
        )


def run_chaos(world: World, plan: Plan, ledger: Ledger | None = None) -> Ledger:
    ledger = ledger or Ledger()
    steps: list[tuple[str, Callable[[], None]]] = [
        ("disk_files", lambda: scenario_disk_files(world, ledger, plan.disk_rounds)),
        ("bitflip_host", lambda: scenario_host_flips(world, ledger, plan.host_rounds)),
        ("enospc", lambda: scenario_enospc(world, ledger, plan.enospc_fills)),
        ("kill9_write", lambda: scenario_kill9(world, ledger, plan.kills)),
        ("nixl_disk", lambda: scenario_nixl_disk(world, ledger, plan.nixl_rounds)),
        ("nixl_transfer", lambda: scenario_transfer(world, ledger, plan.transfer_rounds)),
        ("calibration", lambda: scenario_calibration(world, ledger)),
        ("host_alloc", lambda: scenario_host_alloc(world, ledger, plan.rlimit_ops)),
        ("soak_lossless", lambda: scenario_soak(world, ledger, plan.soak_seconds, plan.clients, True)),
        ("soak_lossy", lambda: scenario_soak(world, ledger, plan.soak_seconds, plan.clients, False)),
    ]
    wanted = set(plan.kinds)
    for name, fn in steps:
        covers = (
            set(FILE_OPS)
            if name == "disk_files"
            else ({name, "transfer_malformed"} if name == "nixl_transfer" else {name})
        )
        if not covers & wanted:
            continue
        log.info("chaos: %s", name)
        with ledger.timed(name):
            try:
                fn()
            except Exception as e:  # a scenario that blows up is a crash of the thing under test or of the harness
                ledger.add(name if name in KINDS else "bitflip_disk", crashes=1)
                ledger.problem(name, f"scenario aborted: {type(e).__name__}: {e}")
                log.exception("chaos scenario %s aborted", name)
    return ledger


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="the CI-sized run (about a minute on 2 cores)")
    p.add_argument("--duration", type=float, default=None, help="seconds of soak per mode (lossless, lossy)")
    p.add_argument("--clients", type=int, default=None, help="concurrent soak clients")
    p.add_argument("--rounds", type=int, default=None, help="disk-file fault rounds (others scale with it)")
    p.add_argument("--kills", type=int, default=None, help="kill -9 restarts of a writing process")
    p.add_argument("--kinds", default=None, help="comma-separated subset of: " + ",".join(KINDS))
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one, removed after)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_path", help="write the counts (per kind and in total) as JSON")


def plan_from_args(args: argparse.Namespace) -> Plan:
    plan = Plan.quick() if args.quick else Plan()
    if args.rounds is not None:
        f = args.rounds / plan.disk_rounds
        plan.disk_rounds = args.rounds
        plan.host_rounds = max(1, int(plan.host_rounds * f))
        plan.nixl_rounds = max(12, int(plan.nixl_rounds * f))
        plan.transfer_rounds = max(8, int(plan.transfer_rounds * f))
    if args.kills is not None:
        plan.kills = args.kills
    if args.duration is not None:
        plan.soak_seconds = args.duration
    if args.clients is not None:
        plan.clients = args.clients
    if args.kinds:
        kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
        bad = set(kinds) - set(KINDS)
        if bad:
            raise SystemExit(f"unknown fault kinds {sorted(bad)}; choose from {', '.join(KINDS)}")
        plan.kinds = kinds
    return plan


def _table(report: dict[str, Any]) -> str:
    head = ["kind", "injected", "detected", "wrong KV", "lost blocks", "crashes", "recomputes"]
    rows = [(k, *(v[c] for c in KEYS)) for k, v in report["kinds"].items()]
    rows.append(("total", *(report["total"][c] for c in KEYS)))
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{widths[0]}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*r) for r in [head, *rows])


def run_bench_chaos(args: argparse.Namespace) -> int:
    from .common import machine, write_json

    plan = plan_from_args(args)
    if not getattr(args, "verbose", False):  # the tiers log every fault they absorb: thousands of expected warnings
        for name in ("dynamo_kvtc.tiers", "dynamo_kvtc.codec", "dynamo_kvtc.connector", "nixl"):
            logging.getLogger(name).setLevel(logging.ERROR)
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # child processes
    t0 = time.perf_counter()
    own = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="kvtc-chaos-")) if own else Path(args.workdir)
    try:
        world = World(workdir, seed=args.seed)
        ledger = run_chaos(world, plan)
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
    report = ledger.report()
    out = {
        "command": "dynamo-kvtc bench chaos "
        + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "chaos"] else sys.argv[1:]),
        "machine": machine(),
        "plan": {k: v for k, v in plan.__dict__.items() if k != "extra"},
        "seconds": round(time.perf_counter() - t0, 1),
        **report,
    }
    print(_table(report))
    for p in report["problems"][:20]:
        print("problem:", p)
    print(f"{out['seconds']} s")
    write_json(args.json_path, out)
    t = report["total"]
    return 0 if t["wrong_kv_served"] == 0 and t["committed_blocks_lost"] == 0 and t["crashes"] == 0 else 1


def _child_main(role: str, raw: str) -> None:
    args = json.loads(raw)
    logging.basicConfig(level=logging.ERROR)
    world = World(args["workdir"], seed=args["seed"])
    {"kill9": _child_kill9, "server": _child_server, "rlimit": _child_rlimit}[role](world, args)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["_child"]:
        _child_main(argv[1], argv[2])
        return 0
    p = argparse.ArgumentParser(prog="dynamo-kvtc bench chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("-v", "--verbose", action="store_true", help="log every fault the tiers report")
    add_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    return run_bench_chaos(args)


if __name__ == "__main__":
    sys.exit(main())

"""The chaos world: a synthetic model, its calibration and KV, stores built on it, and the reference every
restore is checked against (``Expect``)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import threading
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..calibration.artifact import Calibration
from ..codec.kvtc import KvtcCodec
from ..errors import KvtcError
from ..tiers import KvtcStore, TierConfig
from ..tiers.keys import sequence_hashes
from .ledger import Ledger

BS = 16
SHAPE = (4, 2, 16)  # layers, kv heads, head_dim of the synthetic model
RATIO = 8.0
LOSSLESS_WINDOW = 1 << 20  # a window this large keeps every blob raw: restores are bit-exact
LOSSY_WINDOW = 32
SPAN = 128


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
        **{"disk_min_uses": 1, **kw},  # the disk faults need every eviction on disk
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
            runs, _ = store.export(list(hashes[:n]))
        except KvtcError:  # a blob left the tiers meanwhile: take the others one block at a time
            runs = []
            for h in hashes[:n]:
                with contextlib.suppress(KvtcError):
                    runs.extend(store.export([h])[0])
        seen = set()
        for r in runs:
            key = (r.meta.id, zlib.crc32(r.blob.host()))
            if key not in seen:
                seen.add(key)
                self.add_blob(r.blob.host(), r.meta.hashes)

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


def committed_blobs(store: KvtcStore, blob_ids: Sequence[str]) -> dict[str, tuple[list[int], int]]:
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


def account_faulted_restore(
    ledger: Any, kind: str, label: str, out: Outcome, expect: Expect, hashes: Sequence[int], first: int = 0
) -> None:
    """Count one restore made while a fault was armed: served blocks are checked against the reference (wrong ones
    are ``wrong_kv_served``), a clean failure is a detected fault and a recompute, anything else a crash."""
    if out.ok:
        wrong, _ = expect.check(hashes, first, out.k, out.v)
        ledger.add(kind, wrong_kv_served=wrong)
        if wrong:
            ledger.problem(kind, f"{label}: {wrong} blocks served wrong")
        ledger.detail(kind, **{f"{label}:served_ok": 1})
        return
    ledger.add(kind, faults_detected=1, recomputes=1)
    if out.status != "failed":
        ledger.add(kind, crashes=1)
        ledger.problem(kind, f"{label}: restore {out.status}: {out.error}")

"""Disk-tier faults: blob files flipped, truncated or swapped on disk, and ENOSPC on a small tmpfs."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import struct
import subprocess
from pathlib import Path

from .ledger import Ledger
from .testbed import BS, Expect, World, check_blobs, close_store, committed_blobs, make_store, offload, restore

log = logging.getLogger(__name__)


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
                new = committed_blobs(store, res.blobs)
                for bid, (hashes, _) in new.items():
                    expect.add_blob(store.disk.copy(bid), hashes)
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
                    before = store.stats.tier("disk").write_errors["TierFullError"]
                    hashes, res = offload(world, store, toks)
                    new = committed_blobs(store, res.blobs)
                    for bid, (h, _) in new.items():
                        expect.add_blob(store.disk.copy(bid), h)
                    committed.update(new)
                    if store.stats.tier("disk").write_errors["TierFullError"] > before:
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

"""Host-memory faults: bit flips in the host arena, an impossible arena size, and ``RLIMIT_AS`` in a child."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess
from collections import Counter
from pathlib import Path

import torch

from ..errors import KvtcError
from ..tiers.keys import sequence_hashes
from .ledger import KEYS, Ledger
from .process import child_cmd
from .testbed import BS, Expect, Sink, World, close_store, make_store, offload, restore


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
                    meta = store.index.meta(bid)
                    if meta is not None:
                        blobs[bid] = (list(meta.hashes), meta.first_position // BS)
            target = rng.choice(sorted(blobs))
            extents = store.host.extents(target)  # (arena offset, length) of each piece of the blob
            off = rng.randrange(sum(n for _, n in extents))
            left = off
            for start, n in extents:
                if left < n:
                    at = start + left
                    break
                left -= n
            store.host.arena[at] ^= 1 << rng.randrange(8)
            hlen = struct.unpack_from("<I", store.host.copy(target), 8)[0]
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
        child_cmd(
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


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _vm_size() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def child_rlimit(world: World, args: dict) -> None:
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
    errors = {k: v for k, v in store.stats.as_dict().items() if "error" in k and v}
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

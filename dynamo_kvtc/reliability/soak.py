"""Soak: concurrent clients offloading and restoring against one store for a while, with tiers under pressure."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import threading
import time
from collections import Counter

from ..errors import KvtcError
from ..tiers.keys import sequence_hashes
from .ledger import Ledger
from .memory_faults import rss_bytes
from .testbed import BS, Expect, Sink, World, close_store, make_store


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
            rss.append((time.monotonic() - t0, rss_bytes()))
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
        indexed = store.index.blob_ids()  # disk blobs the store no longer indexes (dropped while moving host -> disk)
        snap["disk_orphans"] = sum(1 for b in store.disk.ids() if b not in indexed)
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
    early = [m for t, m in rss if t >= seconds * 0.25] or [m for _, m in rss] or [rss_bytes()]
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
        store_errors=json.dumps({k: v for k, v in snap.items() if "error" in k and v}),
    )

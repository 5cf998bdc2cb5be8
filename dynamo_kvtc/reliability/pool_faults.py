"""Faults of the cluster-wide pool (the ``pool`` tier on Mooncake Store): what a late, killed or stopped master, a
worker that leaves with its memory, a corrupted or forged object and a full pool cost. All against the real code: a
real ``mooncake_master`` on loopback (:class:`~dynamo_kvtc.tiers.mooncake_master.MooncakeMaster`), real stores with
the pool tier, real signals (SIGKILL, SIGSTOP). Two workers: ``a`` writes a conversation through to the pool, ``b``
(which never saw it) restores it from there; every block ``b`` is served is checked bit for bit (lossless stores).

- ``pool_master_late``: the stores start before the master exists. They serve from their own tiers meanwhile (a
  lookup of another worker's conversation is a miss, at once); the tier connects once the master appears
  (``connect_s``) and the pool then works.
- ``pool_master_killed``: the master is SIGKILLed mid-run and restarted on the same ports: restores from the pool
  are misses meanwhile (recomputes), saves still land in host memory, and both tiers reconnect (``reconnect_s``).
  The first lookup after the kill must return within ``pool_timeout_s`` + 100 ms (``first_lookup_ms``), and no
  thread of the process may stop longer than that from the kill to the restart (``worst_stall_ms``, a
  :class:`Ticker`: Mooncake's binding holds the GIL in some calls, where a deadline on a future cannot help).
- ``pool_worker_leaves``: the only worker contributing memory writes, then closes its client: its segment's objects
  vanish, so every restore of them is a miss.
- ``pool_corrupt`` / ``pool_forged``: an object bit-flipped in place, and objects sealed under another secret (a
  blob under a genuine locator; locators for conversations never stored): refused, never served.
- ``pool_full``: a pool of a few MiB written far past its size: Mooncake evicts or refuses; every restore is exact
  or a miss (``evicted``, ``put_failed`` counted).
- ``pool_slow``: the master SIGSTOPped: lookups and restores give up at ``pool_timeout_s`` (a miss; ``worst_ms``)
  and the pool serves again once it is continued.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..tiers.mooncake_master import MooncakeMaster
from .ledger import Ledger
from .testbed import BS, Expect, World, account_faulted_restore, close_store, make_store, offload, restore

SECRET = b"chaos pool cluster secret, 32+ bytes"
TIMEOUT_S = 1.0  # pool_timeout_s of the chaos stores
WAIT_S = 120.0  # bound on a (re)connect: Mooncake's setup retries an absent master for ~80 s
SEQ_BLOCKS = 8
FULL_BLOCKS = 64  # 1,024 tokens, 512 KiB raw: 32 of them fill a 16 MiB segment
SLACK_S = 0.1  # a lookup's bound past pool_timeout_s


class Ticker:
    """A thread that ticks every 5 ms while in its ``with`` block: :attr:`worst` is the longest gap between ticks,
    the longest time every Python thread of the process was stopped (an engine's scheduler thread is one of them)."""

    def __init__(self) -> None:
        self.last, self.worst, self._stop = time.monotonic(), 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-ticker", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.monotonic()
            self.worst, self.last = max(self.worst, now - self.last), now
            time.sleep(0.005)

    def __enter__(self) -> Ticker:
        self.last = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.worst = max(self.worst, time.monotonic() - self.last)


def _store(world: World, m: MooncakeMaster, segment_gb: float = 1 / 64, wait: bool = True, **kw: Any):
    store = make_store(world, True, host=64 << 20, pool_master=m.master, pool_metadata_server=m.metadata_server,
                       pool_secret=kw.pop("secret", SECRET), pool_segment_gb=segment_gb, pool_timeout_s=TIMEOUT_S,
                       **kw)  # fmt: skip
    if wait and not _pool(store).wait_idle(WAIT_S):
        close_store(store)
        raise TimeoutError("the pool tier did not connect")
    return store


def _pool(store):
    return store.placement.tier("pool")


def _write(world: World, store, tag: Any, n: int = SEQ_BLOCKS) -> list[int]:
    hashes, _ = offload(world, store, world.tokens(tag, n * BS))
    _pool(store).wait_idle(WAIT_S)
    return hashes


def _from_pool(ledger: Ledger, kind: str, world: World, store, hashes: Sequence[int], label: str, fault: bool) -> bool:
    """Restore ``hashes`` through ``store`` (which finds them in the pool or not); True when served exactly. Under a
    fault a miss is a detected fault and a recompute; without one a miss is a problem (the pool should serve)."""
    expect = Expect(world, True)
    t = time.perf_counter()
    n = store.match(list(hashes))
    if n < len(hashes):
        out = None
    else:
        out = restore(world, store, hashes, WAIT_S)
    took = time.perf_counter() - t
    ledger.detail(kind, worst_ms=0)
    d = ledger.details[kind]
    d["worst_ms"] = max(d["worst_ms"], round(1e3 * took))
    if took > 2 * TIMEOUT_S + 2:  # a lookup and a restore: two reads, each bounded by pool_timeout_s
        ledger.detail(kind, over_deadline=1)
        ledger.problem(kind, f"{label}: the lookup and restore took {took:.1f} s (pool_timeout_s {TIMEOUT_S} s)")
    if fault:
        ledger.add(kind, faults_injected=1)
        if out is None:
            ledger.add(kind, faults_detected=1, recomputes=1)
            ledger.detail(kind, misses=1)
            return False
        account_faulted_restore(ledger, kind, label, out, expect, hashes)
        return out.ok
    if out is None or not out.ok:
        ledger.problem(kind, f"{label}: the pool did not serve without a fault ({n}/{len(hashes)} found)")
        ledger.add(kind, recomputes=1)
        return False
    wrong, _ = expect.check(hashes, 0, out.k, out.v)
    ledger.add(kind, wrong_kv_served=wrong)
    if wrong:
        ledger.problem(kind, f"{label}: {wrong} blocks served wrong")
    return not wrong


def _own_tiers(ledger: Ledger, kind: str, world: World, store, tag: Any) -> None:
    """A save and a restore on the worker's own tiers while the pool is down: the engine serves."""
    hashes, _ = offload(world, store, world.tokens(tag, SEQ_BLOCKS * BS))
    out = restore(world, store, hashes, WAIT_S)
    if not out.ok or Expect(world, True).check(hashes, 0, out.k, out.v)[0]:
        ledger.problem(kind, f"{tag}: the worker's own tiers did not serve while the pool was down: {out.error}")
        ledger.add(kind, crashes=int(out.status in ("hang", "escaped")))
    ledger.detail(kind, own_tier_restores=1)


def _wait_connected(stores: Sequence, probe: list[int]) -> float:
    """Seconds until every store's pool is connected (lookups make a connected client notice a lost master)."""
    t, deadline = time.perf_counter(), time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if all(_pool(s).connected for s in stores):
            return time.perf_counter() - t
        for s in stores:
            s.match(probe)
        time.sleep(0.2)
    raise TimeoutError("the pool tier did not reconnect")


def _closing(*stores) -> None:
    for s in stores:
        close_store(s)


# ====================================================================================================== the master
def scenario_master_late(world: World, ledger: Ledger, rounds: int) -> None:
    kind = "pool_master_late"
    m = MooncakeMaster()
    try:
        a = _store(world, m, wait=False)
        b = _store(world, m, wait=False)
        try:
            t = time.perf_counter()
            _from_pool(ledger, kind, world, b, world_hashes(world, ("late-never", 0)), "before the master", True)
            ledger.detail(kind, miss_ms=round(1e3 * (time.perf_counter() - t)))
            _own_tiers(ledger, kind, world, a, ("late-own", 0))
            m.start()
            ledger.detail(kind, connect_s=round(_wait_connected([a, b], [1]), 1))
            for r in range(rounds):
                hashes = _write(world, a, ("late", r))
                _from_pool(ledger, kind, world, b, hashes, f"round {r} after the master appeared", False)
        finally:
            _closing(a, b)
    finally:
        m.stop()


def world_hashes(world: World, tag: Any, n: int = SEQ_BLOCKS) -> list[int]:
    from ..tiers.keys import sequence_hashes

    return sequence_hashes(world.tokens(tag, n * BS), BS)


def scenario_master_killed(world: World, ledger: Ledger, rounds: int) -> None:
    kind = "pool_master_killed"
    m = MooncakeMaster().start()
    try:
        a, b = _store(world, m), _store(world, m)
        try:
            for r in range(rounds):
                hashes = _write(world, a, ("killed", r))
                with Ticker() as tick:
                    m.stop()  # SIGKILL: the master's objects are gone with it
                    t = time.perf_counter()
                    first = b.match(world_hashes(world, ("killed-first", r)))  # the first lookup: another worker's
                    took = time.perf_counter() - t
                    _from_pool(ledger, kind, world, b, hashes, f"round {r} master dead", True)
                    _own_tiers(ledger, kind, world, a, ("killed-own", r))
                d = ledger.details.setdefault(kind, {})
                d["first_lookup_ms"] = max(d.get("first_lookup_ms", 0), round(1e3 * took))
                d["worst_stall_ms"] = max(d.get("worst_stall_ms", 0), round(1e3 * tick.worst))
                if first or took > TIMEOUT_S + SLACK_S or tick.worst > TIMEOUT_S + SLACK_S:
                    ledger.problem(kind, f"round {r}: the first lookup after the kill took {took:.2f} s and found "
                                   f"{first} blocks; threads stopped for up to {tick.worst:.2f} s")  # fmt: skip
                m.start()
                ledger.detail(kind, reconnect_s=round(_wait_connected([a, b], hashes), 1))
                after = _write(world, a, ("killed-after", r))
                _from_pool(ledger, kind, world, b, after, f"round {r} master back", False)
        finally:
            _closing(a, b)
    finally:
        m.stop()


def scenario_master_slow(world: World, ledger: Ledger, rounds: int) -> None:
    kind = "pool_slow"
    m = MooncakeMaster().start()
    try:
        a, b = _store(world, m), _store(world, m, segment_gb=0)
        try:
            for r in range(rounds):
                hashes = _write(world, a, ("slow", r))
                os.killpg(m.proc.pid, signal.SIGSTOP)
                time.sleep(0.2)
                try:
                    _from_pool(ledger, kind, world, b, hashes, f"round {r} master stopped", True)
                finally:
                    os.killpg(m.proc.pid, signal.SIGCONT)
                _wait_connected([a, b], hashes)
                _from_pool(ledger, kind, world, b, _write(world, a, ("slow-after", r)), f"round {r} continued", False)
            ledger.detail(kind, timeouts=_pool(b).counts["timeout"])
        finally:
            _closing(a, b)
    finally:
        m.stop()


# ====================================================================================================== the objects
def scenario_worker_leaves(world: World, ledger: Ledger, rounds: int) -> None:
    kind = "pool_worker_leaves"
    m = MooncakeMaster().start()
    try:
        b = _store(world, m, segment_gb=0)  # contributes nothing: every object lives in the leaving worker's segment
        try:
            for r in range(rounds):
                w = _store(world, m)
                try:
                    hashes = _write(world, w, ("leaves", r))
                    _from_pool(ledger, kind, world, b, hashes, f"round {r} before it left", False)
                    fresh = _write(world, w, ("leaves-unread", r))
                finally:
                    close_store(w)
                _from_pool(ledger, kind, world, b, fresh, f"round {r} after it left", True)
        finally:
            close_store(b)
    finally:
        m.stop()


def scenario_corrupt(world: World, ledger: Ledger, rounds: int, forged: bool) -> None:
    from ..tiers.seal import Sealer, associated

    kind = "pool_forged" if forged else "pool_corrupt"
    m = MooncakeMaster().start()
    try:
        a, b = _store(world, m), _store(world, m)
        other = Sealer(b"another cluster's secret, not ours!!")
        try:
            for r in range(rounds):
                hashes = _write(world, a, (kind, r))
                pa = _pool(a)
                (bid,) = [i for i in a.index.blob_ids() if a.index.meta(i).hashes[0] == hashes[0]] or [None]
                key = pa.object_key(bid)
                obj = pa._client.get(key)
                parts = pa.parts(bid)
                if forged:  # well-formed parts of the right lengths, sealed for these very keys under another secret
                    aad, n = associated("blob", pa.cal, pa.salt, hashes), len(parts.plain)
                    plain = b"".join(pa.sealer.open_part(obj[s0 : s0 + sn], aad, k, n)
                                     for k, (s0, sn, _, _) in enumerate(parts.spans()))  # fmt: skip
                    new, _ = other.seal_parts(plain, parts.plain, aad)
                else:
                    new = bytearray(obj)
                    new[len(new) // 2] ^= 1
                assert pa._client.remove(key, True) == 0 and pa._client.put(key, bytes(new)) == 0
                refused = _pool(b).counts["refused"]
                _from_pool(ledger, kind, world, b, hashes, f"round {r} blob", True)
                if forged:  # a locator for a conversation nobody stored, sealed under another secret
                    planted = world_hashes(world, ("planted", r))
                    meta = dict(a.index.meta(bid).to_dict(), hashes=planted)
                    from ..transport.channel import pack

                    loc = pack({"meta": meta, "parts": parts.record()})
                    rec = other.seal(loc, associated("meta", pa.cal, pa.salt, planted[:1]))
                    assert pa._client.put(pa._at(planted[0]), rec) == 0
                    _from_pool(ledger, kind, world, b, planted, f"round {r} locator", True)
                ledger.detail(kind, refused=_pool(b).counts["refused"] - refused)
        finally:
            _closing(a, b)
    finally:
        m.stop()


def scenario_full(world: World, ledger: Ledger, rounds: int) -> None:
    kind = "pool_full"
    m = MooncakeMaster().start()
    try:
        a, b = _store(world, m), _store(world, m, segment_gb=0)  # the pool: a's 16 MiB segment
        try:
            written = [_write(world, a, ("full", i), FULL_BLOCKS) for i in range(rounds)]
            ledger.detail(kind, written_mib=round(_pool(a).used_bytes / (1 << 20), 1), segment_mib=16)
            served = 0
            for i, hashes in enumerate(written):
                served += _from_pool(ledger, kind, world, b, hashes, f"conversation {i}", True)
            ledger.detail(kind, served=served, evicted=len(written) - served, put_failed=_pool(a).counts["put_failed"],
                          put=_pool(a).counts["put"])  # fmt: skip
            if served == len(written):
                ledger.problem(kind, "the pool never filled (every conversation served)")
        finally:
            _closing(a, b)
    finally:
        m.stop()

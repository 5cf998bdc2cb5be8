"""NIXL failures injected by :class:`FaultyAgent`, a wrapper around the real agent, on the disk tier's reads and
writes."""

from __future__ import annotations

import ctypes
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

from .ledger import Ledger
from .testbed import (
    BS,
    Expect,
    World,
    account_faulted_restore,
    check_blobs,
    close_store,
    committed_blobs,
    make_store,
    offload,
    restore,
)


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
            committed.update(committed_blobs(store, res.blobs))
        for r in range(rounds):
            mode = modes[r % len(modes)]
            op = ops[(r // len(modes)) % len(ops)]
            ledger.detail(kind, **{f"{op}:{mode}": 1})
            if op == "WRITE":
                before = sum(store.stats.tier("disk").write_errors.values())
                agent.arm(mode, None if mode == "descs_none" else "WRITE")
                hashes, res = offload(world, store, world.tokens(("nixl", r), rng.randint(4, 12) * BS))
                agent.disarm()
                ledger.add(kind, faults_injected=1)
                refused = sum(store.stats.tier("disk").write_errors.values()) > before
                new = committed_blobs(store, res.blobs)
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
                account_faulted_restore(ledger, kind, f"{op}:{mode}", out, expect, hashes, first)
                # the fault is gone: the committed blob must come back exactly
                if check_blobs(ledger, kind, world, store, expect, {target: committed[target]}, set())[target] != "ok":
                    committed.pop(target)
        ledger.detail(kind, quarantined_bytes=store.disk.io.quarantined_bytes)
        check_blobs(ledger, kind, world, store, expect, committed, set())
    finally:
        close_store(store)
        shutil.rmtree(d, ignore_errors=True)

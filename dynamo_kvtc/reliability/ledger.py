"""Counts of a chaos run: per fault kind, the six outcome counters (``KEYS``), details and problems."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

log = logging.getLogger(__name__)


KEYS = ("faults_injected", "faults_detected", "wrong_kv_served", "committed_blocks_lost", "crashes", "recomputes")

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
    "transfer_auth",
    "tenant_keys",
    "calibration",
    "host_alloc",
    "soak_lossless",
    "soak_lossy",
    "offload_queue",
    "restore_cancel",
    "slow_restore",
    "hostile_params",
    "poisoning_peer",
    "slow_peer",
    "metadata_holder",
    "multipart_flood",
    "dead_peer_stall",
    "cancel_timeout",
    "pool_master_late",
    "pool_master_killed",
    "pool_worker_leaves",
    "pool_corrupt",
    "pool_forged",
    "pool_full",
    "pool_slow",
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

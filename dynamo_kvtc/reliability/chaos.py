"""The chaos run (``dynamo-kvtc bench chaos``): every fault scenario against the real tiers, and what happened.

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

The scenarios live beside this module (``disk_faults``, ``memory_faults``, ``process``, ``nixl_faults``,
``transfer_faults``, ``calibration_faults``, ``network_faults``, ``pool_faults``, ``soak``); ``world`` and
``ledger`` are what they share.
``python -m dynamo_kvtc.reliability`` runs the same command as ``dynamo-kvtc bench chaos``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..bench.output import machine, write_json
from .calibration_faults import scenario_calibration
from .disk_faults import FILE_OPS, scenario_disk_files, scenario_enospc
from .ledger import KEYS, KINDS, Ledger
from .memory_faults import child_rlimit, scenario_host_alloc, scenario_host_flips
from .network_faults import (
    scenario_cancel_timeout,
    scenario_dead_peer_stall,
    scenario_metadata_holder,
    scenario_multipart_flood,
)
from .nixl_faults import scenario_nixl_disk
from .peer_faults import POISON_MODES, scenario_hostile_params, scenario_poisoning_peer, scenario_slow_peer
from .pool_faults import (
    scenario_corrupt,
    scenario_full,
    scenario_master_killed,
    scenario_master_late,
    scenario_master_slow,
    scenario_worker_leaves,
)
from .process import child_kill9, scenario_kill9
from .queue_faults import scenario_offload_queue, scenario_restore_cancel, scenario_slow_restore
from .soak import scenario_soak
from .tenant_faults import scenario_tenant_keys
from .testbed import World
from .transfer_faults import child_server, scenario_transfer, scenario_transfer_auth

log = logging.getLogger(__name__)


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
        ("transfer_auth", lambda: scenario_transfer_auth(world, ledger)),
        ("tenant_keys", lambda: scenario_tenant_keys(world, ledger)),
        ("calibration", lambda: scenario_calibration(world, ledger)),
        ("host_alloc", lambda: scenario_host_alloc(world, ledger, plan.rlimit_ops)),
        ("soak_lossless", lambda: scenario_soak(world, ledger, plan.soak_seconds, plan.clients, True)),
        ("soak_lossy", lambda: scenario_soak(world, ledger, plan.soak_seconds, plan.clients, False)),
        ("offload_queue", lambda: scenario_offload_queue(world, ledger, max(2, plan.host_rounds // 10))),
        ("restore_cancel", lambda: scenario_restore_cancel(world, ledger, max(4, plan.host_rounds))),
        ("slow_restore", lambda: scenario_slow_restore(world, ledger, max(2, plan.host_rounds // 4))),
        ("hostile_params", lambda: scenario_hostile_params(world, ledger, max(len(POISON_MODES), plan.rlimit_ops * 8))),
        ("poisoning_peer", lambda: scenario_poisoning_peer(world, ledger, max(4, plan.transfer_rounds // 2))),
        ("slow_peer", lambda: scenario_slow_peer(world, ledger, max(2, plan.transfer_rounds // 8))),
        ("metadata_holder", lambda: scenario_metadata_holder(world, ledger, max(2, plan.transfer_rounds // 4))),
        ("multipart_flood", lambda: scenario_multipart_flood(world, ledger, max(1, plan.transfer_rounds // 16))),
        ("dead_peer_stall", lambda: scenario_dead_peer_stall(world, ledger, max(1, plan.transfer_rounds // 8))),
        ("cancel_timeout", lambda: scenario_cancel_timeout(world, ledger, max(2, plan.host_rounds // 4))),
        ("pool_master_late", lambda: scenario_master_late(world, ledger, max(1, plan.host_rounds // 4))),
        ("pool_master_killed", lambda: scenario_master_killed(world, ledger, max(1, plan.kills // 2))),
        ("pool_worker_leaves", lambda: scenario_worker_leaves(world, ledger, max(2, plan.host_rounds // 2))),
        ("pool_corrupt", lambda: scenario_corrupt(world, ledger, max(2, plan.host_rounds // 2), False)),
        ("pool_forged", lambda: scenario_corrupt(world, ledger, max(2, plan.host_rounds // 2), True)),
        ("pool_full", lambda: scenario_full(world, ledger, 48 if plan.host_rounds < 20 else 96)),
        ("pool_slow", lambda: scenario_master_slow(world, ledger, max(2, plan.host_rounds // 2))),
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
    if args.kinds:  # a tuple of names from KINDS (the command line checks them)
        plan.kinds = tuple(args.kinds)
    return plan


def table(report: dict[str, Any]) -> str:
    head = ["kind", "injected", "detected", "wrong KV", "lost blocks", "crashes", "recomputes"]
    rows = [(k, *(v[c] for c in KEYS)) for k, v in report["kinds"].items()]
    rows.append(("total", *(report["total"][c] for c in KEYS)))
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    fmt = "  ".join(f"{{:<{widths[0]}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join(fmt.format(*r) for r in [head, *rows])


def run_bench_chaos(args: argparse.Namespace) -> int:
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
    print(table(report))
    for p in report["problems"][:20]:
        print("problem:", p)
    print(f"{out['seconds']} s")
    write_json(args.json_path, out)
    t = report["total"]
    return 0 if t["wrong_kv_served"] == 0 and t["committed_blocks_lost"] == 0 and t["crashes"] == 0 else 1


def child_main(role: str, raw: str) -> None:
    """A child process of a scenario (``python -m dynamo_kvtc.reliability _child ROLE JSON``)."""
    args = json.loads(raw)
    logging.basicConfig(level=logging.ERROR)
    world = World(args["workdir"], seed=args["seed"])
    {"kill9": child_kill9, "server": child_server, "rlimit": child_rlimit}[role](world, args)
